"""One thread at a time in a network or a solver.

A network's outputs, gradients and weights are buffers that every call writes (``forward`` returns the layer's own
output tensors), and a solver's step reads and writes all of them, so two threads inside one network or solver mix
their batches without a word. Rather than serialise them behind a lock (one thread would wait on the other, and its
results would still be overwritten by the next call), the second caller is refused with a LeafpyError that says what
to do. Calls from the thread already inside (a container running its layers, a solver its network, a callback
calling ``forward`` during a step) go on: the guard counts them.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import LeafpyError

FIX = ("give each thread its own network or solver (lp.Layer.load(backend, path), lp.Layer.from_config, "
       "lp.Solver.from_config), or serialise the calls (one threading.Lock held around each)")


class OneCaller:
    """``with guard("forward"): ...`` lets one thread in (and in again, nested); another thread calling meanwhile
    gets a LeafpyError naming ``what`` (e.g. "layer 'lenet'") and both calls. Costs an uncontended lock per call."""

    __slots__ = ("_what", "_lock", "_owner", "_depth", "_doing")

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside (only that thread ever finds its own id here)
        self._depth = 0
        self._doing = ""

    def __call__(self, doing: str) -> OneCaller:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
        elif self._lock.acquire(blocking=False):
            self._owner, self._depth, self._doing = me, 1, doing
        else:
            self._refuse(doing)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def _refuse(self, doing: str) -> None:
        owner, busy = self._owner, self._doing
        other = next((t.name for t in threading.enumerate() if t.ident == owner), None) if owner else None
        inside = f"thread '{other}' is running {busy}" if other else "another thread is inside it"
        raise LeafpyError(f"{self._what}: {doing} called from thread '{threading.current_thread().name}' while "
                          f"{inside}; one network or solver serves one thread at a time (its outputs, gradients and "
                          f"weights are buffers every call writes): {FIX}")
