"""data.augment: the batch augmentation against a plain per-image loop written here, its run-file checks, and a
run with augmentation stopped by Ctrl-C mid-epoch and resumed through the leafpy command, which must end with the
uninterrupted run's weights bit for bit."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env, terminal_signals
from test_user_paths import _weights, failed_cleanly, leafpy

import leafpy as lp
from leafpy.sources import augment


def _reference(x: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
    """One image at a time, pixel by pixel where it moves: pad with zeros and crop; shift repeating edges; flip."""
    out = np.empty_like(x)
    _, _, height, width = x.shape
    for i, image in enumerate(x):
        img = image.copy()
        if "random_crop" in draws:
            dy, dx = (int(v) for v in draws["random_crop"][:, i])
            moved = np.zeros_like(img)
            for h in range(height):
                for w in range(width):
                    if 0 <= h + dy < height and 0 <= w + dx < width:
                        moved[:, h, w] = img[:, h + dy, w + dx]
            img = moved
        if "shift" in draws:
            dy, dx = (int(v) for v in draws["shift"][:, i])
            moved = np.empty_like(img)
            for h in range(height):
                for w in range(width):
                    moved[:, h, w] = img[:, min(max(h + dy, 0), height - 1), min(max(w + dx, 0), width - 1)]
            img = moved
        if draws.get("horizontal_flip", np.zeros(len(x), bool))[i]:
            img = img[:, :, ::-1]
        if draws.get("vertical_flip", np.zeros(len(x), bool))[i]:
            img = img[:, ::-1, :]
        out[i] = img
    return out


@pytest.mark.parametrize("spec", [
    {"random_crop": 3, "horizontal_flip": True, "vertical_flip": True, "shift": 2},
    {"random_crop": 2},
    {"shift": 4, "vertical_flip": True},
    {"horizontal_flip": True},
])
def test_the_batch_augmentation_equals_a_loop_over_its_images(spec):
    x = np.random.default_rng(1).random((37, 3, 9, 11)).astype(np.float32)
    aug = augment.from_dict(spec)
    assert aug is not None
    draws = augment.draw(aug, len(x), seed=5, epoch=2, batch=7)
    got = augment.apply(x, draws)
    np.testing.assert_array_equal(got, _reference(x, draws))
    assert got.dtype == x.dtype and not np.shares_memory(got, x)
    if "random_crop" in spec:
        assert np.any(draws["random_crop"] != 0) and not np.array_equal(got, x)
    # the draws depend on (seed, epoch, batch) alone: the same again, another batch differs
    again = augment.draw(aug, len(x), seed=5, epoch=2, batch=7)
    other = augment.draw(aug, len(x), seed=5, epoch=2, batch=8)
    assert all(np.array_equal(again[k], draws[k]) for k in draws)
    assert any(not np.array_equal(other[k], draws[k]) for k in draws)


@pytest.mark.parametrize("value,words", [
    ("{crop: 2}", ["unknown key 'crop'", "random_crop, horizontal_flip, vertical_flip, shift"]),
    ("{random_crop: -1}", ["data.augment.random_crop", "non-negative integer", "-1"]),
    ("{horizontal_flip: yes please}", ["data.augment.horizontal_flip", "true or false"]),
    ("[random_crop]", ["data.augment", "expected a mapping", "random_crop, horizontal_flip"]),
    ("{shift: 8}", ["data.augment.shift", "8x8", "fewer pixels"]),
])
def test_a_wrong_augment_section_is_refused_naming_the_valid_choices(tmp_path, value, words):
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "r", "--set", f"data.augment={value}")
    failed_cleanly(p, *words)


AUGMENTED = ["--set", "data.augment={random_crop: 1, horizontal_flip: true, shift: 1}", "--set", "data.batch_size=4",
             "--set", "solver.solver=adam", "--set", "solver.base_lr=0.002"]


@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_mid_epoch_with_augmentation_then_resume_equals_the_uninterrupted_run(tmp_path, workers):
    """The uninterrupted run prepares its batches on the training thread; the interrupted one and its resume with
    ``workers`` threads preparing batches ahead."""
    whole = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "whole", *AUGMENTED)
    assert whole.returncode == 0, whole.stderr
    assert "augment: {random_crop: 1, horizontal_flip: true, vertical_flip: false, shift: 1}" in \
        (tmp_path / "whole" / "run.yaml").read_text()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--epochs", "2", "--out", "cut",
                             "--set", "train.log_every=1", "--set", f"data.workers={workers}", *AUGMENTED],
                            cwd=tmp_path, env=env, preexec_fn=terminal_signals,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # (the command prints its progress lines on stdout)
        if line.startswith("iteration 500:"):  # epoch 2 of 360 batches, the Ctrl-C lands mid-epoch
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "cut" / "checkpoint.leaf")).trainer_state
    assert state["epoch"] == 1 and 0 < state["sample"] < 1438, state  # stopped in the middle of epoch 2
    r = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "cut", "--resume", "cut/checkpoint.leaf",
               "--set", f"data.workers={workers}", *AUGMENTED)
    assert r.returncode == 0, r.stderr
    a, b = _weights(tmp_path / "whole" / "model.leaf"), _weights(tmp_path / "cut" / "model.leaf")
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name  # bit for bit
    # the augmentation changed what was trained on: without it the same run ends elsewhere
    plain = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "plain", *AUGMENTED[2:])
    assert plain.returncode == 0, plain.stderr
    c = _weights(tmp_path / "plain" / "model.leaf")
    assert not np.array_equal(a["fc1/weight"], c["fc1/weight"])
    # a resume with another augmentation would train on other data: refused
    other = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "3", "--out", "cut", "--resume", "cut/checkpoint.leaf",
                   *AUGMENTED[2:], "--set", "data.augment={random_crop: 2}")
    failed_cleanly(other, "data.augment")


def test_worker_threads_end_when_training_stops_mid_epoch():
    import threading

    class Stop(lp.Callback):
        def on_batch_end(self, trainer, epoch, batch, loss):
            if batch == 5:
                trainer.interrupted = True

    run = lp.config.load("digits_mlp", ["data.workers=3", "data.augment={horizontal_flip: true}"])
    before = threading.active_count()
    t = lp.Trainer(run, lp.backend("native"), callbacks=[Stop()], log=lambda m: None)
    with pytest.raises(lp.train.TrainingInterrupted):
        t.fit(1)
    assert threading.active_count() == before
    assert not any(th.name.startswith("leafpy-data") for th in threading.enumerate())


def test_workers_must_be_a_count(tmp_path):
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "r", "--set", "data.workers=-2")
    failed_cleanly(p, "data.workers", "non-negative integer")
