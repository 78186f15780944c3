"""Run directories and run files as users meet them: `leafpy summary` on a run directory (summary prints a network,
scores nothing and takes no --weights), keys of a Sequential in YAML that must act or be refused, and the best
epochs a resumed run keeps. Each test checks what the user sees against what the command is documented to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

import leafpy as lp

ROOT = Path(__file__).resolve().parent.parent


def leafpy(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m leafpy ARGS`` in ``cwd`` with this checkout's leafpy."""
    env = child_env()
    return subprocess.run([sys.executable, "-m", "leafpy", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _run_directory(tmp_path: Path, *, model: bool) -> Path:
    """What `leafpy train` leaves: run.yaml and checkpoint.leaf, and model.leaf once the run ends."""
    be = lp.backend("native")
    run = lp.config.load("digits_mlp")
    d = tmp_path / "run"
    d.mkdir()
    lp.config.save(run, d / "run.yaml")
    lp.Solver.from_config(be, be, run.solver).save_checkpoint(str(d / "checkpoint.leaf"))
    if model:
        lp.Layer.from_config(be, run.network).save(str(d / "model.leaf"))
    return d


def test_summary_of_a_run_directory_with_a_data_setting_shows_the_network(tmp_path):
    """summary scores no held-out samples: a --set of the data section cannot mix training samples into them."""
    _run_directory(tmp_path, model=True)
    p = leafpy(tmp_path, "summary", "run", "--set", "data.seed=3")
    assert p.returncode == 0, p.stderr
    assert "total parameters" in p.stdout, p.stdout


def test_summary_of_a_stopped_run_names_no_option_it_lacks(tmp_path):
    """A run stopped before model.leaf: summary shows the network from run.yaml, or names a fix that works for
    summary (it takes no --weights)."""
    _run_directory(tmp_path, model=False)
    p = leafpy(tmp_path, "summary", "run")
    if p.returncode != 0 and "--weights run/checkpoint.leaf" in p.stderr:  # the fix it names must work
        fixed = leafpy(tmp_path, "summary", "run", "--weights", "run/checkpoint.leaf")
        assert fixed.returncode == 0, (p.stderr, fixed.stderr)


def test_the_outermost_network_cannot_name_a_blob_that_feeds_it(tmp_path):
    """`from` names a blob of the enclosing container; the outermost network has none, so a `from` there (a typo
    or a block pasted from a nested one) is refused instead of being kept and ignored."""
    text = (ROOT / "configs" / "digits_mlp.yaml").read_text().replace(
        "inputs: [{name: data, shape: [null, 1, 8, 8]}]",
        "inputs: [{name: data, shape: [null, 1, 8, 8], from: pixels}]")
    assert "from: pixels" in text
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(lp.errors.LeafpyError, match="from"):
        lp.Layer.from_config(lp.backend("native"), lp.config.load(str(tmp_path / "r.yaml")).network)


def test_params_on_a_nested_sequential_take_effect_or_are_refused():
    """`params: [{lr_mult: 0}]` on a nested Sequential in YAML: either its weights are frozen as asked, or the key is
    refused as a Sequential's, never accepted and dropped (the block would train while the run file says not)."""
    d = {"name": "n", "type": "Sequential", "inputs": [{"name": "data", "shape": [4, 6]}], "layers": [
        {"name": "fc0", "type": "Linear", "output_size": 5},
        {"name": "blk", "type": "Sequential", "inputs": [{"name": "a", "shape": [4, 5]}],
         "params": [{"lr_mult": 0.0}], "layers": [{"name": "fc1", "type": "Linear", "output_size": 3}]}]}
    try:
        net = lp.Layer.from_config(lp.backend("native"), lp.config.layer_from_dict(d))
    except lp.errors.ConfigError as e:
        assert "params" in str(e)
        return
    multipliers = dict(zip(net.learnable_weights_names(), (c.lr_mult for c in net.learnable_weights_configs())))
    assert multipliers["blk/fc1/weight"] == 0.0, multipliers


def test_a_run_resumed_from_an_earlier_best_epoch_keeps_no_best_file_of_the_epochs_it_replaced(tmp_path):
    """Resumed from best-epoch2.leaf, the run's epochs 3.. are new: a best-epoch4.leaf left from the epochs it
    replaced is not one of this run's (its history ends at epoch 3), so it must not stay beside them."""
    keep = ["--set", "train.keep_best=3", "--set", "train.monitor=test_loss"]
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "4", "--out", "run", *keep).returncode == 0
    assert (tmp_path / "run" / "best-epoch2.leaf").exists() and (tmp_path / "run" / "best-epoch4.leaf").exists()
    r = leafpy(tmp_path, "train", "run", "--resume", "run/best-epoch2.leaf", "--epochs", "3", *keep)
    assert r.returncode == 0, r.stderr
    epochs = [h["epoch"] for h in json.loads((tmp_path / "run" / "history.json").read_text())]
    assert epochs == [1, 2, 3]
    kept = sorted(int(p.name[len("best-epoch"):-len(".leaf")]) for p in (tmp_path / "run").glob("best-epoch*.leaf"))
    assert set(kept) <= set(epochs), kept


def test_evaluate_a_run_directory_with_weights_of_another_split_is_refused(tmp_path):
    """`leafpy evaluate DIR --weights OTHER/model.leaf`, OTHER trained with another seed: DIR's held-out samples are
    mostly OTHER's training samples, as with `leafpy evaluate DIR/run.yaml --weights ...`, which is refused."""
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "a").returncode == 0
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "b", "--seed", "3").returncode == 0
    as_file = leafpy(tmp_path, "evaluate", "a/run.yaml", "--weights", "b/model.leaf")
    assert as_file.returncode == 1 and "another data split" in as_file.stderr, as_file.stderr
    as_directory = leafpy(tmp_path, "evaluate", "a", "--weights", "b/model.leaf")
    assert as_directory.returncode == 1 and "another data split" in as_directory.stderr, as_directory.stdout


@pytest.mark.parametrize("options, refused", [({"keep_best": 1, "monitor": "val_accuracy"}, "monitor"),
                                              ({"keep_best": -1}, "keep_best")])
def test_the_trainer_from_python_refuses_best_epoch_settings_a_run_file_may_not_have(tmp_path, options, refused):
    """`lp.Trainer(run, keep_best=..., monitor=...)` takes what train.keep_best and train.monitor take: a run file
    with these values is refused before training, so the same values from Python must not silently keep nothing."""
    with pytest.raises(lp.errors.ConfigError, match=refused):
        lp.Trainer(lp.config.load("digits_mlp"), out_dir=str(tmp_path / "run"), log=lambda m: None,
                   **options).fit(1)
    with pytest.raises(lp.errors.ConfigError, match=f"train.{refused}"):
        lp.config.load("digits_mlp", [f"train.{key}={value}" for key, value in options.items()])


DOCS_TRAINER = """
import leafpy as lp
run = lp.config.load("digits_mlp")
trainer = lp.Trainer(run, backend=lp.backend("native"), out_dir="runs/mlp",
                     callbacks=[lp.train.EarlyStopping(monitor="test_loss", patience=3, min_delta=1e-3)])
history = trainer.fit(epochs=2)
trainer.save_model("runs/mlp/model.leaf")
print(f"trainer accuracy: {trainer.evaluate().accuracy:.2%}")
"""


def test_a_run_the_trainer_wrote_from_python_is_read_by_evaluate_summary_and_resume(tmp_path):
    """The Trainer example of docs/training.md leaves a run directory the commands take, as `leafpy train` does: its
    run.yaml is the resolved run (the data split, the backend and precision it ran on, the epochs it trained)."""
    env = child_env()
    p = subprocess.run([sys.executable, "-c", DOCS_TRAINER], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    trained = p.stdout.strip().splitlines()[-1].split(": ")[1]
    written = lp.config.load(tmp_path / "runs" / "mlp" / "run.yaml")
    assert written.train["backend"] == "native" and written.train["precision"] == "fp32"
    assert written.train["epochs"] == 2 and written.data["seed"] == 0 and written.data["dataset"] == "digits"
    assert written == lp.config.loads(lp.config.dumps(written))
    evaluated = leafpy(tmp_path, "evaluate", "runs/mlp")
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"held-out accuracy: {trained}" in evaluated.stdout, (trained, evaluated.stdout)
    summary = leafpy(tmp_path, "summary", "runs/mlp")
    assert summary.returncode == 0 and "total parameters" in summary.stdout, summary.stderr
    resumed = leafpy(tmp_path, "train", "runs/mlp", "--resume", "runs/mlp/checkpoint.leaf", "--epochs", "3")
    assert resumed.returncode == 0 and "epochs 3..3" in resumed.stdout, resumed.stderr


def test_a_run_file_whose_batch_follows_data_batch_size_resumes_and_scores_with_another_batch_size(tmp_path):
    """digits_mlp declares its batch `null` (data.batch_size): a network declared for 32 samples a batch is the
    same network for 16, so a resumed run or weights scored with another batch size are not refused."""
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run").returncode == 0
    resumed = leafpy(tmp_path, "train", "digits_mlp", "--out", "run", "--resume", "run/checkpoint.leaf",
                     "--epochs", "2", "--set", "data.batch_size=16")
    assert resumed.returncode == 0 and "batch 16" in resumed.stdout, resumed.stderr
    scored = leafpy(tmp_path, "evaluate", "digits_mlp", "--weights", "run/model.leaf", "--set", "data.batch_size=8")
    assert scored.returncode == 0 and "held-out accuracy" in scored.stdout, scored.stderr
