"""The run directory's lock (DIR/.lock): of processes starting at once exactly one trains into a directory, a dead
run's lock is taken over by one of them, and a failed start leaves no lock behind. Holding it, a run removes the
temporary files that a save killed midway left in the directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env
from test_user_paths import ROOT, failed_cleanly, leafpy

from leafpy._run_lock import EMPTY_STALE_S, RunLock
from leafpy.errors import LeafpyError

MLP = str(ROOT / "configs" / "digits_mlp.yaml")
PROCESSES = 8


def _hold(directory: str, barrier, inside, most) -> None:
    barrier.wait()
    try:
        with RunLock(directory):
            with inside.get_lock():
                inside.value += 1
                most.value = max(most.value, inside.value)
            time.sleep(0.02)
            with inside.get_lock():
                inside.value -= 1
    except LeafpyError:
        pass


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.skipif(sys.platform == "win32", reason="starts its processes by fork")
@pytest.mark.parametrize("left", ["nothing", "a dead run's lock"])
def test_processes_starting_at_once_hold_the_lock_one_at_a_time(tmp_path, left):
    ctx = mp.get_context("fork")
    for trial in range(10):
        directory = tmp_path / str(trial)
        directory.mkdir()
        if left != "nothing":
            (directory / ".lock").write_text(str(_dead_pid()))
        barrier, inside, most = ctx.Barrier(PROCESSES), ctx.Value("i", 0), ctx.Value("i", 0)
        procs = [ctx.Process(target=_hold, args=(str(directory), barrier, inside, most)) for _ in range(PROCESSES)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * PROCESSES
        assert most.value == 1, f"trial {trial}: {most.value} processes held the lock at once"
        assert os.listdir(directory) == []  # no lock, no temporary left


def test_a_lock_not_yet_holding_its_process_id_is_not_taken_for_stale(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # another process's, between creating the file and writing its id
    failed_cleanly(leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", str(out)), "another process is taking")
    assert (out / ".lock").exists() and not (out / "model.leaf").exists()
    old = time.time() - EMPTY_STALE_S - 5  # left empty long ago (a crash, a full disk): stale
    os.utime(out / ".lock", (old, old))
    p = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert not (out / ".lock").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
def test_a_lock_that_is_a_fifo_or_a_directory_is_refused_by_name_without_waiting(tmp_path):
    for kind in ("fifo", "directory"):
        out = tmp_path / kind
        out.mkdir()
        os.mkfifo(out / ".lock") if kind == "fifo" else (out / ".lock").mkdir()
        p = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", str(out))  # (a timeout if it blocked)
        failed_cleanly(p, f"{out / '.lock'}: a {'FIFO' if kind == 'fifo' else 'directory'}, not a regular file")
        assert f"remove it if no run is using {out}" in p.stderr
        assert not (out / "model.leaf").exists()


def test_a_lock_written_on_another_host_is_never_taken_over(tmp_path):
    """A run in another container or on another machine sharing the directory: its process id means nothing here
    (often 1, or this very process's), so its lock stands, however old, and the message says how to clear it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(f"{os.getpid()} another-container")
    old = time.time() - 86400
    os.utime(out / ".lock", (old, old))
    with pytest.raises(LeafpyError, match=r"a leafpy run on host 'another-container' \(process \d+: another machine "
                                          r"or container .*if no run is using the directory, remove .*\.lock\)"):
        with RunLock(str(out)):
            pass
    assert (out / ".lock").read_text() == f"{os.getpid()} another-container"
    (out / ".lock").write_text(str(_dead_pid()))  # an earlier leafpy's lock, an id alone: judged here as before
    with RunLock(str(out)):
        pid, host = (out / ".lock").read_text().split()
        assert int(pid) == os.getpid() and host
    assert not (out / ".lock").exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process states are read from /proc")
def test_a_lock_of_a_zombie_is_stale_and_a_live_holder_names_the_way_out(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ended, not yet reaped
    try:
        for _ in range(200):
            with open(f"/proc/{zombie.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.02)
        (out / ".lock").write_text(str(zombie.pid))
        with RunLock(str(out)):
            assert int((out / ".lock").read_text().split()[0]) == os.getpid()
    finally:
        zombie.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live process, no leafpy
    try:
        (out / ".lock").write_text(str(sleeper.pid))
        with pytest.raises(LeafpyError, match=rf"another leafpy run \(process {sleeper.pid}\) is writing .*if process "
                                              rf"{sleeper.pid} is no leafpy run, .*remove .*\.lock"):
            with RunLock(str(out)):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()


def test_commands_meeting_a_live_run_say_so_rather_than_advise_on_its_files(tmp_path):
    """A directory with a run's files and a live run's lock: train without --resume is told a run is writing there
    (not to pass --overwrite), evaluate is told the same (not to finish the run with --resume)."""
    first = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", "run")
    assert first.returncode == 0, first.stderr
    (tmp_path / "run" / "model.leaf").unlink()  # as while a run trains: a checkpoint, no model yet
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the live run, here
    try:
        (tmp_path / "run" / ".lock").write_text(str(sleeper.pid))
        p = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", "run")
        failed_cleanly(p, f"another leafpy run (process {sleeper.pid}) is writing to this directory")
        assert "--overwrite" not in p.stderr
        e = leafpy(tmp_path, "evaluate", "run")
        failed_cleanly(e, f"run: no model.leaf yet: another leafpy run (process {sleeper.pid}) is writing",
                       "meanwhile, give its last checkpoint: --weights")
        assert "--resume" not in e.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def _no_file_writes() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # every write into a file fails, as on a full disk


def test_a_start_that_cannot_write_the_lock_leaves_none(tmp_path):
    out = tmp_path / "run"
    env = child_env(PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-m", "leafpy", "train", MLP, "--epochs", "1", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                       preexec_fn=_no_file_writes)
    failed_cleanly(p, "cannot write the run directory's lock")
    assert os.listdir(out) == []


def test_two_runs_started_at_once_into_one_directory(tmp_path):
    out = tmp_path / "run"
    env = child_env()
    cmd = [sys.executable, "-m", "leafpy", "train", MLP, "--epochs", "3", "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [subprocess.CompletedProcess(p.args, p.returncode, *p.communicate(timeout=300)) for p in procs]
    done = [subprocess.CompletedProcess(d.args, p.returncode, d.stdout, d.stderr) for d, p in zip(done, procs)]
    assert sorted(d.returncode for d in done) == [0, 1], [d.stderr for d in done]
    refused = next(d for d in done if d.returncode)
    failed_cleanly(refused, "another --out")  # the lock; or, where the other run ended first, its files
    assert "another leafpy run (process" in refused.stderr or "holds another run's files" in refused.stderr
    assert "epoch 3/3" in next(d for d in done if not d.returncode).stdout
    assert not Path(out / ".lock").exists()


# --- what a killed save left ------------------------------------------------------------------------------------
KILLED_SAVES = [".checkpoint.leaf.leafpy-a1b2c3d4.tmp", ".history.json.leafpy-zz_9x8y7.tmp",
                ".model.leaf.leafpy-q0w9e8r7.tmp", ".best-epoch2.leaf.leafpy-abcdefgh.tmp",
                ".run.yaml.leafpy-0123abcd.tmp"]
NOT_OURS = [".notes.txt.leafpy-a1b2c3d4.tmp", "checkpoint.leaf.tmp", ".checkpoint.leaf.leafpy-toolong123.tmp",
            "mine.tmp", ".model.leaf.backup01.tmp", ".checkpoint.leaf.a1b2c3d4.tmp"]  # (a user's, unmarked: left)


@pytest.mark.parametrize("start", ["resume", "overwrite"])
def test_a_run_removes_the_temporaries_a_killed_save_left_and_nothing_else(tmp_path, start):
    first = leafpy(tmp_path, "train", MLP, "--epochs", "1", "--out", "run")
    assert first.returncode == 0, first.stderr
    out = tmp_path / "run"
    for name in KILLED_SAVES + NOT_OURS:
        (out / name).write_bytes(b"\0" * 1000)
    more = ("--resume", "run/checkpoint.leaf") if start == "resume" else ("--overwrite",)
    p = leafpy(tmp_path, "train", MLP, "--epochs", "2", "--out", "run", *more)
    assert p.returncode == 0, p.stderr
    left = set(os.listdir(out))
    assert not left & set(KILLED_SAVES), sorted(left)
    assert set(NOT_OURS) <= left
    assert "removed 5 temporary files left by an interrupted save" in p.stdout
    assert not [n for n in left if n.endswith(".tmp") and n not in NOT_OURS]  # nor did this run leave any
