"""Compiled kernels for the native backend, where numba is installed (``pip install numba``, the ``numba`` extra).

The native backend's work outside its products is bound by memory traffic, and NumPy makes a pass over memory per
operation. The kernels here make one where NumPy makes several:

- max pooling (:func:`max_pool_case`): NumPy runs one pass per window position (compare, maximum, mask), so a 2x2
  pooling reads its input and mask four times; LeNet-64's two poolings took 7 of its 27 ms a training step on a
  2-core Intel Xeon. The kernels: forward 2x2 pooling 6x faster there, its gradient 2-5x. They take max pooling
  over 2x2 windows at stride 2 and 3x3 windows at any stride, without padding, the windows inside the input, on
  C-contiguous float32/float64 NCHW arrays and an int32 mask, and give the values of NumPy's passes (a zero's
  sign aside): the first of equal maxima, NaN propagated to the output (the mask then keeps the last position that
  was larger before it), and a gradient that is ``dy`` where ``mask == position`` and 0 elsewhere (an inf or NaN
  in ``dy`` reaches its window's maximum only, as on the other backends and in PyTorch), summed where windows
  overlap in NumPy's order.
- a convolution's columns (:func:`windows_case`), batch innermost or per image: gathered from its input and added
  back into its input's gradient, one loop over every window position where NumPy makes a strided pass per
  position.
- a recorded training step's calls (:func:`fuse`): a Linear layer's bias and the ReLU after it, and the ReLU's
  gradient with the bias gradient of the Linear before it, each one pass; a classifier's log-softmax and
  negative log-likelihood, forward and backward, as one call.
- update rules (:func:`update_loop`): a line of ``updates.TABLE`` as one loop over the elements, generated from
  its formula, where NumPy's code makes a pass per operation.

They are serial (no thread pool of their own beside the BLAS's). The fixed kernels are compiled once per dtype into
numba's cache, an update rule's loop once per process. numba is imported only when work at least
:data:`MIN_ELEMENTS` (pooling), :data:`COLUMNS_MIN_ELEMENTS` (columns), :data:`FUSE_MIN_ELEMENTS` (fused calls)
or :data:`UPDATE_MIN_ELEMENTS` (updates) large runs, so small models (``make demo``) start as fast as without it.
``LEAFPY_COMPILED=0`` in the environment, set before the first such call, turns them off."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import math
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from . import updates

MIN_ELEMENTS = 1 << 16
"""Smaller pooling inputs stay with NumPy (there a call costs microseconds either way, and numba's import, about
0.4 s, would not pay)."""

COLUMNS_MIN_ELEMENTS = 1 << 18
"""Smaller columns stay with NumPy: the default digits LeNet's (92,160 values at batch 32) never import numba."""

MIN_BATCH_RUN = 16
"""The shortest batch (the innermost run of a convolution's batch-innermost columns) the column kernels take."""

_KERNELS: list[Any] = []
_LOADING = threading.Lock()


def kernels() -> Any | None:
    """The kernel module (leafpy.backends._kernels, compiled on first call), or None where numba is missing or
    cannot load, or LEAFPY_COMPILED=0 (read once, at the first call)."""
    if not _KERNELS:
        with _LOADING:
            if not _KERNELS:
                module: Any = None
                if os.environ.get("LEAFPY_COMPILED", "1") != "0":
                    try:
                        module = importlib.import_module("leafpy.backends._kernels")
                    except Exception:  # noqa: BLE001 - numba missing, or its llvmlite unable to load: NumPy's paths
                        module = None
                _KERNELS.append(module)
    return _KERNELS[0]


def max_pool_case(x: Any, out: Any, mask: Any, kernel: tuple, stride: tuple, padding: tuple) -> str | None:
    """Which kernel takes this max pooling ("2x2": windows 2x2 at stride 2; "3x3": 3x3 windows at any stride, the
    gradient through the general kernel), or None (NumPy's passes take it). Each takes unpadded windows inside the
    input only."""
    if x.size < MIN_ELEMENTS or x.ndim != 4 or tuple(padding) != (0, 0) or mask is None:
        return None
    if x.dtype != out.dtype or x.dtype.kind != "f" or x.dtype.itemsize not in (4, 8) or mask.dtype.name != "int32":
        return None
    if not (x.flags.c_contiguous and out.flags.c_contiguous and mask.flags.c_contiguous):
        return None
    (kh, kw), (sh, sw) = kernel, stride
    n, c, h, w = x.shape
    oh, ow = out.shape[2], out.shape[3]
    if out.shape[:2] != (n, c) or mask.shape != out.shape or oh < 1 or ow < 1:
        return None
    if (oh - 1) * sh + kh > h or (ow - 1) * sw + kw > w:
        return None
    if (kh, kw, sh, sw) == (2, 2, 2, 2):
        return "2x2"
    return "3x3" if (kh, kw) == (3, 3) else None  # other windows: the general kernel measured no faster


def max_pool(case: str, x: Any, out: Any, mask: Any, kernel: tuple, stride: tuple) -> None:
    k: Any = kernels()
    if case == "2x2":
        k.max_pool_2x2(x, out, mask)
    else:
        k.max_pool_3x3(x, out, mask, stride[0], stride[1])


def max_pool_grad(case: str, dy: Any, dx: Any, mask: Any, kernel: tuple, stride: tuple) -> None:
    k: Any = kernels()
    if case == "2x2":
        k.max_pool_2x2_grad(dy, dx, mask)
    else:
        k.max_pool_grad(dy, dx, mask, kernel[0], kernel[1], stride[0], stride[1])


def windows_case(x: Any, windows: Any, batch_innermost: bool) -> bool:
    """Whether the kernels take a convolution's columns ``windows`` gathered from, or added back into, ``x``: batch
    innermost (x [C, H, W, N], windows [C, kh, kw, R, ow, N]: :meth:`ArrayBackend._gather_windows`), or per image
    (x [N, C, H, W], windows [N, C·kh·kw + 1, oh·ow] gathered or [N, C, kh, kw, oh, ow] added back): C-contiguous
    float32/float64 arrays of one dtype, at least :data:`COLUMNS_MIN_ELEMENTS` values of columns.
    NumPy's path makes a strided pass per window position; the data gradient's adds (LeNet-64's second convolution:
    25 passes of 20 x 8 x 8 x 64 values) take 1.5 ms there and 0.4 in the kernel, the first convolution's columns
    per image (64 x 25 x 24 x 24) 0.5 and 0.3. A batch-innermost run shorter than :data:`MIN_BATCH_RUN` stays with NumPy
    (its passes copy rows of the image there; the kernel's loop over the batch is too short: a batch of 1 or 4
    took 1.2-1.6x as long)."""
    if batch_innermost and (windows.ndim != 6 or windows.shape[5] < MIN_BATCH_RUN):
        return False
    return (windows.size >= COLUMNS_MIN_ELEMENTS and x.ndim == 4 and x.dtype == windows.dtype
            and x.dtype.kind == "f" and x.dtype.itemsize in (4, 8) and x.flags.c_contiguous
            and windows.flags.c_contiguous and kernels() is not None)


_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a rule's compiled loop, while the rule lives


def update_loop(rule: Any) -> tuple[Any, Any] | None:
    """(prepare, kernel) of an update rule's line (``updates.loop_sources``: one pass over the elements, with the
    values of the NumPy code), compiled once per line; None where the line computes what a loop does not take or
    the kernels are unavailable. Adam's update of MLP-128's 669,706 weights on a 2-core Xeon: 2.9 ms through
    NumPy's ufunc calls over cached pieces, 0.5 in one pass."""
    k: Any = kernels()
    if k is None:
        return None
    if rule not in _LOOPS:
        with _BUILDING:  # (threads each with a solver of their own reach their first update together)
            if rule not in _LOOPS:
                _LOOPS[rule] = _build_loop(rule)
    return _LOOPS[rule]


_BUILDING = threading.Lock()
"""Held while an update loop is built: a second thread would find its module half made (no kernel yet)."""


def _build_loop(rule: Any) -> tuple[Any, Any] | None:
    sources = updates.loop_sources(rule)
    if sources is None:
        return None
    space: dict[str, Any] = {"np": np, "math": math}
    exec(compile(sources[0], f"<update rule {rule.name}: prepare>", "exec"), space)
    kernel = _cached_kernel(sources[1])
    if kernel is None:  # no cache directory to write: compiled in this process only
        exec(compile(sources[1], f"<update rule {rule.name}: kernel>", "exec"), space)
        kernel = importlib.import_module("numba").njit(**_LOOP_OPTIONS)(space["kernel"])
    return space["prepare"], kernel


_LOOP_OPTIONS = {"nogil": True, "boundscheck": False, "error_model": "numpy"}
"""How the update loops compile: NumPy's error model makes a division IEEE's (no zero check in the loop, which
would keep it scalar)."""


def cache_folder() -> Path:
    """Where generated kernels' modules are kept, so numba's on-disk cache serves them in later processes:
    LEAFPY_CACHE_DIR, else $XDG_CACHE_HOME/leafpy, else ~/.cache/leafpy."""
    given = os.environ.get("LEAFPY_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leafpy"


def _cached_kernel(source: str) -> Any:
    """The kernel of a generated ``source`` through a module file named by the source's hash in
    :func:`cache_folder` (written if missing or different), compiled with numba's cache: a later process loads the
    machine code instead of compiling it (Adam's loop: 0.25 s). None where the folder cannot be written."""
    text = (f"import numba\nimport numpy as np\n\n\n@numba.njit(cache=True, **{_LOOP_OPTIONS!r})\n{source}")
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    path = cache_folder() / "update_loops" / f"loop_{digest}.py"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
            part.write_text(text, encoding="utf-8")
            os.replace(part, path)
        name = f"leafpy_update_loop_{digest}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # numba's cache finds the kernel's module by its name
            spec.loader.exec_module(module)
    except OSError:
        return None
    return module.kernel


UPDATE_MIN_ELEMENTS = 1 << 18
"""Smaller updates keep the NumPy code (or MKL's, for momentum): a model this small (the default digits LeNet's
72,500 weights, updated in one call) never imports numba."""


def update_case(w: Any, g: Any, states: tuple, lr_mult: Any, params: tuple) -> bool:
    """Whether an update suits the loop kernels: at least :data:`UPDATE_MIN_ELEMENTS` weights, every array
    C-contiguous, of the weight's float32/float64 dtype and its size, ``lr_mult`` and the hyper-parameters Python
    numbers (NumPy computes with a NumPy float64 in float64 before it rounds, which the loop's scalars do not)."""
    if any(type(v) not in (int, float) for v in (lr_mult, *params)):
        return False
    if w.size < UPDATE_MIN_ELEMENTS or w.dtype.kind != "f" or w.dtype.itemsize not in (4, 8):
        return False
    return all(a.flags.c_contiguous and a.dtype == w.dtype and a.size == w.size for a in (w, g, *states))


# --- fusing a recorded step's calls ---------------------------------------------------------------------------------
FUSE_MIN_ELEMENTS = 1 << 16
"""Smaller layer outputs keep their separate calls (a fused call saves a pass over memory: nothing at this size)."""
LOADED_FUSE_MIN_ELEMENTS = 1 << 12
"""Where numba is loaded already (another kernel of the step ran), fused calls from this size: their values are
the separate calls' either way, and a step of a model that small saves a call and a pass (LeNet-64's 64 x 500
Linear + ReLU: 0.09 -> 0.05 ms in the step)."""


def _fusable_size(size: int) -> bool:
    loaded = bool(_KERNELS) and _KERNELS[0] is not None
    return size >= (LOADED_FUSE_MIN_ELEMENTS if loaded else FUSE_MIN_ELEMENTS)


def _matrix(a: Any, dtype: Any = None) -> bool:
    return (getattr(a, "ndim", 0) == 2 and a.flags.c_contiguous and a.dtype.kind == "f" and a.dtype.itemsize in (4, 8)
            and (dtype is None or a.dtype == dtype))


def _same(a: Any, b: Any) -> bool:
    """The same elements in the same layout (views made separately of one buffer count)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _apart(*arrays: Any) -> bool:
    """Each pair the same elements or no shared memory (an elementwise pass may then read and write them)."""
    return all(_same(a, b) or not np.may_share_memory(a, b)
               for k, a in enumerate(arrays) for b in arrays[k + 1:])


def _vector_of(v: Any, m: Any) -> bool:
    return getattr(v, "ndim", 0) == 1 and v.flags.c_contiguous and v.dtype == m.dtype and v.shape[0] == m.shape[1]


def _is(call: tuple, name: str, primitives: dict) -> bool:
    """Whether a recorded call is the native backend's own primitive ``name`` (a subclass's override is not)."""
    return getattr(call[0], "__func__", None) is primitives[name] and not call[2]


def fuse(calls: list, primitives: dict) -> list:
    """A recorded step's calls (function, args, kwargs) with two patterns of a Linear layer and a ReLU joined
    where the kernels are available: ``bias_add(y, b)`` then ``activation("relu", y, z)`` becomes the kernel
    ``bias_relu``; ``activation_grad("relu", y, dy, dx)`` and the ``bias_grad(dx, db, beta)`` of the layer before
    (after at most its weight-gradient ``gemm``s, which neither write dx or db nor read db) become
    ``relu_grad_bias``; the four calls of a classifier's loss become one (:func:`_loss_head`). Each fused call
    computes what the calls it replaces computed, in the same order of operations (a zero's sign aside).
    ``primitives``: the native backend's functions by name, which the calls must be. numba is imported only when
    a pattern of at least :data:`FUSE_MIN_ELEMENTS` values is found (of :data:`LOADED_FUSE_MIN_ELEMENTS` where it
    is loaded already)."""
    out: list = []
    dropped: set[int] = set()
    i = 0
    while i < len(calls):
        if i in dropped:
            i += 1
            continue
        call = calls[i]
        nxt = calls[i + 1] if i + 1 < len(calls) else None
        if _is(call, "bias_add", primitives) and nxt is not None and _is(nxt, "activation", primitives):
            (y, b), (kind, x, z, *params) = call[1], nxt[1]
            if (kind == "relu" and not any(params) and _matrix(y) and _fusable_size(y.size) and _vector_of(b, y)
                    and _same(x, y) and _matrix(z, y.dtype) and z.shape == y.shape and _apart(y, z)
                    and not np.may_share_memory(b, y) and not np.may_share_memory(b, z) and kernels() is not None):
                out.append((_KERNELS[0].bias_relu, (y, b, z), {}))
                i += 2
                continue
        if _is(call, "activation_grad", primitives):
            kind, y, dy, dx, *params = call[1]
            plain = kind == "relu" and not any(params) and _matrix(dx)
            j = _bias_grad_of(calls, i, dx, primitives) if plain else None
            db: Any = calls[j][1][1] if j is not None else None
            if (j is not None and _matrix(y, dx.dtype) and _matrix(dy, dx.dtype) and y.shape == dy.shape == dx.shape
                    and _apart(y, dy, dx) and not any(np.may_share_memory(db, a) for a in (y, dy, dx))
                    and kernels() is not None):
                beta = calls[j][1][2]
                out.append((_KERNELS[0].relu_grad_bias, (y, dy, dx, db, db.dtype.type(beta), beta != 0.0), {}))
                dropped.add(j)
                i += 1
                continue
        if _is(call, "log_softmax", primitives) and (head := _loss_head(calls[i:i + 4], primitives)) is not None:
            out.append(head)
            i += 4
            continue
        out.append(call)
        i += 1
    return out


def _named(call: tuple, primitives: dict, name: str) -> dict | None:
    """A recorded call's arguments by name, defaults applied, where it is the backend's own ``name``; else None."""
    if getattr(call[0], "__func__", None) is not primitives[name]:
        return None
    try:
        bound = _signature(primitives[name]).bind(None, *call[1], **call[2])
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


@functools.cache
def _signature(fn: Any) -> Any:
    import inspect
    return inspect.signature(fn)


def _loss_head(calls: list, primitives: dict) -> tuple | None:
    """``log_softmax(x, o)``, ``nll(o, labels, loss)``, ``nll_grad(labels, dloss, dx)`` and
    ``log_softmax_grad(o, dx, dx2)`` (a LogSoftmax layer before a NegativeLogLikelihood, or the loss's own
    log-softmax) as one call: four kernels of :mod:`_kernels` and NumPy's own exp, log and exp between them, for
    [N, C] float rows without class weights or an ignored index. It computes the four calls' values in their order
    of operations (sums in NumPy's pairwise order), which it checks on a copy of the step's values before it is
    taken; a label that is no class index runs the four calls instead. About 30 NumPy calls become 7 (MLP-128's
    loss, 128 x 10: 0.22 -> 0.05 ms in the step). Only where numba is loaded already, or the rows are at least
    :data:`FUSE_MIN_ELEMENTS` values."""
    if len(calls) < 4:
        return None
    ls, nll, grad, lsg = (_named(c, primitives, n) for c, n in zip(calls, ("log_softmax", "nll", "nll_grad",
                                                                          "log_softmax_grad")))
    if ls is None or nll is None or grad is None or lsg is None:
        return None
    x, o = ls["x"], ls["out"]
    if not (_matrix(x) and _matrix(o, x.dtype) and o.shape == x.shape and x.shape[1] >= 1 and _apart(x, o)):
        return None
    options = [(d["weight"], d["ignore_index"], d["reduction"]) for d in (nll, grad)]
    if options[0] != options[1] or options[0][0] or options[0][1] is not None or options[0][2] not in ("mean", "sum"):
        return None
    labels, loss, dloss, dx, dx2 = nll["labels"], nll["out"], grad["dloss"], grad["dx"], lsg["dx"]
    if not (_same(nll["logp"], o) and _same(lsg["y"], o) and _same(lsg["dy"], dx) and _same(grad["labels"], labels)):
        return None
    if not (_matrix(dx, x.dtype) and _matrix(dx2, x.dtype) and dx.shape == dx2.shape == x.shape
            and getattr(labels, "size", 0) == x.shape[0] and labels.dtype.kind in "fiu" and labels.flags.c_contiguous
            and all(getattr(v, "size", 0) == 1 and v.dtype == x.dtype for v in (loss, dloss))):
        return None
    if not (_apart(x, o, dx, dx2) and _apart(o, loss, dloss, dx)
            and not any(np.may_share_memory(v, w) for v in (loss, dloss) for w in (x, dx2))
            and not any(np.may_share_memory(labels, w) for w in (x, o, loss, dloss, dx, dx2))):
        return None  # (the labels, read as indices after o, loss and dx are written, share memory with none)
    if not (_KERNELS and _KERNELS[0] is not None) and x.size < FUSE_MIN_ELEMENTS:
        return None
    k = kernels()
    if k is None:
        return None
    run = _head_call(k, x, o, labels.reshape(-1), loss.reshape(-1), dloss.reshape(-1), dx, dx2,
                     options[0][2] == "mean", calls[:4])
    return (run, (), {}) if _head_agrees(run, calls[:4], (x, labels, dloss), (o, loss, dx, dx2)) else None


def _same_values(a: Any, b: Any) -> bool:
    """Equal, bit for bit, a zero's sign included; NaN where NaN (whose sign bit means nothing)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan], b[~nan])
                and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan])))


def _head_call(k: Any, x: Any, o: Any, labels: Any, loss: Any, dloss: Any, dx: Any, dx2: Any, mean: bool,
               calls: list) -> Any:
    e, s, picks = np.empty_like(o), np.empty(o.shape[0], o.dtype), np.empty(o.shape[0], o.dtype)
    exp, log = np.exp, np.log

    def loss_head() -> None:
        if k.log_softmax_shift(x, o, labels) >= 0:  # a label that is no class index: the calls, as recorded
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)
            return
        exp(o, out=e)
        k.row_sums(e, s)
        log(s, out=s)
        k.nll_rows(o, s, labels, loss, dloss, dx, picks, mean)
        exp(o, out=e)
        k.log_softmax_grad_rows(e, dx, dx2)

    return loss_head


def _head_agrees(head: Any, calls: list, inputs: tuple, outputs: tuple) -> bool:
    """Whether the joined call writes what the four calls write, bit for bit, from the step's inputs as they are now
    and from random logits: each run on the real arrays, which are put back as they were."""
    saved = [a.copy() for a in inputs + outputs]
    rng = np.random.default_rng(0)
    x = inputs[0]
    trials = [None, (rng.standard_normal(x.shape) * 4).astype(x.dtype)]
    try:
        for logits in trials:
            if logits is not None:
                x[...] = logits
            start = [a.copy() for a in inputs]
            results = []
            for run in (lambda: [fn(*args, **kwargs) for fn, args, kwargs in calls], head):
                for a in outputs:
                    a.fill(0)
                for a, b in zip(inputs, start):  # after: an output that is an input (o is x) starts from the input
                    a[...] = b
                run()
                results.append([a.copy() for a in outputs])
            if not all(_same_values(a, b) for a, b in zip(*results)):
                return False
        return True
    except Exception:  # noqa: BLE001 - the calls raise (labels no class index now): left as recorded
        return False
    finally:
        for a, b in zip(inputs + outputs, saved):
            a[...] = b


def _bias_grad_of(calls: list, i: int, dx: Any, primitives: dict) -> int | None:
    """Where the bias gradient of ``dx`` follows call ``i`` with only products that leave it alone in between. One
    column is left alone: NumPy sums a contiguous column pairwise, the kernel row by row. So is a beta that is not a
    Python number (NumPy multiplies by a NumPy float64 in float64)."""
    if not _fusable_size(dx.size) or dx.shape[1] < 2:
        return None
    for j in range(i + 1, min(i + 4, len(calls))):
        call = calls[j]
        if _is(call, "bias_grad", primitives) and len(call[1]) == 3:
            g, db, beta = call[1]
            if _matrix(g) and _same(g, dx) and _vector_of(db, dx) and type(beta) in (int, float):
                for c in calls[i + 1:j]:
                    a, b, out = c[1][0], c[1][2], c[1][4]
                    if any(np.may_share_memory(p, q) for p, q in ((out, dx), (out, db), (a, db), (b, db))):
                        return None
                return j
            return None
        if not (_is(call, "gemm", primitives) and len(call[1]) >= 5):
            return None
    return None
