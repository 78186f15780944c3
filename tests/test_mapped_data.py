"""Datasets read through memory maps (``dataset: npz`` with ``memory_map: true``, ``dataset: npy``): through the
leafpy command they train as the same arrays loaded whole do, and a file whose float32 samples exceed the
process's address-space limit (RLIMIT_AS, set in the child as ``ulimit -v`` would) trains an epoch under it, where
loading it whole is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env
from runs import layer, run_file
from test_data_files import npy as npy_file
from test_data_files import npz_with_member
from test_user_paths import _weights, failed_cleanly, leafpy

import leafpy as lp

RUN = run_file([layer("pool", "Pooling", mode="average", filter_shape=[8, 8], stride=8), layer("flat", "Flatten"),
                layer("head", "Linear", output_size=5), layer("logsm", "LogSoftmax")], [3, 64, 64], name="mapped",
               data={"dataset": "npz", "path": "data.npz", "batch_size": 64, "test_fraction": 0.25, "seed": 0},
               solver={"solver": "momentum", "base_lr": 0.05, "momentum": 0.9, "seed": 3}, train={"epochs": 1})


def _write(tmp_path: Path, n: int, dtype: type = np.uint8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, n)
    x = rng.integers(0, 255, (n, 3, 64, 64), dtype=np.uint8)
    x[:, 0, :8, :8] = y[:, None, None] * 50  # something to learn
    x = x.astype(dtype)
    (tmp_path / "run.yaml").write_text(RUN)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    return x, y


@pytest.mark.parametrize("dtype", [np.uint8, np.float64])
def test_mapped_npz_and_npy_train_as_the_arrays_loaded_whole(tmp_path, dtype):
    x, y = _write(tmp_path, 400, dtype)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    runs = {"whole": [], "mapped": ["--set", "data.memory_map=true"],
            "npy": ["--set", "data.dataset=npy", "--set", "data.path={x: x.npy, y: y.npy}"]}
    for out, extra in runs.items():
        p = leafpy(tmp_path, "train", "run.yaml", "--out", out, "--epochs", "2", *extra)
        assert p.returncode == 0, p.stderr
    w = {out: _weights(tmp_path / out / "model.leaf") for out in runs}
    for out in ("mapped", "npy"):
        for name in w["whole"]:
            assert np.array_equal(w["whole"][name], w[out][name]), (out, name)  # converted a batch at a time alike
    assert "x: ../x.npy" in (tmp_path / "npy" / "run.yaml").read_text()
    e = leafpy(tmp_path, "evaluate", "npy")
    assert e.returncode == 0 and "held-out accuracy" in e.stdout, e.stderr


def test_a_mapped_dataset_that_cannot_be_mapped_is_refused_naming_the_fix(tmp_path):
    x, y = _write(tmp_path, 40)
    np.savez_compressed(tmp_path / "small.npz", x=x, y=y)
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.path=small.npz", "--set",
               "data.memory_map=true")
    failed_cleanly(p, "small.npz", "compressed", "np.savez", "memory_map: false")
    np.save(tmp_path / "x.npy", np.asfortranarray(x))
    np.save(tmp_path / "y.npy", y)
    q = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.dataset=npy", "--set",
               "data.path={x: x.npy, y: y.npy}")
    failed_cleanly(q, "x.npy", "Fortran order", "np.ascontiguousarray")
    r = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.dataset=npy", "--set", "data.path=x.npy")
    failed_cleanly(r, "data.path", "{x: X.npy, y: Y.npy}")
    s = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.memory_map=sure")
    failed_cleanly(s, "data.memory_map", "true or false")


@pytest.mark.parametrize("labels", [np.arange(40) % 5 - 1, np.arange(39) % 5, np.array(list("abcde") * 8)])
def test_npy_labels_at_fault_are_named_by_their_own_file(tmp_path, labels):
    """dataset: npy reads each array from a file of its own: a message about the labels names the labels' file,
    not the samples'."""
    x, _ = _write(tmp_path, 40)
    np.save(tmp_path / "samples.npy", x)
    np.save(tmp_path / "labels.npy", labels)
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.dataset=npy", "--set",
               "data.path={x: samples.npy, y: labels.npy}")
    failed_cleanly(p, "labels.npy")
    assert "samples.npy" not in p.stderr, p.stderr


@pytest.mark.parametrize("shape, words", [("(-1, 4), }", "declares shape (-1, 4), with a negative dimension"),
                                          ("(4, 4 ", "is not a readable .npy array (TokenError")],
                         ids=["a negative dimension", "a header cut short"])
def test_a_damaged_npy_header_is_refused_naming_the_file(tmp_path, shape, words):
    """NumPy's header parser takes a negative dimension (np.memmap then failed with a bare ValueError) and raises
    tokenize's TokenError on a header cut short: both are the file's fault, named as such."""
    x = npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': " + shape, bytes(256))
    (tmp_path / "x.npy").write_bytes(x)
    np.save(tmp_path / "y.npy", np.zeros(4, np.int64))
    npz_with_member(tmp_path / "data.npz", "x.npy", x, y=np.zeros(4, np.int64))
    (tmp_path / "run.yaml").write_text(RUN)
    for memory_map in (True, False):
        with pytest.raises(lp.SerializationError, match=re.escape(f"data.npz: x {words}")):
            lp.data.npz(str(tmp_path / "data.npz"), memory_map=memory_map)
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "r", "--set", "data.dataset=npy", "--set",
               "data.path={x: x.npy, y: y.npy}")
    failed_cleanly(p, "x.npy: x " + words, "write it again")


CHILD = textwrap.dedent("""
    import atexit, resource, runpy, sys
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))

    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                print("peak resident", line.split(":")[1].strip(), file=sys.stderr)

    atexit.register(peak)
    sys.argv = ["leafpy"] + sys.argv[2:]
    runpy.run_module("leafpy", run_name="__main__")
""")


def test_a_dataset_larger_than_the_address_space_limit_trains_through_a_memory_map(tmp_path):
    n = 16384  # 201 MB of uint8 samples: 805 MB as float32
    _write(tmp_path, n)
    size = os.path.getsize(tmp_path / "data.npz")
    limit = size + (450 << 20)  # the file mapped, the interpreter, NumPy and leafpy, batches
    assert n * 3 * 64 * 64 * 4 > limit
    env = child_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")

    def train(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", CHILD, str(limit), "train", "run.yaml", "--epochs", "1", *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    whole = train("--out", "whole")  # loading it whole: refused before anything is allocated
    assert whole.returncode == 1 and "memory-mapped dataset" in whole.stderr, whole.stderr
    assert "Traceback" not in whole.stderr
    p = train("--out", "mapped", "--set", "data.memory_map=true")
    assert p.returncode == 0, p.stderr
    accuracy = float(p.stdout.split("held-out accuracy: ")[1].split("%")[0])
    assert accuracy > 50.0, p.stdout  # it learned the marked corner (chance: 20%)
    peak_kb = int(p.stderr.split("peak resident")[1].split()[0])
    print(f"file {size >> 20} MiB, limit {limit >> 20} MiB, peak resident {peak_kb >> 10} MiB")
    assert peak_kb * 1024 < limit


def test_an_epoch_over_a_mapped_file_keeps_the_resident_memory_below_the_file_size(tmp_path):
    """A mapped file's pages are let go as reads pass (mapped.RESIDENT_BYTES): an epoch over a 590 MB .npy peaks
    far below the file's size in resident memory (it stayed at the whole file plus the interpreter before)."""
    n, chunk = 48000, 4000
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, n)
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.uint8, shape=(n, 3, 64, 64))
    for start in range(0, n, chunk):  # written a chunk at a time: the test itself stays small too
        part = rng.integers(0, 255, (min(chunk, n - start), 3, 64, 64), dtype=np.uint8)
        part[:, 0, :8, :8] = y[start:start + len(part), None, None] * 50
        x[start:start + len(part)] = part
    x.flush()
    del x
    np.save(tmp_path / "y.npy", y)
    (tmp_path / "run.yaml").write_text(RUN)
    size = os.path.getsize(tmp_path / "x.npy")
    p = subprocess.run([sys.executable, "-c", CHILD, str(1 << 40), "train", "run.yaml", "--out", "r", "--epochs", "1",
                        "--set", "data.dataset=npy", "--set", "data.path={x: x.npy, y: y.npy}"],
                       cwd=tmp_path, env=child_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout.split("held-out accuracy: ")[1].split("%")[0]) > 50.0, p.stdout
    peak_kb = int(p.stderr.split("peak resident")[1].split()[0])
    print(f"file {size >> 20} MiB, peak resident {peak_kb >> 10} MiB")
    assert size > 560 << 20 and peak_kb * 1024 < 400 << 20, (size, peak_kb)


def test_reads_through_a_mapping_let_its_pages_go_past_the_budget_and_keep_their_values(tmp_path, monkeypatch):
    """The mechanism under the epoch above, in process: reads past the budget release the mapping's pages
    (``Pages.releases``), and rows read after a release are the file's rows still."""
    from leafpy.sources import mapped

    x = np.random.default_rng(0).integers(0, 255, (512, 3, 16, 16), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    monkeypatch.setattr(mapped, "RESIDENT_BYTES", 1 << 16)
    m = mapped.Mapped(mapped.npy(str(tmp_path / "x.npy"), "x"))
    assert m.pages.mapping is not None
    rows = np.random.default_rng(1).permutation(512)
    for start in range(0, 512, 32):
        idx = rows[start:start + 32]
        np.testing.assert_array_equal(m[idx], x[idx].astype(np.float32) / np.float32(255.0))
    assert m.pages.releases >= 8, m.pages.releases
    assert sum(len(c) for c in m.chunks()) == 512


def test_scattered_rows_are_read_in_groups_in_their_order_and_measured_pages_let_go(tmp_path, monkeypatch):
    """A long list of scattered rows (a split's chunk, a batch) is read a group at a time, each group counted
    before the next is read, and comes back in the order asked; the mapping is let go when the process's resident
    file pages (as the system reports them) grew by the budget, though the bytes read stayed under it (Linux 6.16+
    maps a whole 2 MiB folio for a row of a few KiB)."""
    from leafpy.sources import mapped

    x = np.random.default_rng(2).integers(0, 255, (300, 2, 8, 8), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    row = x[0].nbytes
    monkeypatch.setattr(mapped, "LARGEST_FOLIO_BYTES", row)
    monkeypatch.setattr(mapped, "SCATTERED_READ_BYTES", 5 * row)  # groups of 5 rows
    resident = [0]
    monkeypatch.setattr(mapped, "file_resident", lambda: resident[0])
    reads = []
    m = mapped.Mapped(mapped.npy(str(tmp_path / "x.npy"), "x"), np.random.default_rng(3).permutation(300))
    m.pages.budget = 1 << 40  # only the measured pages can let the mapping go

    def counted(nbytes, real=m.pages.read):
        reads.append(nbytes)
        resident[0] += 1 << 20  # each group maps a megabyte, as the system would report
        real(nbytes)
    monkeypatch.setattr(m.pages, "read", counted)
    idx = np.random.default_rng(4).permutation(300)[:37]
    np.testing.assert_array_equal(m[idx], x[m.rows[idx]].astype(np.float32) / np.float32(255.0))
    assert len(reads) == 8 and sum(reads) == 37 * (row + mapped.FAULT_AROUND_BYTES)  # 7 groups of 5, one of 2
    assert m.pages.releases == 0
    m.pages.budget = 3 << 20
    m[idx]
    assert m.pages.releases == 3  # grown 9 MiB at the first group, then 3 MiB by the 4th and by the 7th
    np.testing.assert_array_equal(np.concatenate(list(m.raw_chunks())), x[m.rows])


def test_a_mask_or_an_index_array_of_rows_reads_as_numpy_indexes(tmp_path):
    """Mapped samples indexed by a boolean mask, or by a 2-D array of indices, longer than a group of scattered
    rows: the rows NumPy's indexing picks, in its shape."""
    from leafpy.sources import mapped

    x = np.random.default_rng(5).integers(0, 255, (300, 2, 8, 8), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    m = mapped.Mapped(mapped.npy(str(tmp_path / "x.npy"), "x"))
    expect = x.astype(np.float64) / 255.0
    mask = np.arange(300) % 3 == 0
    np.testing.assert_allclose(m[mask], expect[mask], rtol=1e-6)
    grid = np.random.default_rng(6).permutation(300)[:80].reshape(40, 2)
    np.testing.assert_allclose(m[grid], expect[grid], rtol=1e-6)
    with pytest.raises(IndexError):
        m[mask[:-1]]


@pytest.mark.parametrize("rows", [None, "taken"])
def test_normalize_auto_statistics_of_byte_images_equal_float64_numpy(rows):
    """`normalize: auto` over an image folder's uint8 images (counted by byte value per channel) gives the float64
    mean and standard deviation of the [0, 1] samples per channel, a constant channel's deviation 1, also over a
    subset of the rows (a split), and the same as the same samples given as float32 arrays."""
    from leafpy.sources.mapped import Mapped
    from leafpy.sources.prepare import channel_statistics

    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, (301, 3, 5, 4), dtype=np.uint8)
    images[:, 2] = 77  # a constant channel
    picked = np.sort(rng.choice(301, 200, replace=False)) if rows else None
    samples = Mapped(images, picked)
    reference = (images if picked is None else images[picked]).astype(np.float64) / 255.0
    mean, std = channel_statistics(samples)
    np.testing.assert_allclose(mean, reference.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std[:2], reference.std(axis=(0, 2, 3))[:2], rtol=1e-10)
    assert std[2] == 1.0 and abs(mean[2] - 77 / 255) < 1e-12
    as_floats = channel_statistics(reference.astype(np.float32))
    np.testing.assert_allclose(as_floats[0], mean, rtol=1e-6)
    np.testing.assert_allclose(as_floats[1][:2], std[:2], rtol=1e-5)
