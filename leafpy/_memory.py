"""How much memory this process may still allocate, read from the system (MemAvailable), a container's limit
(cgroup v2) and the address-space limit (RLIMIT_AS): what the data loaders check a dataset against before they
allocate it."""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the system's available memory (MemAvailable), what a
    container's memory limit leaves (cgroup v2) and what the address-space limit leaves (RLIMIT_AS, as ``ulimit
    -v`` sets it); None where none of them can be read."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    known = [n for n in (_meminfo_available(), _cgroup_left(), _address_space_left(page)) if n is not None]
    if not known and hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        known.append(os.sysconf("SC_AVPHYS_PAGES") * page)
    return min(known) if known else None


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip()
    except (OSError, ValueError):
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """What a cgroup v2 memory limit leaves, counting the page cache it may reclaim (inactive files) as free."""
    limit, used = _first_line("/sys/fs/cgroup/memory.max"), _first_line("/sys/fs/cgroup/memory.current")
    if not limit or not used or not limit.isdigit() or not used.isdigit():
        return None  # no cgroup v2 limit ("max"), or none readable
    reclaimable = 0
    try:
        with open("/sys/fs/cgroup/memory.stat") as f:
            for line in f:
                if line.startswith("inactive_file "):
                    reclaimable = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return max(0, int(limit) - int(used) + reclaimable)


def _address_space_left(page: int) -> int | None:
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    statm = _first_line("/proc/self/statm")
    if soft == resource.RLIM_INFINITY or not statm:
        return None
    return max(0, soft - int(statm.split()[0]) * page)
