"""Recorded training steps, shared by the backends that replay them (cuda: CUDA graphs; webgpu: dispatch lists).

A step is recorded once its key has been seen before (the first run allocates what the step needs), and replayed
from then on while every tensor it touched still has the buffer the recording holds. The key covers everything
the step's launches depend on (the solver, its bindings, the accumulation phase); values that change from step to
step (the learning rate, Adam's bias correction) live in device buffers written before the step, never in the
recording. A backend supplies four operations (see :class:`Replayer`), this module the bookkeeping.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from ..tensor import SharedTensor, recording_accesses

Step = Callable[[], None]


class Replayer(Protocol):
    """What a backend provides to :class:`StepRecorder`."""

    key: str

    def first_run(self, entry: RecordedStep, step: Step) -> None:
        """Run ``step`` the first time its key is seen (from memory the recording may later own)."""

    def capture(self, entry: RecordedStep, step: Step) -> tuple[Any, bool]:
        """Record ``step``: (the recording, or None where the step cannot be recorded; whether ``step`` ran)."""

    def launch(self, recording: Any) -> None:
        """Submit a recording's work once."""

    def handle(self, buffer: Any) -> Any:
        """What identifies a tensor's device buffer in a recording (an address, a buffer object)."""


class RecordedStep:
    """One key's recording: the backend's recording object, the tensors it touches (weakly: a deleted solver's
    step is dropped, not kept alive) with the buffer handles baked in, and backend extras (cuda: a memory pool)."""

    __slots__ = ("recording", "tensors", "eager", "extra", "failed", "released", "generation", "__weakref__")

    def __init__(self) -> None:
        self.recording: Any = None
        self.tensors: list[tuple[weakref.ref, bool, Any]] = []
        self.eager = False  # the step cannot be recorded: always run it as it is
        self.extra: Any = None
        self.failed = False  # set by a backend's capture where the step itself raised (a refused batch, Ctrl-C)
        self.released = False
        self.generation = 0  # counts the recordings made: a tensor of an older one going away releases nothing

    def dead(self) -> bool:
        return self.released or any(ref() is None for ref, _, _ in self.tensors)

    def release(self, generation: int) -> None:
        """A tensor the recording touches was deleted (its solver is gone): let go of the recording and the buffers
        it holds (a native recording holds its operands' arrays, a cuda one its memory), rather than keep them
        until another step is recorded (a deleted solver's weights, gradients and update state stayed alive).
        ``generation``: the recording the tensor belonged to (a tensor of an earlier one, released while the step
        is recorded again, must not release the new one)."""
        if generation != self.generation:
            return
        self.released = True
        self.recording = None
        self.tensors = []
        self.extra = None


def _releaser(entry: RecordedStep) -> Callable[[Any], None]:
    """The callback of the references to a recording's tensors: the entry's release of this recording, held weakly
    (the references must not keep the entry alive). It may run in any thread, from the garbage collector."""
    method = weakref.WeakMethod(entry.release)
    generation = entry.generation

    def gone(_tensor: Any) -> None:
        bound = method()
        if bound is not None:
            bound(generation)
    return gone


class StepRecorder:
    """Keeps up to ``capacity`` recorded steps of one backend and runs steps through them."""

    def __init__(self, backend: Replayer, capacity: int) -> None:
        self.backend = backend
        self.capacity = capacity
        self.steps: dict[Hashable, RecordedStep] = {}
        self.replays = 0  # steps run from an existing recording (not counting the run that made it)
        self.error: str | None = None  # why the last step that could not be recorded could not

    def run(self, key: Hashable, step: Step) -> None:
        if key is None:
            step()
            return
        entry = self.steps.get(key)
        if entry is None:
            for k in [k for k, e in self.steps.items() if e.dead()]:  # their solver is gone (keys never recur)
                del self.steps[k]
            if len(self.steps) >= self.capacity:
                self.steps.pop(next(iter(self.steps)))
            entry = self.steps[key] = RecordedStep()
            self.backend.first_run(entry, step)
            return
        if entry.eager:
            step()
            return
        if entry.recording is not None and self._launch(entry):
            self.replays += 1
            return
        self._record(entry, step)

    def forget(self) -> None:
        """Drop every recording (a buffer they bind was released): each is recorded again when next run."""
        for entry in self.steps.values():
            entry.recording = None

    def live_extras(self) -> list:
        return [e.extra for e in self.steps.values() if e.extra is not None]

    def _record(self, entry: RecordedStep, step: Step) -> None:
        be = self.backend
        entry.recording = None
        entry.generation += 1  # (before the capture: a tensor of the previous recording may go meanwhile)
        entry.released = False
        with recording_accesses() as accesses:
            try:
                recording, ran = be.capture(entry, step)
            except Exception as e:  # noqa: BLE001 - whatever cannot be recorded runs as it is from now on
                recording, ran = None, False
                self.error = f"{type(e).__name__}: {e}"
        if recording is None:
            entry.eager = not entry.failed  # (a step that raised is recorded again at its next call)
            entry.failed = False
            if not ran:
                step()
            return
        gone = _releaser(entry)
        entry.tensors = [(weakref.ref(t, gone), w, be.handle(t.buffer_on(be.key)))
                         for t, w in SharedTensor.touched(accesses)]
        entry.recording = recording
        if not ran:
            self._launch(entry)

    def _launch(self, entry: RecordedStep) -> bool:
        """Launch a recording; False (nothing launched) where a tensor it touches has another buffer now."""
        be = self.backend
        recording = entry.recording  # (read once: a release from another thread may clear it meanwhile)
        if recording is None:
            return False
        key, handle_of = be.key, be.handle  # (looked up once: this runs for every tensor of every replayed step)
        stale = []
        written = []
        for ref, writes, handle in entry.tensors:
            t = ref()
            if t is None:
                return False
            buf = t.buffer_on(key)
            if buf is None or handle_of(buf) != handle:
                return False
            if not t.is_fresh_on(key):
                stale.append(t)
            if writes:
                written.append(t)
        for t in stale:  # host data changed (weights set, the learning rate): upload into the same buffer
            t.read(be)
        be.launch(recording)
        for t in written:
            t.mark_fresh_only(key)
        return True
