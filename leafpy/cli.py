"""The ``leafpy`` command: train, evaluate, apply and summarise networks described by YAML run files.

    leafpy train RUN.yaml [--backend B] [--epochs N] [--out DIR] [--resume CHECKPOINT] [--seed S]
    leafpy evaluate RUN.yaml --weights FILE [--backend B]
    leafpy predict RUN.yaml --weights FILE --input SAMPLES.npz [--out PREDICTIONS.npz|.csv] [--backend B]
    leafpy summary RUN.yaml

Every command takes ``--set KEY=VALUE`` (repeatable) to change one value of the run file. A run whose objective
has classes (NegativeLogLikelihood) reports accuracy and a confusion matrix; one without (MeanSquaredError) is a
regression, scored by its held-out loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from . import config as run_config
from . import data as datasets
from .backends import BACKEND_NAMES
from .backends import backend as get_backend
from .errors import LeafpyError
from .layers.container.sequential import Sequential
from .layers.layer import Layer, layout_hint, same_layout
from .metrics import ConfusionMatrix, predictions
from .serialization import atomic_write, load_weights
from .solvers.solver import Solver


class TrainingDiverged(LeafpyError):
    """The loss became NaN or infinite."""


def _out(msg: str = "") -> None:
    print(msg, flush=True)


# --- summary --------------------------------------------------------------------------------------------------
def summary_rows(layer: Layer, depth: int = 0) -> list[tuple[str, str, str, int]]:
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
    out.append(f"total parameters: {net.num_parameters():,}")
    return "\n".join(out)


# --- evaluation -----------------------------------------------------------------------------------------------
def is_classifier(run: run_config.RunConfig) -> bool:
    """Whether the run's objective scores classes (a layer of it has num_classes, as NegativeLogLikelihood does);
    otherwise it regresses on values (MeanSquaredError)."""
    return any(getattr(layer.config, "num_classes", None) is not None for layer in run.objective.config.layers)


@dataclasses.dataclass
class Scores:
    """A network on held-out data: the objective's mean over the samples and, for classes, the confusion matrix."""

    loss: float
    matrix: ConfusionMatrix | None


def evaluate(net: Layer, objective: Layer, x: np.ndarray, y: np.ndarray, num_classes: int,
             batch_size: int) -> Scores:
    net.set_training(False)
    cm = ConfusionMatrix(num_classes) if num_classes else None
    total = 0.0
    for xb, yb in datasets.batches(x, y, batch_size, seed=None):
        out = net.forward([xb])[0]
        total += float(objective.forward([out, yb])[0].to_numpy().reshape(-1)[0]) * len(xb)
        if cm is not None:
            cm.add(predictions(out), yb)
    net.set_training(True)
    return Scores(total / len(x), cm)


def first_non_finite(net: Layer, xb: np.ndarray) -> str:
    """The first layer (in network order) whose output is NaN or infinite for this batch."""
    net.forward([xb])

    def walk(layer: Layer) -> str | None:
        if isinstance(layer, Sequential):
            for child in layer.layers:
                found = walk(child)
                if found:
                    return found
            return None
        for t in layer.outputs:
            if not np.all(np.isfinite(t.to_numpy())):
                return f"layer '{layer.name}' ({layer.config.type})"
        return None

    bad_weights = [n for n, w in zip(net.learnable_weights_names(), net.learnable_weights_data())
                   if not np.all(np.isfinite(w.to_numpy()))]
    found = walk(net)
    if found:
        return found + (f"; non-finite weights: {', '.join(bad_weights)}" if bad_weights else "")
    return "the objective (every network output is finite)"


def check_samples(run: run_config.RunConfig, shape: Sequence[int], what: str) -> None:
    """Samples of this per-sample shape fit the network's input (the same shape, or one the network reshapes
    them to without guessing a layout: see leafpy.layers.layer.same_layout)."""
    name, declared = run.network.config.inputs[0]
    if tuple(shape) != tuple(declared[1:]) and math.prod(declared[1:]) == math.prod(shape) \
            and not same_layout(tuple(shape), tuple(declared[1:])):
        hint = layout_hint((declared[0], *shape), declared, "x", first=1)
        raise LeafpyError(f"{what} have shape {list(shape)}, but the network's input {name!r} is declared "
                          f"{list(declared)}{hint}; convert the data (or declare [{declared[0]}, "
                          f"{', '.join(map(str, shape))}] if that is the network's real layout)")
    if math.prod(declared[1:]) != math.prod(shape):
        raise LeafpyError(f"{what} have shape {list(shape)}, but the network's input {name!r} is declared "
                          f"{list(declared)}; declare [{declared[0]}, {', '.join(map(str, shape))}] in network.inputs")


def load_data(run: run_config.RunConfig) -> datasets.Dataset:
    """The run's dataset (class labels or regression values, as its objective needs), checked against the
    network's input and the objective before any training."""
    classes = is_classifier(run)
    ds = datasets.load(run.data, targets="classes" if classes else "values",
                       input_shape=run.network.config.inputs[0][1][1:])
    check_samples(run, ds.input_shape, f"data: the {ds.name} samples")
    if classes:
        for layer in run.objective.config.layers:
            n = getattr(layer.config, "num_classes", None)
            if n is not None and ds.num_classes > n:
                raise LeafpyError(f"data: the {ds.name} labels go up to {ds.num_classes - 1}, but objective layer "
                                  f"'{layer.name}' has num_classes {n}; set it (and the network's output size) to "
                                  f"{ds.num_classes}")
    else:
        inputs = run.objective.config.inputs
        target_name, target = inputs[-1]
        if len(inputs) < 2 or math.prod(target[1:]) != math.prod(ds.target_shape):
            raise LeafpyError(f"data: the {ds.name} targets have shape {list(ds.target_shape)} per sample, but the "
                              f"objective's target input {target_name!r} is declared {list(target)}; declare "
                              f"[{target[0]}, {', '.join(map(str, ds.target_shape))}] in objective.inputs")
    return ds


# --- train ------------------------------------------------------------------------------------------------------
def _plot(history: list[dict], path: str) -> bool:
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
    fig.savefig(path)
    plt.close(fig)
    return True


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (a log file, CI), where it would only add lines
    return tqdm(total=total, desc=desc, unit="batch", leave=False, mininterval=0.25, dynamic_ncols=True,
                file=sys.stderr, disable=None)


def train(args: argparse.Namespace) -> int:
    run = run_config.load(args.config, args.set)
    if args.seed is not None:
        run.data["seed"] = args.seed
        run.solver = dataclasses.replace(run.solver, seed=args.seed)
    epochs = args.epochs if args.epochs is not None else run.epochs
    be = get_backend(args.backend)
    ds = load_data(run)
    batch = run.batch_size
    out_dir = args.out or os.path.join("runs", run.name or "run")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise LeafpyError(f"--out {out_dir}: cannot create the output directory: {e.strerror or e}") from e
    ckpt_path = os.path.join(out_dir, "checkpoint.leaf")
    if args.resume:
        solver = Solver.load_checkpoint(be, be, args.resume)
        for part in ("network", "objective"):
            if getattr(solver.config, part) != getattr(run.solver, part):
                raise LeafpyError(f"{args.resume}: this checkpoint's {part} differs from the one in {args.config}; "
                                  "resume with the run file it was trained from")
    else:
        solver = Solver.from_config(be, be, run.solver)
    net = solver.network
    objective = Layer.from_config(be, run.solver.objective)  # scores held-out data beside the solver's own
    batches_per_epoch = math.ceil(len(ds.x_train) / batch)
    updates_per_epoch = max(1, batches_per_epoch // run.solver.minibatch_size)
    start_epoch = solver.iteration // updates_per_epoch
    history_path = os.path.join(out_dir, "history.json")
    history: list[dict] = []
    if args.resume and os.path.exists(history_path):
        with open(history_path) as f:
            history = [h for h in json.load(f) if h["epoch"] <= start_epoch]
    _out(f"leafpy: training {run.name or args.config} on {be.name}: {len(ds.x_train)} training and "
         f"{len(ds.x_test)} held-out samples ({ds.name}), batch {batch}, {net.num_parameters():,} parameters, "
         f"epochs {start_epoch + 1}..{epochs}")
    running = ConfusionMatrix(ds.num_classes, capacity=10 * batch) if ds.num_classes else None
    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    epoch = start_epoch
    try:
        for epoch in range(start_epoch, epochs):
            bar = _progress(batches_per_epoch, f"epoch {epoch + 1}/{epochs}")
            t0 = time.perf_counter()
            seen = 0
            losses = []
            for xb, yb in datasets.batches(ds.x_train, ds.y_train, batch, seed=int(run.data.get("seed", 0)),
                                           epoch=epoch):
                out = solver.train_minibatch(xb, yb)
                loss = solver.loss()
                if not math.isfinite(loss):
                    where = first_non_finite(net, xb)
                    raise TrainingDiverged(
                        f"the loss became {loss} at iteration {solver.iteration}; first non-finite output: {where}. "
                        f"The last good checkpoint is {ckpt_path if os.path.exists(ckpt_path) else 'not written yet'}"
                        "; try a smaller base_lr or clip_gradients")
                losses.append(loss)
                if running is not None:
                    running.add(predictions(out), yb)
                seen += len(xb)
                if bar is not None:
                    rate = seen / max(time.perf_counter() - t0, 1e-9)
                    acc = f" acc {running.accuracy():.1%}" if running is not None else ""
                    bar.set_postfix_str(f"loss {loss:.4f}{acc} {rate:,.0f} samples/s", refresh=False)
                    bar.update(1)
                if interrupted:
                    break
            if bar is not None:
                bar.close()
            if interrupted:
                solver.save_checkpoint(ckpt_path)
                _out(f"interrupted at iteration {solver.iteration}: checkpoint saved to {ckpt_path}; "
                     f"continue with --resume {ckpt_path}")
                return 130
            elapsed = time.perf_counter() - t0
            held_out = evaluate(net, objective, ds.x_test, ds.y_test, ds.num_classes, batch)
            lr = run.solver.learning_rate(max(solver.iteration - 1, 0))  # the epoch's last update's rate
            record = {"epoch": epoch + 1, "iteration": solver.iteration, "loss": float(np.mean(losses)),
                      "test_loss": held_out.loss, "learning_rate": lr, "seconds": elapsed,
                      "samples_per_second": seen / elapsed}
            line = f"epoch {epoch + 1}/{epochs}: loss {record['loss']:.4f}, held-out loss {held_out.loss:.4f}"
            if held_out.matrix is not None and running is not None:
                record["train_accuracy"] = running.accuracy()
                record["test_accuracy"] = held_out.matrix.accuracy()
                line += (f", training accuracy {record['train_accuracy']:.2%}, held-out accuracy "
                         f"{record['test_accuracy']:.2%}")
            history.append(record)
            solver.save_checkpoint(ckpt_path)
            with open(history_path, "w") as f:
                json.dump(history, f, indent=1)
            _out(f"{line}, lr {lr:.3g} ({elapsed:.1f} s, {record['samples_per_second']:,.0f} samples/s)")
    finally:
        signal.signal(signal.SIGINT, previous)
    model_path = os.path.join(out_dir, "model.leaf")
    net.save(model_path)
    final = evaluate(net, objective, ds.x_test, ds.y_test, ds.num_classes, batch)
    if final.matrix is not None:
        _out("\nconfusion matrix on the held-out set:")
        _out(str(final.matrix))
    if history and _plot(history, os.path.join(out_dir, "training.png")):
        _out(f"plot: {os.path.join(out_dir, 'training.png')}")
    _out(f"model: {model_path}  checkpoint: {ckpt_path}")
    _report(final)
    return 0


def _report(scores: Scores) -> None:
    _out(f"held-out loss: {scores.loss:.6g}")
    if scores.matrix is not None:
        _out(f"held-out accuracy: {scores.matrix.accuracy():.2%}")


def evaluate_cmd(args: argparse.Namespace) -> int:
    run = run_config.load(args.config, args.set)
    be = get_backend(args.backend)
    ds = load_data(run)
    net = Layer.from_config(be, run.network)
    load_weights(net, args.weights)
    scores = evaluate(net, Layer.from_config(be, run.objective), ds.x_test, ds.y_test, ds.num_classes,
                      run.batch_size)
    if scores.matrix is not None:
        _out(str(scores.matrix))
    _report(scores)
    return 0


def predict_cmd(args: argparse.Namespace) -> int:
    if args.out and not args.out.endswith((".npz", ".csv")):
        raise LeafpyError(f"--out {args.out}: predictions are written as .npz or .csv; name the file so")
    run = run_config.load(args.config, args.set)
    be = get_backend(args.backend)
    x = datasets.npz_samples(args.input)
    check_samples(run, x.shape[1:], f"{args.input}: the samples")
    net = Layer.from_config(be, run.network)
    load_weights(net, args.weights)
    net.set_training(False)
    batch = run.batch_size
    outputs = np.concatenate([net.forward([x[i:i + batch]])[0].to_numpy() for i in range(0, len(x), batch)])
    classes = predictions(outputs) if is_classifier(run) else None
    if args.out:
        write_predictions(args.out, outputs, classes)
    _out(f"leafpy: {len(x)} samples of {args.input} through {args.weights}: outputs {list(outputs.shape)}")
    if classes is not None:
        counts = np.bincount(classes)
        _out("predicted classes: " + ", ".join(f"{k}: {n}" for k, n in enumerate(counts) if n))
        shown = " ".join(map(str, classes[:20])) + (" ..." if len(classes) > 20 else "")
        _out(f"first samples: {shown}")
    _out(f"written: {args.out}" if args.out else "write them with --out FILE.npz or FILE.csv")
    return 0


def write_predictions(path: str, outputs: np.ndarray, classes: np.ndarray | None) -> None:
    """``outputs`` (and ``classes``) into an .npz file, or a .csv file of one row per sample (atomically)."""
    if path.endswith(".csv"):
        flat = outputs.reshape(len(outputs), -1)
        header = [f"output_{i}" for i in range(flat.shape[1])]
        rows = flat if classes is None else np.column_stack([classes, flat])
        if classes is not None:
            header.insert(0, "class")
        text = io.StringIO()
        fmt = (["%d"] if classes is not None else []) + ["%.9g"] * flat.shape[1]
        np.savetxt(text, rows, fmt=fmt, delimiter=",", header=",".join(header), comments="")
        data = text.getvalue().encode()
    else:
        buf = io.BytesIO()
        np.savez(buf, outputs=outputs, **({"classes": classes} if classes is not None else {}))
        data = buf.getvalue()
    atomic_write(path, data)


def summary_cmd(args: argparse.Namespace) -> int:
    run = run_config.load(args.config, args.set)
    net = Layer.from_config(get_backend("native"), run.network)
    _out(f"{run.name or args.config}: network '{net.name}'")
    _out(summary_text(net))
    return 0


def _command(sub: Any, name: str, func: Any, summary: str, description: str, *, weights: bool = False,
             backend: bool = True) -> argparse.ArgumentParser:
    """A subcommand taking a run file, ``--set`` overrides and, where it runs a network, the backend."""
    c = sub.add_parser(name, help=summary, description=description)
    c.add_argument("config", help="the YAML run file")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one value of the run file, e.g. solver.base_lr=0.01 or "
                   "network.layers.conv1.num_output=32 (repeatable)")
    if weights:
        c.add_argument("--weights", required=True, help="a model.leaf or checkpoint.leaf file")
    if backend:
        c.add_argument("--backend", choices=BACKEND_NAMES, default="native")
    c.set_defaults(func=func)
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafpy", description="Train and evaluate leafpy networks from YAML run files.")
    p.add_argument("--version", action="version", version=f"leafpy {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = _command(sub, "train", train, "train a run file's network", "Train a run file's network; a checkpoint is "
                 "written after each epoch, and Ctrl-C saves one and stops.")
    t.add_argument("--epochs", type=int, help="train up to this epoch (default: the run file's train.epochs)")
    t.add_argument("--out", help="output directory (default: runs/NAME)")
    t.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint")
    t.add_argument("--seed", type=int, help="seed for weights, dropout and shuffling")
    _command(sub, "evaluate", evaluate_cmd, "held-out loss and accuracy of saved weights",
             "Evaluate saved weights (a model or a checkpoint) on the run's held-out data.", weights=True)
    r = _command(sub, "predict", predict_cmd, "run saved weights on new samples",
                 "Run saved weights (a model or a checkpoint) on the samples x of an .npz file; prints the "
                 "predicted classes and writes the outputs with --out.", weights=True)
    r.add_argument("--input", required=True, help="an .npz file with the samples as x (np.savez(path, x=...))")
    r.add_argument("--out", help="write the outputs (and classes) to this .npz or .csv file")
    _command(sub, "summary", summary_cmd, "table of layers, output shapes and parameter counts",
             "Print the network's layers, output shapes and parameter counts.", backend=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "epochs", None) is not None and args.epochs <= 0:
        print("leafpy: error: --epochs must be a positive integer", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except LeafpyError as e:
        print(f"leafpy: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
