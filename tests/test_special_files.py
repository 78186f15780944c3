"""A FIFO, a device or a directory given where leafpy reads a file is refused at once, naming it; never waited on
(opening a FIFO for reading waits for a writer that never comes)."""

from __future__ import annotations

import os

import pytest
from test_user_paths import ROOT, failed_cleanly, leafpy

MLP = str(ROOT / "configs" / "digits_mlp.yaml")

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")


@pytest.mark.parametrize("args", [
    ("train", MLP, "--epochs", "1", "--out", "run", "--weights", "{fifo}"),
    ("train", MLP, "--epochs", "1", "--out", "run", "--resume", "{fifo}"),
    ("evaluate", MLP, "--weights", "{fifo}"),
    ("predict", MLP, "--weights", "{fifo}", "--input", "{fifo}"),
    ("convert", "{fifo}", "out.onnx"),
    ("export", "--web", "site", "{fifo}"),
], ids=["train --weights", "train --resume", "evaluate --weights", "predict --weights", "convert", "export"])
def test_a_fifo_given_as_a_weights_file_is_refused_without_waiting(tmp_path, args):
    fifo = tmp_path / "model.leaf"
    os.mkfifo(fifo)
    p = leafpy(tmp_path, *(a.format(fifo=fifo) for a in args), timeout=60)  # a hang fails here, after 60 s
    failed_cleanly(p, str(fifo), "FIFO", "not a regular file")


def test_a_fifo_as_the_history_of_a_resumed_run_is_named_not_waited_on(tmp_path):
    first = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", "run")
    assert first.returncode == 0, first.stderr
    history = tmp_path / "run" / "history.json"
    history.unlink()
    os.mkfifo(history)
    p = leafpy(tmp_path, "train", MLP, "--epochs", "2", "--out", "run", "--resume", "run/checkpoint.leaf", timeout=120)
    assert "warning: run/history.json cannot be read (run/history.json: a FIFO, not a regular file" in p.stdout
    failed_cleanly(p, "history.json", "not a regular file")  # nor is it replaced by the history written after
