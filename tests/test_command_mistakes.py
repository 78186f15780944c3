"""Mistakes users make on the ``leafpy`` command line and in run files, each meeting a clear error (or, where a
value means the default, the default) instead of a silent change of meaning, a traceback or a lost file."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import child_env

import leafpy as lp
from leafpy import cli, config

ROOT = Path(__file__).resolve().parent.parent
MLP = yaml.safe_load((ROOT / "leafpy" / "configs" / "digits_mlp.yaml").read_text())


def leafpy(capsys, *args: str) -> tuple[int, str, str]:
    """The command in this process: exit code, stdout, stderr (argparse's refusals exit with code 2)."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write(path: Path, doc: dict) -> str:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def run_doc(**changes) -> dict:
    doc = copy.deepcopy(MLP)
    doc.update(changes)
    return doc


@pytest.mark.parametrize("option", ["--resume", "--weights", "--out"])
def test_an_empty_path_is_refused_not_taken_for_the_default(capsys, tmp_path, option, monkeypatch):
    # `--resume "$CKPT"` with CKPT unset: a fresh run would replace the one to continue
    monkeypatch.chdir(tmp_path)
    code, out, err = leafpy(capsys, "train", "digits_mlp", "--epochs", "1", option, "")
    assert code == 2 and f"argument {option}: expected a path, got ''" in err
    assert not (tmp_path / "runs").exists()


def test_epochs_beyond_what_a_run_file_can_record_is_refused(capsys):
    code, _, err = leafpy(capsys, "train", "digits_mlp", "--epochs", str(2**70))
    assert code == 2 and "argument --epochs: expected a positive integer up to" in err
    code, _, err = leafpy(capsys, "train", "digits_mlp", "--seed", "-1")
    assert code == 2 and "argument --seed: expected a non-negative integer" in err


def test_an_objective_without_a_loss_is_refused(capsys, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.random((96, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 10, 96))
    objective = {"type": "Sequential", "inputs": [{"name": "network_out", "shape": [32, 10]},
                                                  {"name": "label", "shape": [32, 1]}],
                 "layers": [{"name": "squash", "type": "Sigmoid"}]}
    doc = run_doc(data={"dataset": "npz", "path": str(tmp_path / "d.npz"), "batch_size": 32},
                  objective=objective)
    code, out, err = leafpy(capsys, "train", write(tmp_path / "r.yaml", doc), "--epochs", "1", "--out",
                            str(tmp_path / "run"))
    assert code == 1, out
    assert "solver.objective: its output ('objective') has shape [32, 10], where a loss is one value" in err
    assert "loss" not in out


def test_null_for_a_train_setting_means_its_default(capsys, tmp_path):
    code, out, err = leafpy(capsys, "train", "digits_mlp", "--epochs", "1", "--out", str(tmp_path / "run"),
                            "--set", "train.log_every=null", "--set", "train.backend=null")
    assert code == 0, err
    assert "epoch 1/1" in out


def test_set_with_a_non_ascii_digit_is_a_name_not_an_index(capsys):
    code, _, err = leafpy(capsys, "summary", "digits_mlp", "--set", "network.layers.\u00b2.output_size=3")
    assert code == 1 and "no entry named '\u00b2'" in err
    code, _, err = leafpy(capsys, "summary", "digits_mlp", "--set", "network.layers.\u0661.output_size=3")
    assert code == 1 and "no entry named '\u0661'" in err


def test_set_on_a_model_used_without_a_run_file_is_refused(capsys, tmp_path):
    cfg = lp.SequentialConfig(inputs=[("data", [1, 4])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    model = str(tmp_path / "alone" / "model.leaf")
    os.makedirs(os.path.dirname(model))
    lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg)).save(model)
    np.savez(tmp_path / "x.npz", x=np.ones((3, 4), np.float32))
    code, _, err = leafpy(capsys, "summary", model, "--set", "network.layers.fc.output_size=3")
    assert code == 1 and "--set changes a run file" in err
    code, out, err = leafpy(capsys, "predict", model, "--input", str(tmp_path / "x.npz"), "--set", "solver.x=1")
    assert code == 1 and "--set changes a run file" in err, out


def test_a_run_file_named_run_yaml_in_the_output_directory_is_replaced_only_with_overwrite(capsys, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(run_doc()) + "# my notes on this run\n"
    (tmp_path / "run.yaml").write_text(text)
    code, _, err = leafpy(capsys, "train", "run.yaml", "--out", ".", "--epochs", "1")
    assert code == 1 and "which would replace it (a file of your own" in err
    assert (tmp_path / "run.yaml").read_text() == text
    # a finished run's directory, and one whose run failed before its first checkpoint (its run.yaml alone, the
    # resolved one leafpy wrote), train again there with --overwrite
    code, _, err = leafpy(capsys, "train", "digits_mlp", "--out", "r", "--epochs", "1")
    assert code == 0, err
    code, _, err = leafpy(capsys, "train", "r", "--out", "r", "--epochs", "1", "--overwrite")
    assert code == 0, err
    code, _, err = leafpy(capsys, "train", "digits_mlp", "--out", "nan", "--epochs", "1", "--set", "solver.base_lr=1e6")
    assert code == 1 and sorted(os.listdir("nan")) == ["run.yaml"], err
    code, _, err = leafpy(capsys, "train", "nan", "--overwrite", "--epochs", "1", "--set", "solver.base_lr=0.05")
    assert code == 0, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_after_a_command_whose_output_was_lost_the_next_one_prints(tmp_path):
    """Standard output full for one command run in a process (cli.main), then writable again: the next command
    prints and succeeds (the first left standard output on /dev/null and every later command failing)."""
    script = ("import os, sys\nfrom leafpy import cli\nsaved = os.dup(1)\n"
              "os.dup2(os.open('/dev/full', os.O_WRONLY), 1)\nfirst = cli.main(['summary', 'digits_mlp'])\n"
              "os.dup2(saved, 1)\nsecond = cli.main(['summary', 'digits_mlp'])\n"
              "print('codes', first, second)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=child_env(),
                       timeout=300)
    assert "codes 1 0" in p.stdout and "total parameters" in p.stdout, (p.stdout, p.stderr)


@pytest.mark.skipif(not os.path.exists("/dev/full") or not os.path.isdir("/proc/self/fd"),
                    reason="no /dev/full or /proc/self/fd on this system")
def test_commands_run_in_a_loop_with_standard_output_full_keep_no_descriptors():
    """Each command whose standard output was full opened the null device for it and never closed that: 200
    commands run by cli.main in one process left 200 more descriptors open."""
    script = ("import os\nfrom leafpy import cli\nos.dup2(os.open('/dev/full', os.O_WRONLY), 1)\n"
              "cli.main(['summary', 'digits_mlp'])\nbefore = len(os.listdir('/proc/self/fd'))\n"
              "codes = {cli.main(['summary', 'digits_mlp']) for _ in range(50)}\n"
              "import sys\nprint('codes', codes, 'descriptors', before, len(os.listdir('/proc/self/fd')), "
              "file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=child_env(),
                       timeout=300)
    words = p.stderr.split("descriptors ")[-1].split()
    assert "codes {1}" in p.stderr and words[0] == words[1], p.stderr[-2000:]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_standard_output_drops_the_output_not_the_run(tmp_path):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--epochs", "1", "--out",
                            str(tmp_path / "run")], stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env=child_env(), timeout=300)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert "cannot write to standard output (No space left on device)" in p.stderr
    assert (tmp_path / "run" / "model.leaf").is_file()


@pytest.mark.parametrize("data, key, reader", [
    ({"dataset": "npz", "path": "d.npz", "channels": 3}, "channels", "image_folder does"),
    ({"dataset": "npz", "path": "d.npz", "skip_unreadable": "maybe"}, "skip_unreadable", "image_folder does"),
    ({"dataset": "npy", "path": {"x": "x.npy", "y": "y.npy"}, "memory_map": True}, "memory_map",
     "npz and image_folder do"),
    ({"dataset": "digits", "cache_dir": "/tmp"}, "cache_dir", "image_folder does"),
    ({"dataset": "csv", "path": "t.csv", "target": "y", "image_size": [9, 9]}, "image_size", "image_folder does"),
])
def test_a_data_key_the_dataset_does_not_read_is_refused(data, key, reader):
    with pytest.raises(lp.ConfigError, match=f"data.{key}: the {data['dataset']} dataset does not read it .*"
                                             f"{reader}"):
        config.from_dict(run_doc(data=dict(data, batch_size=32)), "r.yaml")


def test_errors_name_the_key_in_the_file():
    doc = run_doc()
    doc["network"]["layers"][1]["params"] = [{"filler": {"type": "gaussian", "std": -1}}]
    with pytest.raises(lp.ConfigError, match=r"^network\.layers\[1\]\.params\[0\]\.filler\.std: expected"):
        config.from_dict(doc, "r.yaml")
    doc = run_doc()
    doc["network"]["layers"][1]["name"] = doc["network"]["layers"][0]["name"]
    with pytest.raises(lp.ConfigError, match=r"^network\.layers\[1\]: two layers are named 'flat'"):
        config.from_dict(doc, "r.yaml")
    with pytest.raises(lp.ConfigError, match="train.backend: expected one of native, cuda, webgpu, got 'cudda'"):
        config.from_dict(run_doc(train={"backend": "cudda"}), "r.yaml")


@pytest.mark.parametrize("change, message", [
    ({"solver": False}, "solver: expected a mapping, got bool False"),
    ({"data": 0}, "data: expected a mapping, got int 0"),
    ({"train": ""}, "train: expected a mapping, got str ''"),
])
def test_a_false_or_empty_section_is_refused_not_taken_for_the_default(change, message):
    with pytest.raises(lp.ConfigError, match=message):
        config.from_dict(run_doc(**change), "r.yaml")


@pytest.mark.parametrize("key, value", [("inputs", 0), ("outputs", ""), ("inputs", 5), ("params", False)])
def test_a_layer_key_of_the_wrong_type_is_refused(key, value):
    doc = run_doc()
    doc["network"]["layers"][1][key] = value
    with pytest.raises(lp.ConfigError, match=rf"network\.layers\[1\].*{key}: expected a list"):
        config.from_dict(doc, "r.yaml")


def test_a_document_that_is_no_run_file_is_named_briefly(capsys, tmp_path):
    (tmp_path / "history.json").write_text(str([{"epoch": i, "loss": 0.5} for i in range(2000)]))
    code, _, err = leafpy(capsys, "summary", str(tmp_path / "history.json"))
    assert code == 1 and "expected a mapping, got list" in err and len(err) < 500
    (tmp_path / "empty.yaml").write_text("")
    code, _, err = leafpy(capsys, "summary", str(tmp_path / "empty.yaml"))
    assert code == 1 and "got nothing (an empty document" in err


def test_a_missing_backend_named_by_the_run_file_says_how_to_run_here():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the cuda backend may be usable")
    except ImportError:
        pass
    with pytest.raises(lp.BackendUnavailable, match="the run's train.backend is 'cuda'; --backend native runs it"):
        lp.backends.run_backend({"backend": "cuda"})
