"""Malformed values in the files users hand leafpy (model files made by other writers, run files, CSV tables,
arrays), each through the command or the API a user goes through: a LeafpyError that names the place, never a
raw Python exception."""
from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from conftest import ROOT, child_env

import leafpy as lp
from leafpy import serialization as ser
from leafpy.errors import ConfigError, LeafpyError, SerializationError

HUGE = "1" + "0" * 400  # an integer past float's range (YAML and JSON read it as a Python int)


def leafpy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leafpy", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=child_env())


def _model(path) -> None:
    cfg = lp.SequentialConfig(inputs=[("data", [4, 1, 8, 8])])
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
    lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0).save(str(path))


def _with_preparation(path, text: str) -> None:
    """The model at ``path`` rewritten with another data-preparation record (a valid file: header, checksum)."""
    msg = ser.editable_message(path, "Layer")
    msg.preparation = text
    path.write_bytes(ser.encode(msg, "Layer"))


def _resealed(data: bytes) -> bytes:
    """A leafpy file's bytes with its checksum made right again after an edit, as another writer would."""
    size = struct.calcsize("<8sIIQQI")
    crc = zlib.crc32(data[size:], zlib.crc32(data[:size - 4])) & 0xFFFFFFFF
    return data[:size - 4] + struct.pack("<I", crc) + data[size:]


@pytest.mark.parametrize("record", ["not utf-8", "huge mean", "deep nesting"])
def test_a_model_whose_data_preparation_is_malformed_gives_a_clear_error(tmp_path, record):
    path = tmp_path / "model.leaf"
    _model(path)
    if record == "not utf-8":
        _with_preparation(path, '{"class_names": ["AAAAAAAAAAAAAAAA"]}')
        data = bytearray(path.read_bytes())
        data[data.index(b"AAAAAAAA")] = 0xFF
        path.write_bytes(_resealed(bytes(data)))
    else:
        _with_preparation(path, '{"normalize": {"mean": [' + HUGE + '], "std": [1]}}' if record == "huge mean"
                          else "[" * 100_000)
    with pytest.raises(SerializationError, match="model.leaf"):
        lp.Layer.load(lp.backend("native"), str(path))


@pytest.mark.parametrize("setting,says", [
    (f"solver.loss_scale={HUGE}", "solver.loss_scale"),
    (f"data.normalize={{mean: [{HUGE}], std: [1]}}", "data.normalize.mean"),
    ("data.class_names=7", "data.class_names"),
    ("data.class_names=abcdefghij", "data.class_names"),  # a string is no list of ten names
])
def test_malformed_run_settings_give_clear_errors_from_the_command(tmp_path, setting, says):
    r = leafpy("train", "configs/digits_mlp.yaml", "--epochs", "1", "--out", str(tmp_path / "run"), "--set", setting)
    assert r.returncode == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run" / "model.leaf").exists()


def test_a_huge_static_loss_scale_is_refused_by_the_solver_config():
    with pytest.raises(ConfigError, match="solver.loss_scale"):
        lp.SolverConfig(loss_scale=10 ** 400)


def test_a_csv_header_that_names_a_column_twice_is_refused(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("f1,f1,f3,label\n" + "".join(f"{i},{100 + i},{200 + i},{'ab'[i % 2]}\n" for i in range(8)))
    with pytest.raises(LeafpyError, match=r"line 1: the header names column 'f1' twice \(columns 1 and 2\)"):
        lp.data.csv(str(path), "label")


@pytest.mark.parametrize("text,line,column", [
    ("f1,f2,label\n\n\n1,2,a\n\n3,,b\n", 6, "f2"),  # blank lines before it
    ('f1,f2,label\n1,2,"a\nb"\n3,,b\n', 4, "f2"),  # a quoted cell over two lines before it
    ("f1,f2,label\n\n\n1,2,a\n3,4,\n", 5, "label"),  # a missing target
    ('f1,f2,label\n"1\n",2,a\n3,x,b\n', 4, "f2"),
])
def test_csv_errors_name_the_line_the_row_is_on(tmp_path, text, line, column):
    path = tmp_path / "table.csv"
    path.write_text(text)
    with pytest.raises(LeafpyError, match=rf"line {line}, column '{column}'"):
        lp.data.csv(str(path), "label")


def test_csv_predictions_name_the_lines_their_rows_are_on(tmp_path):
    """``leafpy predict --input table.csv`` labels each prediction with its row's line, blank lines counted."""
    rows = "".join(f"{i % 3},{(i * 7) % 5},{'ab'[i % 2]}\n" for i in range(40))
    (tmp_path / "train.csv").write_text("f1,f2,label\n" + rows)
    (tmp_path / "run.yaml").write_text(f"""
name: table
data: {{dataset: csv, path: {tmp_path / 'train.csv'}, target: label, batch_size: 8, test_fraction: 0.25, seed: 0}}
train: {{epochs: 1}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 2]}}]
  layers:
    - {{name: fc, type: Linear, output_size: 2}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}}
""")
    r = leafpy("train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    (tmp_path / "new.csv").write_text("f1,f2\n\n1,2\n\n\n2,3\n")
    r = leafpy("predict", str(tmp_path / "out"), "--input", str(tmp_path / "new.csv"))
    assert r.returncode == 0, r.stderr
    assert "line 3" in r.stdout and "line 6" in r.stdout and "line 2" not in r.stdout, r.stdout


@pytest.mark.parametrize("memory_map", [False, True])
def test_an_array_of_no_samples_is_refused_mapped_or_not(tmp_path, memory_map):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.float32(1.0), y=np.int64(0))
    with pytest.raises(LeafpyError, match=r"x must hold samples as \[N, \.\.\.\]"):
        lp.data.npz(str(path), memory_map=memory_map)
