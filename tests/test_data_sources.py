"""Data as users have it, through the leafpy command: scikit-learn's digits written as a folder of PNG (and a
JPEG, an RGB file, a corrupt file, a class with one image, a unicode class name) and its breast cancer and diabetes
sets as CSV tables; trained, evaluated and predicted in a temporary directory, predictions checked by class name."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env, terminal_signals
from test_user_paths import ROOT, failed_cleanly, leafpy

pytest.importorskip("PIL", reason="image folders need Pillow (the data extra)")
pytest.importorskip("sklearn", reason="the user's data here is scikit-learn's bundled sets")

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CNN_NAMES = NAMES[:-1] + ["neun \u00fc\u4e5d"]  # a unicode class name


def write_digits(root: Path, per_class: int | None = None, *, names: list[str] = NAMES, odd: bool = True) -> dict:
    """The digits as root/NAME/i.png (8-bit grayscale), with odd files when ``odd``; returns their true names."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    truth = {}
    counts = dict.fromkeys(range(10), 0)
    for i, (img, t) in enumerate(zip(d.images, d.target)):
        if per_class is not None and counts[t] >= per_class:
            continue
        counts[t] += 1
        folder = root / names[t]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (img * 255 / 16).astype(np.uint8)
        if odd and i == 3:  # an RGB file in a grayscale set
            Image.fromarray(np.stack([pixels] * 3, axis=-1), "RGB").save(folder / f"{i:04d}.png")
        elif odd and i == 5:  # a JPEG
            Image.fromarray(pixels, "L").save(folder / f"{i:04d}.jpg", quality=95)
        elif odd and i == 6:  # a 16-bit PNG
            Image.fromarray(pixels.astype(np.uint16) * 257).save(folder / f"{i:04d}.png")
        else:
            Image.fromarray(pixels, "L").save(folder / f"{i:04d}.png")
        truth[f"{names[t]}/{i:04d}"] = names[t]
    return truth


MLP = ["digits_mlp", "--epochs", "8", "--set", "data.dataset=image_folder"]


def test_an_image_folder_trains_evaluates_and_predicts_by_class_name(tmp_path):
    write_digits(tmp_path / "digits")
    env_cache = ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    p = leafpy(tmp_path, "train", *MLP, "--set", "data.path=digits", *env_cache, "--set", "train.keep_best=1",
               "--set", "train.monitor=test_macro_f1", "--out", "run")
    assert p.returncode == 0, p.stderr
    accuracy = float(re.findall(r"held-out accuracy: ([\d.]+)%", p.stdout)[-1])
    npz_run = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "8", "--out", "arrays")
    npz_accuracy = float(re.findall(r"held-out accuracy: ([\d.]+)%", npz_run.stdout)[-1])
    print(f"digits: image folder {accuracy:.2f}%, bundled arrays {npz_accuracy:.2f}%")
    assert accuracy > 93.0 and abs(accuracy - npz_accuracy) < 3.0, (accuracy, npz_accuracy)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1  # decoded once, kept
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    assert f"held-out accuracy: {accuracy:.2f}%" in e.stdout  # the same split, from the cache
    assert "held-out top-5 accuracy: " in e.stdout and re.search(r"\n\s+seven\s+[\d.]+", e.stdout), e.stdout
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    history = history["epochs"] if isinstance(history, dict) else history
    assert all(0.9 < h["test_macro_f1"] <= 1 and h["test_top5_accuracy"] >= h["test_accuracy"] for h in history[-1:])
    assert len(list((tmp_path / "run").glob("best-epoch*.leaf"))) == 1  # kept by macro F1
    # new images of one class, given as a folder and as one file: named by the class they show
    (tmp_path / "new").mkdir()
    for f in sorted((tmp_path / "digits" / "seven").iterdir())[:12]:
        (tmp_path / "new" / f.name).write_bytes(f.read_bytes())
    q = leafpy(tmp_path, "predict", "run", "--input", "new", "--out", "p.csv")
    assert q.returncode == 0, q.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert len(rows) == 12 and rows[0]["input"].endswith(".png")
    assert sum(r["class"] == "seven" for r in rows) >= 11, rows
    assert all(0.0 <= float(r["probability"]) <= 1.0 for r in rows)
    one = leafpy(tmp_path, "predict", "run", "--input", "digits/three/0003.png")  # the RGB file
    assert one.returncode == 0 and "0003.png: three " in one.stdout, (one.stdout, one.stderr)


def test_an_image_folder_memory_mapped_from_its_cache_trains_as_one_held_in_memory(tmp_path):
    import leafpy as lp

    write_digits(tmp_path / "digits", 40)
    runs = {}
    for mm in ("false", "true"):
        p = leafpy(tmp_path, "train", *MLP[:-2], "--epochs", "2", "--set", "data.dataset=image_folder", "--set",
                   "data.path=digits", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set",
                   "data.augment={shift: 1, horizontal_flip: true}", "--set", "data.normalize=auto", "--set",
                   f"data.memory_map={mm}", "--set", "data.workers=2", "--out", f"run_{mm}")
        assert p.returncode == 0, p.stderr
        runs[mm] = json.loads((tmp_path / f"run_{mm}" / "history.json").read_text())
    for a, b in zip(runs["false"], runs["true"]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["test_accuracy"] - b["test_accuracy"]) < 1e-9, (a, b)
    ds = lp.data.image_folder(tmp_path / "digits", channels=1, cache_dir=str(tmp_path / "cache"), memory_map=True)
    assert isinstance(ds.x_train, lp.sources.mapped.Mapped) and ds.x_train.source.dtype == np.uint8
    assert isinstance(ds.x_train.source, np.memmap)  # the cache file the runs wrote, not a copy in memory
    whole = lp.data.image_folder(tmp_path / "digits", channels=1, cache_dir=str(tmp_path / "cache"))
    assert np.array_equal(np.asarray(ds.x_train), whole.x_train)


def test_a_killed_decodes_temporary_cache_file_is_removed_by_the_next_run(tmp_path):
    """A decode into the cache (memory_map: true) writes a temporary file as large as the folder's images; a process
    killed meanwhile (SIGKILL, out of memory) runs no clean-up, and each such kill left one for good. The next run
    on this host removes those whose process has ended, and leaves another host's and a running process's."""
    import signal

    write_digits(tmp_path / "digits", 6, odd=False)
    cache = tmp_path / "cache"
    cache.mkdir()
    killed = subprocess.run([sys.executable, "-c",
                             "import os, signal\nfrom leafpy.sources import decoding\n"
                             f"decoding.temporary_map({str(cache)!r}, (60, 1, 8, 8))\n"
                             "os.kill(os.getpid(), signal.SIGKILL)\n"], cwd=ROOT, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left = os.listdir(cache)
    assert len(left) == 1 and left[0].startswith(".tmp-cache-"), left
    from leafpy._run_lock import _host

    running = f".tmp-cache-{_host()}-{os.getpid()}-abc"  # this process: still running
    (cache / running).write_bytes(b"x")
    (cache / ".tmp-cache-elsewhere-1-abc").write_bytes(b"x")  # another host's
    named_alike = f".tmp-cache-{_host()}-4000000-{os.getpid()}-abcd1234"  # host "<this host>-4000000"'s
    (cache / named_alike).write_bytes(b"x")
    p = leafpy(tmp_path, "train", *MLP[:-2], "--epochs", "1", "--set", "data.dataset=image_folder", "--set",
               "data.path=digits", "--set", f"data.cache_dir={cache}", "--set", "data.memory_map=true", "--out", "run")
    assert p.returncode == 0, p.stderr
    names = sorted(os.listdir(cache))
    assert left[0] not in names and running in names and ".tmp-cache-elsewhere-1-abc" in names, names
    assert named_alike in names
    assert sum(n.endswith(".npy") for n in names) == 1


def test_a_corrupt_image_is_named_or_skipped_and_listed(tmp_path):
    write_digits(tmp_path / "digits", per_class=6, odd=False)
    (tmp_path / "digits" / "four" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    p = leafpy(tmp_path, "train", *MLP[:-2], "--epochs", "1", "--set", "data.dataset=image_folder", "--set",
               "data.path=digits", "--set", "data.cache_dir=null", "--out", "run")
    failed_cleanly(p, "broken.png", "skip_unreadable")
    assert len(p.stderr.strip().splitlines()) == 1
    q = leafpy(tmp_path, "train", *MLP[:-2], "--epochs", "1", "--set", "data.dataset=image_folder", "--set",
               "data.path=digits", "--set", "data.skip_unreadable=true", "--set", "data.cache_dir=null", "--out",
               "skipping")  # (the first run's directory holds its run.yaml: it stopped in its first epoch)
    assert q.returncode == 0, q.stderr
    assert "skipped 1 unreadable file" in q.stdout and "broken.png" in q.stdout
    assert "48 training and 12 held-out samples" in q.stdout  # 10 x 6 images; the broken one left out


def test_given_splits_a_unicode_class_and_a_class_with_one_image(tmp_path):
    write_digits(tmp_path / "train", per_class=20, names=CNN_NAMES)
    truth = write_digits(tmp_path / "test", per_class=3, names=CNN_NAMES, odd=False)
    for f in sorted((tmp_path / "train" / CNN_NAMES[9]).iterdir())[1:]:  # a class with one image
        f.unlink()
    p = leafpy(tmp_path, "train", *MLP, "--set", "data.path.train=train", "--set", "data.path.test=test", "--set",
               "data.normalize=auto", "--set", "data.cache_dir=null", "--out", "run")
    assert p.returncode == 0, p.stderr
    run_yaml = (tmp_path / "run" / "run.yaml").read_text(encoding="utf-8")
    assert CNN_NAMES[9] in run_yaml and "mean:" in run_yaml and "std:" in run_yaml
    q = leafpy(tmp_path, "predict", "run", "--input", "test", "--out", "p.csv")
    assert q.returncode == 0, q.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text(encoding="utf-8"))))
    right = sum(r["class"] == truth[os.path.splitext(r["input"])[0]] for r in rows)
    assert len(rows) == 30 and right >= 24, rows


# --- the first epoch decodes ---------------------------------------------------------------------------------------
FOLDER = [*MLP[:-2], "--set", "data.dataset=image_folder", "--set", "data.path=digits", "--set", "train.log_every=0"]


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_the_first_epoch_trains_while_the_folder_decodes_and_the_same_with_any_number_of_workers(tmp_path):
    """With no cache yet an image folder is decoded as its batches are first taken (by `data.workers` threads):
    runs with 0, 1 and 2 workers, each decoding into its own empty cache, train the same batches to the same
    history, and each leaves the cache a folder decoded whole leaves. In Python the dataset comes back at once and
    the cache appears once every image has been read. (Before, the whole folder was decoded, on one thread, before
    the first batch.)"""
    import leafpy as lp

    write_digits(tmp_path / "digits", per_class=30)
    runs = {}
    before = decode_workers()
    for w in (0, 1, 2, "1p", "2p"):  # 2p: two workers handing their batches to two decoding processes
        mode = ["--set", "data.decoding=processes"] if str(w).endswith("p") else []
        p = leafpy(tmp_path, "train", *FOLDER, "--epochs", "2", "--set", "data.augment={shift: 1, horizontal_flip: "
                   "true}", "--set", f"data.workers={str(w)[0]}", *mode, "--set",
                   f"data.cache_dir={tmp_path / f'cache{w}'}", "--out", f"run{w}")
        assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr
        runs[w] = json.loads((tmp_path / f"run{w}" / "history.json").read_text())
        names = cache_files(tmp_path / f"cache{w}")
        assert len(names) == 2 and {Path(n).suffix for n in names} == {".npy", ".json"}, names  # no temporary left
    assert (tmp_path / "cache2p" / names[1]).read_bytes() == (tmp_path / "cache0" / names[1]).read_bytes()
    assert decode_workers() <= before  # the decoding processes ended with their run
    for w in (1, 2, "1p", "2p"):
        for a, b in zip(runs[0], runs[w]):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (w, a, b)
            assert abs(a["test_loss"] - b["test_loss"]) <= 1e-6 * abs(a["test_loss"]), (w, a, b)
    fresh = tmp_path / "fresh"
    ds = lp.data.image_folder(tmp_path / "digits", channels=1, cache_dir=str(fresh), workers=2)
    assert cache_files(fresh) == []  # nothing decoded yet
    first = ds.x_train[np.arange(8)]
    assert first.dtype == np.float32 and first.shape == (8, 1, 8, 8) and cache_files(fresh) == []
    whole = np.asarray(ds.x_train), np.asarray(ds.x_test)
    assert len(cache_files(fresh)) == 2  # every image read: the cache is written
    cached = lp.data.image_folder(tmp_path / "digits", channels=1, cache_dir=str(tmp_path / "cache0"))
    assert np.array_equal(whole[0], np.asarray(cached.x_train)) and np.array_equal(whole[1], np.asarray(cached.x_test))
    assert np.array_equal(first, whole[0][:8]) and ds.digest() == cached.digest()


@pytest.mark.parametrize("memory_map", ["false", "true"])
def test_a_corrupt_image_met_in_the_first_epoch_by_a_worker_ends_the_run_naming_it(tmp_path, memory_map):
    """The file is decoded by one of two worker threads, mid-epoch: the run ends at once with the one-line error
    one thread gives, naming the file, and leaves no half-written cache (nor, memory-mapped, its temporary file)."""
    write_digits(tmp_path / "digits", per_class=20, odd=False)
    (tmp_path / "digits" / "seven" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    errors = {}
    for w in (0, 2, "2p"):
        mode = ["--set", "data.decoding=processes"] if w == "2p" else []
        p = leafpy(tmp_path, "train", *FOLDER, "--epochs", "2", "--set", f"data.workers={str(w)[0]}", *mode, "--set",
                   f"data.memory_map={memory_map}", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--out",
                   f"run{w}", timeout=60)
        failed_cleanly(p, "broken.png", "cannot decode the image", "skip_unreadable")
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        errors[w] = p.stderr
        assert cache_files(tmp_path / "cache") == [], cache_files(tmp_path / "cache")
    assert errors[0] == errors[2] == errors["2p"]
    # the file replaced, the same command again: no checkpoint to continue, so --overwrite is offered, not --resume
    (tmp_path / "digits" / "seven" / "broken.png").unlink()
    again = ["train", *FOLDER, "--epochs", "1", "--out", "run0", "--set", f"data.memory_map={memory_map}"]
    p = leafpy(tmp_path, *again, timeout=60)
    failed_cleanly(p, "run0", "no checkpoint to continue from", "--overwrite")
    assert "--resume" not in p.stderr
    p = leafpy(tmp_path, *again, "--overwrite", timeout=120)
    assert p.returncode == 0 and "held-out accuracy" in p.stdout, p.stderr


def decode_workers() -> set[int]:
    """The process ids of this checkout's decoding processes running on this machine (its folder is on their
    command line: another checkout's tests, running beside these, start their own)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if b"leafpy.sources.decode_worker" in command and os.fsencode(ROOT) in command:
                found.add(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("decoding", ["threads", "processes"])
def test_ctrl_c_in_the_first_epoch_ends_the_decoding_threads_and_the_resumed_run_equals_the_whole(tmp_path,
                                                                                                   decoding):
    """SIGINT while two workers are decoding the first epoch (themselves, or through two decoding processes, which
    leave the Ctrl-C to the run and end with it): the run stops within seconds with its checkpoint (and the cache:
    the checkpoint's fingerprint of the data reads every image), and resumed with no workers it ends with the
    weights of a run never stopped."""
    import signal
    import subprocess

    from test_user_paths import _weights

    write_digits(tmp_path / "digits")
    args = [*FOLDER, "--epochs", "1", "--set", "data.batch_size=4", "--set", "data.augment={shift: 1}"]
    whole = leafpy(tmp_path, "train", *args, "--set", "data.workers=1", "--set",
                   f"data.cache_dir={tmp_path / 'cache_whole'}", "--out", "whole")
    assert whole.returncode == 0, whole.stderr
    env = child_env()
    cache = tmp_path / "cache"
    before = decode_workers()
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", *args, "--set", "data.workers=2", "--set",
                             f"data.decoding={decoding}", "--set", f"data.cache_dir={cache}", "--set",
                             "train.log_every=1", "--out", "cut"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_signals)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("iteration 20:"):  # 80 of 1437 images trained on
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "checkpoint saved to" in out + err and len(cache_files(cache)) == 2, (out[-500:], err[-500:])
    assert "Traceback" not in err, err
    for _ in range(50):  # (a decoding process that ended may stay listed until it is reaped)
        if decode_workers() <= before:
            break
        time.sleep(0.1)
    assert decode_workers() <= before
    r = leafpy(tmp_path, "train", *args, "--set", f"data.cache_dir={cache}", "--out", "cut", "--resume",
               "cut/checkpoint.leaf")
    assert r.returncode == 0, r.stderr
    a, b = _weights(tmp_path / "whole" / "model.leaf"), _weights(tmp_path / "cut" / "model.leaf")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit


# --- CSV tables ---------------------------------------------------------------------------------------------------
TABLE_RUN = """
name: table
data: {{dataset: csv, path: {path}, target: {target}, batch_size: 32, normalize: auto}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [32, {features}]}}]
  layers:
    - {{name: fc1, type: Linear, output_size: 32}}
    - {{name: act, type: ReLU}}
    - {{name: fc2, type: Linear, output_size: {outputs}}}
{last}
objective:
  type: Sequential
  inputs: [{{name: network_out, shape: [32, {outputs}]}}, {{name: target, shape: [32, 1]}}]
  layers: [{objective}]
solver: {{solver: adam, base_lr: 0.01}}
train: {{epochs: {epochs}}}
"""


def write_table(path: Path, x: np.ndarray, target: list, names: list[str], target_name: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*names, target_name])
        for row, t in zip(x, target):
            w.writerow([*(f"{v:.6g}" for v in row), t])


def test_a_csv_table_with_class_names(tmp_path):
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    names = [n.replace(" ", "_") for n in d.feature_names]
    labels = [d.target_names[t] for t in d.target]
    write_table(tmp_path / "cancer.csv", d.data, labels, names, "diagnosis")
    (tmp_path / "cancer.yaml").write_text(TABLE_RUN.format(
        path="cancer.csv", target="diagnosis", features=30, outputs=2, epochs=10,
        last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 2}"))
    p = leafpy(tmp_path, "train", "cancer.yaml", "--out", "run")
    assert p.returncode == 0, p.stderr
    accuracy = float(re.findall(r"held-out accuracy: ([\d.]+)%", p.stdout)[-1])
    print(f"breast cancer CSV: held-out accuracy {accuracy:.2f}%")
    assert accuracy > 92.0
    import leafpy as lp

    saved = lp.Layer.load(lp.backend("native"), str(tmp_path / "run" / "model.leaf")).preparation
    assert saved.class_names == ("benign", "malignant") and len(saved.mean) == 30
    # new rows, without the label column, in another column order: read by feature name
    order = names[::-1]
    rows = d.data[:40, ::-1]
    write_table(tmp_path / "new.csv", rows, [""] * 40, order, "unused")
    q = leafpy(tmp_path, "predict", "run", "--input", "new.csv", "--out", "p.csv")
    assert q.returncode == 0, q.stderr
    got = [r["class"] for r in csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text()))]
    assert sum(g == t for g, t in zip(got, labels[:40])) >= 36, got
    # evaluate's metrics are scikit-learn's on the held-out split's predictions
    from sklearn.metrics import f1_score

    import leafpy as lp

    held_out = lp.data.csv(tmp_path / "cancer.csv", "diagnosis", test_fraction=0.2, seed=0)
    write_table(tmp_path / "held_out.csv", held_out.x_test, [""] * len(held_out.x_test), names, "unused")
    q = leafpy(tmp_path, "predict", "run", "--input", "held_out.csv", "--out", "h.csv")
    assert q.returncode == 0, q.stderr
    predicted = [r["class"] for r in csv.DictReader(io.StringIO((tmp_path / "h.csv").read_text()))]
    truth = [held_out.class_names[k] for k in held_out.y_test]
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    macro = float(re.search(r"macro F1 ([\d.]+), weighted F1 ([\d.]+)", e.stdout).group(1))
    assert abs(macro - f1_score(truth, predicted, average="macro")) < 1e-4, e.stdout
    assert re.search(r"\s+malignant\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+", e.stdout), e.stdout  # per class, by name
    # a missing value is an error naming its line and column
    text = (tmp_path / "cancer.csv").read_text().splitlines()
    cells = text[7].split(",")
    cells[4] = ""
    text[7] = ",".join(cells)
    (tmp_path / "cancer.csv").write_text("\n".join(text) + "\n")
    e = leafpy(tmp_path, "train", "cancer.yaml", "--out", "run2")
    failed_cleanly(e, "cancer.csv", "line 8", repr(names[4]), "missing")
    cells[4] = "n/a"
    text[7] = ",".join(cells)
    (tmp_path / "cancer.csv").write_text("\n".join(text) + "\n")
    failed_cleanly(leafpy(tmp_path, "train", "cancer.yaml", "--out", "run2"), "line 8", "'n/a'")


def test_a_16_bit_image_is_scaled_a_band_at_a_time_and_one_past_the_memory_available_is_refused(tmp_path,
                                                                                                monkeypatch):
    """16-bit pixels are scaled to 8 bits in float64 a band of rows at a time (as a whole, with its temporaries,
    a 171 KB PNG of 9400x9400 pixels took 2.46 GB), to the values the whole image scaled gave; an image whose
    decoding would take more than the memory available is refused from its header, naming it."""
    from PIL import Image

    import leafpy as lp
    from leafpy.sources import image_folder

    ramp = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    monkeypatch.setattr(image_folder, "BAND_PIXELS", 1000)  # 3 rows a band
    got = image_folder.decode(str(tmp_path / "ramp.png"), (256, 256), 1)[0]
    np.testing.assert_array_equal(got, np.floor(ramp / 65535.0 * 255.0 + 0.5).astype(np.uint8))
    for c in ("a", "b"):
        (tmp_path / "set" / c).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "set" / c / "small.png")
    Image.fromarray(ramp[:64, :64]).save(tmp_path / "set" / "b" / "wide.png")
    monkeypatch.setattr(image_folder, "available_memory", lambda: 2**15)
    ds = lp.data.image_folder(str(tmp_path / "set"), image_size=(8, 8), channels=1, cache_dir=None)
    with pytest.raises(lp.LeafpyError, match=r"wide\.png: decoding its 4,096 pixels needs about 64\.0 KB, more "
                                             r"than the 32\.0 KB available; save the image smaller"):
        [np.asarray(x) for x in (ds.x_train, ds.x_test)]  # (decoded as they are read)


def test_floating_point_images_are_scaled_by_their_range_and_a_turned_photo_sizes_the_folder_upright(tmp_path):
    """Pillow's mode F (a float TIFF) in [0, 1] or [0, 255] decodes to the 8-bit pixels those values mean; other
    values are refused naming the file. Without image_size, the first image's size is taken as it is shown
    (EXIF orientation applied), as every image is decoded."""
    from PIL import Image

    import leafpy as lp
    from leafpy.sources import image_folder

    ramp = np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4)
    for scale in (1.0, 255.0):
        Image.fromarray(ramp * scale, "F").save(tmp_path / f"f{scale:g}.tif")
        got = image_folder.decode(str(tmp_path / f"f{scale:g}.tif"), (4, 4), 1)[0]
        np.testing.assert_array_equal(got, np.floor(ramp * 255 + 0.5).astype(np.uint8))
    Image.fromarray(ramp * 1000 - 3, "F").save(tmp_path / "wide.tif")
    with pytest.raises(lp.LeafpyError, match=r"wide\.tif.*floating-point.*8- or 16-bit"):
        image_folder.decode(str(tmp_path / "wide.tif"), (4, 4), 1)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise
    stored = np.zeros((40, 20), np.uint8)
    stored[:, :10] = 255  # 20 wide and 40 high as stored; 40 wide and 20 high as shown
    for c in ("a", "b"):
        (tmp_path / "photos" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(stored).save(tmp_path / "photos" / c / f"{i}.png", exif=exif)
    ds = lp.data.image_folder(str(tmp_path / "photos"), channels=1, cache_dir=None)
    assert ds.x_train.shape[1:] == (1, 20, 40)
    shown = np.rot90(stored, -1)  # turned a quarter clockwise: the left half white becomes the top half
    np.testing.assert_allclose(np.asarray(ds.x_train[0])[0], shown / 255.0, atol=1e-6)


def test_32_bit_integer_images_are_scaled_in_range_and_refused_or_skipped_outside_it(tmp_path):
    """Pillow's mode I (a 32-bit integer TIFF) with values in [0, 255] decodes with 255 white, with brighter ones up
    to 65535 with 65535 white; one with values outside [0, 65535] has no white (it was clipped: -5000 black,
    1000000 white) and is a file that cannot be decoded: named, or skipped with data.skip_unreadable."""
    from PIL import Image

    import leafpy as lp

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "photos" / c).mkdir(parents=True)
    files = {"a/0.tif": rng.integers(0, 256, (8, 8)), "a/1.tif": rng.integers(0, 65536, (8, 8)),
             "b/0.tif": rng.integers(0, 256, (8, 8)), "b/1.tif": rng.integers(0, 65536, (8, 8)),
             "a/dark.tif": rng.integers(-5000, 256, (8, 8)), "b/bright.tif": rng.integers(0, 1_000_000, (8, 8))}
    for name, values in files.items():
        Image.fromarray(values.astype(np.int32), "I").save(tmp_path / "photos" / name)
        with Image.open(tmp_path / "photos" / name) as img:
            assert img.mode == "I"
    (tmp_path / "run.yaml").write_text(
        "name: img\ndata: {dataset: image_folder, path: photos, image_size: [8, 8], channels: 1, batch_size: 2, "
        "test_fraction: 0.25, cache_dir: null}\ntrain: {epochs: 1}\nnetwork: {type: Sequential, inputs: [{name: "
        "data, shape: [null, 1, 8, 8]}], layers: [{name: f, type: Flatten}, {name: fc, type: Linear, output_size: 2},"
        " {name: sm, type: LogSoftmax}]}\nobjective: nll\nsolver: {solver: momentum, base_lr: 0.01, momentum: 0.9}\n")
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "out")
    failed_cleanly(p, "32-bit integer", "[0, 65535]", "skip_unreadable")
    assert re.search(r"(dark|bright)\.tif: cannot decode", p.stderr), p.stderr  # (whichever a batch meets first)
    p = leafpy(tmp_path, "train", "run.yaml", "--set", "data.skip_unreadable=true", "--out", "skipping")
    assert p.returncode == 0, p.stderr
    assert "skipped 2 unreadable files" in p.stdout and "dark.tif" in p.stdout and "bright.tif" in p.stdout, p.stdout
    q = leafpy(tmp_path, "predict", "skipping", "--input", "photos/b", "--set", "data.skip_unreadable=false")
    failed_cleanly(q, "bright.tif", "32-bit integer", f"to {files['b/bright.tif'].max()})")
    ds = lp.data.image_folder({"train": str(tmp_path / "photos"), "test": str(tmp_path / "photos")}, channels=1,
                              cache_dir=None, skip_unreadable=True)  # (a given split: the files in order)
    for got, name in zip(np.asarray(ds.x_train), ["a/0.tif", "a/1.tif", "b/0.tif", "b/1.tif"]):
        values = files[name]
        top = 255.0 if values.max() <= 255 else 65535.0
        np.testing.assert_allclose(got[0] * 255.0, np.floor(values * 255.0 / top + 0.5), atol=1e-3)


def test_a_linked_subfolder_of_a_class_counts_once_and_a_link_cycle_ends(tmp_path):
    """A class folder's subfolder that is a link counts as a subfolder does (it was ignored, while a linked class
    folder was followed): in training, in predict's folder and in the cache's key, which changes when an image is
    added behind the link; a link back into a folder already walked (a cycle) adds nothing."""
    from PIL import Image

    for folder, n in (("photos/a", 4), ("photos/b", 2), ("extra", 3)):
        (tmp_path / folder).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((8, 8), 20 * i + 100 * (folder == "extra"), np.uint8)).save(
                tmp_path / folder / f"{i}.png")
    os.symlink(os.path.join("..", "..", "extra"), tmp_path / "photos" / "b" / "more")
    os.symlink(".", tmp_path / "extra" / "again")  # extra/again/again/... is extra
    os.symlink(".", tmp_path / "photos" / "a" / "self")
    (tmp_path / "run.yaml").write_text(
        "name: img\ndata: {dataset: image_folder, path: photos, image_size: [8, 8], channels: 1, batch_size: 3, "
        f"test_fraction: 0.34, cache_dir: {tmp_path / 'cache'}}}\ntrain: {{epochs: 1}}\nnetwork: {{type: Sequential, "
        "inputs: [{name: data, shape: [null, 1, 8, 8]}], layers: [{name: f, type: Flatten}, {name: fc, type: Linear, "
        "output_size: 2}, {name: sm, type: LogSoftmax}]}\nobjective: nll\nsolver: {solver: momentum, base_lr: 0.01, "
        "momentum: 0.9}\n")
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "run")
    assert p.returncode == 0, p.stderr
    assert "6 training and 3 held-out samples" in p.stdout, p.stdout  # a: 4, b: 2 + the 3 behind the link
    q = leafpy(tmp_path, "predict", "run", "--input", "photos/b", "--out", "p.csv")
    assert q.returncode == 0, q.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert sorted(r["input"] for r in rows) == ["0.png", "1.png", *(os.path.join("more", f"{i}.png") for i in range(3))]
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    assert leafpy(tmp_path, "train", "run.yaml", "--out", "again").returncode == 0
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1  # the same files: the same key
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "extra" / "3.png")
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "added")
    assert p.returncode == 0, p.stderr
    assert sum(map(int, re.search(r"(\d+) training and (\d+) held-out samples", p.stdout).groups())) == 10, p.stdout
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2  # an image added behind the link: another key


def test_a_cielab_image_decodes_in_grayscale_as_its_rgb_decode_turned_gray(tmp_path):
    """An image Pillow holds as CIELAB (a LAB TIFF), which it converts to RGB but not straight to grayscale, gives
    channels 1 the gray of its RGB decode (Pillow's own conversions), as channels 3 gives that RGB."""
    from PIL import Image

    import leafpy as lp

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                rgb = Image.fromarray(rng.integers(0, 256, (6, 7, 3), dtype=np.uint8))
                rgb.convert("LAB").save(tmp_path / split / c / f"{i}.tif")
    files = sorted((tmp_path / "train").glob("*/*.tif"))
    with Image.open(files[0]) as img:
        assert img.mode == "LAB"
    folders = {"train": str(tmp_path / "train"), "test": str(tmp_path / "test")}
    for channels, mode in ((3, "RGB"), (1, "L")):
        ds = lp.data.image_folder(folders, channels=channels, cache_dir=None)
        for got, f in zip(np.asarray(ds.x_train), files):
            with Image.open(f) as img:
                want = np.asarray(img.convert("RGB").convert(mode), np.float32) / 255.0
            want = want[None] if want.ndim == 2 else want.transpose(2, 0, 1)
            np.testing.assert_allclose(got, want, atol=1e-6)


def test_predict_skips_unreadable_images_as_the_run_does_and_refuses_images_for_a_table_run(tmp_path):
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "photos" / c).mkdir(parents=True)
        for i in range(5):
            pixels = np.full((8, 8), 40 * i + 30 * (c == "b"), np.uint8)
            Image.fromarray(pixels).save(tmp_path / "photos" / c / f"{i}.png")
    (tmp_path / "photos" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "run.yaml").write_text(
        "name: img\ndata: {dataset: image_folder, path: photos, image_size: [8, 8], channels: 1, batch_size: 4, "
        "skip_unreadable: true, cache_dir: null}\ntrain: {epochs: 1}\nnetwork: {type: Sequential, inputs: [{name: "
        "data, shape: [null, 1, 8, 8]}], layers: [{name: f, type: Flatten}, {name: fc, type: Linear, output_size: 2},"
        " {name: sm, type: LogSoftmax}]}\nobjective: nll\nsolver: {solver: momentum, base_lr: 0.01, momentum: 0.9}\n")
    assert leafpy(tmp_path, "train", "run.yaml", "--out", "out").returncode == 0
    p = leafpy(tmp_path, "predict", "out", "--input", "photos", "--out", "p.csv")
    assert p.returncode == 0, p.stderr
    assert f"skipped 1 unreadable file: {os.path.join('a', 'broken.png')}" in p.stdout, p.stdout
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert len(rows) == 10 and not any("broken" in str(r) for r in rows)
    q = leafpy(tmp_path, "predict", "out", "--input", "photos", "--set", "data.skip_unreadable=false")
    failed_cleanly(q, "broken.png", "cannot decode")
    # a run trained on a table reads no images
    x = np.random.default_rng(0).normal(0, 1, (40, 2))
    write_table(tmp_path / "t.csv", x, ["ab"[int(v > 0)] for v in x[:, 0]], ["f1", "f2"], "label")
    (tmp_path / "table.yaml").write_text(TABLE_RUN.format(
        path="t.csv", target="label", features=2, outputs=2, epochs=1, last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 2}"))
    assert leafpy(tmp_path, "train", "table.yaml", "--out", "table").returncode == 0
    failed_cleanly(leafpy(tmp_path, "predict", "table", "--input", "photos/a/0.png"), "photos/a/0.png",
                   "f1, f2", "CSV")


def _class_support(stdout: str) -> dict[str, int]:
    """evaluate's per-class table: {class name: support}."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\S+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$",
                                                             stdout, re.M)}


def test_classes_keep_the_names_they_were_trained_under_when_the_data_changes(tmp_path):
    """A table's classes are numbered in sorted name order; once a class is gone from the data (or the run file
    orders them), the labels are numbered as the run's class_names say, not shifted onto another class's name; a
    class the model was not trained on is refused, naming it."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (600, 2))
    truth = np.array(["cat", "dog", "emu"])[(x[:, 0] > 0.4).astype(int) + (x[:, 0] > -0.4)]
    write_table(tmp_path / "t.csv", x, list(truth), ["a", "b"], "animal")
    (tmp_path / "run.yaml").write_text(TABLE_RUN.format(
        path="t.csv", target="animal", features=2, outputs=3, epochs=15, last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 3}"))
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "run")
    assert p.returncode == 0, p.stderr
    assert float(re.findall(r"held-out accuracy: ([\d.]+)%", p.stdout)[-1]) > 90.0, p.stdout
    # the cats leave the table: dog and emu, numbered 0 and 1 in the data alone, stay classes 1 and 2
    keep = truth != "cat"
    write_table(tmp_path / "t.csv", x[keep], list(truth[keep]), ["a", "b"], "animal")
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    support = _class_support(e.stdout)
    assert support["cat"] == 0 and support["dog"] > 0 and support["emu"] > 0, e.stdout
    assert float(re.findall(r"held-out accuracy: ([\d.]+)%", e.stdout)[-1]) > 90.0, e.stdout  # shifted: about 0%
    # an ant joins them: refused, named
    write_table(tmp_path / "t.csv", x, list(np.where(truth == "cat", "ant", truth)), ["a", "b"], "animal")
    failed_cleanly(leafpy(tmp_path, "evaluate", "run"), "t.csv", "'ant'", "data.class_names", "'cat', 'dog', 'emu'")
    failed_cleanly(leafpy(tmp_path, "train", "run", "--resume", "run/checkpoint.leaf", "--epochs", "16"), "'ant'")
    # a run file naming the classes in an order of its own: its class k is class_names[k]
    write_table(tmp_path / "t.csv", x, list(truth), ["a", "b"], "animal")
    text = (tmp_path / "run.yaml").read_text().replace("normalize: auto}", "normalize: auto, "
                                                       "class_names: [emu, cat, dog]}")
    (tmp_path / "mine.yaml").write_text(text)
    q = leafpy(tmp_path, "train", "mine.yaml", "--out", "mine", "--epochs", "3")
    assert q.returncode == 0, q.stderr
    import leafpy as lp

    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "mine" / "model.leaf"))
    assert net.preparation.class_names == ("emu", "cat", "dog")
    write_table(tmp_path / "new.csv", x[:100], [""] * 100, ["a", "b"], "unused")
    r = leafpy(tmp_path, "predict", "mine", "--input", "new.csv", "--out", "p.csv")
    assert r.returncode == 0, r.stderr
    got = [row["class"] for row in csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text()))]
    assert np.mean(np.array(got) == truth[:100]) > 0.85, got


def test_class_names_recorded_as_floats_an_ignored_index_and_too_many_names(tmp_path):
    """A run.yaml from before integer labels written as floats were one class ('0.0' recorded for '0') still
    evaluates; a class whose index is the objective's ignore_index is still numbered by its name; more class names
    than the objective scores is refused before training, naming both."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (600, 2))
    k = (x[:, 0] > 0.4).astype(int) + (x[:, 0] > -0.4)
    write_table(tmp_path / "t.csv", x, [f"{v}.0" for v in k], ["a", "b"], "label")
    (tmp_path / "run.yaml").write_text(TABLE_RUN.format(
        path="t.csv", target="label", features=2, outputs=3, epochs=15, last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 3}"))
    assert leafpy(tmp_path, "train", "run.yaml", "--out", "run").returncode == 0
    text = (tmp_path / "run" / "run.yaml").read_text()
    assert "class_names: ['0', '1', '2']" in text, text
    (tmp_path / "run" / "run.yaml").write_text(text.replace("class_names: ['0', '1', '2']",
                                                            "class_names: ['0.0', '1.0', '2.0']"))
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    assert float(re.findall(r"held-out accuracy: ([\d.]+)%", e.stdout)[-1]) > 90.0, e.stdout
    # ignore_index 0 names no label of a table: with class 0 gone from the data, class 1 is not taken for it
    truth = np.array(["cat", "dog", "emu"])[k]
    write_table(tmp_path / "n.csv", x, list(truth), ["a", "b"], "animal")
    (tmp_path / "ign.yaml").write_text(TABLE_RUN.format(
        path="n.csv", target="animal", features=2, outputs=3, epochs=15, last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 3, ignore_index: 0}"))
    assert leafpy(tmp_path, "train", "ign.yaml", "--out", "ign").returncode == 0
    keep = truth != "cat"
    write_table(tmp_path / "n.csv", x[keep], list(truth[keep]), ["a", "b"], "animal")
    e = leafpy(tmp_path, "evaluate", "ign")
    assert e.returncode == 0, e.stderr
    support = _class_support(e.stdout)
    assert support["dog"] > 0 and support["emu"] > 0, e.stdout
    # four names for a three-way objective
    mine = (tmp_path / "ign.yaml").read_text().replace("normalize: auto}", "normalize: auto, class_names: "
                                                       "[ant, cat, dog, emu]}")
    (tmp_path / "long.yaml").write_text(mine.replace(", ignore_index: 0", ""))
    failed_cleanly(leafpy(tmp_path, "train", "long.yaml", "--out", "long"), "data.class_names names 4",
                   "num_classes 3")


def test_more_class_names_than_the_objective_scores_are_refused_for_numbered_data(tmp_path):
    """An npz file's classes are numbered; data.class_names naming three of a two-way objective's classes is
    refused before anything is written, as too few names are (the third name was dropped from the reports and
    recorded in run.yaml); two names train and name the classes."""
    rng = np.random.default_rng(0)
    x = rng.random((40, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0.5).astype(np.int64))
    (tmp_path / "run.yaml").write_text(
        "name: cn\ndata: {dataset: npz, path: d.npz, batch_size: 8, test_fraction: 0.25, class_names: [cat, dog, "
        "bird]}\ntrain: {epochs: 1}\nnetwork: {type: Sequential, inputs: [{name: data, shape: [null, 4]}], layers: "
        "[{name: fc, type: Linear, output_size: 2}, {name: sm, type: LogSoftmax}]}\nobjective: nll\nsolver: "
        "{solver: momentum, base_lr: 0.05, momentum: 0.9}\n")
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "run"), "data.class_names: 3 names",
                   "'bird'", "num_classes 2", "set num_classes")
    assert not (tmp_path / "run" / "run.yaml").exists()
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--set", "data.class_names=[cat]", "--out", "run"),
                   "data.class_names: 1 names for 2 classes")
    p = leafpy(tmp_path, "train", "run.yaml", "--set", "data.class_names=[cat, dog]", "--out", "run")
    assert p.returncode == 0, p.stderr
    held_out = int(re.search(r"(\d+) held-out samples", p.stdout).group(1))
    assert set(_class_support(p.stdout)) == {"cat", "dog"} and sum(_class_support(p.stdout).values()) == held_out


def test_a_two_class_run_reports_scikit_learns_roc_auc_and_names_its_classes(tmp_path):
    from sklearn.datasets import load_breast_cancer
    from sklearn.metrics import roc_auc_score

    import leafpy as lp

    d = load_breast_cancer()
    names = [n.replace(" ", "_") for n in d.feature_names]
    write_table(tmp_path / "cancer.csv", d.data, [d.target_names[t] for t in d.target], names, "diagnosis")
    (tmp_path / "cancer.yaml").write_text(TABLE_RUN.format(
        path="cancer.csv", target="diagnosis", features=30, outputs=2, epochs=3,
        last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 2}"))
    p = leafpy(tmp_path, "train", "cancer.yaml", "--out", "run", "--set", "train.keep_best=1", "--set",
               "train.monitor=test_roc_auc")
    assert p.returncode == 0, p.stderr
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert all(0.5 < r["test_roc_auc"] <= 1.0 for r in history), history
    assert len(list((tmp_path / "run").glob("best-epoch*.leaf"))) == 1
    # evaluate's ROC AUC is scikit-learn's on the positive class's probability of the held-out rows
    held_out = lp.data.csv(tmp_path / "cancer.csv", "diagnosis", test_fraction=0.2, seed=0)
    write_table(tmp_path / "held_out.csv", held_out.x_test, [""] * len(held_out.x_test), names, "unused")
    assert leafpy(tmp_path, "predict", "run", "--input", "held_out.csv", "--out", "h.npz").returncode == 0
    out = np.load(tmp_path / "h.npz")["outputs"].astype(np.float64)
    malignant = np.exp(out[:, 1]) / np.exp(out).sum(axis=1)
    expected = roc_auc_score(held_out.y_test == held_out.class_names.index("malignant"), malignant)
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    auc = float(re.search(r"held-out ROC AUC: ([\d.]+)", e.stdout).group(1))
    assert abs(auc - expected) < 1e-3, (auc, expected, e.stdout)
    # the confusion matrix's rows and columns by class name
    assert re.search(r"target\\pred\s+benign\s+malignant\s+recall", e.stdout), e.stdout
    assert re.search(r"\n\s+malignant\s+\d+\s+\d+\s+[\d.]+%", e.stdout), e.stdout
    # more than two classes: no ROC AUC to keep the best epochs by
    q = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--set", "train.keep_best=1", "--set",
               "train.monitor=test_roc_auc", "--out", "run2")
    failed_cleanly(q, "train.monitor", "test_roc_auc", "two classes")


def test_roc_auc_is_left_out_with_a_note_without_scikit_learn(monkeypatch):
    from leafpy.metrics import roc_auc

    assert roc_auc([0, 1, 1, 0], [0.1, 0.8, 0.7, 0.3]) == (1.0, "")
    assert roc_auc([1, 1], [0.1, 0.8])[0] is None
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)  # import sklearn.metrics fails
    value, note = roc_auc([0, 1, 1, 0], [0.1, 0.8, 0.7, 0.3])
    assert value is None and "scikit-learn" in note


def _diabetes_run(tmp_path: Path, epochs: int) -> tuple:
    """scikit-learn's diabetes set as a CSV table (in its own units), and a regression run file training on it:
    (the data, its feature names)."""
    from sklearn.datasets import load_diabetes

    d = load_diabetes(scaled=False)
    names = list(d.feature_names)
    write_table(tmp_path / "diabetes.csv", d.data, [f"{v:g}" for v in d.target], names, "progression")
    (tmp_path / "diabetes.yaml").write_text(TABLE_RUN.format(
        path="diabetes.csv", target="progression", features=10, outputs=1, epochs=epochs, last="",
        objective="{name: mse, type: MeanSquaredError}"))
    return d, names


def test_a_csv_regression_gives_predictions_in_the_targets_units(tmp_path):
    d, names = _diabetes_run(tmp_path, epochs=30)
    p = leafpy(tmp_path, "train", "diabetes.yaml", "--out", "run")
    assert p.returncode == 0, p.stderr
    assert "target_mean" in (tmp_path / "run" / "run.yaml").read_text()
    write_table(tmp_path / "new.csv", d.data[:100], [""] * 100, names, "unused")
    q = leafpy(tmp_path, "predict", "run", "--input", "new.csv", "--out", "p.npz")
    assert q.returncode == 0, q.stderr
    with np.load(tmp_path / "p.npz") as f:
        predicted = f["outputs"][:, 0]
    # in the targets' units (25..346), not normalised ones; better than predicting the mean
    assert 50 < predicted.mean() < 250, predicted[:5]
    mse = float(np.mean((predicted - d.target[:100]) ** 2))
    print(f"diabetes CSV: mean squared error {mse:.0f} (variance {np.var(d.target[:100]):.0f})")
    assert mse < 0.8 * np.var(d.target[:100])
    # evaluate reports MSE, MAE and R² in the targets' units, as scikit-learn computes them from the predictions
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    import leafpy as lp

    held_out = lp.data.csv(tmp_path / "diabetes.csv", "progression", test_fraction=0.2, seed=0, targets="values")
    write_table(tmp_path / "held_out.csv", held_out.x_test, [""] * len(held_out.x_test), names, "unused")
    assert leafpy(tmp_path, "predict", "run", "--input", "held_out.csv", "--out", "h.npz").returncode == 0
    with np.load(tmp_path / "h.npz") as f:
        got = f["outputs"][:, 0]
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    mse, mae, r2 = map(float, re.search(r"MSE ([\d.e+-]+), MAE ([\d.e+-]+), R² ([\d.e+-]+)", e.stdout).groups())
    print(e.stdout.strip().splitlines()[-1])
    # the run file itself (normalize: auto) with the weights scores the same split with the same values
    again = leafpy(tmp_path, "evaluate", "diabetes.yaml", "--weights", "run/model.leaf")
    assert again.returncode == 0 and e.stdout.splitlines()[-1] in again.stdout, (again.stdout, again.stderr)
    t = held_out.y_test[:, 0]
    assert mse == pytest.approx(mean_squared_error(t, got), rel=1e-3)
    assert mae == pytest.approx(mean_absolute_error(t, got), rel=1e-3)
    assert r2 == pytest.approx(r2_score(t, got), abs=1e-3) and r2 > 0.2
    # a model loaded in Python carries what it needs
    import leafpy as lp

    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "run" / "model.leaf"))
    x = net.preparation.inputs(d.data[:100].astype(np.float32))
    y = net.preparation.outputs(net.forward([x])[0].to_numpy())
    np.testing.assert_allclose(y[:, 0], predicted, rtol=1e-4, atol=1e-3)


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height grayscale pixels, with one tiny compressed row of data."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_it_is_decoded(tmp_path):
    write_digits(tmp_path / "digits", per_class=3, odd=False)
    (tmp_path / "digits" / "two" / "bomb.png").write_bytes(_png_declaring(100_000, 100_000))  # 10^10 pixels
    p = leafpy(tmp_path, "train", *MLP[:-2], "--epochs", "1", "--set", "data.dataset=image_folder", "--set",
               "data.path=digits", "--set", "data.cache_dir=null", "--out", "run")
    failed_cleanly(p, "bomb.png", "cannot decode")
    assert "decompression bomb" in p.stderr.lower() or "exceeds limit" in p.stderr, p.stderr


def test_an_image_past_pillows_pixel_limit_is_refused_whatever_the_warning_filters_say(tmp_path, monkeypatch):
    """Between Pillow's limit and twice it, Pillow only warns; decode turns that warning into an error, but the
    warning filters are the process's, which a decoding thread may find restored under another thread's: the size
    is checked on its own as well."""
    import warnings

    from PIL import Image

    import leafpy as lp
    from leafpy.sources import image_folder

    side = int((Image.MAX_IMAGE_PIXELS * 1.2) ** 0.5)
    (tmp_path / "big.png").write_bytes(_png_declaring(side, side))
    monkeypatch.setattr(image_folder.warnings, "simplefilter", lambda *a, **k: None)  # another thread's filters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(lp.LeafpyError, match=r"big\.png.*decompression bomb limit"):
            image_folder.decode(str(tmp_path / "big.png"), (8, 8), 1)


def test_a_checkpoint_from_before_images_were_kept_as_bytes_resumes_on_the_same_folder(tmp_path):
    """tests/data/image_folder_checkpoint_v2.leaf was written by a leafpy that held image-folder samples as float32
    (and fingerprinted them so): it resumes on the same images, and is refused on changed ones."""
    import shutil
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from make_image_folder_checkpoint import RUN, write_images

    write_images(tmp_path / "images")
    shutil.copy(ROOT / "tests" / "data" / "image_folder_checkpoint_v2.leaf", tmp_path / "old.leaf")
    p = leafpy(tmp_path, "train", *RUN, "--epochs", "2", "--out", "run", "--resume", "old.leaf")
    assert p.returncode == 0, p.stderr
    assert "epoch 2/2" in p.stdout and "epoch 1/2" not in p.stdout, p.stdout
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), np.uint8), "L").save(tmp_path / "images" / "class1" / "3.png")
    p = leafpy(tmp_path, "train", *RUN, "--epochs", "2", "--out", "changed", "--resume", "old.leaf")
    assert p.returncode == 1 and "are not those the checkpoint" in p.stderr, p.stderr


def test_an_image_folder_of_fewer_classes_than_the_network_scores_trains_and_reports_them_all(tmp_path):
    """Three class folders under a ten-way network: the report names the three and numbers the rest."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from make_image_folder_checkpoint import write_images

    write_images(tmp_path / "images")
    p = leafpy(tmp_path, "train", "digits_mlp", "--set", "data.dataset=image_folder", "--set", "data.path=images",
               "--set", "data.batch_size=4", "--epochs", "1", "--out", "run")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert re.search(r"class2 +\d", p.stdout) and re.search(r"\n +9 +0\.000", p.stdout), p.stdout
    # the confusion matrix names the three too, as its header and its rows (it numbered all ten)
    table = p.stdout[p.stdout.index("target\\pred"):].splitlines()
    assert table[0].split() == ["target\\pred", "class0", "class1", "class2", *map(str, range(3, 10)), "recall"]
    assert [r.split()[0] for r in table[1:11]] == ["class0", "class1", "class2", *map(str, range(3, 10))]
    held_out = int(re.search(r"(\d+) held-out samples", p.stdout).group(1))
    assert sum(int(v) for r in table[1:11] for v in r.split()[1:11]) == held_out
    assert re.match(rf"accuracy [\d.]+% of {held_out} predictions$", table[11]), table[11]
    # two class folders: each prediction's three best classes name the two and number the third
    import shutil

    shutil.rmtree(tmp_path / "images" / "class2")
    p = leafpy(tmp_path, "train", "digits_mlp", "--set", "data.dataset=image_folder", "--set", "data.path=images",
               "--set", "data.batch_size=4", "--epochs", "1", "--out", "two")
    assert p.returncode == 0, p.stderr
    q = leafpy(tmp_path, "predict", "two", "--input", "images/class1", "--out", "p.csv")
    assert q.returncode == 0 and "Traceback" not in q.stderr, q.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert len(rows) == 8 and all({r["class"], r["class_2"], r["class_3"]} & {"class0", "class1"} for r in rows)
    assert all(sum(r[k] in set(map(str, range(2, 10))) for k in ("class", "class_2", "class_3")) >= 1 for r in rows)
    assert all(0 <= float(r[k]) <= 1 for r in rows for k in ("probability", "probability_2", "probability_3"))
    assert re.search(r"0\.png: \w+ [\d.]+%, \w+ [\d.]+%, \w+ [\d.]+%", q.stdout), q.stdout


def test_decoding_threads_are_used_where_they_measure_faster_and_results_keep_file_order(monkeypatch):
    """Threads are chosen where the pool decodes faster than one thread by THREADS_PAY (a clock that the decoding
    advances stands for time: 2 threads at 1.9x and at 1.1x one thread's rate); the results come in file order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from leafpy.sources import decoding

    clock = [0.0]
    lock = threading.Lock()
    monkeypatch.setattr(decoding.time, "perf_counter", lambda: clock[0])
    for speedup, chosen in ((1.9, True), (1.1, False)):
        def decode(i, speedup=speedup):
            with lock:  # a file decoded in the pool advances the clock by 1/speedup of one decoded alone
                clock[0] += 1.0 if threading.current_thread() is threading.main_thread() else 1.0 / speedup
            return i

        with ThreadPoolExecutor(2) as pool:
            got: list = []
            assert decoding.threads_pay(decode, list(range(32)), pool, got) is chosen and got == list(range(32))


@pytest.mark.parametrize("threads", [False, True])
def test_a_decoder_shares_a_whole_split_request_and_gives_each_row_its_file(threads):
    """A request of a whole split (past SHARED_ROWS rows) decoded by the pool or in the caller's thread, as measured:
    each row is its own file's image, and the cache is finished once."""
    from leafpy.sources import decoding

    n = decoding.SHARED_ROWS + 77
    files = [str(i) for i in range(n)]
    finished = []
    d = decoding.Decoder(files, lambda f: np.full((1, 2, 2), int(f) % 251, np.uint8), np.zeros((n, 1, 2, 2), np.uint8),
                         workers=2, finish=finished.append)
    d.threads = threads
    first = d[np.arange(3)]  # a batch: decoded in this thread
    assert first[:, 0, 0, 0].tolist() == [0, 1, 2] and not finished
    rows = d[np.arange(n)]
    assert rows[:, 0, 0, 0].tolist() == [i % 251 for i in range(n)] and d.complete and len(finished) == 1


def test_a_decoding_process_that_dies_is_replaced_by_this_one_with_a_warning(tmp_path):
    """Processes decode a list of files as this process would (a corrupt file's error in its place); when they
    are killed, the files go on being decoded here, the same images, with one warning; closing ends them."""
    from leafpy.errors import LeafpyError
    from leafpy.sources import image_folder

    write_digits(tmp_path / "digits", per_class=6)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1]
    files.insert(7, str(tmp_path / "not-an-image.png"))
    (tmp_path / "not-an-image.png").write_bytes(b"GIF89a and no more")
    here = [image_folder.decode_or_error(f, (8, 8), 1) for f in files]
    processes = image_folder.processes(2, (8, 8), 1)
    try:
        for round_ in range(2):
            got = processes.map(files)
            assert len(got) == len(files) and isinstance(got[7], LeafpyError) and str(got[7]) == str(here[7])
            assert all(np.array_equal(a, b) for i, (a, b) in enumerate(zip(got, here)) if i != 7)
            if round_ == 0:
                for p in processes.processes:
                    p.kill()
                    p.wait()
                with pytest.warns(UserWarning, match="a decoding process ended"):
                    assert all(np.array_equal(a, b) for i, (a, b) in enumerate(zip(processes.map(files), here))
                               if i != 7)
    finally:
        processes.close()
    assert all(p.returncode is not None for p in processes.processes)


def test_decoding_must_be_a_known_way(tmp_path):
    write_digits(tmp_path / "digits", per_class=3)
    p = leafpy(tmp_path, "train", *FOLDER, "--epochs", "1", "--set", "data.decoding=fork", "--set",
               f"data.cache_dir={tmp_path / 'cache'}")
    failed_cleanly(p, "data.decoding", "auto, threads, processes", "'fork'")


def _dds_of_unknown_pixel_format() -> bytes:
    """A DDS header (which Pillow reads whatever the file's name) declaring a pixel format it does not know: its
    reader raises NotImplementedError, not OSError."""
    import struct

    return b"DDS " + struct.pack("<7I", 124, 0x1007, 8, 8, 0, 0, 0) + bytes(44) + \
        struct.pack("<8I", 32, 0x1D, 0, 24, 0xFF0000, 0xFF00, 0xFF, 0) + bytes(20 + 192)


def test_a_damaged_file_pillow_reads_as_another_format_is_named_by_threads_and_processes_alike(tmp_path):
    write_digits(tmp_path / "digits", per_class=3, odd=False)
    (tmp_path / "digits" / "two" / "odd.png").write_bytes(_dds_of_unknown_pixel_format())
    errors = []
    for mode in ("threads", "processes"):
        p = leafpy(tmp_path, "train", *FOLDER, "--epochs", "1", "--set", "data.workers=2", "--set",
                   f"data.decoding={mode}", "--set", "data.cache_dir=null", "--out", f"run-{mode}", timeout=60)
        failed_cleanly(p, "odd.png", "cannot decode the image", "NotImplementedError", "skip_unreadable")
        errors.append(p.stderr)
    assert errors[0] == errors[1] and len(errors[0].strip().splitlines()) == 1, errors


def test_decoding_processes_keep_their_answers_from_prints_and_leave_other_failures_to_this_process(
        tmp_path, monkeypatch, capfd):
    """A ``sitecustomize`` that prints as the decoding processes start, and a Pillow whose reader fails on one
    file with ZeroDivisionError (a reader's own bug): the processes decode on (no warning, none given up), that file's
    ZeroDivisionError is raised here as a thread would raise it, with no traceback from the processes; paths with a
    newline or bytes that are not UTF-8 reach them intact."""
    import warnings

    from PIL import Image

    from leafpy.errors import LeafpyError
    from leafpy.sources import image_folder

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "print('hello from sitecustomize')\n"
        "import PIL.Image\n_open = PIL.Image.open\n"
        "def _failing(fp, *args, **kwargs):\n"
        "    if 'boom' in str(fp):\n        raise ZeroDivisionError('a reader bug')\n"
        "    return _open(fp, *args, **kwargs)\n"
        "PIL.Image.open = _failing\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    opened = Image.open

    def failing(fp, *args, **kwargs):  # (this process's Pillow as the sitecustomize makes theirs)
        if "boom" in str(fp):
            raise ZeroDivisionError("a reader bug")
        return opened(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", failing)
    folder = os.fsencode(tmp_path / "odd")
    os.mkdir(folder)
    files = []
    for i, name in enumerate([b"new\nline.png", b"lat\xe9n1.png", b"boom.png"]):
        Image.fromarray(np.full((8, 8), 40 * i + 3, np.uint8), "L").save(os.path.join(folder, name), format="PNG")
        files.append(os.fsdecode(os.path.join(folder, name)))
    (tmp_path / "broken.png").write_bytes(b"GIF89a and no more")
    processes = image_folder.processes(2, (8, 8), 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a process given up warns)
            got = processes.map(files[:2] * 3)
            assert [int(g[0, 0, 0]) for g in got] == [3, 43] * 3
            got = processes.map(files)
            assert isinstance(got[2], ZeroDivisionError) and [int(g[0, 0, 0]) for g in got[:2]] == [3, 43]
            assert not processes.failed and len(processes.map(files[:2])) == 2
    finally:
        processes.close()
    # a request's first failure in file order, whichever its kind, as a thread decoding it would meet it
    for order, raised in (([0, 3, 1, 1, 2], LeafpyError), ([0, 2, 1, 1, 3], ZeroDivisionError)):
        listed = [[*files, str(tmp_path / "broken.png")][i] for i in order]
        decoder = image_folder._decoder(listed, (8, 8), 1, None, "key", False, 2, "processes")
        with pytest.raises(raised):
            decoder[np.arange(len(listed))]
        del decoder
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ZeroDivisionError" not in err, err


def test_decoding_processes_let_go_by_their_last_piece_still_end(tmp_path):
    """The last reference to the decoding processes dropped by a piece of work in one of their own threads (a
    dataset dropped while a request it had made was under way, say after Ctrl-C): the processes end all the same
    (their pipes closed) rather than being left running by a thread that cannot wait for itself."""
    import threading
    import time

    from leafpy.sources import image_folder

    write_digits(tmp_path / "digits", per_class=2, odd=False)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1]
    processes = image_folder.processes(2, (8, 8), 1)
    children = list(processes.processes)
    processes.wait_ready()
    go = threading.Event()
    done = processes.pool.submit(lambda piece=processes._piece: go.wait() and len(piece(files)))
    del processes
    go.set()
    assert done.result(timeout=30) == len(files)
    deadline = time.monotonic() + 20
    while not all(p.stdout.closed for p in children) and time.monotonic() < deadline:  # (closed once ended)
        time.sleep(0.05)
    assert all(p.stdout.closed and p.poll() is not None for p in children)


def _peak_memory(pid: int) -> int:
    """The most memory process ``pid`` has held so far (bytes: Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads processes' peak memory from Linux's /proc")
def test_decoding_processes_hold_about_one_piece_of_large_images_at_a_time(tmp_path):
    """Images of 3 MiB each (1024x1024 RGB), 48 files to two processes: each answers in pieces of at most
    PROCESS_PIECE_BYTES, without copies of the whole answer, so its memory grows by well under 3 pieces; the
    images are those decoded here."""
    from leafpy.sources import decoding, image_folder

    write_digits(tmp_path / "digits", per_class=5, odd=False)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1][:48]
    size = (1024, 1024)
    with image_folder.processes(2, size, 3) as processes:
        processes.wait_ready()
        started = {p.pid: _peak_memory(p.pid) for p in processes.processes}
        got = processes.map(files)
        grown = {pid: _peak_memory(pid) - before for pid, before in started.items()}
    assert all(g < 3 * decoding.PROCESS_PIECE_BYTES for g in grown.values()), grown
    assert all(np.array_equal(got[i], image_folder.decode(files[i], size, 3)) for i in (0, 23, 47))


def test_a_decoding_process_whose_run_is_gone_ends_without_a_traceback(tmp_path):
    """A decoding process answering a run that was killed meanwhile (OOM, kill -9: nobody reads its answer) ends
    quietly, as a command in a pipe does, instead of printing a BrokenPipeError traceback on the terminal."""
    import subprocess

    from leafpy.sources import decoding

    write_digits(tmp_path / "digits", per_class=1, odd=False)
    files = sorted(str(f) for f in (tmp_path / "digits").rglob("*.png"))
    worker = subprocess.Popen([sys.executable, "-c", decoding.WORKER, str(ROOT), "256", "256", "3"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    assert worker.stdout is not None and worker.stdin is not None
    assert worker.stdout.readline() == b"ready\n"
    worker.stdout.close()  # (the run is gone: its end of the pipe closed)
    worker.stdin.write(json.dumps(files * 20).encode() + b"\n")  # (more than a pipe holds: 200 images of 196 KiB)
    worker.stdin.close()
    assert worker.stderr is not None
    err = worker.stderr.read()  # (to its end: the process's)
    worker.wait(timeout=60)
    worker.stderr.close()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_a_ctrl_c_while_the_decoding_processes_start_leaves_them_usable(tmp_path, monkeypatch):
    """Ctrl-C (in a Python session) after one decoding process said it was ready and while the other was still
    starting: the next request waits for the second alone and is decoded, rather than waiting forever for the
    first to say again that it is ready."""
    import signal
    import threading

    from leafpy.sources import image_folder

    write_digits(tmp_path / "digits", per_class=1, odd=False)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(  # (the second process to start takes 2 s longer)
        f"import os, time\ntry:\n    os.close(os.open({str(tmp_path / 'first')!r}, os.O_CREAT | os.O_EXCL))\n"
        "except FileExistsError:\n    time.sleep(2)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    processes = image_folder.processes(2, (8, 8), 1)
    kept = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as an interactive session has it)
    try:
        main = threading.get_ident()
        threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            processes.wait_ready()
        got: list = []
        later = threading.Thread(target=lambda: got.extend(processes.map(files)), daemon=True)
        later.start()
        later.join(timeout=30)
        assert not later.is_alive() and len(got) == len(files) and not processes.failed
    finally:
        signal.signal(signal.SIGINT, kept)
        processes.close()


def test_decoding_processes_closed_before_their_first_request_leave_it_to_this_process(tmp_path):
    """The folder decoded whole (its decoder closing the processes) while the thread that started them had yet to
    ask them anything: its request is decoded here, with no error and no warning of a process ended."""
    import warnings

    from leafpy.sources import image_folder

    write_digits(tmp_path / "digits", per_class=1, odd=False)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1]
    processes = image_folder.processes(2, (8, 8), 1)
    processes.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = processes.map(files)
    assert all(np.array_equal(a, image_folder.decode(f, (8, 8), 1)) for a, f in zip(got, files))


def test_decoding_processes_that_measure_slower_end_before_the_folder_is_decoded(tmp_path, monkeypatch):
    """`auto` tries processes on a folder past PROCESS_MIN_FILES; where they measure slower than this process the
    files are decoded here and the processes have ended by the time the first image comes back."""
    from leafpy.sources import decoding, image_folder

    write_digits(tmp_path / "digits", per_class=4, odd=False)
    files = image_folder.list_classes(str(tmp_path / "digits"))[1]
    tried = []

    def slower(decode, some, processes, results):
        tried.append(processes)
        real(decode, some, processes, results)
        return False

    real = decoding.processes_pay
    monkeypatch.setattr(decoding, "PROCESS_MIN_FILES", 8)
    monkeypatch.setattr(decoding, "processes_pay", slower)
    images = image_folder._each(files, (8, 8), 1, 2, "auto")
    first = next(images)
    assert len(tried) == 1 and all(p.poll() is not None for p in tried[0].processes)
    rest = [first, *images]
    here = [image_folder.decode(f, (8, 8), 1) for f in files]
    assert len(rest) == len(here) and all(np.array_equal(a, b) for a, b in zip(rest, here))


def test_class_folders_named_like_numbers_keep_their_names_through_run_yaml(tmp_path):
    """Folders '1e3', '5e-4' and '0x10': run.yaml records the names as text, so evaluate, predict and a resume read
    back the run that train wrote."""
    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from make_image_folder_checkpoint import write_images

    write_images(tmp_path / "images")
    names = ["1e3", "5e-4", "0x10"]
    for c, name in enumerate(names):
        (tmp_path / "images" / f"class{c}").rename(tmp_path / "images" / name)
    args = ["--set", "data.dataset=image_folder", "--set", "data.path=images", "--set", "data.batch_size=4"]
    p = leafpy(tmp_path, "train", "digits_mlp", *args, "--epochs", "1", "--out", "run")
    assert p.returncode == 0, p.stderr
    for command in (["evaluate", "run"], ["predict", "run", "--input", "images/5e-4"], ["summary", "run"],
                    ["train", "run/run.yaml", "--epochs", "2", "--out", "run", "--resume", "run/checkpoint.leaf"]):
        q = leafpy(tmp_path, *command)
        assert q.returncode == 0, (command, q.stderr)
    import leafpy as lp

    run = lp.config.load(str(tmp_path / "run" / "run.yaml"))
    assert list(run.data["class_names"]) == sorted(names)


def test_a_normalised_regression_converted_to_onnx_predicts_in_the_targets_units_everywhere(tmp_path):
    """A CSV regression (normalize: auto) converted to ONNX, and that back to .leaf, predicts what the run does; the
    ONNX model's metadata holds the values, with which onnxruntime gives the same predictions."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    d, _ = _diabetes_run(tmp_path, epochs=3)
    assert leafpy(tmp_path, "train", "diabetes.yaml", "--out", "run").returncode == 0
    x = d.data[:50].astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    expected = None
    for source, onnx_file in (("run", "model.onnx"), ("run/checkpoint.leaf", "from_checkpoint.onnx")):
        c = leafpy(tmp_path, "convert", source, onnx_file)
        assert c.returncode == 0 and "metadata (leafpy.preparation)" in c.stdout, (c.stdout, c.stderr)
        assert leafpy(tmp_path, "convert", onnx_file, "back.leaf").returncode == 0
        for model in ("run", onnx_file, "back.leaf"):
            q = leafpy(tmp_path, "predict", model, "--input", "x.npz", "--out", "p.npz")
            assert q.returncode == 0, q.stderr
            with np.load(tmp_path / "p.npz") as f:
                got = f["outputs"][:, 0]
            expected = got if expected is None else expected
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3, err_msg=model)
    assert 50 < expected.mean() < 250  # the targets' units
    import onnx

    model = onnx.load(str(tmp_path / "model.onnx"))
    prep = json.loads({p.key: p.value for p in model.metadata_props}["leafpy.preparation"])
    mean, std = np.asarray(prep["normalize"]["mean"]), np.asarray(prep["normalize"]["std"])
    np.testing.assert_allclose(mean, d.data.mean(0), rtol=0.1)  # of the training split: near the whole set's
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    y = session.run(None, {session.get_inputs()[0].name: ((x - mean) / std).astype(np.float32)})[0][:, 0]
    y = y * prep["normalize"]["target_std"][0] + prep["normalize"]["target_mean"][0]
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3)


def test_csv_cells_keep_their_line_breaks_and_characters_as_pythons_csv_module_reads_them(tmp_path):
    """A quoted cell over two lines ("1\\n5", "set\\nosa") and a form feed or U+2028 inside a cell: read as Python's
    csv module reads the file (before, the lines were split by str.splitlines: "1\\n5" became 15.0 silently, "set\\nosa"
    merged with "setosa", and a form feed in a column not even used broke the table's rows)."""
    import leafpy as lp

    rows = [["a", "note", "y"], ["1", "page\x0cbreak", "cat"], ["2", "x\u2028y", "dog"], ["3", "ok", "set\nosa"],
            ["4", "ok", "setosa"], ["5", "ok", "cat"]]
    with open(tmp_path / "t.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    with open(tmp_path / "t.csv", newline="") as f:
        assert list(csv.reader(f)) == rows  # the independent reading
    ds = lp.data.csv(tmp_path / "t.csv", "y", features=["a"], test_fraction=0.2)
    assert sorted(ds.class_names) == ["cat", "dog", "set\nosa", "setosa"]
    got = np.concatenate([ds.x_train.reshape(-1), ds.x_test.reshape(-1)])
    assert sorted(float(v) for v in got) == [1.0, 2.0, 3.0, 4.0, 5.0]
    rows[1][0] = "1\n5"
    with open(tmp_path / "t.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    with pytest.raises(lp.LeafpyError, match=r"t.csv: line 2, column 'a': the value is '1\\n5', not a finite number"):
        lp.data.csv(tmp_path / "t.csv", "y", features=["a"])


def test_predict_reads_a_tsv_table_and_evaluate_warns_when_the_data_changed_since_training(tmp_path):
    """A run trained on a tab-separated table: `leafpy predict --input new.tsv` reads it as the training table
    (before: 'not a NumPy .npz file'). A row appended to the table after training re-draws the held-out split:
    `leafpy evaluate` warns that its held-out samples may include training ones (the checkpoint's fingerprint of the
    data no longer matches), and says nothing while the data are unchanged."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3))
    labels = ["pos" if v > 0 else "neg" for v in x[:, 0] + x[:, 1]]
    lines = ["f0\tf1\tf2\ty"] + ["\t".join([*(f"{v:.5f}" for v in row), t]) for row, t in zip(x, labels)]
    (tmp_path / "t.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "t.yaml").write_text(TABLE_RUN.format(
        path="t.tsv", target="y", features=3, outputs=2, epochs=2, last="    - {name: logsm, type: LogSoftmax}",
        objective="{name: nll, type: NegativeLogLikelihood, num_classes: 2}").replace(
        "normalize: auto", "normalize: auto, delimiter: \"\\t\""))
    assert leafpy(tmp_path, "train", "t.yaml", "--out", "run").returncode == 0
    (tmp_path / "new.tsv").write_text("f2\tf0\tf1\n" + "\n".join(f"{r[2]:.5f}\t{r[0]:.5f}\t{r[1]:.5f}"
                                                                 for r in x[:5]) + "\n")
    p = leafpy(tmp_path, "predict", "run", "--input", "new.tsv", "--out", "p.csv")
    assert p.returncode == 0, p.stderr
    assert len(list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))) == 5
    # the same rows split by commas: the header read as one cell, and the message names both delimiters
    (tmp_path / "new.csv").write_text((tmp_path / "new.tsv").read_text().replace("\t", ","))
    wrong = leafpy(tmp_path, "predict", "run", "--input", "new.csv")
    failed_cleanly(wrong, "no column 'f0'", "'f2,f0,f1'", "split by ','", "data.delimiter '\\t'")
    commas = leafpy(tmp_path, "predict", "run", "--input", "new.csv", "--set", "data.delimiter=','", "--out", "c.csv")
    assert commas.returncode == 0, commas.stderr
    np.testing.assert_allclose(np.loadtxt(tmp_path / "c.csv", delimiter=",", skiprows=1, usecols=[2, 4]),
                               np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1, usecols=[2, 4]), atol=1e-6)
    same = leafpy(tmp_path, "evaluate", "run")
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr
    with open(tmp_path / "t.tsv", "a") as f:
        f.write("0.1\t0.2\t0.3\tpos\n")
    changed = leafpy(tmp_path, "evaluate", "run")
    assert changed.returncode == 0, changed.stderr
    assert "warning: the t.tsv samples or targets are not those run/checkpoint.leaf was trained on" in changed.stderr


def test_csv_class_labels_that_read_as_one_integer_keep_one_order(tmp_path):
    """Labels "1", "01" and "2": numbered by value, then by their text, whatever Python's hash seed (before, "01"
    and "1" swapped numbers between two identical runs)."""
    orders = set()
    (tmp_path / "l.csv").write_text("a,y\n" + "".join(f"{k},{lab}\n" for k, lab in enumerate(["1", "01", "2"] * 4)))
    for seed in ("0", "3", "11"):
        p = subprocess.run([sys.executable, "-c", "import leafpy as lp; print(lp.data.csv('l.csv', 'y', "
                            "features=['a']).class_names)"], cwd=tmp_path, capture_output=True, text=True,
                           env={**child_env(), "PYTHONHASHSEED": seed})
        assert p.returncode == 0, p.stderr
        orders.add(p.stdout.strip())
    assert orders == {"('01', '1', '2')"}, orders


def test_a_column_named_like_a_number_is_refused_with_the_quotes_that_name_it(tmp_path):
    """A table whose columns are years (`features: [2019, 2020]`, `target: 2021` in YAML are numbers): the error
    says to quote them; quoted, they are read."""
    import leafpy as lp

    (tmp_path / "y.csv").write_text("2019,2020,2021\n" + "".join(f"{k},{k + 1},{k % 2}\n" for k in range(20)))
    with pytest.raises(lp.ConfigError, match=r"data.features: expected a list of column names, got \[2019, 2020\] "
                                             r"\(a column named like a number is written in quotes: '2020'\)"):
        lp.data.csv(tmp_path / "y.csv", "2021", features=[2019, 2020])
    with pytest.raises(lp.ConfigError, match=r"data.target: .* got 2021 \(a column named like a number"):
        lp.data.csv(tmp_path / "y.csv", 2021)
    ds = lp.data.csv(tmp_path / "y.csv", "2021", features=["2019", "2020"])
    assert ds.x_train.shape[1] == 2 and sorted(ds.class_names) == ["0", "1"]


@pytest.mark.parametrize("damage", ["nested", "huge", "out of range", "repeated"])
def test_a_damaged_image_cache_list_is_decoded_again(tmp_path, damage):
    """The cache's list of skipped files (KEY.json beside KEY.npy) damaged, or written by something else: the folder
    is decoded again, with its own images (a list nested past Python's recursion limit raised RecursionError; one
    far longer than the folder's files could need is not read whole; indices out of range or repeated are no
    list leafpy writes)."""
    import leafpy as lp

    write_digits(tmp_path / "digits", 3)
    cache = tmp_path / "cache"
    first = lp.data.image_folder(tmp_path / "digits", channels=1, image_size=[8, 8], cache_dir=str(cache),
                                 test_fraction=0.5, skip_unreadable=True)  # (decoded whole at once: cached now)
    (listing,) = cache.glob("*.json")
    listing.write_text({"nested": "[" * 100_000, "huge": '{"skipped": []}' + " " * 10_000_000,
                        "out of range": '{"skipped": [999]}', "repeated": '{"skipped": [0, 0]}'}[damage])
    again = lp.data.image_folder(tmp_path / "digits", channels=1, image_size=[8, 8], cache_dir=str(cache),
                                 test_fraction=0.5, skip_unreadable=True)
    np.testing.assert_array_equal(again.x_train, first.x_train)
    np.testing.assert_array_equal(again.y_train, first.y_train)
