"""The ``leafpy`` command: train, evaluate, apply and summarise networks described by YAML run files.

    leafpy train RUN.yaml [--backend B] [--epochs N] [--out DIR] [--resume CHECKPOINT] [--seed S]
    leafpy evaluate RUN.yaml --weights FILE [--backend B]
    leafpy predict RUN.yaml --weights FILE --input IMAGE|FOLDER|TABLE.csv|SAMPLES.npz [--out FILE.csv|.npz]
    leafpy summary RUN.yaml

Every command takes ``--set KEY=VALUE`` (repeatable) to change one value of the run file. A run whose objective
has classes (NegativeLogLikelihood) reports accuracy and a confusion matrix; one without (MeanSquaredError) is a
regression, scored by its held-out loss.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__, _checks
from . import config as run_config
from . import data as datasets
from ._run_lock import RunLock, held_by
from .backends import BACKEND_NAMES, PRECISIONS, run_backend
from .backends import backend as get_backend
from .errors import LeafpyError
from .layers.container.sequential import Sequential, batch_free
from .layers.layer import Layer
from .metrics import predictions
from .serialization import saved_network_config
from .serialization.atomic import atomic_write, remove_temporaries
from .train import load_weights, resolve_data, same_path

_lost_output: list[str] = []
"""Why standard output could not be written (a full disk, an I/O error), once it failed: the command goes on (a
run keeps training and saving) with its output dropped, and ends with exit code 1 saying so."""


_saved_stdout: list[int] = []


def _restore_stdout() -> None:
    """Standard output's descriptor as it was before :func:`_out` sent it to /dev/null (what is buffered goes
    there first, not back to the device that refused it)."""
    try:
        sys.stdout.flush()
    except OSError:
        pass
    if _saved_stdout:
        os.dup2(_saved_stdout[0], sys.stdout.fileno())
        os.close(_saved_stdout.pop())


def _to_devnull(fd: int) -> None:
    """Point ``fd`` at the null device (the descriptor opened for it closed again: a process running commands in a
    loop keeps no more descriptors than it had)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _out(msg: str = "") -> None:
    if _lost_output:
        return
    try:
        print(msg, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        _lost_output.append(e.strerror or str(e))
        if not _saved_stdout:
            _saved_stdout.append(os.dup(sys.stdout.fileno()))
        _to_devnull(sys.stdout.fileno())  # (what is buffered: dropped, not retried)
        try:
            print(f"leafpy: cannot write to standard output ({_lost_output[0]}); its output is dropped from here on",
                  file=sys.stderr, flush=True)
        except OSError:
            pass


# --- summary --------------------------------------------------------------------------------------------------
def summary_rows(layer: Layer, depth: int = 0) -> list[tuple[str, str, str, int]]:
    if depth == 0 and not isinstance(layer, Sequential):  # a bare layer (a model file of one Linear): its row
        shape = "x".join(map(str, layer.outputs[0].shape)) if layer.outputs else "?"
        return [(layer.name, layer.config.type, shape, layer.num_parameters())]
    rows = []
    if isinstance(layer, Sequential):
        for child in layer.layers:
            shape = "x".join(map(str, child.outputs[0].shape)) if child.outputs else "?"
            params = child.num_parameters()
            note = " (in place)" if child.in_place else ""
            rows.append(("  " * depth + child.name, child.config.type + note, shape, params))
            if isinstance(child, Sequential):
                rows.extend(summary_rows(child, depth + 1))
    return rows


def parameter_counts(net: Layer) -> tuple[int, int]:
    """(trained, untrained) numbers in the network's weights: untrained ones have lr_mult 0 (BatchNorm's running
    statistics, frozen weights), and the solver never changes them."""
    trained = untrained = 0
    for w, cfg in zip(net.learnable_weights_data(), net.learnable_weights_configs()):
        if cfg.lr_mult:
            trained += w.size
        else:
            untrained += w.size
    return trained, untrained


def summary_text(net: Layer) -> str:
    rows = summary_rows(net)
    header = ("layer", "type", "output shape", "parameters")
    widths = [max(len(header[i]), *(len(str(r[i]) if i < 3 else f"{r[i]:,}") for r in rows)) for i in range(4)]
    line = "  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join([str(r[0]).ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                              f"{r[3]:,}".rjust(widths[3])]))
    out.append("-" * len(line))
    trained, untrained = parameter_counts(net)
    out.append(f"total parameters: {trained + untrained:,} ({trained:,} trained"
               + (f", {untrained:,} untrained: running statistics and weights with lr_mult 0)" if untrained else ")"))
    return "\n".join(out)


# --- train ------------------------------------------------------------------------------------------------------
def _plot(history: list[dict], path: str | io.BytesIO) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [h["epoch"] for h in history]
    classes = all(h.get("test_accuracy") is not None for h in history)
    fig, axes = plt.subplots(1, 2 if classes else 1, figsize=(10 if classes else 5, 4), squeeze=False)
    a1 = axes[0][0]
    a1.plot(epochs, [h["loss"] for h in history], marker="o", label="training")
    if all("test_loss" in h for h in history):
        a1.plot(epochs, [h["test_loss"] for h in history], marker="o", label="held-out")
        a1.legend()
    a1.set_xlabel("epoch")
    a1.set_ylabel("loss")
    if classes:
        a2 = axes[0][1]
        a2.plot(epochs, [h["train_accuracy"] for h in history], marker="o", label="training")
        a2.plot(epochs, [h["test_accuracy"] for h in history], marker="o", label="held-out")
        a2.set_xlabel("epoch")
        a2.set_ylabel("accuracy")
        a2.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


RUN_FILE = run_config.RUN_FILE


def out_dir_for(run: run_config.RunConfig, out: str | None, resume: str | None = None) -> str:
    """``--out``, else the directory of the checkpoint a run resumes (the run it continues), else runs/NAME."""
    if out:
        return out
    if resume:
        return os.path.dirname(resume) or "."
    return os.path.join("runs", run_config.check_run_name(run.name) or "run")


RELAUNCH_STOP_S = 60.0
"""How long ``leafpy train --nproc`` waits, after a stop signal, for the ranks to write their checkpoint and end."""


def _relaunch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``leafpy train --nproc N``: the same command under mpiexec with N ranks."""
    import shutil
    import subprocess

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise LeafpyError("--nproc: mpiexec was not found; install it with pip install mpi4py mpich (the "
                          "dist extra; mpich's wheel holds mpiexec), or launch with your cluster's mpiexec or srun")
    rest, i = list(argv), 0
    while i < len(rest):  # --nproc N, --nproc=N, or as argparse takes it abbreviated (--np 2)
        name = rest[i].split("=", 1)[0]
        if len(name) >= 3 and "--nproc".startswith(name):
            del rest[i:i + (1 if "=" in rest[i] else 2)]
            continue
        if rest[i] == "--":
            break
        i += 1
    cmd = [mpiexec, "-n", str(args.nproc), sys.executable, "-m", "leafpy", *rest]
    # mpiexec and the ranks in a session of their own: a terminal's signals (Ctrl-C; SIGHUP when it closes, which
    # ends mpiexec at once, ranks and all) reach this process alone, which passes each on as SIGTERM
    proc = subprocess.Popen(cmd, start_new_session=True)
    stopping: list[float] = []

    def forward(signum: int, frame: Any) -> None:
        # a stop signal (Ctrl-C, a closed terminal, kill PID, a scheduler, timeout) must reach the ranks, or they
        # train on without it. mpiexec passes SIGTERM on to them: each rank then stops at the same step and rank 0
        # writes a checkpoint. A second one ends the job at once, without a checkpoint.
        if proc.poll() is not None:
            return
        if stopping:
            _kill_job(proc)
            return
        stopping.append(time.monotonic())
        proc.send_signal(signal.SIGTERM)

    from .train import STOP_SIGNALS

    previous = [(s, signal.getsignal(s)) for s in STOP_SIGNALS]
    for s, handler in previous:
        if handler is not signal.SIG_IGN:
            signal.signal(s, forward)
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > RELAUNCH_STOP_S:  # the ranks did not stop
                    _kill_job(proc)
                    proc.wait()
                    return 130
    finally:
        for s, handler in previous:
            signal.signal(s, handler)


def _kill_job(proc: Any) -> None:
    """End mpiexec's session (mpiexec, its proxies and the ranks) at once."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def train(args: argparse.Namespace) -> int:
    from . import distributed

    run = run_config.load(args.config, args.set)
    if args.seed is not None:
        run.data["seed"] = args.seed
        run.solver = dataclasses.replace(run.solver, seed=args.seed)
    resolve_data(run)
    backend_name = args.backend or str(run.train.get("backend", "native"))
    run.train["backend"] = backend_name
    run.train["precision"] = args.precision or str(run.train.get("precision", "fp32"))
    if args.epochs is not None:
        run.train["epochs"] = args.epochs
    group = distributed.init()
    with distributed.failing_rank_ends_the_job(group):
        options: dict[str, Any] = {}
        if backend_name == "cuda" and group.local_size > 1:
            options["device"] = group.local_rank
        be = run_backend(run.train, **options)
        out_dir = out_dir_for(run, args.out, args.resume)
        continues = False
        if group.is_root:
            if os.path.islink(out_dir) and not os.path.exists(out_dir):
                raise LeafpyError(f"--out {out_dir}: a symbolic link to {os.readlink(out_dir)}, which does not exist; "
                                  "create the directory it points to, or give another --out")
            if os.path.exists(out_dir) and not os.path.isdir(out_dir):
                raise LeafpyError(f"--out {out_dir}: cannot create the output directory: a file, not a directory, is "
                                  "there; give the directory the run's files go into (it is made if missing)")
            try:
                os.makedirs(out_dir, exist_ok=True)
            except OSError as e:
                raise LeafpyError(f"--out {out_dir}: cannot create the output directory: {e.strerror or e}") from e
            # a resumed run writes over its own files; any other run's are kept unless --overwrite
            continues = bool(args.resume) and same_path(os.path.dirname(args.resume) or ".", out_dir)
            given = os.path.join(args.config, RUN_FILE) if os.path.isdir(args.config) else args.config
            own = os.path.join(out_dir, RUN_FILE)
            if not continues and not args.overwrite and os.path.isfile(given) and same_path(given, own) and \
                    not {"checkpoint.leaf", "model.leaf", "history.json"} & set(os.listdir(out_dir)):
                raise LeafpyError(f"--out {out_dir}: the run file {given} is where the run writes its resolved copy "
                                  f"of the run ({RUN_FILE}), which would replace it (a file of your own: its comments "
                                  "and short forms); keep it under another name or in another folder, give another "
                                  "--out, or pass --overwrite to train there all the same")
            if not continues and not args.overwrite:
                present = set(os.listdir(out_dir))  # (any of a run's files: its history or best epochs alone too)
                held = [f for f in RUN_FILES if f in present] + sorted(f for f in present if _is_run_file(f) and
                                                                       f not in RUN_FILES)
                live = held_by(out_dir) if held else None
                if live:  # (its files are a live run's: --overwrite or --resume would not be the way)
                    raise LeafpyError(live)
                if "checkpoint.leaf" in held:
                    raise LeafpyError(f"--out {out_dir}: holds another run's files ({', '.join(held)}); continue it "
                                      f"with --resume {os.path.join(out_dir, 'checkpoint.leaf')}, train into another "
                                      "--out, or pass --overwrite to replace them")
                if held:  # a run that ended before its first checkpoint (a file it could not read, say)
                    raise LeafpyError(f"--out {out_dir}: holds another run's files ({', '.join(held)}) but no "
                                      "checkpoint to continue from; pass --overwrite to replace them (to train this "
                                      "run again there), or train into another --out")
        group.barrier()
        lock = RunLock(out_dir) if group.is_root else contextlib.nullcontext()
        with lock:
            if group.is_root:
                _remove_stale_temporaries(out_dir)
            return _train(args, run, be, out_dir, group, replace=args.overwrite and not continues)


RUN_FILES = ("model.leaf", "checkpoint.leaf", RUN_FILE, "history.json", "history.csv", "training.png", "confusion.csv")
"""The files a training run writes into its directory, besides its best-epochE.leaf checkpoints."""


def _is_run_file(name: str) -> bool:
    """Whether ``name`` is one of the files a training run writes into its directory."""
    return name in RUN_FILES or (name.startswith("best-epoch") and name.endswith(".leaf"))


def _remove_stale_temporaries(directory: str) -> None:
    """Remove the temporary files of the run's files that a save killed midway left (the lock is held)."""
    removed = remove_temporaries(directory, _is_run_file)
    if removed:
        _out(f"leafpy: removed {len(removed)} temporary file{'s' * (len(removed) != 1)} left by an interrupted save "
             f"in {directory}: {', '.join(sorted(removed))}")


def _remove_run_files(directory: str) -> None:
    """Remove the files a training run wrote into ``directory`` (and nothing else in it)."""
    names = [n for n in os.listdir(directory) if _is_run_file(n)]
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise LeafpyError(f"--overwrite: cannot remove the previous run's {os.path.join(directory, name)}: "
                              f"{e.strerror or e}") from e


def _train(args: argparse.Namespace, run: run_config.RunConfig, be: Any, out_dir: str, group: Any, *,
           replace: bool = False) -> int:
    """The training run; ``replace``: remove another run's files from ``out_dir`` once this one can start."""
    from .train import Trainer, TrainingInterrupted

    if args.resume and args.weights:
        raise LeafpyError(f"--resume {args.resume} continues a run with its own weights, --weights {args.weights} "
                          "starts a new run from a file's; give one of them")
    trainer = Trainer(run, be, out_dir=out_dir, resume=args.resume, group=group, log=_out, weights=args.weights)
    done, within = trainer.start_epoch, trainer.start_sample > 0
    if trainer.epochs < done or (trainer.epochs == done and within):
        where = f"is in epoch {done + 1}" if within else f"ends epoch {done}"
        asked = f"{trainer.epochs} epoch{'s' * (trainer.epochs != 1)}"
        raise LeafpyError(f"--resume {args.resume}: the checkpoint {where}, past the {asked} asked for (--epochs or "
                          f"train.epochs); give --epochs {done + 1} or more to train further")
    if group.is_root:
        if replace:
            _remove_run_files(out_dir)  # none of the replaced run's files may pass for this run's
    ds = trainer.dataset
    ranks = f" on {group.size} ranks (global batch {trainer.global_batch})" if group.size > 1 else ""
    modes = [m for m in (be.precision if be.precision != "fp32" else "", "channels-last" * be.channels_last) if m]
    mode = f" ({', '.join(modes)})" if modes else ""
    epochs = (f"epochs {done + 1}..{trainer.epochs}" if trainer.epochs > done else
              f"nothing left to train: the checkpoint ends epoch {done}, the last asked for (--epochs or "
              f"train.epochs); its model and scores follow (give --epochs {done + 1} or more to train further)")
    adapter = f" [{be.adapter_name}]" if be.adapter_name else ""
    trainer.log(f"leafpy: training {run.name or args.config} on {be.name}{adapter}{mode}{ranks}: {len(ds.x_train)} "
                f"training and {len(ds.x_test)} held-out samples ({ds.name}), batch {run.batch_size}, "
                f"{trainer.solver.network.num_parameters():,} parameters, {epochs}")
    if ds.skipped:
        shown = ", ".join(ds.skipped[:10]) + (f" and {len(ds.skipped) - 10} more" if len(ds.skipped) > 10 else "")
        trainer.log(f"skipped {len(ds.skipped)} unreadable file{'s' * (len(ds.skipped) != 1)}: {shown}")
    if be.emulated:
        trainer.log(f"note: {be.adapter_name} is a CPU emulation of a GPU: webgpu runs correctly there but far "
                    "slower than --backend native")
    if trainer.loaded is not None:
        kept, ignored = trainer.loaded.missing, trainer.loaded.unexpected
        trainer.log(f"starting from the weights in {args.weights}" +
                    (f"; initial values for {', '.join(kept)}" if kept else "") +
                    (f"; not in this network: {', '.join(map(str, ignored))}" if ignored else ""))
    try:
        history = trainer.fit()
    except TrainingInterrupted as e:
        trainer.log(str(e))
        return 130
    model_path = os.path.join(out_dir, "model.leaf")
    ckpt_path = os.path.join(out_dir, "checkpoint.leaf")
    trainer.save_model(model_path)
    final = trainer.evaluate()
    if not group.is_root:
        return 0
    if final.matrix is not None:
        _matrix(final.matrix, trainer.preparation.class_names, os.path.join(out_dir, "confusion.csv"), always=False,
                before="\n")
    if history and _plot_atomic(history, os.path.join(out_dir, "training.png")):
        _out(f"plot: {os.path.join(out_dir, 'training.png')}")
    _out(f"model: {model_path}  checkpoint: {ckpt_path}  run: {os.path.join(out_dir, RUN_FILE)}")
    _report(final, trainer.preparation.class_names)
    return 0


def _plot_atomic(history: list[dict], path: str) -> bool:
    """Draw the training curves to ``path`` (atomically); False where matplotlib is missing. A plot that cannot be
    written (a full disk) is a warning, not a failure: the run's model and checkpoint are saved by then."""
    try:
        image = io.BytesIO()  # drawn in memory: the only temporary file is atomic_write's
        if not _plot(history, image):
            return False
        atomic_write(path, image.getvalue(), example=None)
        return True
    except (OSError, LeafpyError) as e:
        why = getattr(e, "strerror", None) or str(e)
        print(f"leafpy: warning: the plot {path} was not written ({why}); the model and checkpoint are saved",
              file=sys.stderr, flush=True)
        return False


SUMMARISED_CLASSES = 20
"""Past this many classes, ``train`` and ``evaluate`` print a summary of the confusion matrix and the per-class
scores (the most frequent confusions, macro and weighted F1) and write the whole matrix to a CSV file."""


def _matrix(matrix: Any, class_names: Sequence[str], path: str | None, *, always: bool, before: str = "") -> None:
    """The held-out confusion matrix: printed whole (``before`` it: a line's start) up to SUMMARISED_CLASSES classes;
    past them, a summary printed and the matrix written to ``path`` as CSV (None: not written; ``always``: written
    at any number of classes)."""
    if path is not None and (always or matrix.num_classes > SUMMARISED_CLASSES):
        atomic_write(path, matrix.csv(class_names).encode(), example="confusion.csv")
    if matrix.num_classes <= SUMMARISED_CLASSES:
        if before:
            _out(f"{before}confusion matrix on the held-out set:")
        _out(matrix.table(class_names))
        return
    where = (f"written to {path} (rows: targets, columns: predictions)" if path is not None else
             "write it with --confusion FILE.csv")
    _out(f"{before}confusion matrix on the held-out set: {matrix.num_classes} classes, too many to print; {where}")
    names = matrix.names(class_names)
    found = matrix.confusions(10)
    if found:
        _out("most frequent confusions (target -> prediction: count):")
        for t, p, n in found:
            _out(f"  {names[t]} -> {names[p]}: {n}")
    _out(f"accuracy {matrix.accuracy():.2%} of {matrix.samples} predictions")


def _report(scores: Any, class_names: Sequence[str] = ()) -> None:
    """The held-out scores: loss; per class precision, recall and F1 (past SUMMARISED_CLASSES classes, not listed),
    macro and weighted F1, accuracy and top-5 accuracy; or a regression's MSE, MAE and R² in the targets' units."""
    if scores.matrix is not None and scores.matrix.num_classes > SUMMARISED_CLASSES:
        _out(f"macro F1 {scores.matrix.macro_f1():.4f}, weighted F1 {scores.matrix.weighted_f1():.4f} (per-class "
             f"precision, recall and F1 of {scores.matrix.num_classes} classes: not listed)")
    elif scores.matrix is not None:
        _out(scores.matrix.report(class_names))
    _out(f"held-out loss: {scores.loss:.6g}")
    if scores.matrix is not None:
        _out(f"held-out accuracy: {scores.matrix.accuracy():.2%}")
    if scores.top_k is not None:
        _out(f"held-out top-{scores.top_k[0]} accuracy: {scores.top_k[1]:.2%}")
    if scores.roc_auc is not None:
        _out(f"held-out ROC AUC: {scores.roc_auc:.4f}")
    elif scores.roc_auc_note:
        _out(f"held-out ROC AUC: not computed ({scores.roc_auc_note})")
    if scores.regression is not None:
        r = scores.regression
        _out(f"held-out MSE {r['mse']:.6g}, MAE {r['mae']:.6g}, R² {r['r2']:.4f} (in the targets' units)")


def config_difference(saved: Any, given: Any, path: str,
                      sides: tuple[str, str] = ("in the weights' file", "in the run file")) -> str | None:
    """Where two configs (dataclasses, lists, dicts, values) first differ: "path: A in one, B in the other", where
    ``sides`` name where ``saved`` and ``given`` come from."""
    if dataclasses.is_dataclass(saved) and dataclasses.is_dataclass(given) and type(saved) is type(given):
        for f in dataclasses.fields(saved):
            found = config_difference(getattr(saved, f.name), getattr(given, f.name), f"{path}.{f.name}", sides)
            if found:
                return found
        return None
    if isinstance(saved, (list, tuple)) and isinstance(given, (list, tuple)):
        if len(saved) != len(given):
            return f"{path}: {len(saved)} entries {sides[0]}, {len(given)} {sides[1]}"
        for i, (a, b) in enumerate(zip(saved, given)):
            label = f"{path}[{i}]" + (f" ({a.name})" if hasattr(a, "name") and isinstance(a.name, str) else "")
            found = config_difference(a, b, label, sides)
            if found:
                return found
        return None
    if isinstance(saved, dict) and isinstance(given, dict):
        for key in sorted(set(saved) | set(given), key=str):
            found = config_difference(saved.get(key), given.get(key), f"{path}.{key}", sides)
            if found:
                return found
        return None
    if saved != given:
        kind = lambda v: type(v).__name__ if dataclasses.is_dataclass(v) else repr(v)  # noqa: E731
        return f"{path}: {kind(saved)} {sides[0]}, {kind(given)} {sides[1]}"
    return None


def resolve_run(target: str, overrides: Sequence[str], weights: str | None, *, need_run: bool = True,
                need_weights: bool = True, command: str = "evaluate", check_split: bool = True
                ) -> tuple[run_config.RunConfig | None, str | None]:
    """The run and the weights a command works on, from a run directory (its run.yaml and model.leaf), a model
    or checkpoint file (with the run.yaml beside it, if any) or a run file with ``--weights``. Weights trained with
    another network than the run describes are refused, naming the difference, and with ``check_split`` (the
    commands that score the held-out split) so are weights trained on another data split than the run's, as the
    run.yaml beside them records. Without ``need_weights`` (summary) a run directory gives the run alone."""
    run_file = target  # what describes the run, as the user named it
    if os.path.isdir(target):
        run_file = os.path.join(target, RUN_FILE)
        if not os.path.isfile(run_file):
            raise LeafpyError(f"{target}: a directory without {RUN_FILE}; give a run directory that leafpy train "
                              "wrote (--out), or the run file and --weights")
        if weights is None and need_weights:
            weights = os.path.join(target, "model.leaf")
            checkpoint = os.path.join(target, "checkpoint.leaf")
            if not os.path.exists(weights) and os.path.isfile(checkpoint):
                live = held_by(target)
                if live:
                    raise LeafpyError(f"{target}: no model.leaf yet: {live.split(': ', 1)[1]}; meanwhile, give its "
                                      f"last checkpoint: --weights {checkpoint}")
                raise LeafpyError(f"{target}: no model.leaf yet (the run stopped before its end, or a Trainer without "
                                  "save_model ran it); give its last "
                                  f"checkpoint: --weights {checkpoint}, or finish the run: leafpy train {target} "
                                  f"--resume {checkpoint}")
        run: run_config.RunConfig | None = run_config.load(run_file, overrides)
    elif target.endswith((".leaf", ".onnx")):
        if weights:
            raise LeafpyError(f"{target} is a weights file already; give either it or --weights, not both")
        weights = target
        run_file = os.path.join(os.path.dirname(target), RUN_FILE)
        if os.path.isfile(run_file):
            run = run_config.load(run_file, overrides)
        elif need_run:
            raise LeafpyError(f"{target}: no {RUN_FILE} beside it says which data and split it was trained on; "
                              f"give the run file: leafpy {command} RUN.yaml --weights {target}")
        else:
            run = None
    else:
        run = run_config.load(target, overrides)
        if weights is None and need_run:
            raise LeafpyError(f"{target}: a run file needs --weights (a model.leaf or checkpoint.leaf), or give the "
                              "run directory that leafpy train wrote")
    if weights is not None and run is not None and check_split:
        trained = os.path.join(os.path.dirname(weights), RUN_FILE)  # the run the weights were trained in
        if os.path.isfile(trained):
            own = same_path(trained, run_file)  # then only the --set can change the split
            _check_split(run_config.load(trained), run, weights, trained,
                         f"in {run_file}" + (" with the --set" if overrides else ""),
                         "--set changes it: drop the --set of data" if own else
                         f"score them on their own split: leafpy {command} {weights}")
    if weights is not None and run is not None and not weights.endswith(".onnx"):  # ONNX: matched by name on load
        found = config_difference(batch_free(saved_network_config(weights)), batch_free(run.network), "network")
        if found:
            raise LeafpyError(f"{weights} holds another network than the run file describes ({found}); give the "
                              "run file these weights were trained with")
    return run, weights


def _check_split(trained: run_config.RunConfig, run: run_config.RunConfig, weights: str, trained_file: str,
                 given: str, fix: str) -> None:
    """Refuse to score ``weights`` on another split than the one they were trained on (as ``trained_file``
    records; ``given`` says where the run's own split comes from): its held-out samples would include training
    ones. The batch size does not change the split."""
    resolve_data(run)
    resolve_data(trained)
    # what training resolves and records (normalize: auto's values, class names...) does not change the split
    kept = ("batch_size", "normalize", "class_names", "features", "image_size", "channels", "cache_dir")
    split = {k: v for k, v in run.data.items() if k not in kept}
    found = config_difference({k: v for k, v in trained.data.items() if k not in kept}, split, "data",
                              (f"in {trained_file}", given))
    if found:
        raise LeafpyError(f"{weights} was trained on another data split ({found}), whose held-out samples would "
                          f"include training ones; {fix}")


def _warn_if_data_changed(weights: str, ds: Any) -> None:
    """A warning where the data's fingerprint differs from the one the checkpoint beside ``weights`` (or ``weights``
    itself, a checkpoint) recorded: rows or images added or changed since training re-draw the split, so the held-out
    samples may include training ones."""
    from .serialization import file_kind, read_checkpoint
    from .solvers.solver import SolverConfig

    beside = os.path.join(os.path.dirname(weights), "checkpoint.leaf")
    checkpoint = weights if file_kind(weights) == "checkpoint" else beside
    if not os.path.isfile(checkpoint) or file_kind(checkpoint) != "checkpoint":
        return
    try:
        digest = read_checkpoint(checkpoint, SolverConfig).state["trainer_state"].get("data_digest")
    except LeafpyError:
        return  # (the weights' own loading reports a damaged file)
    if digest is not None and not ds.fingerprinted_by(digest):
        print(f"leafpy: warning: the {ds.name} samples or targets are not those {checkpoint} was trained on (the "
              "files changed since): the held-out split is drawn again and may hold training samples, so these "
              "scores can overstate the model; score it on held-out data of its own", file=sys.stderr)


def _backend_for(args: argparse.Namespace, run: run_config.RunConfig | None) -> Any:
    return run_backend(run.train if run is not None else {}, args.backend, args.precision)


def evaluate_cmd(args: argparse.Namespace) -> int:
    from .train import evaluate, ignored_label, load_data, num_classes

    run, weights = resolve_run(args.config, args.set, args.weights)
    assert run is not None and weights is not None  # resolve_run raises otherwise
    if args.confusion and not num_classes(run):  # (before the data is read and scored)
        raise LeafpyError(f"--confusion {args.confusion}: the run has no classes (a regression), so no confusion "
                          "matrix; leave --confusion out")
    be = _backend_for(args, run)
    resolve_data(run)
    ds = load_data(run)
    net = Layer.from_config(be, run.network)
    load_weights(net, weights)
    _warn_if_data_changed(weights, ds)
    objective = Layer.from_config(be.full_precision(), run.objective)  # losses in fp32 under bf16 and fp16
    prep = _preparation(run, weights)
    scores = evaluate(net, objective, ds.x_test, ds.y_test, num_classes(run), run.batch_size, preparation=prep,
                      ignore_index=ignored_label(run))
    _out(f"leafpy: {weights} on the held-out split of {ds.name} ({len(ds.x_test)} samples, seed "
         f"{run.data.get('seed', 0)})")
    if scores.matrix is not None:
        _matrix(scores.matrix, prep.class_names, args.confusion, always=True)
    _report(scores, prep.class_names)
    return 0


def predict_cmd(args: argparse.Namespace) -> int:
    from . import sources
    from .train import check_samples, num_classes

    if args.out and not args.out.lower().endswith((".npz", ".csv")):  # (case does not matter, as for --input)
        raise LeafpyError(f"--out {args.out}: predictions are written as .npz or .csv; name the file so")
    beside = os.path.join(os.path.dirname(args.config), RUN_FILE)
    if args.weights is None and (args.config.endswith(".onnx") or (args.config.endswith(".leaf")
                                                                   and not os.path.isfile(beside))):
        # a model alone (an ONNX model, or a model file with no run beside it): its graph is the network, its
        # file says how it reads data (a leafpy model file records that; an ONNX graph reads its input as given)
        from . import onnx
        from .sources import image_folder, prepare

        _refuse_set(args, "with no run file beside it")
        suffix = os.path.splitext(args.input)[1].lower()
        if os.path.isdir(args.input) or suffix in (".csv", ".tsv", ".txt", *image_folder.EXTENSIONS):
            raise LeafpyError(f"{args.input}: {args.config} alone reads samples from an .npz file (x: [N, ...]); "
                              "which columns of a table, or what size of image, the model takes is what its run "
                              "records: give the run directory that leafpy train wrote (its run.yaml says), or the "
                              "samples as an .npz file")
        x = datasets.npz_samples(args.input)
        labels = [str(i) for i in range(len(x))]
        be = _backend_for(args, None)
        if args.config.endswith(".onnx"):
            net: Any = onnx.load(args.config, be)
            prep = net.preparation or prepare.from_dict({})
        else:
            net = Layer.load(be, args.config)
            prep = _recorded_preparation(args.config) or prepare.from_dict({})
        weights = args.config
        want = tuple(net.input_shapes[0][1:])
        if tuple(x.shape[1:]) != want:
            raise LeafpyError(f"{args.input}: samples of shape {list(x.shape[1:])}, where {args.config} takes "
                              f"{list(want)} per sample; reshape x to [N, {', '.join(map(str, want))}]")
        outputs = _forward_batches(net, prep.inputs(x), 64, be)
        classes = predictions(outputs) if outputs.ndim == 2 and outputs.shape[1] > 1 else None
        if classes is None:
            outputs = prep.outputs(outputs)
        names = (list(prep.class_names) or [str(k) for k in range(outputs.shape[1])]) if classes is not None else []
    else:
        # new samples: the split the weights were trained on does not matter here
        run, weights = resolve_run(args.config, args.set, args.weights, command="predict", check_split=False)
        assert run is not None and weights is not None
        be = _backend_for(args, run)
        prep = _preparation(run, weights)
        found = sources.samples_for_prediction(run.data, args.input, run.network.config.inputs[0][1][1:])
        if found is None:
            x = datasets.npz_samples(args.input)
            found = x, [str(i) for i in range(len(x))], []
        x, labels, skipped = found
        if skipped:  # (data.skip_unreadable)
            shown = ", ".join(skipped[:10]) + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
            _out(f"leafpy: skipped {len(skipped)} unreadable file{'s' * (len(skipped) != 1)}: {shown}")
        check_samples(run, x.shape[1:], f"{args.input}: the samples", trained=True)
        net = Layer.from_config(be, run.network)
        load_weights(net, weights)
        outputs = _forward_batches(net, prep.inputs(x), run.batch_size, be)
        classes = predictions(outputs) if num_classes(run) else None
        if classes is None:
            outputs = prep.outputs(outputs)
        names = list(prep.class_names) or [str(k) for k in range(num_classes(run))]
    probs = probabilities(outputs) if classes is not None else None
    if probs is not None:  # classes past the names (a network scoring more classes than the data names): numbered
        names = names[:probs.shape[1]] + [str(k) for k in range(len(names), probs.shape[1])]
    if args.out:
        if prep.class_names and probs is not None and probs.ndim == 2 and args.out.lower().endswith(".csv"):
            write_named_predictions(args.out, labels, probs, names)
        else:
            write_predictions(args.out, outputs, classes)
    _out(f"leafpy: {len(x)} samples of {args.input} through {weights}: outputs {list(outputs.shape)}")
    if classes is not None and probs is not None:
        counts = np.bincount(classes.reshape(-1), minlength=len(names))  # (outputs [N, C, d1, ...]: every position's)
        _out("predicted classes: " + ", ".join(f"{names[k]}: {n}" for k, n in enumerate(counts) if n))
        for label, row, picked in list(zip(labels, probs, classes))[:20]:
            if row.ndim > 1:  # a class at every position
                _out(f"  {label}: " + " ".join(names[k] for k in picked.reshape(-1)[:20]) +
                     " ..." * (picked.size > 20))
                continue
            _out(f"  {label}: " + ", ".join(f"{names[k]} {row[k]:.1%}" for k in _top(row)))
        if len(labels) > 20:
            _out(f"  ... ({len(labels) - 20} more)")
    _out(f"written: {args.out}" if args.out else "write them with --out FILE.npz or FILE.csv")
    return 0


def _recorded_preparation(model: str) -> Any:
    """How a model file records that it reads data (None: it records nothing)."""
    from .serialization import read_model
    from .sources import prepare

    return prepare.from_text(read_model(model).preparation, model)


def _preparation(run: run_config.RunConfig, weights: str) -> Any:
    """How the model reads data: as its model file records it, else as the run's data section does."""
    from .serialization import file_kind
    from .sources import prepare

    # a checkpoint records none (its run.yaml does), nor ONNX weights; a model file's unreadable record is refused,
    # not replaced by the run's
    records = not weights.endswith(".onnx") and file_kind(weights) != "checkpoint"
    saved = _recorded_preparation(weights) if records else None
    if saved is not None:
        return saved
    if run.data.get("normalize") == "auto":
        raise LeafpyError(f"{weights}: the run normalises its data (normalize: auto) but records no values for it; "
                          "give the run directory that leafpy train wrote (its run.yaml records them)")
    return prepare.from_dict(run.data)


def probabilities(outputs: np.ndarray) -> np.ndarray:
    """Class probabilities of network outputs [N, C] (or [N, C, d1, ...]: at every position), in their shape: the
    outputs themselves where each already is a distribution over axis 1 (Softmax), else their softmax over it
    (log-probabilities, scores)."""
    a = outputs.astype(np.float64)
    if (a >= 0).all() and np.allclose(a.sum(axis=1), 1.0, atol=1e-3):
        return a
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def _top(row: np.ndarray, k: int = 3) -> list[int]:
    return [int(i) for i in np.argsort(-row, kind="stable")[:k]]


def write_named_predictions(path: str, labels: Sequence[str], probs: np.ndarray, names: Sequence[str]) -> None:
    """One CSV row per sample: its input, the top classes by name and their probabilities (atomically)."""
    import csv

    k = min(3, len(names))
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(["input", "class", "probability"] + [f"{c}_{i}" for i in range(2, k + 1) for c in ("class",
                                                                                                 "probability")])
    for label, row in zip(labels, probs):
        w.writerow([label] + [v for c in _top(row, k) for v in (names[c], f"{row[c]:.6g}")])
    # (a file name that is no UTF-8, as the file system gave it, written back as its bytes)
    atomic_write(path, text.getvalue().encode("utf-8", "surrogateescape"), example="predictions.csv")


def _forward_batches(net: Layer, x: np.ndarray, batch: int, be: Any) -> np.ndarray:
    """The network's first output for every sample of ``x``, in inference mode, ``batch`` samples at a time."""
    net.set_training(False)
    return np.concatenate([net.forward([x[i:i + batch]])[0].to_numpy().astype(be.dtype)  # bf16/fp16 as fp32
                           for i in range(0, len(x), batch)])


def write_predictions(path: str, outputs: np.ndarray, classes: np.ndarray | None) -> None:
    """``outputs`` (and ``classes``) into an .npz file, or a .csv file of one row per sample (atomically); the
    suffix in any case."""
    if path.lower().endswith(".csv"):
        flat = outputs.reshape(len(outputs), -1)
        header = [f"output_{i}" for i in range(flat.shape[1])]
        picked = np.zeros((len(flat), 0), np.int64) if classes is None else classes.reshape(len(classes), -1)
        rows = np.column_stack([picked, flat])  # (a class column per position of outputs [N, C, d1, ...])
        header[:0] = ["class"] if picked.shape[1] == 1 else [f"class_{i}" for i in range(picked.shape[1])]
        text = io.StringIO()
        fmt = ["%d"] * picked.shape[1] + ["%.9g"] * flat.shape[1]
        np.savetxt(text, rows, fmt=fmt, delimiter=",", header=",".join(header), comments="")
        data = text.getvalue().encode()
    else:
        buf = io.BytesIO()
        if classes is None:
            np.savez(buf, outputs=outputs)
        else:
            np.savez(buf, outputs=outputs, classes=classes)
        data = buf.getvalue()
    atomic_write(path, data, example="predictions" + os.path.splitext(path)[1])


def _refuse_set(args: argparse.Namespace, why: str) -> None:
    """A command given a model file that it uses without a run file: a ``--set`` would change nothing."""
    if args.set:
        raise LeafpyError(f"--set {args.set[0]}: --set changes a run file, and {args.config} is used {why}; give "
                          "the run directory or run file to change, or drop --set")


def summary_cmd(args: argparse.Namespace) -> int:
    be = get_backend("native")
    target = args.config
    if target.endswith((".onnx", ".leaf")) and not os.path.isdir(target):
        _checks.regular_file(target, "a model (.leaf or .onnx), a checkpoint.leaf, a run file or a run directory",
                             LeafpyError)
        _refuse_set(args, "(its saved network is shown)")
        net = _model_from(target, be)
        _out(f"{target}: network '{net.name}' (with its saved weights)")
    else:
        # summary scores nothing and shows the network the run file describes: no weights, no split to check
        run, _ = resolve_run(target, args.set, None, need_run=False, need_weights=False, command="summary",
                             check_split=False)
        if run is None:  # (resolve_run gives a run for anything but a .leaf file)
            raise LeafpyError(f"{target}: no run file describes a network here; give a run file or a run directory")
        net = Layer.from_config(be, run.network)
        _out(f"{run.name or target}: network '{net.name}'")
        if os.path.isdir(target) and not os.path.exists(os.path.join(target, "model.leaf")):
            _out(f"(no model.leaf in {target}: the run stopped before its end, or a Trainer without save_model "
                 "ran it)")
    _out(summary_text(net))
    if not isinstance(net, Sequential) and net.has_weights and not net.num_parameters():
        _out(f"(a bare {net.config.type} layer declares no input: its output shape and its weights, set from the "
             "file, are made on its first forward pass)")
    return 0


def _model_from(path: str, be: Any) -> Layer:
    """The network of a model file: an ONNX model, a leafpy (or Leaf) model, a checkpoint's network, or a run
    directory's model.leaf."""
    if path.endswith(".onnx"):
        from . import onnx

        return onnx.load(path, be)
    if os.path.isdir(path):
        path = os.path.join(path, "model.leaf")
    from .serialization import file_kind

    if file_kind(path) != "checkpoint":  # a model file's own errors (naming it), whatever else it might be
        return Layer.load(be, path)
    config = saved_network_config(path)  # a checkpoint: its network
    try:
        net = Layer.from_config(be, config)
    except LeafpyError as e:
        raise type(e)(f"{path}: {e}") from None
    load_weights(net, path)
    beside = os.path.join(os.path.dirname(path), RUN_FILE)
    if os.path.isfile(beside):  # the run that wrote the checkpoint records how its model reads data
        net.preparation = _preparation(run_config.load(beside), path)
    return net


def convert_cmd(args: argparse.Namespace) -> int:
    kinds = (".onnx", ".leaf")
    if not args.output.endswith(kinds):
        raise LeafpyError(f"{args.output}: name the output .onnx (an ONNX model) or .leaf (a leafpy model)")
    if not (args.input.endswith(kinds) or os.path.isdir(args.input)):
        raise LeafpyError(f"{args.input}: give an .onnx or .leaf model (or a checkpoint.leaf, or a run directory)")
    if args.output.endswith(".onnx"):
        from .onnx.exporter import MAX_OPSET, MIN_OPSET

        if not MIN_OPSET <= args.opset <= MAX_OPSET:
            raise LeafpyError(f"--opset {args.opset}: expected an ONNX opset from {MIN_OPSET} to {MAX_OPSET}")
    net = _model_from(args.input, get_backend("native"))
    if args.output.endswith(".onnx"):
        from . import onnx

        onnx.export(net, args.output, opset=args.opset)
    else:
        net.save(args.output)
    _out(f"leafpy: {args.input} -> {args.output} (network '{net.name}', {net.num_parameters()} parameters)")
    prep = net.preparation
    if args.output.endswith(".onnx") and prep is not None and (prep.mean or prep.class_names):
        from .onnx.exporter import PREPARATION_KEY

        told = [what for what, given in (("takes inputs normalised as (x - mean) / std", prep.mean),
                                          ("gives targets in standard units (y * std + mean)", prep.target_mean),
                                          ("scores classes by number", prep.class_names)) if given]
        _out(f"note: the ONNX graph {', '.join(told)}; the values and names are in its metadata "
             f"({PREPARATION_KEY}), which leafpy predict applies; other programs apply them themselves")
    return 0


def export_cmd(args: argparse.Namespace) -> int:
    from . import web

    if not (args.model.endswith((".onnx", ".leaf")) or os.path.isdir(args.model)):
        raise LeafpyError(f"{args.model}: give a model (.leaf or .onnx), a checkpoint.leaf or a run directory")
    if os.path.isdir(args.model) and not os.path.isfile(os.path.join(args.model, "model.leaf")):
        raise LeafpyError(f"{args.model}: no model.leaf in this folder; give a run directory that leafpy train "
                          "finished, or a model file")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(1 <= b <= web.MAX_BATCH for b in sizes):
        raise LeafpyError(f"--batch-sizes {args.batch_sizes}: expected comma-separated integers from 1 to "
                          f"{web.MAX_BATCH}, e.g. 1,8,32")
    net = _model_from(args.model, get_backend("native"))
    written = web.export(net, args.web, batch_sizes=sizes, precision=args.precision)
    lacking = args.precision == "auto" and "fp16" not in written  # auto leaves fp16 out only for the adapter
    note = " (no fp16 plans: this machine's WebGPU adapter lacks shader-f16)" if lacking else ""
    _out(f"leafpy: {args.model} -> {args.web} (network '{net.name}', batch sizes "
         f"{', '.join(map(str, sorted({1, *sizes})))}, precisions {', '.join(written)}{note}): serve the folder "
         f"(python -m http.server -d {args.web}) and open index.html in a browser with WebGPU")
    return 0


def _path(text: str) -> str:
    """An argument naming a file or directory: an empty one (an unset shell variable, ``--resume "$CKPT"``) is
    refused, where it would silently mean the default (a fresh run instead of the one to continue)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (an unset shell variable?)")
    return text


def _integer(check: Any, expected: str) -> Any:
    """An argparse type: an integer that ``check`` (one of _checks' counts) takes, within the run file's bound (a
    run.yaml recording more could not be read)."""
    def parse(text: str) -> int:
        try:
            return check("argument", int(text))
        except (ValueError, LeafpyError):
            raise argparse.ArgumentTypeError(f"expected {expected} up to {_checks.INT_LIMIT}, got {text!r}") from None
    return parse


_epochs = _integer(_checks.positive_int, "a positive integer")
_seed = _integer(_checks.non_negative_int, "a non-negative integer")


def _command(sub: Any, name: str, func: Any, summary: str, description: str, *, weights: bool = False,
             backend: bool = True) -> argparse.ArgumentParser:
    """A subcommand taking a run file, ``--set`` overrides and, where it runs a network, the backend."""
    c = sub.add_parser(name, help=summary, description=description)
    c.add_argument("config", type=_path, help="a YAML run file (or a shipped one's name), or a run directory that "
                   "leafpy train wrote" + (", or a model or checkpoint file (.leaf or .onnx)" if name != "train"
                                           else ""))
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one value of the run file, e.g. solver.base_lr=0.01 or "
                   "network.layers.conv1.num_output=32 (repeatable)")
    if weights:
        c.add_argument("--weights", type=_path, help="a model.leaf or checkpoint.leaf file (default: the run "
                       "directory's model.leaf)")
    if backend:
        c.add_argument("--backend", choices=BACKEND_NAMES, help="default: the run's train.backend, else native")
        c.add_argument("--precision", choices=PRECISIONS, help="fp32, tf32, or mixed bf16 or fp16 (fp32 master "
                       "weights); default: the run's train.precision, else fp32")
    c.set_defaults(func=func)
    return c


class _RankParser(argparse.ArgumentParser):
    """The parser of a rank a launcher started: a refused argument is a LeafpyError, which ends every rank with
    its message, not a usage text and exit status 2 on one of them."""

    def error(self, message: str) -> Any:
        raise LeafpyError(f"{self.prog}: {message}")


def build_parser(parser: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser(prog="leafpy", description="Train and evaluate leafpy networks from YAML run files.")
    p.add_argument("--version", action="version", version=f"leafpy {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = _command(sub, "train", train, "train a run file's network", "Train a run file's network; a checkpoint is "
                 "written after each epoch, and Ctrl-C saves one and stops.")
    t.add_argument("--epochs", type=_epochs, help="train up to this epoch (default: the run file's train.epochs)")
    t.add_argument("--out", type=_path, help="output directory (default: the --resume checkpoint's directory, else "
                   "runs/NAME)")
    t.add_argument("--resume", type=_path, metavar="CHECKPOINT", help="continue from a checkpoint")
    t.add_argument("--weights", type=_path, metavar="FILE", help="start a new run from the weights of a model.leaf or "
                   "checkpoint.leaf, matched by name (fine-tuning: weights the file lacks keep their initial values, "
                   "weights the network lacks are ignored)")
    t.add_argument("--seed", type=_seed, help="seed for the initial weights, dropout, shuffling and the held-out "
                   "split (solver.seed and data.seed; --set solver.seed=S keeps the run file's split)")
    t.add_argument("--overwrite", action="store_true", help="replace another run's files in --out")
    t.add_argument("--nproc", type=int, help="train data-parallel on this many local processes (under mpiexec)")
    a = _command(sub, "evaluate", evaluate_cmd, "held-out loss and accuracy of saved weights",
                 "Evaluate saved weights (a model or a checkpoint) on the run's held-out data.", weights=True)
    a.add_argument("--confusion", type=_path, metavar="FILE.csv", help="write the whole confusion matrix to this CSV "
                   f"file (past {SUMMARISED_CLASSES} classes only a summary is printed)")
    r = _command(sub, "predict", predict_cmd, "run saved weights on new samples",
                 "Run saved weights (a model or a checkpoint) on new samples (images, a CSV table, an .npz "
                 "file); prints the top classes by name and writes them (or the outputs) with --out.", weights=True)
    r.add_argument("--input", type=_path, required=True, help="an image, a folder of images, a CSV table with the "
                   "run's feature columns, or an .npz file with the samples as x (np.savez(path, x=...))")
    r.add_argument("--out", type=_path, help="write the outputs (and classes) to this .npz or .csv file")
    v = sub.add_parser("convert", help="convert a model between ONNX and leafpy's format",
                       description="Convert a model by the files' suffixes: .onnx -> .leaf imports an ONNX model, "
                       ".leaf (a model, a checkpoint's network or a run directory) -> .onnx exports one.")
    v.add_argument("input", type=_path, help="an .onnx or .leaf model, a checkpoint.leaf, or a run directory")
    v.add_argument("output", type=_path, help="the file to write: .onnx or .leaf")
    v.add_argument("--opset", type=int, default=17, help="the ONNX opset to write (13 to 23; default 17)")
    v.set_defaults(func=convert_cmd)
    e = sub.add_parser("export", help="export a model to run in a web browser (WebGPU)",
                       description="Write a static folder that runs the model in a web browser on WebGPU: "
                       "leafpy.js, index.html (a demo page) and model/ (the forward pass as dispatches, the weights, "
                       "the WGSL, class names and input normalisation).")
    e.add_argument("--web", type=_path, metavar="DIR", required=True, help="the folder to write")
    e.add_argument("model", type=_path, help="a model (.leaf or .onnx), a checkpoint.leaf, or a run directory")
    e.add_argument("--batch-sizes", default="1,8,32", help="the batch sizes to record plans for, comma-separated "
                   "(1 is always added; leafpy.js splits and pads other batch sizes over them; default 1,8,32)")
    e.add_argument("--precision", choices=("auto", "fp32", "fp16", "both"), default="auto",  # web.PRECISIONS
                   help="the plans to record: fp32, fp16 (float16, for browsers whose adapter offers shader-f16), "
                   "both, or auto (the default: both where this machine's WebGPU adapter offers shader-f16, else "
                   "fp32); leafpy.js picks fp16 where the browser can run it")
    e.set_defaults(func=export_cmd)
    _command(sub, "summary", summary_cmd, "table of layers, output shapes and parameter counts",
             "Print the network's layers, output shapes and parameter counts.", backend=False)
    return p


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) outside the training loop, which handles its own: it ends the command as
    Ctrl-C does, with a message and exit code 130, instead of killing it without a word."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _stop_signals_interrupt() -> Any:
    """While the command runs, SIGTERM and SIGHUP (where not ignored) raise :class:`Interrupted`; the training
    loop puts its own handlers (checkpoint, then stop) in place while it runs."""
    import threading

    from .train import STOP_SIGNALS

    previous = []
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            handler = signal.getsignal(sig)
            if sig != signal.SIGINT and handler is signal.SIG_DFL:
                previous.append((sig, handler))
                signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in previous:
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    with _stop_signals_interrupt():
        try:
            return _main(argv)
        except KeyboardInterrupt as e:
            print(f"leafpy: interrupted ({e.args[0] if isinstance(e, Interrupted) else 'SIGINT'})", file=sys.stderr)
            return 130


def _main(argv: Sequence[str] | None) -> int:
    from .distributed.group import launched_size

    if launched_size() > 1:
        return _as_rank(argv)
    return _run_command(argv)


def _as_rank(argv: Sequence[str] | None) -> int:
    """One rank of a job a launcher started (mpiexec, srun): it joins the job before anything can fail, so that an
    error on one rank alone (its run file missing or different on its node, a bad argument) ends every rank, where
    the others would wait for it at start forever."""
    from . import distributed

    try:
        group = distributed.init()
    except LeafpyError as e:
        print(f"leafpy: error: {e}", file=sys.stderr)
        return 1
    with distributed.failing_rank_ends_the_job(group):
        return _run_command(argv, raising=True)


def _run_command(argv: Sequence[str] | None, *, raising: bool = False) -> int:
    """Parse and run one command; ``raising``: a LeafpyError propagates (to a rank's failing_rank_ends_the_job)
    instead of being printed here."""
    args = build_parser(_RankParser if raising else argparse.ArgumentParser).parse_args(argv)
    _lost_output.clear()
    try:
        if getattr(args, "nproc", None) is not None:
            from .distributed.group import launched_size

            if args.nproc <= 0:
                raise LeafpyError(f"--nproc: expected a positive number of processes, got {args.nproc}")
            if launched_size() > 1:
                raise LeafpyError(f"--nproc {args.nproc}: this process is already one of {launched_size()} ranks a "
                                  "launcher started; drop --nproc under mpiexec or srun (or run leafpy train --nproc "
                                  "N without a launcher)")
            return _relaunch(args, list(sys.argv[1:] if argv is None else argv))
        code = args.func(args)
        if _lost_output and code == 0:
            print(f"leafpy: error: standard output could not be written ({_lost_output[0]})", file=sys.stderr)
            return 1
        return code
    except LeafpyError as e:
        if raising:
            raise
        print(f"leafpy: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (leafpy summary ... | head): stop quietly, as SIGPIPE would
        _to_devnull(sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + 13
    finally:
        if _lost_output:  # standard output back where it was, for what the process does after this command
            _restore_stdout()


if __name__ == "__main__":
    sys.exit(main())
