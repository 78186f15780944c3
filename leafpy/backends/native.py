"""The native backend: NumPy on the CPU, float32 by default (float64 for gradient checks).

GEMMs go to NumPy's BLAS, or to Intel MKL's where the ``mkl`` package is installed on an Intel CPU (``blas``;
leafpy.backends.mkl); the rest is bound by memory traffic, so this module overrides the shared array code
where the CPU's caches decide: per-image columns for short convolution columns, the filter gradient in the
orientation BLAS runs fastest, large columns and pooling in pieces that stay in cache, and per-call scratch shared
by all layers. Each tuning attribute below says what it was measured to do."""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, ConfigError
from ..tensor import HOST, host_arena
from . import compiled, mkl, updates
from .array import ArrayBackend
from .base import MEMORY, PRIMITIVES
from .recorder import StepRecorder

RECORDED = tuple(n for n in PRIMITIVES if n not in MEMORY) + ("cast", "relayout")
"""The calls a recorded step keeps: every compute primitive (memory management happens in the tensors)."""
_MOMENTUM = updates.TABLE["momentum"]
"""The momentum rule as leafpy defines it: MKL runs it where a process has not registered another line."""


class NativeBackend(ArrayBackend):
    """NumPy arrays in host memory; the host copy of a SharedTensor is this backend's copy.

    ``channels_last``: store 4-D tensors NHWC, as the cuda backend can, in copies of their own beside the host's
    row-major copy (moved to and from it as a device's are): the channels-last code paths, and the conversions
    at their edges, run and are tested without a GPU. Not faster on a CPU.

    ``blas``: whose GEMMs run the products: "numpy" (the BLAS NumPy was built with: OpenBLAS in its wheels),
    "mkl" (Intel's MKL through its ``mkl`` package: ``pip install mkl``; 1.2-1.3x faster products on Intel CPUs)
    or "auto" (MKL where it is installed and the CPU is Intel's, else NumPy's). Not given: the environment's
    LEAFPY_BLAS, else "auto" (so a ``leafpy`` command can be told). The backend's :attr:`blas` says which one
    runs."""

    name = "native"
    key = HOST
    xp = np
    BLAS_CHOICES = ("auto", "numpy", "mkl")

    def __init__(self, dtype: Any = np.float32, precision: str = "fp32", channels_last: bool | None = False,
                 blas: str | None = None) -> None:
        self._threads = threading.local()
        if blas is None:
            blas = os.environ.get("LEAFPY_BLAS", "") or "auto"
            if blas not in self.BLAS_CHOICES:
                raise ConfigError(f"LEAFPY_BLAS={blas!r} in the environment: valid values are "
                                  f"{', '.join(self.BLAS_CHOICES)}; unset it for auto")
        if not isinstance(blas, str) or blas not in self.BLAS_CHOICES:
            raise ConfigError(f"backend 'native': unknown blas {blas!r}; valid: {', '.join(self.BLAS_CHOICES)}")
        self._mkl = None if blas == "numpy" or (blas == "auto" and not mkl.intel_cpu()) else mkl.load()
        if blas == "mkl" and self._mkl is None:
            raise BackendUnavailable("backend 'native': blas='mkl' needs Intel MKL's runtime, which is not installed "
                                     "here: pip install mkl (the mkl extra), or use blas='numpy'")
        self.blas = "mkl" if self._mkl is not None else "numpy"
        """Whose GEMMs this backend runs: "mkl" or "numpy"."""
        if self._mkl is not None:
            self.xp = self._mkl.numpy  # every product of the shared array code goes to MKL where it can
        super().__init__(dtype, precision, channels_last)
        self._options["blas"] = self.blas
        if self.channels_last:
            self.key = "native:channels_last"

    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        if self._mkl is None or not self._mkl.gemm(a.T if trans_a else a, b.T if trans_b else b, out, alpha, beta):
            super().gemm(a, trans_a, b, trans_b, out, alpha, beta)

    def axpby(self, alpha, x, beta, y):
        if self._mkl is None or not self._mkl.axpby(alpha, x, beta, y):  # (weight decay: one pass on MKL's threads)
            super().axpby(alpha, x, beta, y)

    def solver_update(self, kind, w, g, rate, lr_mult, params=(), s1=None, s2=None, s3=None, copy=None):
        line = updates.TABLE.get(kind) or updates.rule(kind)
        states = tuple(s for s in (s1, s2, s3)[:len(line.state)])
        if not (self._mkl_momentum(line, w, g, s1, rate, lr_mult, params)
                or self._update_loop(line, w, g, states, rate, lr_mult, params)):
            return super().solver_update(kind, w, g, rate, lr_mult, params, s1, s2, s3, copy)
        if copy is not None:
            self.cast(w, copy)

    def _mkl_momentum(self, line, w, g, h, rate, lr_mult, params) -> bool:
        """The momentum rule on MKL's threads (see Mkl.momentum), where it is TABLE's own line: two passes on both
        cores beat one pass on one (MLP-128's 669,706 weights: 0.25 against 0.37 ms on a 2-core Xeon). Whether it
        ran (or the step is skipped)."""
        return self._mkl is not None and line is _MOMENTUM and h is not None and bool(
            rate[1] == 0 or self._mkl.momentum(w, g, h, float(rate[0]) * lr_mult, float(params[0])))

    @staticmethod
    def _update_loop(line, w, g, states, rate, lr_mult, params) -> bool:
        """A large update as one numba loop over the elements (compiled.update_loop: the NumPy code's values).
        Whether it ran (or the step is skipped)."""
        if not compiled.update_case(w, g, states, lr_mult, params) or (loop := compiled.update_loop(line)) is None:
            return False
        consts = loop[0](rate, lr_mult, params, w.dtype)  # the rule's scalars; None: the step is skipped
        if consts is not None:
            loop[1](consts, w.reshape(-1), g.reshape(-1), *(s.reshape(-1) for s in states))
        return True

    def _work(self, ws, name, shape, dtype=None):
        # one buffer per name and dtype for every layer, grown to the largest size asked for: a network's layers
        # run one primitive at a time (AlexNet at batch 8 on native: 849 -> 813 MB, of which 730 MB are weights,
        # their gradients and momentum). Per thread: networks run in different threads share the backend.
        dtype = np.dtype(dtype or self.dtype)
        size = math.prod(shape)
        shared = getattr(self._threads, "work", None)
        if shared is None:
            shared = self._threads.work = {}
        buf = shared.get((name, dtype))
        if buf is None or buf.size < size:
            buf = shared[(name, dtype)] = np.empty(size, dtype)
        return buf[:size].reshape(shape)

    def allocate(self, size: int, dtype: Any) -> np.ndarray:
        return np.empty(size, dtype)

    def upload(self, host: np.ndarray, out: Any) -> None:
        np.copyto(out, host)

    def download(self, buf: Any, host: np.ndarray) -> None:
        if getattr(self._threads, "calls", None) is not None:  # a value read back can steer the step (a custom
            self._threads.read_back = True                       # rule's rate): that step is never replayed
        np.copyto(host, buf)

    def synchronize(self) -> None:
        pass

    # --- recorded steps: the primitive calls of a step, replayed without the layers' Python ----------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in RECORDED:  # a subclass's own primitives are recorded too
            if name in vars(cls):
                setattr(cls, name, _recorded(vars(cls)[name]))

    replay = True
    """Replay replayable training steps as the list of their primitive calls (see :meth:`run_step`)."""
    MAX_RECORDED_STEPS = 8

    def run_step(self, key: Any, step: Any) -> None:
        """A replayable step (``key`` not None) is recorded on its second sight as the list of its primitive calls
        (method and operands) and from then on run straight from that list, without the layers' Python, while the
        tensors it touches keep their buffers (recorder.StepRecorder): the same calls on the same arrays, so the
        same results. Each thread keeps its own recordings. Mixed precision and channels-last run every step as
        it is."""
        if not self.replay or self.mixed or self.channels_last:
            key = None
        self.recorder.run(key, step)
        error, self._threads.capture_error = getattr(self._threads, "capture_error", None), None
        if error is not None:
            raise error

    @property
    def recorder(self) -> StepRecorder:
        """This thread's recorded steps."""
        rec = getattr(self._threads, "recorder", None)
        if rec is None:
            rec = self._threads.recorder = StepRecorder(self, self.MAX_RECORDED_STEPS)
        return rec

    @property
    def replays(self) -> int:
        """Steps this thread ran from a recording so far."""
        return self.recorder.replays

    def first_run(self, entry: Any, step: Any) -> None:
        step()

    def capture(self, entry: Any, step: Any) -> tuple[Any, bool]:
        # the calls are taken where the class's primitives run: a function put on this object in front of one (a
        # profiler's, a test's spy) runs when the step is recorded, not when it is replayed, as the layers' Python
        calls: list = []
        self._threads.calls, self._threads.read_back = calls, False
        try:
            step()
        except BaseException as e:  # the step ran partly: raised from run_step, never run a second time
            self._threads.capture_error = e
            entry.failed = True
            return None, True
        finally:
            self._threads.calls = None
        if self._threads.read_back:
            return None, True
        try:
            return [self._replay_call(c) for c in compiled.fuse(calls, FUSABLE)], True
        except Exception:  # noqa: BLE001 - the step ran: its calls as recorded, never a second run of it
            return calls, True

    def _replay_call(self, call: tuple) -> tuple:
        """A recorded call as a replay runs it: a product MKL takes as MKL's function with the operands' addresses
        and layouts worked out once (Mkl.gemm_call; the same function on the same arrays, so the same values),
        any other call as it was recorded."""
        fn, args, kwargs = call
        if self._mkl is None or getattr(fn, "__func__", None) is not FUSABLE["gemm"]:
            return call
        named = _GEMM_ARGS.bind(self, *args, **kwargs)
        named.apply_defaults()
        a, trans_a, b, trans_b, out, alpha, beta = named.args[1:]
        bound = self._mkl.gemm_call(a.T if trans_a else a, b.T if trans_b else b, out, alpha, beta)
        return call if bound is None else (bound, (), {})

    def arrange(self, groups):
        if self.key == HOST:  # host copies only (a channels-last native backend keeps copies of its own)
            for group in groups:
                host_arena(group)

    def span(self, buffers):
        # a piece of one C-contiguous 1-D array of the buffers' dtype, each buffer C-contiguous right after the last
        root = buffers[0]
        while root.base is not None:
            root = root.base
        if not (isinstance(root, np.ndarray) and root.ndim == 1 and root.flags.c_contiguous
                and root.dtype == buffers[0].dtype):
            return None
        start = address = buffers[0].__array_interface__["data"][0]
        for b in buffers:
            base = b
            while base.base is not None:
                base = base.base
            if (base is not root or b.dtype != root.dtype or not b.flags.c_contiguous
                    or b.__array_interface__["data"][0] != address):
                return None
            address += b.nbytes
        first = (start - root.__array_interface__["data"][0]) // root.itemsize
        return root[first:first + (address - start) // root.itemsize]

    def launch(self, recording: Any) -> None:
        for fn, args, kwargs in recording:
            fn(*args, **kwargs)

    @staticmethod
    def handle(buffer: Any) -> Any:
        # the array itself, its id first: the recording holds it alive, so an equal id is the same array (tuples
        # compare an identical element without reading it), and no other array can take its id meanwhile. 0.1 us
        # against 2 us for its address through __array_interface__, for each of a step's 40 tensors
        return id(buffer), buffer

    TRANSPOSE_BLOCK = 64
    """Rows of the source per block when moving a batch-innermost layout back to NCHW: a plain transposed copy
    reads the source with a stride of N for every element (4.2 ms for a 64 x 20 x 24 x 24 convolution output on
    a 2-core machine); in blocks the rows being read stay in cache (0.44 ms)."""

    def _to_batch_first(self, dst: Any, src: Any) -> None:
        b = self.TRANSPOSE_BLOCK
        for s in range(0, src.shape[0], b):
            dst[:, s:s + b] = src[s:s + b].T

    # --- convolution with few input values per output: per-image columns -------------------------------------
    PER_IMAGE_MAX_K = 32
    PER_IMAGE_MIN_P = 256
    """A convolution whose columns are short (C * kh * kw <= 32: a first layer on 1-channel images) over many
    output positions (oh * ow >= 256) uses columns per image, [N, C * kh * kw, oh * ow]: the product W @ cols
    then lands in NCHW as it is, with no transposes, and the filter gradient is a batch of per-image products
    straight from dy. LeNet-64's first convolution on a 2-core machine: forward 1.37 -> 0.89 ms, filter gradient
    0.91 -> 0.54 ms; batch 1024: 43.5 -> 28.4 and 33.4 -> 13.6 ms. With longer columns (LeNet's second
    convolution, K = 500 over 64 positions) the per-image products are too small and the batch-innermost columns
    of the shared path win (forward 2.07 against 5.93 ms)."""

    def _conv_path(self, x_shape, w_shape, y_shape, stride, padding, dilation, groups) -> str:
        """Which code computes a convolution here: "general" (grouped, dilated, asymmetric: the shared code),
        "per_image" (short columns), "images" (the shared code on pieces of the batch) or "shared"."""
        if not self._plain_conv(x_shape, w_shape, y_shape, stride, padding, dilation, groups):
            return "general"
        if self._per_image(w_shape, y_shape):
            return "per_image"
        return "images" if len(self._batch_pieces(x_shape, w_shape, y_shape)) > 1 else "shared"

    def _per_image(self, w_shape, out_shape) -> bool:
        o, c, kh, kw = w_shape
        return c * kh * kw <= self.PER_IMAGE_MAX_K and out_shape[2] * out_shape[3] >= self.PER_IMAGE_MIN_P

    def _image_cols(self, x, kh, kw, oh, ow, stride, padding, ws):
        """cols [N, C * kh * kw + 1, oh * ow] of x, zero padded, with a last row of ones (the bias's column)."""
        n, c, h, w = x.shape
        ph, pw = padding
        src = x
        if ph or pw:
            src = self._zeroed_once(ws, "x_padded", (n, c, h + 2 * ph, w + 2 * pw), x.dtype)
            src[:, :, ph:ph + h, pw:pw + w] = x
        k = c * kh * kw
        cols = self._scratch(ws, "image_cols", (n, k + 1, oh * ow), x.dtype)
        cols[:, k] = 1
        if compiled.windows_case(src, cols, batch_innermost=False):
            compiled.kernels().gather_image_windows(src, cols, kh, kw, oh, ow, *stride)
        else:
            windows = cols[:, :k].reshape(n, c, kh, kw, oh, ow)  # a view: the first k rows split by channel and tap
            for i, j, rows, columns in self._windows(kh, kw, oh, ow, stride):
                windows[:, :, i, j] = src[:, :, rows, columns]
        ws["image_cols_of"] = self._identity(x)
        return cols

    def conv2d(self, x, w, out, stride, padding, ws, bias=None, dilation=(1, 1), groups=1):
        path = self._conv_path(x.shape, w.shape, out.shape, stride, padding, dilation, groups)
        if path == "images":
            for a, b in self._batch_pieces(x.shape, w.shape, out.shape):
                super().conv2d(x[a:b], w, out[a:b], stride, padding, ws, bias)
            return None
        if path != "per_image":
            return super().conv2d(x, w, out, stride, padding, ws, bias, dilation, groups)
        o, c, kh, kw = w.shape
        n, _, oh, ow = out.shape
        cols = self._image_cols(x, kh, kw, oh, ow, stride, padding, ws)
        filt = self._filter_with_bias(w, bias, ws)  # LeNet-64's first convolution: 0.56 -> 0.38 ms with the bias
        with self._row_major(out, read=False) as y:
            self.xp.matmul(filt, cols[:, :filt.shape[1]], out=y.reshape(n, o, oh * ow))

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0, dilation=(1, 1), groups=1):
        path = self._conv_path(x.shape, dw.shape, dy.shape, stride, padding, dilation, groups)
        if path == "images":  # the last piece first: the forward pass's columns are that piece's
            for a, b in reversed(self._batch_pieces(x.shape, dw.shape, dy.shape)):
                super().conv2d_grad_filter(x[a:b], dy[a:b], dw, stride, padding, ws, beta if b == x.shape[0] else 1.0)
            return None
        if path != "per_image":
            return super().conv2d_grad_filter(x, dy, dw, stride, padding, ws, beta, dilation, groups)
        o, c, kh, kw = dw.shape
        n, _, oh, ow = dy.shape
        k = c * kh * kw
        if ws.pop("image_cols_of", None) == self._identity(x) and "image_cols" in ws:
            cols = ws["image_cols"]  # the forward pass's columns of this x
        else:
            cols = self._image_cols(x, kh, kw, oh, ow, stride, padding, ws)
            ws.pop("image_cols_of", None)  # columns made here serve this call only
        parts = self._work(ws, "dw_parts", (n, o, k), dw.dtype)
        self.xp.matmul(dy.reshape(n, o, oh * ow), cols[:, :k].transpose(0, 2, 1), out=parts)
        with self._row_major(dw, read=beta != 0.0) as d:
            self.axpby(1.0, np.sum(parts, axis=0, out=self._work(ws, "dw_sum", (o, k), dw.dtype)), beta,
                       d.reshape(o, -1))

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws, dilation=(1, 1), groups=1):
        path = self._conv_path(dx.shape, w.shape, dy.shape, stride, padding, dilation, groups)
        if path == "images":
            for a, b in self._batch_pieces(dx.shape, w.shape, dy.shape):
                super().conv2d_grad_data(dy[a:b], w, dx[a:b], stride, padding, ws)
            return None
        if path != "per_image":
            return super().conv2d_grad_data(dy, w, dx, stride, padding, ws, dilation, groups)
        o, c, kh, kw = w.shape
        n, _, h, wd = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        ph, pw = padding
        dcols = self._work(ws, "image_dcols", (n, c, kh, kw, oh, ow), dy.dtype)
        self.xp.matmul(w.reshape(o, -1).T, dy.reshape(n, o, oh * ow), out=dcols.reshape(n, c * kh * kw, oh * ow))
        target = dx
        if ph or pw:
            target = self._work(ws, "dx_padded", (n, c, h + 2 * ph, wd + 2 * pw), dx.dtype)
        target.fill(0)
        if compiled.windows_case(target, dcols, batch_innermost=False):
            compiled.kernels().scatter_image_windows(dcols, target, *stride)
        else:
            for i, j, rows, columns in self._windows(kh, kw, oh, ow, stride):
                target[:, :, rows, columns] += dcols[:, :, i, j]
        if target is not dx:
            dx[...] = target[:, :, ph:ph + h, pw:pw + wd]

    # --- work in pieces that stay in cache ---------------------------------------------------------------------
    CONV_PIECE_BYTES = 4 << 20
    """Batch-innermost columns of more than four times this many bytes are never held whole: the forward pass
    gathers and multiplies them in pieces of whole output rows (about this size) while each piece is in cache, the
    filter gradient gathers them again piece by piece, and the data gradient computes and scatters its columns the
    same way. LeNet's second convolution on a 2-core machine, batch 1024: forward 50.0 -> 42.2 ms, data gradient
    45.8 -> 34.0, filter gradient 28.6 -> 37.7 (the gathering again), 131 MB less memory; at batch 64 the columns
    are one piece and kept for the filter gradient. (Measured before pieces of the batch, below: at batch 1024
    LeNet's columns are now cut that way; pieces of rows remain for large images, AlexNet's.)"""
    CONV_BATCH_PIECE_MIN = 16
    """Columns too large to hold whole are cut into pieces of the batch, each a convolution of its own (columns,
    product, scatter and transposes while in cache: the batch-innermost layout is the piece's), when a piece of
    CONV_PIECE_BYTES holds at least this many images; else (large images) into pieces of output rows, as above.
    LeNet's second convolution on a 2-core machine, batch 1024 (32 images a piece, against pieces of one output
    row; minimum of 16 calls, interleaved): forward 54.3 -> 36.5 ms, filter gradient 45.5 -> 34.4, data gradient
    45.2 -> 45.6; pieces of 64 images measured the same, of 16 slower (data gradient 52). The whole LeNet-1024
    training step (steps alternating in one process, median): 274.0 -> 256.5 ms. Padded (16 -> 32 channels, 3 x 3,
    14 x 14) and strided (stride 2) convolutions at batch 1024: forward + both gradients 123 -> 91 and 77 -> 53
    ms."""
    POOL_PIECE_BYTES = 512 << 10
    """Input bytes per piece of a pooling pass: its per-window passes and temporaries then stay in cache. LeNet's
    first pooling on a 2-core machine, batch 1024: forward 44.3 -> 24.1 ms, gradient 31.1 -> 18.6; batch 64:
    1.29 -> 1.08 and 0.92 -> 0.78."""

    def _batch_pieces(self, x_shape, w_shape, y_shape) -> list[tuple[int, int]]:
        n, _, oh, ow = y_shape
        image = (math.prod(w_shape[1:]) + 1) * oh * ow * np.dtype(self.dtype).itemsize  # one image's columns
        if n * image <= 4 * self.CONV_PIECE_BYTES or self.CONV_PIECE_BYTES // image < self.CONV_BATCH_PIECE_MIN:
            return [(0, n)]
        return self._pieces(n, image, self.CONV_PIECE_BYTES)

    def _row_spans(self, oh, row_bytes):
        if oh * row_bytes <= 4 * self.CONV_PIECE_BYTES:
            return [(0, oh)]
        return self._pieces(oh, row_bytes, self.CONV_PIECE_BYTES)

    RELU_PIECE = 1 << 18
    """Elements per piece of a ReLU (see :meth:`activation`); 0: NumPy's maximum against a scalar zero."""

    def activation(self, kind, x, out, params=()):
        # NumPy's maximum against a scalar zero runs its slow broadcast loop; against an array of zeros its SIMD
        # loop: ReLU over 2M float32 in pieces of RELU_PIECE against one piece of zeros, 0.79 -> 0.21 ms here
        # (AMD EPYC Zen 4, NumPy 2.4; MLP-4096's two ReLUs a step). The same ufunc, the same values.
        plain = x.shape == out.shape and x.dtype == out.dtype and x.dtype.kind == "f"
        if kind != "relu" or not self.RELU_PIECE or not (plain and x.flags.c_contiguous and out.flags.c_contiguous):
            return super().activation(kind, x, out, params)
        xs, outs = x.reshape(-1), out.reshape(-1)
        step = self.RELU_PIECE
        zeros = self._work({}, "relu_zeros", (min(xs.size, step),), x.dtype)
        zeros.fill(0)
        for i in range(0, xs.size, step):
            piece = min(step, xs.size - i)
            np.maximum(xs[i:i + piece], zeros[:piece], out=outs[i:i + piece])

    def pool2d(self, x, out, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        case = compiled.max_pool_case(x, out, mask, kernel, stride, padding) if mode == "max" else None
        if case and compiled.kernels():
            return compiled.max_pool(case, x, out, mask, kernel, stride)
        for a, b in self._pieces(x.shape[0], x[0].nbytes, self.POOL_PIECE_BYTES):
            super().pool2d(x[a:b], out[a:b], None if mask is None else mask[a:b], mode, kernel, stride, padding,
                           pad_end, count_pad)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        case = compiled.max_pool_case(dx, dy, mask, kernel, stride, padding) if mode == "max" else None
        if case and compiled.kernels():
            return compiled.max_pool_grad(case, dy, dx, mask, kernel, stride)
        for a, b in self._pieces(dx.shape[0], dx[0].nbytes, self.POOL_PIECE_BYTES):
            super().pool2d_grad(dy[a:b], dx[a:b], None if mask is None else mask[a:b], mode, kernel, stride,
                                padding, pad_end, count_pad)

    def _gather_windows(self, xt, windows, a, stride):
        if compiled.windows_case(xt, windows, batch_innermost=True):
            return compiled.kernels().move_windows(windows, xt, stride[0], stride[1], a, False)
        return super()._gather_windows(xt, windows, a, stride)

    def _scatter_windows(self, windows, dxt, a, stride):
        if compiled.windows_case(dxt, windows, batch_innermost=True):
            return compiled.kernels().move_windows(windows, dxt, stride[0], stride[1], a, True)
        return super()._scatter_windows(windows, dxt, a, stride)

    FILTER_SPLIT = 1024
    FILTER_SPLIT_MAX_OUTPUTS = 4096
    """Columns per product when a filter gradient has at most FILTER_SPLIT_MAX_OUTPUTS values: such a small [O, K]
    result of a long product (20 x 25 over 36864 columns: a 1-channel 5x5 convolution, batch 64, 24 x 24 outputs)
    keeps one core busy and reads its operands once from memory (0.99 ms on a 2-core machine); as a batch of
    products over 1024-column slices, summed, it takes 0.50 ms."""

    def _filter_product(self, dy_t, cols, dw, beta, ws):
        # dw^T = cols @ dy_t^T: BLAS runs this orientation faster for every filter gradient measured (LeNet-64's
        # second convolution 1.60 -> 1.21 ms, 50 x 500 over 4096 columns)
        o, k = dw.shape
        length = cols.shape[1]
        split = self.FILTER_SPLIT
        grad_t = self._work(ws, "dw_sum", (k, o), dw.dtype)
        if o * k <= self.FILTER_SPLIT_MAX_OUTPUTS and length >= 2 * split:
            b = length // split
            head = b * split
            parts = self._work(ws, "dw_parts", (b, k, o), dw.dtype)
            self.xp.matmul(cols[:, :head].reshape(k, b, split).transpose(1, 0, 2),
                           dy_t[:, :head].reshape(o, b, split).transpose(1, 2, 0), out=parts)
            np.sum(parts, axis=0, out=grad_t)
            if head < length:
                grad_t += self.xp.matmul(cols[:, head:], dy_t[:, head:].T)
        else:
            self.xp.matmul(cols, dy_t.T, out=grad_t)
        self.axpby(1.0, grad_t.T, beta, dw)


def _recorded(fn: Any) -> Any:
    """``fn``, a primitive, appending itself and its operands to the thread's step being recorded, if any (the
    primitives it calls in turn run inside it, unrecorded)."""
    @functools.wraps(fn)
    def call(self: NativeBackend, *args: Any, **kwargs: Any) -> Any:
        calls = getattr(self._threads, "calls", None)
        if calls is None:
            return fn(self, *args, **kwargs)
        calls.append((fn.__get__(self), args, kwargs))
        self._threads.calls = None
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._threads.calls = calls
    return call


for _name in RECORDED:
    setattr(NativeBackend, _name, _recorded(getattr(NativeBackend, _name)))
FUSABLE = {name: getattr(NativeBackend, name).__wrapped__
           for name in ("bias_add", "activation", "activation_grad", "bias_grad", "gemm", "log_softmax", "nll",
                        "nll_grad", "log_softmax_grad")}
"""The native backend's own primitives that :func:`compiled.fuse` may join, as a recorded call holds them."""
_GEMM_ARGS = inspect.signature(FUSABLE["gemm"])
"""How a recorded product's operands are named (NativeBackend._replay_call), defaults applied."""
