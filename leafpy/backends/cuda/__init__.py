"""The cuda backend: CuPy arrays on an NVIDIA GPU.

GEMM goes to cuBLAS through CuPy; elementwise work runs in fused kernels; convolution runs through cuDNN graphs
(NVIDIA's ``nvidia-cudnn-frontend``), built once per shape and cached, with the shared im2col + GEMM path when
the frontend cannot be imported (or with ``use_cudnn=False``); pooling runs in one kernel per pass.

Importing this module does not import CuPy; constructing the backend does. The package: this module (the backend),
``kernels.py`` (the CUDA sources of the pooling and batch-normalisation kernels), ``blas.py`` (cuBLAS on its own
handle, for recording CUDA graphs and for 16-bit GEMMs), ``cudnn.py`` (cuDNN frontend graphs and their autotuner),
``lowp.py`` (bfloat16 and float16 loads and stores in the elementwise kernels).

Buffers in bfloat16 or float16 (mixed precision's activations, their gradients and the weights' copies) run through
the same primitives: GEMMs in cuBLAS with float32 accumulation, convolutions in cuDNN graphs built for those
formats, elementwise work, pooling and batch normalisation in kernels that load and store the 16-bit format and
compute in float (BatchNorm's scale, shift and statistics stay float32). The primitives named in
:attr:`CudaBackend.EMULATED` have no 16-bit kernel: they refuse 16-bit buffers with a BackendError (a backend whose
precision setting is bf16 or fp16 runs them on float32 copies).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ... import _checks
from ...errors import BackendError, BackendUnavailable
from .. import pointwise, updates
from ..array import ArrayBackend
from ..base import MEMORY, NARROW_OPERANDS, PRIMITIVES, SHORTHANDS, emulated
from ..recorder import StepRecorder
from .blas import _CaptureBlas
from .cudnn import _CudnnConv, _strides, geometry
from .kernels import (
    _BN_SOURCE,
    _POOL_SOURCE,
    COMBINE_THREADS,
    PAD_CHANNELS_SOURCE,
    SUM_SQUARES_CHUNK,
    SUMSQ_THREADS,
    module_source,
    sum_squares_chunks,
    sum_squares_source,
    vectorized_source,
)
from .lowp import as_stored, formats_of, is_low, low_dtypes, one_memory_order, storage_format, typed_kernel
from .staging import PinnedStaging

_INSTALL = ("pip install cupy-cuda12x nvidia-cudnn-frontend nvidia-cudnn-cu12 (the cuda extra; with CUDA 13 "
            "drivers install cupy-cuda13x instead)")

# ElementwiseKernel formulas over a type T (in_params, out_params, operation, name): compiled for T = float or
# double, and by lowp.typed_kernel for bfloat16 and float16 operands
_AXPBY = ("T x, T a, T b", "T y", "y = a * x + b * y", "leafpy_axpby")
_MUL = ("T x, T m", "T z", "z = x * m", "leafpy_mul")
_MAXIMUM = ("T x, T m", "T z", "z = (x != x || m != m) ? x + m : (x > m ? x : m)", "leafpy_maximum")
_CAST = ("T x", "T y", "y = x", "leafpy_cast")
_BIAS_ADD = ("raw T b, int32 c, int32 inner", "T y", "y = y + LD_b(b[(i / inner) % c])", "leafpy_bias_add")
_BN_FORWARD = ("T x, raw T mean, raw T var, raw T gamma, raw T beta, int32 c, int32 inner, T eps, int32 flags", "T y",
               "int ch = (int)((i / inner) % c); T s = (T)1 / sqrt(var[ch] + eps);"
               " if (flags & 1) s *= gamma[ch];"
               " y = (x - mean[ch]) * s + ((flags & 2) ? beta[ch] : (T)0)", "leafpy_bn_forward")
_BN_GRAD = ("T x, T dy, raw T mean, raw T var, raw T gamma, raw T sum_dy, raw T sum_dy_xhat, int32 c, int32 inner, "
            "T eps, T inv_m, int32 flags", "T dx",
            "int ch = (int)((i / inner) % c); T invstd = (T)1 / sqrt(var[ch] + eps);"
            " T a = (flags & 1) ? gamma[ch] * invstd : invstd; T v = a * dy;"
            " if (flags & 4) { T xhat = (x - mean[ch]) * invstd;"
            " v -= a * (sum_dy[ch] + xhat * sum_dy_xhat[ch]) * inv_m; }"
            " dx = v", "leafpy_bn_grad")
_DROPOUT = ("raw uint32 seed, uint32 mult, uint32 threshold, T scale", "T mask",
            "unsigned int h = (unsigned int)i + seed[0] * mult;"
            " h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;"
            " mask = h >= threshold ? scale : (T)0", "leafpy_dropout")

_UNSCALE = ("raw T scale", "T x", "x = x * ((T)1 / scale[0])", "leafpy_unscale")
# one thread (size=1): counts = [good steps, skipped steps], rate = [step rate, apply]; see Backend.loss_scale_update
_LOSS_SCALE_UPDATE = (
    "raw T sumsq, T growth, T backoff, T interval, int32 dynamic", "raw T scale, raw T counts, raw T rate",
    "bool ok = isfinite(sumsq[0]); rate[1] = ok ? (T)1 : (T)0; if (!ok) counts[1] = counts[1] + (T)1;"
    " if (dynamic) { T s = scale[0]; T good = counts[0];"
    " if (!ok) { s = s * backoff; good = (T)0; }"
    " else { good = good + (T)1; if (good >= interval) { T grown = s * growth; if (isfinite(grown)) s = grown;"
    " good = (T)0; } }"
    " scale[0] = s; counts[0] = good; }", "leafpy_loss_scale_update")


LOW_PRECISION_KERNELS = frozenset(SHORTHANDS) | {
    "gemm", "axpby", "copy", "fill", "mul", "maximum", "activation", "activation_grad", "bias_add", "bias_grad",
    "batch_norm_stats", "batch_norm", "batch_norm_grad_sums", "batch_norm_grad", "conv2d", "conv2d_grad_data",
    "conv2d_grad_filter", "pool2d", "pool2d_grad", "copy_block", "dropout_mask"}
"""The primitives with bfloat16 and float16 kernels of their own (loads and stores in the buffer's format, float
arithmetic)."""


def _identity(a: Any) -> tuple:
    """What tells one device array from another for as long as neither is freed: address, shape, strides, dtype."""
    return a.data.ptr, a.shape, a.strides, a.dtype


class CudaBackend(ArrayBackend):
    """CuPy on one NVIDIA GPU. ``use_cudnn``: None (use cuDNN graphs when importable), True (require), False
    (im2col + GEMM). ``tf32``: let convolutions (cuDNN) and GEMMs (cuBLAS) use TF32 tensor cores (faster, ~1e-3
    relative error; PyTorch's ``allow_tf32`` switches for both).
    ``graphs``: record training steps with static shapes as CUDA graphs and replay them. ``fuse_bias``: add the
    convolution bias inside the cuDNN forward graph; None (default) does so for bfloat16/float16 convolutions only
    (on an H200: AlexNet-128 in bf16 4.47 -> 4.32 ms a step; in float32 the fused graphs were slower than a
    separate add).
    ``channels_last``: store 4-D tensors NHWC (see ArrayBackend): cuDNN's tensor-core convolutions then read and
    write them as they are, without the transposes it adds around NCHW operands in bfloat16 and float16; users'
    arrays stay NCHW (the conversion happens on upload and download, and where a 4-D tensor is seen with another
    shape). None (the default): channels-last for bf16 and fp16 (:attr:`CHANNELS_LAST_PRECISIONS`), row-major for
    fp32 and tf32. Pooling, BatchNorm, LRN and bias gradients take NHWC operands as they are (:attr:`ONE_LAYOUT`).
    ``conv_tolerance``: without TF32, the relative error (against the median of cuDNN's candidate plans, on the
    first batch) a float32 convolution plan may show to be kept: 2^-12 by default (Winograd filter gradients that
    meet it are kept, the FFT and large-tile transforms that reach 1e-3 to 1e-2 are not; see
    ``_CudnnConv.FP32_TOLERANCE``); 1e-5 keeps only plans as accurate as implicit GEMM; None keeps any fp32 plan,
    as PyTorch's cudnn.benchmark does."""

    name = "cuda"
    CHANNELS_LAST_PRECISIONS = ("bf16", "fp16")
    """On an H100, 2026-12-06, bf16 step times channels-last against the same backend storing NCHW: AlexNet-128 3.84
    against 4.62 ms, ResNet-18 at 32x32 (batch 128) 5.13 against 6.03 ms."""

    EMULATED = tuple(n for n in PRIMITIVES + SHORTHANDS if n not in LOW_PRECISION_KERNELS and n not in MEMORY)
    """The primitives without bfloat16 and float16 kernels (softmax, losses, LRN, embeddings and recurrent cells,
    solver updates, reductions): under a bf16 or fp16 precision setting they run on float32 copies of their 16-bit
    operands; otherwise they refuse 16-bit buffers with a BackendError."""

    def __init__(self, dtype: Any = np.float32, device: int = 0, use_cudnn: bool | None = None,
                 tf32: bool = False, graphs: bool = True, fuse_bias: bool | None = None,
                 conv_tolerance: float | None = _CudnnConv.FP32_TOLERANCE,
                 precision: str = "fp32", channels_last: bool | None = None) -> None:
        tf32 = tf32 or precision == "tf32"  # precision='tf32' is the tf32=True option
        if conv_tolerance is not None:
            conv_tolerance = _checks.number("backend 'cuda': conv_tolerance", conv_tolerance, minimum=0.0,
                                            min_open=True)
        super().__init__(dtype, "tf32" if tf32 and precision == "fp32" else precision, channels_last)
        self._options.update(device=device, use_cudnn=use_cudnn, tf32=tf32, graphs=graphs, fuse_bias=fuse_bias,
                             conv_tolerance=conv_tolerance)  # the fp32 twin (full_precision) runs on the same device
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable(f"backend 'cuda' needs CuPy, which is not installed: {_INSTALL}") from e
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no device
            raise BackendUnavailable(f"backend 'cuda': no usable NVIDIA GPU ({e})") from e
        if device >= count:
            raise BackendUnavailable(f"backend 'cuda': device {device} requested, {count} present")
        self.xp = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        name = cupy.cuda.runtime.getDeviceProperties(device).get("name", b"")
        self.adapter_name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        # a copy's memory order follows from its key: channels-last copies are copies of their own
        self.key = f"cuda:{device}" + (":channels_last" if self.channels_last else "")
        self.tf32 = tf32
        self.fuse_bias = fuse_bias
        self._kernels = self._build_kernels(cupy)
        self._update_kernels: dict[tuple[updates.Rule, bool, str], Any] = {}  # by (rule, float4, copy format)
        self._pool_module = cupy.RawModule(code=module_source(_POOL_SOURCE, "f32"))
        self._bn_module = cupy.RawModule(code=module_source(_BN_SOURCE, "f32"))
        self._low_modules: dict[tuple[str, str, bool], Any] = {}
        self._wgrad_direct: dict[tuple, bool] = {}  # 16-bit filter gradients: cuDNN writes float32 (or converts)
        self._typed_kernels: dict[tuple, Any] = {}
        self._vector_kernels: dict[str, Any] = {}
        self._cudnn = None
        self.graphs = graphs
        self.recorder = StepRecorder(self, self.MAX_RECORDED_STEPS)
        self._capture_blas: _CaptureBlas | None = None
        self._capturing = False
        self._pools: list = []  # each recorded step's private pool: addresses baked into a graph stay its own
        self._peak_used = 0
        self._step_stream = cupy.cuda.Stream()  # blocking: ordered with work on the default stream
        self._staging: PinnedStaging | None = None
        if use_cudnn is not False:
            try:
                self._cudnn = _CudnnConv(cupy, tf32, conv_tolerance)
            except Exception as e:  # ImportError, or a frontend/runtime mismatch
                if use_cudnn:
                    raise BackendUnavailable(f"backend 'cuda': cuDNN graphs unavailable ({e}); "
                                             "pip install nvidia-cudnn-frontend nvidia-cudnn-cu12") from e
        if not getattr(self, "mixed", False):  # a bf16/fp16 setting converts these primitives' 16-bit operands
            self._refuse_low_precision()
        self._one_layout_per_call()

    ONE_LAYOUT = ("pool2d", "pool2d_grad", "batch_norm_stats", "batch_norm_grad_sums", "batch_norm",
                  "batch_norm_grad", "bias_grad", "lrn", "lrn_grad")
    """Primitives with kernels for either layout (:meth:`_layout_of`): they run as they are when their 4-D operands
    are all row-major or all channels-last, and on row-major copies of the channels-last ones for a mix."""

    @staticmethod
    def _layout_of(*arrays: Any) -> bool | None:
        """Of a call's operands: False when every 4-D one is row-major, True when every one is a view of NHWC memory
        (a 4-D array with one channel, or one position, is both), None for a mix."""
        four = [a for a in arrays if getattr(a, "ndim", 0) == 4]
        if all(a.flags.c_contiguous for a in four):
            return False
        if all(a.transpose(0, 2, 3, 1).flags.c_contiguous for a in four):
            return True
        return None

    def relayout(self, buf, old, new):
        super().relayout(as_stored(buf), old, new)  # 16-bit values moved as their bits

    @staticmethod
    def _rows(a: Any) -> Any:
        """A channels-last [N, C, H, W] view's memory as row-major rows [N * H * W, C]."""
        return a.transpose(0, 2, 3, 1).reshape(-1, a.shape[1])

    def _one_layout_per_call(self) -> None:
        """Wrap each primitive of :attr:`ONE_LAYOUT` so that a call with a mix of layouts runs on row-major copies
        of its channels-last operands (written back where the primitive writes them)."""
        xp = self.xp

        def channels_last(a: Any) -> bool:
            return getattr(a, "ndim", 0) == 4 and not a.flags.c_contiguous

        def copies(operands: dict[str, Any]) -> dict[str, Any]:  # 16-bit values moved as their bits
            return {k: xp.ascontiguousarray(as_stored(a)).view(a.dtype) for k, a in operands.items()}

        def back(copy: Any, operand: Any) -> None:
            as_stored(operand)[...] = as_stored(copy)

        for name in self.ONE_LAYOUT:
            method = getattr(self, name)
            converted = emulated(name, method, channels_last, copies, back)

            def run(*args: Any, _method: Any = method, _converted: Any = converted, **kwargs: Any) -> Any:
                one = self._layout_of(*args, *kwargs.values()) is not None
                return (_method if one else _converted)(*args, **kwargs)

            functools.update_wrapper(run, method)
            setattr(self, name, run)

    def _refuse_low_precision(self) -> None:
        """Make each primitive of :attr:`EMULATED` refuse bfloat16 and float16 operands with a BackendError."""
        low = low_dtypes()
        for name in self.EMULATED:
            method = getattr(self, name)

            def guarded(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
                narrow_ones = NARROW_OPERANDS.get(_name, ())
                for a in (*args, *(v for k, v in kwargs.items() if k not in narrow_ones)):
                    if getattr(a, "dtype", None) in low:
                        raise BackendError(
                            f"cuda {_name}: got a {a.dtype} operand, but this primitive has no bfloat16/float16 "
                            "kernel; pass float32 buffers (cast them first), or run the backend with a bf16/fp16 "
                            "precision setting, which converts them")
                return _method(*args, **kwargs)

            functools.update_wrapper(guarded, method)
            setattr(self, name, guarded)

    @property
    def uses_cudnn(self) -> bool:
        return self._cudnn is not None

    @staticmethod
    def _build_kernels(cp: Any) -> dict:
        ek = cp.ElementwiseKernel
        # the activations and their gradients, generated from their formulas (pointwise.TABLE)
        activations = {name: ek(*source) for name, source in pointwise.cuda_kernel_sources().items()}
        return activations | {
            "axpby": ek(*_AXPBY),
            "clip_to_norm": ek("raw T sumsq, T threshold", "T x",
                               "T n = sqrt(sumsq[0]); if (n > threshold) x *= threshold / n", "leafpy_clip_to_norm"),
            "unscale": ek(*_UNSCALE),
            "loss_scale_update": ek(*_LOSS_SCALE_UPDATE),
            "bn_forward": ek(*_BN_FORWARD),
            "bn_grad": ek(*_BN_GRAD),
            "dropout": ek(*_DROPOUT),
        }

    # --- memory contract --------------------------------------------------------------------------------------
    def allocate(self, size: int, dtype: Any) -> Any:
        return self.xp.empty(size, dtype)

    PINNED_UPLOAD_BYTES: int | None = 1 << 20
    """A batch (:meth:`upload_batch`) of at least this many bytes goes through pinned memory on a copy stream
    (:mod:`.staging`: it overlaps the step still running); smaller ones, and every other upload, are copied
    directly. None: every batch is copied directly."""

    def upload(self, host: np.ndarray, out: Any) -> None:
        out.set(np.ascontiguousarray(host))

    def upload_batch(self, host: np.ndarray, out: Any) -> None:
        host = np.ascontiguousarray(host)
        least = self.PINNED_UPLOAD_BYTES
        if (least is None or host.nbytes < least or self._capturing or host.dtype != out.dtype
                or host.size != out.size or not out.flags.c_contiguous):
            out.set(host)
            return
        if self._staging is None:
            self._staging = PinnedStaging(self.xp)
        self._staging.upload(host, out)

    def download(self, buf: Any, host: np.ndarray) -> None:
        buf.get(out=host)

    def synchronize(self) -> None:
        self.device.synchronize()

    def peak_memory(self) -> int:
        """The most bytes in use at once (blocks handed out by CuPy's pools, cached free blocks not counted)
        since :meth:`track_memory`; before that, what the pools hold, free blocks included."""
        if self._peak_used:
            return self._peak_used
        return int(self.xp.get_default_memory_pool().total_bytes() + sum(p.total_bytes() for p in self._pools))

    def track_memory(self) -> None:
        """Record the peak of bytes in use from now on (routes CuPy's default allocator through a counter; a
        second call starts a new peak)."""
        default = self.xp.get_default_memory_pool()

        def tracked(size: int) -> Any:
            mem = default.malloc(size)
            self._note_usage()
            return mem

        self.xp.cuda.set_allocator(tracked)
        self._peak_used = 0
        self._note_usage()

    def _note_usage(self) -> None:
        used = self.xp.get_default_memory_pool().used_bytes() + sum(p.used_bytes() for p in self._pools)
        if used > self._peak_used:
            self._peak_used = int(used)

    def _scalar(self, v: float) -> Any:
        return self.dtype.type(v)

    # --- recorded training steps (CUDA graphs; the bookkeeping is recorder.StepRecorder's) --------------------
    MAX_RECORDED_STEPS = 4

    def run_step(self, key, step):
        if not self.graphs:
            return step()
        self._release_idle_pools()
        self.recorder.run(key, step)

    @property
    def record_error(self) -> str | None:
        """Why the last step that could not be recorded as a CUDA graph could not (None: every one could)."""
        return self.recorder.error

    def _release_idle_pools(self) -> None:
        live = {id(p) for p in self.recorder.live_extras()}
        self._pools = [p for p in self._pools if id(p) in live or p.used_bytes()]

    def first_run(self, entry, step) -> None:
        # run eagerly from the step's own pool, so the recording finds every block it needs; addresses baked into
        # a graph stay the step's own (no other step or eager code is handed them while the graph may write them)
        cp = self.xp
        entry.extra = cp.cuda.MemoryPool()
        self._pools.append(entry.extra)
        with cp.cuda.using_allocator(self._pool_malloc(entry.extra)):
            step()

    def _pool_malloc(self, pool: Any) -> Any:
        def allocate(size: int) -> Any:
            mem = pool.malloc(size)
            self._note_usage()
            return mem

        return allocate

    def capture(self, entry, step) -> tuple[Any, bool]:
        cp = self.xp
        stream = self._step_stream
        self._blas().prepare(stream)
        self._capturing = True
        try:
            with cp.cuda.using_allocator(self._pool_malloc(entry.extra)), stream:
                stream.begin_capture()
                try:
                    step()
                finally:
                    graph = stream.end_capture()
        finally:
            self._capturing = False
        return graph, False  # capturing only records: the recorder launches the graph for this call

    def launch(self, recording) -> None:
        recording.launch(self._step_stream)

    @staticmethod
    def handle(buffer) -> int:
        return buffer.data.ptr

    def _blas(self) -> _CaptureBlas:
        if self._capture_blas is None:
            self._capture_blas = _CaptureBlas(self.xp, self.tf32)
        return self._capture_blas

    def matmul(self, a, trans_a, b, trans_b, out):
        # one gemm per matrix of the stack: gemm is what a recorded step may call (CuPy's matmul calls cuBLAS on
        # its own handle, which a stream being recorded refuses)
        if min(a.ndim, b.ndim, out.ndim) < 2:
            return super().matmul(a, trans_a, b, trans_b, out)
        xp, lead = self.xp, out.shape[:-2]
        if b.ndim == 2 and not trans_a and a.shape[:-2] == lead and a.flags.c_contiguous and out.flags.c_contiguous:
            # a stack times one matrix: one gemm over the stack's rows
            return self.gemm(a.reshape(-1, a.shape[-1]), False, b, trans_b, out.reshape(-1, out.shape[-1]))
        a = xp.broadcast_to(a, lead + a.shape[-2:])
        b = xp.broadcast_to(b, lead + b.shape[-2:])
        for idx in np.ndindex(*lead):
            self.gemm(xp.ascontiguousarray(a[idx]), trans_a, xp.ascontiguousarray(b[idx]), trans_b, out[idx])

    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        if is_low(a) or is_low(b) or is_low(out):
            f = formats_of("gemm", a=a, b=b, out=out)
            if f["a"] != f["b"] or f["a"] == "f32" or f["out"] not in (f["a"], "f32"):
                raise BackendError(f"cuda gemm: a ({a.dtype}) and b ({b.dtype}) must share one 16-bit format and out "
                                   f"({out.dtype}) be in that format or float32; cast the odd operand first")
            blas = self._blas()
            if not self._capturing:  # a recording set the stream when it began
                blas.use_stream(self.xp.cuda.get_current_stream())
            blas.gemm_ex(a, trans_a, b, trans_b, out, alpha, beta, f["a"], f["out"])
        elif self._capturing:  # CuPy refuses cuBLAS calls while a stream records; cuBLAS itself allows them
            self._capture_blas.gemm(a, trans_a, b, trans_b, out, alpha, beta)
        elif self.tf32:
            from cupy_backends.cuda.libs import cublas

            handle = self.device.cublas_handle  # CuPy's, shared: TF32 only for the duration of this call
            cublas.setMathMode(handle, _CaptureBlas.TF32_TENSOR_OP_MATH)
            try:
                super().gemm(a, trans_a, b, trans_b, out, alpha, beta)
            finally:
                cublas.setMathMode(handle, 0)  # CUBLAS_DEFAULT_MATH
        else:
            super().gemm(a, trans_a, b, trans_b, out, alpha, beta)

    # --- fused elementwise ------------------------------------------------------------------------------------
    # float32 arrays whose size is a multiple of 4 (nearly all) go through kernels that move four values per thread
    # (float4): CuPy's ElementwiseKernels, one value per thread with 64-bit indexing, took 2-3x the time of a copy
    # of the same bytes on an H200; the ElementwiseKernels serve every other array.
    VECTOR_BLOCK = 256

    def _fits_float4(self, *arrays: Any, any_order: bool = False) -> bool:
        """Whether a float4 kernel may take these arrays: float32, one size, 16-byte aligned, and row-major — or,
        with ``any_order`` (kernels that never read an element's index), of :func:`one_memory_order`."""
        size = arrays[0].size
        return (size % 4 == 0 and 0 < size < 2**31 and all(
            a.dtype == np.float32 and a.size == size and a.data.ptr % 16 == 0 for a in arrays) and (
            all(a.flags.c_contiguous for a in arrays) or (any_order and one_memory_order(arrays))))

    def _launch4(self, kernel: Any, arrays: tuple, scalars: tuple = ()) -> None:
        n4 = arrays[0].size // 4
        block = self.VECTOR_BLOCK
        kernel(((n4 + block - 1) // block,), (block,), (*arrays, *scalars, np.int32(n4)))

    def _vector_kernel(self, name: str) -> Any:
        """The float4 twin of ``self._kernels[name]`` (compiled on first use)."""
        kernel = self._vector_kernels.get(name)
        if kernel is None:
            inputs: tuple[str, ...]
            outputs: tuple[str, ...]
            scalars: tuple[str, ...]
            if name == "axpby":
                inputs, outputs, scalars, operation, read = ("x",), ("y",), ("a", "b"), "y = a * x + b * y;", True
            else:
                in_params, out_params, operation, _ = pointwise.cuda_kernel_sources()[name]
                line = pointwise.line(name.removesuffix("_grad"))
                names = [p.split()[-1] for p in in_params.split(",")]
                inputs = tuple(n for n in names if n not in line.params)
                outputs, scalars, read = (out_params.split()[-1],), tuple(line.params), False
            source = vectorized_source(f"leafpy_{name}4", inputs, outputs, scalars, operation, read)
            kernel = self._vector_kernels[name] = self.xp.RawModule(code=source).get_function(f"leafpy_{name}4")
        return kernel

    # --- bfloat16 and float16 operands: kernels typed per operand format (lowp.py) ------------------------------
    def _typed(self, source: tuple, formats: dict[str, str], read_outputs: bool = False) -> Any:
        key = (source[3], tuple(sorted(formats.items())))
        kernel = self._typed_kernels.get(key)
        if kernel is None:
            in_params, out_params, operation, name = source
            kernel = self._typed_kernels[key] = typed_kernel(self.xp, in_params, out_params, operation, name, formats,
                                                             read_outputs)
        return kernel

    def _low_module(self, which: str, fmt: str, channels_last: bool = False) -> Any:
        """The pooling ("pool") or batch-normalisation ("bn") kernels for activations stored in ``fmt``."""
        module = self._low_modules.get((which, fmt, channels_last))
        if module is None:
            source = _POOL_SOURCE if which == "pool" else _BN_SOURCE
            module = self._low_modules[(which, fmt, channels_last)] = self.xp.RawModule(
                code=module_source(source, fmt, channels_last))
        return module

    @staticmethod
    def _float32_arrays(op: str, **arrays: Any) -> None:
        for name, a in arrays.items():
            if a is not None and a.dtype != np.float32:
                raise BackendError(f"cuda {op}: '{name}' must be float32 beside 16-bit activations (BatchNorm's "
                                   f"scale, shift and statistics stay float32), got {a.dtype}")

    def cast(self, x, out):
        """``out = x`` converted to ``out``'s dtype (round to nearest even), same number of elements."""
        if x.size != out.size:
            raise BackendError(f"cuda cast: {x.size} elements into {out.size}; the buffers must have one size")
        fx, fo = storage_format(x.dtype), storage_format(out.dtype)
        if fx is None or fo is None:  # float64 on either side: CuPy's own conversion
            out[...] = x.reshape(out.shape)
        elif fx == fo:
            self.copy(x, out)
        else:
            self._typed(_CAST, {"x": fx, "y": fo})(as_stored(x.reshape(out.shape)), as_stored(out))

    def copy(self, x, out):
        if x is out:
            return
        if x.dtype != out.dtype:
            return self.cast(x, out)
        if x.size and x.shape == out.shape and x.strides == out.strides and self._dense(x):
            if x.data.ptr == out.data.ptr:  # two views of the same memory: nothing to move
                return
            # one layout, one span of memory each: a device-to-device copy of the bytes. CuPy's copy kernel indexes a
            # channels-last view element by element: 93 us a copy of ResNet-18's activations on an H100, 34 copies
            # (3.16 ms) a bf16 step (residual adds and their gradients); with the memcpy and batch norm's block-wide
            # combines the step went from 11.06 to 5.13 ms
            if abs(x.data.ptr - out.data.ptr) < x.nbytes:  # overlapping spans: through a copy, as NumPy's assignment
                x = x.copy(order="K")
            out.data.copy_from_device_async(x.data, x.nbytes)
            return
        super().copy(as_stored(x), as_stored(out))

    def copy_block(self, part, whole, part_inner, whole_inner, offset, into_whole):
        if part.dtype != whole.dtype:
            raise BackendError(f"cuda copy_block: part ({part.dtype}) and whole ({whole.dtype}) must share a dtype")
        super().copy_block(as_stored(part), as_stored(whole), part_inner, whole_inner, offset, into_whole)

    @staticmethod
    def _dense(a: Any) -> bool:
        """Whether ``a``'s elements are exactly its memory span (row-major, column-major or channels-last)."""
        return bool(a.flags.c_contiguous or a.flags.f_contiguous
                    or (a.ndim == 4 and a.transpose(0, 2, 3, 1).flags.c_contiguous))

    def _clear(self, out: Any) -> None:
        """Zero ``out``: a memset for a dense array (several times faster than CuPy's fill kernel), else fill."""
        if out.size and self._dense(out):
            out.data.memset_async(0, out.nbytes)
        else:
            as_stored(out).fill(0)

    def fill(self, value, out):
        if value == 0:
            return self._clear(out)
        if is_low(out):
            out.view(np.uint16).fill(int(np.array([value], dtype=out.dtype).view(np.uint16)[0]))
            return
        super().fill(value, out)

    def mul(self, x, y, out):
        if is_low(x) or is_low(y) or is_low(out):
            self._typed(_MUL, formats_of("mul", x=x, m=y, z=out))(as_stored(x), as_stored(y), as_stored(out))
            return
        super().mul(x, y, out)

    def maximum(self, x, y, out):
        if is_low(x) or is_low(y) or is_low(out):
            self._typed(_MAXIMUM, formats_of("maximum", x=x, m=y, z=out))(as_stored(x), as_stored(y),
                                                                         as_stored(out))
            return
        super().maximum(x, y, out)

    def bias_add(self, y, b):
        if is_low(y) or is_low(b):
            c = y.shape[1]
            inner = y.size // max(y.shape[0] * c, 1)
            self._typed(_BIAS_ADD, formats_of("bias_add", y=y, b=b), read_outputs=True)(
                as_stored(b), np.int32(c), np.int32(inner), as_stored(y))
            return
        super().bias_add(y, b)

    def bias_grad(self, dy, db, beta=0.0):
        channels_last = dy.ndim == 4 and not dy.flags.c_contiguous
        if not is_low(dy) and not (channels_last and dy.dtype == np.float32):
            return super().bias_grad(dy, db, beta)
        fmt = formats_of("bias_grad", dy=dy, db=db)["dy"] if is_low(dy) else "f32"
        i32 = np.int32
        if channels_last:  # per channel, partial sums over runs of rows [N * H * W, C]
            rows = self._rows(dy)
            m, c = rows.shape
            run, runs, part = self._row_runs(m, c)
            self._bn_kernels(fmt).get_function("rows_sum_part")(
                *self._row_grid(c, runs), (as_stored(rows), part, i32(m), i32(c), i32(run)))
        else:  # per channel, partial sums over runs of samples (the batch-norm reductions' split)
            c, run, runs, part = self._bn_runs(dy)
            n = dy.shape[0]
            self._low_module("bn", fmt).get_function("channel_sum_part_low")(
                (c, runs), (256,), (as_stored(self.xp.ascontiguousarray(dy)), part, i32(n), i32(c),
                                    i32(dy.size // max(n * c, 1)), i32(run)))
        if db.dtype == np.float32 and db.flags.c_contiguous:  # (as mixed precision keeps weight gradients)
            self._bn_combine("bias_total", c, runs, (part, db, i32(runs), np.float32(beta)))
            return
        sums = part[:c * runs].reshape(c, runs).sum(axis=1)
        if beta == 0.0:
            self.cast(sums, db)
        else:
            self.axpby(1.0, sums, beta, db)

    def axpby(self, alpha, x, beta, y):
        if is_low(x) or is_low(y):
            self._typed(_AXPBY, formats_of("axpby", x=x, y=y), read_outputs=True)(
                as_stored(x), np.float32(alpha), np.float32(beta), as_stored(y))
            return
        if self._fits_float4(x, y, any_order=True):
            self._launch4(self._vector_kernel("axpby"), (x, y), (np.float32(alpha), np.float32(beta)))
            return
        self._kernels["axpby"](x, self._scalar(alpha), self._scalar(beta), y)

    @functools.cached_property
    def _activation_sources(self) -> dict[str, tuple[str, str, str, str]]:
        return pointwise.cuda_kernel_sources()

    def _low_activation(self, name: str, arrays: tuple, params: tuple) -> None:
        source = self._activation_sources[name]
        names = [p.split()[-1] for p in source[0].split(",")][:len(arrays) - 1] + [source[1].split()[-1]]
        kernel = self._typed(source, formats_of(name, **dict(zip(names, arrays))))
        kernel(*(as_stored(a) for a in arrays[:-1]), *(np.float32(p) for p in params), as_stored(arrays[-1]))

    def activation(self, kind, x, out, params=()):
        pointwise.line(kind)
        if is_low(x) or is_low(out):
            return self._low_activation(kind, (x, out), tuple(params))
        if self._fits_float4(x, out, any_order=True):
            self._launch4(self._vector_kernel(kind), (x, out), tuple(np.float32(p) for p in params))
            return
        self._kernels[kind](x, *map(self._scalar, params), out)

    def activation_grad(self, kind, src, dy, dx, params=()):
        pointwise.line(kind)
        if is_low(src) or is_low(dy) or is_low(dx):
            return self._low_activation(kind + "_grad", (src, dy, dx), tuple(params))
        if self._fits_float4(src, dy, dx, any_order=True):
            self._launch4(self._vector_kernel(kind + "_grad"), (src, dy, dx), tuple(np.float32(p) for p in params))
            return
        self._kernels[kind + "_grad"](src, dy, *map(self._scalar, params), dx)

    def clip_to_norm(self, x, sumsq, threshold):
        self._kernels["clip_to_norm"](sumsq, self._scalar(threshold), x)

    def unscale(self, x, scale):
        self._kernels["unscale"](scale, x)

    def sum_squares(self, xs, out, ws, scale=None):
        # one pass over every gradient, two launches in all, where the per-buffer default takes four or five launches
        # a buffer (ResNet-18's 62 weights: 0.87 of 5.8 ms of a loss-scaled fp16 step on an H100). The tensors'
        # addresses and chunks are device tables kept in ws by those addresses, for as long as the caller keeps ws:
        # a recorded step reads them where they were
        f32 = np.dtype(np.float32)
        if (not any(x.size for x in xs) or out.dtype != f32 or (scale is not None and scale.dtype != f32)
                or any(x.dtype != f32 or not self._dense(x) for x in xs)):
            return super().sum_squares(xs, out, ws, scale)
        key = ("sum_squares", tuple((x.data.ptr, x.size) for x in xs))
        tables = ws.get(key)
        if tables is None:
            if self._capturing:  # a recording cannot upload the tables: the per-buffer default records
                return super().sum_squares(xs, out, ws, scale)
            tables = ws[key] = self._sum_squares_tables(xs)
        ptrs, sizes, chunk_tensor, chunk_start, part = tables
        blocks = part.size
        fn = self._sum_squares_module.get_function
        fn("sumsq_part")((blocks,), (SUMSQ_THREADS,), (
            ptrs, sizes, chunk_tensor, chunk_start, np.int64(SUM_SQUARES_CHUNK), scale if scale is not None else out,
            np.int32(scale is not None), part))
        fn("sumsq_total")((1,), (SUMSQ_THREADS,), (part, np.int32(blocks), out))

    def _sum_squares_tables(self, xs: list) -> tuple:
        """The device tables of :meth:`sum_squares`: addresses, sizes, each chunk's tensor and start, the parts."""
        cp = self.xp
        sizes = np.array([x.size for x in xs], np.int64)
        tensor, start = sum_squares_chunks(sizes)
        ptrs = np.array([x.data.ptr for x in xs], np.uint64)
        return (cp.asarray(ptrs), cp.asarray(sizes), cp.asarray(tensor), cp.asarray(start),
                cp.empty(tensor.size, np.float64))

    @functools.cached_property
    def _sum_squares_module(self) -> Any:
        return self.xp.RawModule(code=sum_squares_source())

    def loss_scale_update(self, sumsq, scale, counts, rate, growth_factor, backoff_factor, growth_interval, dynamic):
        s = self._scalar
        self._kernels["loss_scale_update"](sumsq, s(growth_factor), s(backoff_factor), s(growth_interval),
                                           np.int32(bool(dynamic)), scale, counts, rate, size=1)

    def solver_update(self, kind, w, g, rate, lr_mult, params=(), s1=None, s2=None, s3=None, copy=None):
        # one fused kernel per line of updates.TABLE, made on first use: the step's rate is read on the device
        # (rate[0]), so a recorded step replays under any learning-rate schedule; rate[1] == 0 (a loss-scaled step
        # with inf or nan gradients) writes nothing. float32 arrays that fit float4 (nearly all) take the kernel of
        # four elements a thread, which also writes the 16-bit copy where there is one; the rest the
        # ElementwiseKernel, then a cast into the copy
        rule = updates.rule(kind)
        state = (s1, s2, s3)[:len(rule.state)]
        vector = rate.dtype == np.float32 and self._fits_float4(g, w, *state, any_order=True)
        low = ""
        if copy is not None:
            low = (storage_format(copy.dtype) or "") if is_low(copy) else ""
            vector = vector and bool(low) and copy.size == w.size and copy.data.ptr % 8 == 0 and \
                one_memory_order((w, copy))
        key = (rule, vector, low if vector else "")
        kernel = self._update_kernels.get(key)
        if kernel is None:
            kernel = self._update_kernels[key] = self._update_kernel(kind, vector, key[2])
        if vector:
            arrays = (g, w, *state) + ((as_stored(copy),) if key[2] else ()) + (rate,)
            self._launch4(kernel, arrays, tuple(np.float32(p) for p in (lr_mult, *params)))
            return
        kernel(g, rate, self._scalar(lr_mult), *map(self._scalar, params), w, *state)
        if copy is not None:
            self.cast(w, copy)

    def _update_kernel(self, kind: str, vector: bool, copy: str = "") -> Any:
        if not vector:
            return self.xp.ElementwiseKernel(*updates.cuda_kernel_source(kind))
        source, name = updates.cuda_vector_source(kind, copy)
        return self.xp.RawModule(code=source).get_function(name)

    # --- batch normalisation: each per-channel reduction two kernels (runs of samples, then their combination),
    # each per-element pass one kernel -------------------------------------------------------------------------
    BN_BLOCKS = 1024
    """Blocks the per-channel reductions aim for (channels x runs of samples per channel): one block per channel
    left most of an H200 idle at 64 channels."""

    @staticmethod
    def _bn_geometry(x) -> tuple[np.int32, np.int32]:
        c = x.shape[1]
        return np.int32(c), np.int32(x.size // (x.shape[0] * c))

    def _bn_runs(self, x) -> tuple[int, int, int, Any]:
        """(channels, samples per run, runs per channel, scratch for each run's two partial values)."""
        n, c = x.shape[0], x.shape[1]
        rows = -(-n // min(n, max(1, self.BN_BLOCKS // c)))
        runs = -(-n // rows)
        return c, rows, runs, self.xp.empty(2 * c * runs, np.float32)

    ROW_THREADS = 1 << 16
    """Threads the channels-last reductions aim for (channels x runs of rows; each thread adds up one channel over
    its run in float32, and the runs' partials are combined in double), so that few channels or a small batch still
    fill the GPU."""
    ROW_RUN_MAX = 1024
    """The longest run one thread adds up (more runs where there are more rows, up to the grid's 65535)."""

    def _row_runs(self, m: int, c: int) -> tuple[int, int, Any]:
        """(rows per run, runs, scratch for each run's two partial values) of a channels-last reduction over [m, c]."""
        runs = max(1, min(m, 65535, max(-(-self.ROW_THREADS // c), -(-m // self.ROW_RUN_MAX))))
        run = -(-m // runs)
        runs = -(-m // run)
        return run, runs, self.xp.empty(2 * c * runs, np.float32)

    @staticmethod
    def _row_grid(c: int, runs: int) -> tuple[tuple[int, int], tuple[int]]:
        """(grid, block) of a channels-last reduction: a warp-multiple of threads per block, at most 128, across
        the channels; one row of blocks per run."""
        block = min(128, 32 * -(-c // 32))
        return (-(-c // block), runs), (block,)

    def _bn_combine(self, name: str, c: int, runs: int, args: tuple) -> None:
        """Launch a combine kernel: a block per channel, a power of two of threads (at least a warp) over its runs."""
        threads = min(COMBINE_THREADS, 1 << max(5, (runs - 1).bit_length()))
        self._bn_module.get_function(name)((c,), (threads,), args)

    def _bn_kernels(self, fmt: str) -> Any:
        return self._bn_module if fmt == "f32" else self._low_module("bn", fmt)

    def batch_norm_stats(self, x, mean, var):
        low = is_low(x)
        if not low and x.dtype != np.float32:
            return super().batch_norm_stats(x, mean, var)
        if self._layout_of(x):
            if low:
                self._float32_arrays("batch_norm_stats", mean=mean, var=var)
            rows = self._rows(x)
            m, c = rows.shape
            run, runs, part = self._row_runs(m, c)
            i32 = np.int32
            self._bn_kernels(storage_format(x.dtype) if low else "f32").get_function("bn_rows_stats_part")(
                *self._row_grid(c, runs), (as_stored(rows), part, i32(m), i32(c), i32(run)))
            self._bn_combine("bn_stats_combine", c, runs, (part, mean, var, i32(m), i32(c), i32(1), i32(run),
                                                           i32(runs)))
            return
        _, inner = self._bn_geometry(x)
        c, rows, runs, part = self._bn_runs(x)
        i32, f = np.int32, self._bn_module.get_function
        if low:
            self._float32_arrays("batch_norm_stats", mean=mean, var=var)
            self._low_module("bn", storage_format(x.dtype)).get_function("bn_stats_part_low")(
                (c, runs), (256,), (as_stored(x), part, i32(x.shape[0]), i32(c), inner, i32(rows)))
        else:
            wide = inner % 4 == 0 and self._fits_float4(x)
            f("bn_stats_part4" if wide else "bn_stats_part")(
                (c, runs), (256,), (x, part, i32(x.shape[0]), i32(c), i32(inner // 4 if wide else inner),
                                    i32(rows)))
        self._bn_combine("bn_stats_combine", c, runs, (part, mean, var, i32(x.shape[0]), i32(c), inner, i32(rows),
                                                       i32(runs)))

    def batch_norm_grad_sums(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps):
        low = is_low(x) or is_low(dy)
        if not low and x.dtype != np.float32:
            return super().batch_norm_grad_sums(x, dy, mean, var, sum_dy, sum_dy_xhat, eps)
        if self._layout_of(x, dy):
            fmt = formats_of("batch_norm_grad_sums", x=x, dy=dy) if low else {"x": "f32", "dy": "f32"}
            if fmt["x"] != fmt["dy"]:
                raise BackendError(f"cuda batch_norm_grad_sums: x ({x.dtype}) and dy ({dy.dtype}) must share a dtype")
            self._float32_arrays("batch_norm_grad_sums", mean=mean, var=var, sum_dy=sum_dy, sum_dy_xhat=sum_dy_xhat)
            rows, drows = self._rows(x), self._rows(dy)
            m, c = rows.shape
            run, runs, part = self._row_runs(m, c)
            i32 = np.int32
            self._bn_kernels(fmt["x"]).get_function("bn_rows_grad_part")(
                *self._row_grid(c, runs), (as_stored(rows), as_stored(drows), mean, part, i32(m), i32(c), i32(run)))
            self._bn_combine("bn_grad_combine", c, runs, (part, var, sum_dy, sum_dy_xhat, i32(c), i32(runs),
                                                          np.float32(eps)))
            return
        _, inner = self._bn_geometry(x)
        c, rows, runs, part = self._bn_runs(x)
        i32, f = np.int32, self._bn_module.get_function
        if low:
            fmt = formats_of("batch_norm_grad_sums", x=x, dy=dy)
            if fmt["x"] != fmt["dy"]:
                raise BackendError(f"cuda batch_norm_grad_sums: x ({x.dtype}) and dy ({dy.dtype}) must share a dtype")
            self._float32_arrays("batch_norm_grad_sums", mean=mean, var=var, sum_dy=sum_dy, sum_dy_xhat=sum_dy_xhat)
            self._low_module("bn", fmt["x"]).get_function("bn_grad_part_low")(
                (c, runs), (256,), (as_stored(x), as_stored(dy), mean, part, i32(x.shape[0]), i32(c), inner,
                                    i32(rows)))
        else:
            wide = inner % 4 == 0 and self._fits_float4(x, dy)
            f("bn_grad_part4" if wide else "bn_grad_part")(
                (c, runs), (256,), (x, dy, mean, part, i32(x.shape[0]), i32(c), i32(inner // 4 if wide else inner),
                                    i32(rows)))
        self._bn_combine("bn_grad_combine", c, runs, (part, var, sum_dy, sum_dy_xhat, i32(c), i32(runs),
                                                      np.float32(eps)))

    @staticmethod
    def _rows8(c: int, arrays: tuple, channels: tuple) -> bool:
        """Whether a per-element batch-norm pass over rows [M, C] may take the kernels of eight values a thread
        (kernels.py's bn_rows_*8): C a multiple of 8; the arrays of one dtype (float32, bfloat16 or float16),
        row-major and 16-byte aligned; the per-channel arrays (None: absent) float32, contiguous and aligned."""
        first = arrays[0]
        return bool(c % 8 == 0 and (first.dtype == np.float32 or is_low(first)) and all(
            a.dtype == first.dtype and a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays) and all(
            s is None or (s.dtype == np.float32 and s.flags.c_contiguous and s.data.ptr % 16 == 0) for s in channels))

    def _rows8_kernel(self, x: Any, name: str) -> Any:
        fmt = storage_format(x.dtype) if is_low(x) else None
        return (self._bn_module if fmt is None else self._low_module("bn", fmt)).get_function(name)

    def batch_norm(self, x, mean, var, gamma, beta, y, eps):
        if self._layout_of(x, y):  # per element, channel = index % C over rows [N * H * W, C]
            return self.batch_norm(self._rows(x), mean, var, gamma, beta, self._rows(y), eps)
        c, inner = self._bn_geometry(x)
        flags = np.int32((gamma is not None) | ((beta is not None) << 1))
        g, b = mean if gamma is None else gamma, mean if beta is None else beta
        low = is_low(x) or is_low(y)
        if low:
            self._float32_arrays("batch_norm", mean=mean, var=var, gamma=gamma, beta=beta)
        if inner == 1 and self._rows8(c, (x, y), (mean, var, gamma, beta)):
            self._rows8_kernel(x, "bn_rows_apply8")(((x.size // 8 + 255) // 256,), (256,), (
                as_stored(x), as_stored(y), mean, var, g, b, c, np.int64(x.size // 8), np.float32(eps), flags))
            return
        if low:
            self._typed(_BN_FORWARD, formats_of("batch_norm", x=x, y=y))(
                as_stored(x), mean, var, g, b, c, inner, np.float32(eps), flags, as_stored(y))
            return
        if inner % 4 == 0 and self._fits_float4(x, y):
            self._launch4(self._bn_module.get_function("bn_apply4"), (x, y),
                          (mean, var, g, b, c, np.int32(inner // 4), np.float32(eps), flags))
            return
        self._kernels["bn_forward"](x, mean, var, g, b, c, inner, self._scalar(eps), flags, y)

    def batch_norm_grad(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats):
        if self._layout_of(x, dy, dx):
            return self.batch_norm_grad(self._rows(x), self._rows(dy), mean, var, gamma, sum_dy, sum_dy_xhat,
                                        self._rows(dx), eps, batch_stats)
        c, inner = self._bn_geometry(x)
        flags = np.int32((gamma is not None) | (bool(batch_stats) << 2))
        g = mean if gamma is None else gamma
        low = is_low(x) or is_low(dy) or is_low(dx)
        if low:
            self._float32_arrays("batch_norm_grad", mean=mean, var=var, gamma=gamma, sum_dy=sum_dy,
                                 sum_dy_xhat=sum_dy_xhat)
        if inner == 1 and self._rows8(c, (x, dy, dx), (mean, var, gamma, sum_dy, sum_dy_xhat)):
            self._rows8_kernel(x, "bn_rows_backward8")(((x.size // 8 + 255) // 256,), (256,), (
                as_stored(x), as_stored(dy), as_stored(dx), mean, var, g, sum_dy, sum_dy_xhat, c,
                np.int64(x.size // 8), np.float32(eps), np.float32(int(c) / x.size), flags))
            return
        if low:
            self._typed(_BN_GRAD, formats_of("batch_norm_grad", x=x, dy=dy, dx=dx))(
                as_stored(x), as_stored(dy), mean, var, g, sum_dy, sum_dy_xhat, c, inner, np.float32(eps),
                np.float32(int(c) / x.size), flags, as_stored(dx))
            return
        if inner % 4 == 0 and self._fits_float4(x, dy, dx):
            self._launch4(self._bn_module.get_function("bn_backward4"), (x, dy, dx),
                          (mean, var, g, sum_dy, sum_dy_xhat, c, np.int32(inner // 4), np.float32(eps),
                           np.float32(int(c) / x.size), flags))
            return
        self._kernels["bn_grad"](x, dy, mean, var, g, sum_dy, sum_dy_xhat, c, inner, self._scalar(eps),
                                 self._scalar(int(c) / x.size), flags, dx)

    def dropout_mask(self, mask, ratio, seed):
        from ..array import DROPOUT_KEY_MULTIPLIER, dropout_threshold

        if is_low(mask):
            self._typed(_DROPOUT, formats_of("dropout_mask", mask=mask))(
                seed, np.uint32(DROPOUT_KEY_MULTIPLIER), np.uint32(dropout_threshold(ratio)),
                np.float32(1.0 / (1.0 - ratio)), as_stored(mask))
            return
        self._kernels["dropout"](seed, np.uint32(DROPOUT_KEY_MULTIPLIER), np.uint32(dropout_threshold(ratio)),
                                 self._scalar(1.0 / (1.0 - ratio)), mask)

    # --- pooling: one kernel per pass ---------------------------------------------------------------------------
    def _pool_args(self, x_shape, y_shape, kernel, stride, padding, is_max, pad_end=None, count_pad=True):
        n, c, h, w = x_shape
        oh, ow = y_shape[2], y_shape[3]
        total = n * c * oh * ow
        i32 = np.int32
        end = pad_end or padding
        bounds = (-padding[0], -padding[1], h + end[0], w + end[1]) if count_pad else (0, 0, h, w)
        return total, (i32(total), i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(kernel[0]), i32(kernel[1]),
                       i32(stride[0]), i32(stride[1]), i32(padding[0]), i32(padding[1]), i32(is_max),
                       *(i32(b) for b in bounds))

    def _pool_format(self, op: str, a: Any, b: Any) -> str | None:
        """The 16-bit format of a pooling pass's activations, None for float32 (a BackendError for a mix)."""
        if not (is_low(a) or is_low(b)):
            return None
        fa, fb = storage_format(a.dtype), storage_format(b.dtype)
        if fa != fb:
            raise BackendError(f"cuda {op}: input ({a.dtype}) and output ({b.dtype}) must share a dtype")
        return fa

    def _pool_kernel(self, name: str, fmt: str | None, channels_last: bool) -> Any:
        if fmt is None and not channels_last:
            return self._pool_module.get_function(name)
        return self._low_module("pool", fmt or "f32", channels_last).get_function(name)

    POOL_VECTORS = True
    """16-bit channels-last pooling with channels a multiple of 8 runs :data:`_POOL_SOURCE`'s 8-channel kernels
    (``pool_fwd8``, and ``pool_bwd8``, which gathers each input's gradient and writes it once)."""

    def _pool8(self, fmt: str | None, layout: bool, *arrays: Any) -> bool:
        """Whether a pooling pass over ``arrays`` (x or dx first) takes the 8-channel kernels."""
        return (self.POOL_VECTORS and fmt is not None and layout and arrays[0].shape[1] % 8 == 0
                and all(a.data.ptr % 16 == 0 for a in arrays if a is not None))

    def pool2d(self, x, out, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        fmt = self._pool_format("pool2d", x, out)
        if fmt is None and x.dtype != np.float32:
            return super().pool2d(x, out, mask, mode, kernel, stride, padding, pad_end, count_pad)
        layout = bool(self._layout_of(x, out, mask))  # a mix was converted (ONE_LAYOUT)
        total, args = self._pool_args(x.shape, out.shape, kernel, stride, padding, mode == "max", pad_end, count_pad)
        m = mask if mask is not None else out  # unused for average pooling
        name = "pool_fwd"
        if self._pool8(fmt, layout, x, out, mask):
            name, total, args = "pool_fwd8", total // 8, (np.int32(total // 8), np.int32(x.shape[1] // 8)) + args[2:]
        self._pool_kernel(name, fmt, layout)(((total + 255) // 256,), (256,), (as_stored(x), as_stored(out), m)
                                             + args)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        fmt = self._pool_format("pool2d_grad", dy, dx)
        if fmt is None and dy.dtype != np.float32:
            return super().pool2d_grad(dy, dx, mask, mode, kernel, stride, padding, pad_end, count_pad)
        layout = bool(self._layout_of(dy, dx, mask))
        total, args = self._pool_args(dx.shape, dy.shape, kernel, stride, padding, mode == "max", pad_end, count_pad)
        m = mask if mask is not None else dy
        if self._pool8(fmt, layout, dx, dy, mask):  # a thread per 8 channels of dx, gathering
            groups = dx.size // 8
            self._pool_kernel("pool_bwd8", fmt, layout)(((groups + 255) // 256,), (256,), (
                as_stored(dy), as_stored(dx), m, np.int32(groups), np.int32(dx.shape[1] // 8)) + args[2:])
            return
        # 16-bit gradients are added up in float32 scratch (in dx's memory order), then rounded once
        acc = dx if fmt is None else self.xp.empty_like(dx, dtype=np.float32)
        self._clear(acc)
        self._pool_kernel("pool_bwd", fmt, layout)(((total + 255) // 256,), (256,), (as_stored(dy), acc, m) + args)
        if acc is not dx:
            self.cast(acc, dx)

    # --- local response normalisation: one thread per element sums its window of channels ----------------------
    _LRN = ("raw T x, int32 c, int32 inner, int32 size, T a_over_n, T beta, T k", "T scale, T y",
            "int ch = (int)((i / inner) % c); long long base = i - (long long)ch * inner; int pre = (size - 1) / 2;"
            " int lo = max(ch - pre, 0), hi = min(ch - pre + size - 1, c - 1); T total = 0;"
            " for (int j = lo; j <= hi; ++j) { T v = x[base + (long long)j * inner]; total += v * v; }"
            " T s = k + a_over_n * total; scale = s; y = x[i] * pow(s, -beta)", "leafpy_lrn")
    _LRN_GRAD = ("raw T x, raw T y, raw T scale, raw T dy, int32 c, int32 inner, int32 size, T coef, T beta", "T dx",
                 "int ch = (int)((i / inner) % c); long long base = i - (long long)ch * inner;"
                 " int pre = (size - 1) / 2; int lo = max(ch - (size - 1 - pre), 0), hi = min(ch + pre, c - 1);"
                 " T total = 0;"
                 " for (int j = lo; j <= hi; ++j) { long long q = base + (long long)j * inner;"
                 " total += dy[q] * y[q] / scale[q]; }"
                 " dx = dy[i] * pow(scale[i], -beta) - coef * x[i] * total", "leafpy_lrn_grad")

    def _lrn_kernel(self, which: str) -> Any:
        kernel = self._kernels.get(which)
        if kernel is None:
            kernel = self._kernels[which] = self.xp.ElementwiseKernel(*getattr(self, "_" + which.upper()))
        return kernel

    @staticmethod
    def _lrn_geometry(x: Any) -> tuple[int, int]:
        c = x.shape[1]
        return c, x.size // max(x.shape[0] * c, 1)

    def lrn(self, x, scale, out, size, alpha, beta, k):
        if self._layout_of(x, scale, out):  # across channels: along rows [N * H * W, C]
            return self.lrn(self._rows(x), self._rows(scale), self._rows(out), size, alpha, beta, k)
        c, inner = self._lrn_geometry(x)
        s = self._scalar
        self._lrn_kernel("lrn")(x, c, inner, size, s(alpha / size), s(beta), s(k), scale, out)

    def lrn_grad(self, x, y, scale, dy, dx, size, alpha, beta):
        if self._layout_of(x, y, scale, dy, dx):
            return self.lrn_grad(*(self._rows(a) for a in (x, y, scale, dy, dx)), size, alpha, beta)
        c, inner = self._lrn_geometry(x)
        s = self._scalar
        self._lrn_kernel("lrn_grad")(x, y, scale, dy, c, inner, size, s(2.0 * alpha * beta / size), s(beta), dx)

    # --- convolution through cuDNN graphs -----------------------------------------------------------------------
    def _conv_formats(self, op: str, x: Any, w: Any, y: Any, bias: Any = None) -> tuple[str, ...]:
        """The operands' formats (x, w, y, bias) for cuDNN: all float32 unless one is 16-bit."""
        if not any(a is not None and is_low(a) for a in (x, w, y, bias)):
            return ("f32",) * 4
        if self._cudnn is None:
            raise BackendError(f"cuda {op}: bfloat16/float16 convolutions run in cuDNN graphs, which are unavailable "
                               "here; pip install nvidia-cudnn-frontend nvidia-cudnn-cu12 (or cast to float32)")
        arrays = {"x": x, "w": w, "y": y} | ({"bias": bias} if bias is not None else {})
        f = formats_of(op, **arrays)
        return f["x"], f["w"], f["y"], f.get("bias", "f32")

    PAD_CHANNELS = True
    """16-bit channels-last convolutions whose input has a number of channels that is not a multiple of 8 (an RGB
    batch's 3) run on copies of the input and filter padded with zero channels to one: cuDNN's tensor-core kernels
    read rows of 16 bytes and otherwise pad both themselves on every call, the input twice a step (forward pass and
    filter gradient). Here the forward pass pads the input once, in one kernel, and the filter gradient of the same
    input reuses that copy (kept in the layer's workspace). AlexNet-128 bf16 on an H100: cuDNN's padding took 0.22
    ms a step."""

    def _pads_channels(self, x: Any, groups: int, *others: Any) -> bool:
        """Whether a convolution of ``x`` (with ``others``, its filter or filter gradient) runs channel-padded."""
        return (self.PAD_CHANNELS and groups == 1 and x.shape[1] % 8 != 0 and is_low(x)
                and all(a.transpose(0, 2, 3, 1).flags.c_contiguous for a in (x, *others)))

    def _channel_padded(self, a: Any, ws: dict | None, key: str) -> Any:
        """``a`` (16-bit, NHWC memory seen as NCHW) with zero channels added up to a multiple of 8, in a buffer kept in
        ``ws`` under ``key`` (written anew by each call)."""
        n, c, h, w = a.shape
        c8 = -(-c // 8) * 8
        held = self._nhwc_scratch(ws, key, (n, c8, h, w), a.dtype)
        groups = n * h * w * (c8 // 8)
        if groups:
            self._pad_module.get_function("pad_channels")(
                ((groups + 255) // 256,), (256,), (as_stored(a), as_stored(held), np.int64(groups), np.int32(c),
                                                   np.int32(c8 // 8)))
        return held

    def _nhwc_scratch(self, ws: dict | None, key: str, shape: tuple, dtype: Any) -> Any:
        """An array of NCHW ``shape`` over NHWC memory, kept in ``ws`` under ``key`` while shape and dtype stay."""
        held = ws.get(key) if ws is not None else None
        if held is None or held.shape != shape or held.dtype != dtype:
            n, c, h, w = shape
            stored = np.uint16 if np.dtype(dtype).itemsize == 2 else dtype  # 16-bit floats allocated as their bits
            held = self.xp.empty((n, h, w, c), dtype=stored).transpose(0, 3, 1, 2).view(dtype)
            if ws is not None:
                ws[key] = held
        return held

    @functools.cached_property
    def _pad_module(self) -> Any:
        return self.xp.RawModule(code=PAD_CHANNELS_SOURCE)

    def conv2d(self, x, w, out, stride, padding, ws, bias=None, dilation=(1, 1), groups=1):
        fm = self._conv_formats("conv2d", x, w, out, bias)
        if self._cudnn is None:
            return super().conv2d(x, w, out, stride, padding, ws, bias, dilation, groups)
        if w.dtype == x.dtype and self._pads_channels(x, groups, w):
            if ws is not None:  # the filter gradient of this input finds its padded copy here
                ws["padded_input_of"] = _identity(x)
            x = self._channel_padded(x, ws, "padded_input")
            w = self._channel_padded(w, ws, "padded_filter")
        pads = geometry(x.shape, w.shape, out.shape, padding, stride, dilation)
        fuse = self.fuse_bias if self.fuse_bias is not None else fm != ("f32",) * 4
        if bias is not None and fuse and self._cudnn.run("fprop_bias", x.shape, w.shape, out.shape, stride, pads,
                                                         x, w, out, 0.0, bias, formats=fm):
            return
        self._cudnn.run("fprop", x.shape, w.shape, out.shape, stride, pads, x, w, out, 0.0, formats=fm)
        if bias is not None:
            self.bias_add(out, bias)

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws, dilation=(1, 1), groups=1):
        fm = self._conv_formats("conv2d_grad_data", dx, w, dy)
        if self._cudnn is None:
            return super().conv2d_grad_data(dy, w, dx, stride, padding, ws, dilation, groups)
        pads = geometry(dx.shape, w.shape, dy.shape, padding, stride, dilation)
        self._cudnn.run("dgrad", dx.shape, w.shape, dy.shape, stride, pads, dx, w, dy, 0.0, formats=fm)

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0, dilation=(1, 1), groups=1):
        fm = self._conv_formats("conv2d_grad_filter", x, dw, dy)
        if self._cudnn is None:
            return super().conv2d_grad_filter(x, dy, dw, stride, padding, ws, beta, dilation, groups)
        if self._pads_channels(x, groups, dw):
            return self._padded_grad_filter(x, dy, dw, stride, padding, ws, beta, dilation, fm)
        pads = geometry(x.shape, dw.shape, dy.shape, padding, stride, dilation)
        if groups > 1 and len(pads) == 3 and pads[0] != pads[1]:
            # cuDNN's grouped filter gradient is wrong with padding after unlike padding before (seen on an H100
            # and an H200, cuDNN 9), and channel slices of channels-last arrays are misaligned for it: the
            # gradient of the explicitly padded input, trimmed to the rows and columns the windows read, unpadded
            x = self._padded_window_input(x, dy.shape, dw.shape, stride, pads)
            pads = geometry(x.shape, dw.shape, dy.shape, (0, 0), stride, dilation)
        self._grad_filter(x, dy, dw, stride, pads, beta, fm)

    def _padded_grad_filter(self, x, dy, dw, stride, padding, ws, beta, dilation, fm) -> None:
        """The filter gradient of a convolution whose input is padded to 8-channel rows (PAD_CHANNELS): from the
        padded copy the forward pass made of this same input where the workspace holds it, into a gradient of
        the padded filter, whose first channels are dw's."""
        if ws is not None and ws.pop("padded_input_of", None) == _identity(x) and "padded_input" in ws:
            xp8 = ws["padded_input"]  # (used once: a second call, or one after x changed in place, pads anew)
        else:
            xp8 = self._channel_padded(x, None, "")
        k, c, kh, kw = dw.shape
        held = self._nhwc_scratch(ws, "padded_filter_grad", (k, xp8.shape[1], kh, kw), dw.dtype)
        pads = geometry(xp8.shape, held.shape, dy.shape, padding, stride, dilation)
        self._grad_filter(xp8, dy, held, stride, pads, 0.0, fm)
        if beta:
            self.axpby(1.0, held[:, :c], beta, dw)
        else:
            self.copy(held[:, :c], dw)

    def _padded_window_input(self, x, y_shape, w_shape, stride, pads) -> Any:
        """A copy of ``x`` with its zero padding written out (``pads``: geometry's before, after, dilation), cut to
        exactly what the windows of a ``y_shape`` output read, in x's memory order."""
        before, _, dilation = pads
        need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(y_shape[2:], stride, w_shape[2:], dilation)]
        n, c = x.shape[:2]
        src = as_stored(x)  # 16-bit values moved as their bits (zero bits are 0.0)
        if self._layout_of(x):
            out = self.xp.zeros((n, *need, c), dtype=src.dtype).transpose(0, 3, 1, 2)
        else:
            out = self.xp.zeros((n, c, *need), dtype=src.dtype)
        (bh, bw), (h, w) = before, x.shape[2:]
        hh, ww = min(h, need[0] - bh), min(w, need[1] - bw)
        if hh > 0 and ww > 0:
            out[:, :, bh:bh + hh, bw:bw + ww] = src[:, :, :hh, :ww]
        return out.view(x.dtype)

    def _grad_filter(self, x, dy, dw, stride, pads, beta, fm) -> None:
        conv = self._cudnn
        assert conv is not None  # (conv2d_grad_filter's caller checked)
        if fm != ("f32",) * 4:
            return self._low_grad_filter(conv, x, dy, dw, stride, pads, beta, fm)
        if beta:
            tmp = self.xp.empty_like(dw)
            conv.run("wgrad", x.shape, dw.shape, dy.shape, stride, pads, x, tmp, dy, 0.0)
            dw += tmp
        else:
            conv.run("wgrad", x.shape, dw.shape, dy.shape, stride, pads, x, dw, dy, 0.0)

    def _low_grad_filter(self, conv: _CudnnConv, x, dy, dw, stride, padding, beta, fm) -> None:
        """The filter gradient of 16-bit activations into ``dw``: written in dw's format by cuDNN (float32, as mixed
        precision keeps weight gradients), or in the activations' format and then converted — for float32 dw,
        whichever of the two ran faster on the first call for these shapes (cuDNN has few float32-output engines
        for 16-bit inputs: for AlexNet's conv2 on an H200 one plan, 3.5x slower than the 16-bit ones)."""
        cp, run = self.xp, conv.run
        low = (fm[0], fm[0], fm[2], "f32")
        shapes = (x.shape, dw.shape, dy.shape, stride, padding)
        key = (*shapes, fm)
        direct = fm[1] == "f32" and self._wgrad_direct.get(key, True)
        if direct:
            target = cp.empty_like(dw) if beta else dw
            direct = run("wgrad", *shapes, x, target, dy, 0.0, formats=fm, optional=True)
        tmp = None
        if key not in self._wgrad_direct:  # first call: time the other way too, keep the faster
            if direct:
                tmp = cp.empty_like(dw, dtype=x.dtype)
                run("wgrad", *shapes, x, tmp, dy, 0.0, formats=low)
                ms = (conv.plan_ms("wgrad", *shapes, fm, (_strides(x), _strides(target), _strides(dy))),
                      conv.plan_ms("wgrad", *shapes, low, (_strides(x), _strides(tmp), _strides(dy))))
                direct = ms[0] <= ms[1]
            self._wgrad_direct[key] = bool(direct)
        if direct:
            if beta:
                self.axpby(1.0, target, beta, dw)
            return
        if tmp is None:
            tmp = cp.empty_like(dw, dtype=x.dtype)  # dw's order: the conversion below runs over memory in order
            run("wgrad", *shapes, x, tmp, dy, 0.0, formats=low)
        if beta:
            self.axpby(1.0, tmp, beta, dw)
        else:
            self.cast(tmp, dw)

    # --- sequences: embeddings and recurrent cells, each one fused kernel ------------------------------------
    @functools.cached_property
    def _seq_kernels(self) -> dict:
        ek = self.xp.ElementwiseKernel
        row = "T f = ids[i / d]; int r = f >= (T)(v - 1) ? v - 1 : (f > (T)0 ? (int)f : 0);"  # NaN: row 0
        emit = (" h[i] = hv; if (t == 0) hprev[s0] = (T)0; if (t + 1 < steps) hprev[s0 + hs] = hv;"
                " if (seq) y[s0] = hv; else if (t + 1 == steps) y[i] = hv;")
        head = "int n = i / hs, j = i % hs; long long s0 = ((long long)n * steps + t) * hs + j;"
        dh = " T dh = dh_in[i]; if (seq) dh += dy[s0]; else if (t + 1 == steps) dh += dy[i];"
        return {
            "embedding": ek("raw T ids, raw T table, int32 d, int32 v", "T out",
                            row + " out = table[(long long)r * d + i % d]", "leafpy_embedding"),
            "embedding_grad": ek("raw T ids, T dy, int32 d, int32 v", "raw T dt",
                                 row + " atomicAdd(&dt[(long long)r * d + i % d], dy)", "leafpy_embedding_grad"),
            "lstm_cell": ek(
                "raw T hw, raw T bias, int32 steps, int32 hs, int32 t, int32 seq", "raw T a, raw T c, raw T h, "
                "raw T hprev, raw T y",
                head + " long long g = ((long long)n * steps + t) * 4 * hs + j;"
                " long long w = (long long)n * 4 * hs + j;"
                " T gi = (T)1 / ((T)1 + exp(-(a[g] + hw[w] + bias[j])));"
                " T gf = (T)1 / ((T)1 + exp(-(a[g + hs] + hw[w + hs] + bias[j + hs])));"
                " T gg = tanh(a[g + 2 * hs] + hw[w + 2 * hs] + bias[j + 2 * hs]);"
                " T go = (T)1 / ((T)1 + exp(-(a[g + 3 * hs] + hw[w + 3 * hs] + bias[j + 3 * hs])));"
                " a[g] = gi; a[g + hs] = gf; a[g + 2 * hs] = gg; a[g + 3 * hs] = go;"
                " T cn = gi * gg; if (t > 0) cn += gf * c[s0 - hs]; c[s0] = cn; T hv = go * tanh(cn);" + emit,
                "leafpy_lstm_cell"),
            "lstm_cell_grad": ek(
                "raw T a, raw T c, raw T dh_in, raw T dy, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T dc, raw T dg, raw T dgt",
                head + dh + " long long g = ((long long)n * steps + t) * 4 * hs + j;"
                " long long w = (long long)n * 4 * hs + j;"
                " T gi = a[g], gf = a[g + hs], gg = a[g + 2 * hs], go = a[g + 3 * hs]; T tc = tanh(c[s0]);"
                " T dct = dc[i] + dh * go * ((T)1 - tc * tc);"
                " T df = t > 0 ? dct * c[s0 - hs] * gf * ((T)1 - gf) : (T)0;"
                " T di = dct * gg * gi * ((T)1 - gi); T dgg = dct * gi * ((T)1 - gg * gg);"
                " T dgo = dh * tc * go * ((T)1 - go); dc[i] = dct * gf;"
                " dg[g] = dgt[w] = di; dg[g + hs] = dgt[w + hs] = df; dg[g + 2 * hs] = dgt[w + 2 * hs] = dgg;"
                " dg[g + 3 * hs] = dgt[w + 3 * hs] = dgo;", "leafpy_lstm_cell_grad"),
            "gru_cell": ek(
                "raw T hw, raw T bi, raw T bh, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T a, raw T hn, raw T h, raw T hprev, raw T y",
                head + " long long g = ((long long)n * steps + t) * 3 * hs + j;"
                " long long w = (long long)n * 3 * hs + j;"
                " T r = (T)1 / ((T)1 + exp(-(a[g] + bi[j] + hw[w] + bh[j])));"
                " T z = (T)1 / ((T)1 + exp(-(a[g + hs] + bi[j + hs] + hw[w + hs] + bh[j + hs])));"
                " T bn = hw[w + 2 * hs] + bh[j + 2 * hs]; T nv = tanh(a[g + 2 * hs] + bi[j + 2 * hs] + r * bn);"
                " a[g] = r; a[g + hs] = z; a[g + 2 * hs] = nv; hn[s0] = bn;"
                " T hp = t > 0 ? hprev[s0] : (T)0; T hv = ((T)1 - z) * nv + z * hp;" + emit, "leafpy_gru_cell"),
            "gru_cell_grad": ek(
                "raw T a, raw T hn, raw T hprev, raw T dy, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T dh_in, raw T dp, raw T dph, raw T dpht",
                head + dh + " long long g = ((long long)n * steps + t) * 3 * hs + j;"
                " long long w = (long long)n * 3 * hs + j; T r = a[g], z = a[g + hs], nv = a[g + 2 * hs];"
                " T dn = dh * ((T)1 - z) * ((T)1 - nv * nv); T dz = dh * (hprev[s0] - nv) * z * ((T)1 - z);"
                " T dr = dn * hn[s0] * r * ((T)1 - r); dh_in[i] = dh * z;"
                " dp[g] = dph[g] = dpht[w] = dr; dp[g + hs] = dph[g + hs] = dpht[w + hs] = dz;"
                " dp[g + 2 * hs] = dn; dph[g + 2 * hs] = dpht[w + 2 * hs] = dn * r;", "leafpy_gru_cell_grad"),
            "rnn_cell": ek(
                "raw T hw, raw T bias, int32 steps, int32 hs, int32 t, int32 seq", "raw T a, raw T h, raw T hprev, "
                "raw T y", head + " T hv = tanh(a[s0] + hw[i] + bias[j]); a[s0] = hv;" + emit, "leafpy_rnn_cell"),
            "rnn_cell_grad": ek(
                "raw T a, raw T dh_in, raw T dy, int32 steps, int32 hs, int32 t, int32 seq", "raw T dp, raw T dpt",
                head + dh + " T hv = a[s0]; T d = dh * ((T)1 - hv * hv); dp[s0] = d; dpt[i] = d;",
                "leafpy_rnn_cell_grad"),
        }

    def embedding(self, ids, table, out):
        v, d = table.shape
        self._seq_kernels["embedding"](ids, table, np.int32(d), np.int32(v), out)

    def embedding_grad(self, ids, dy, dtable, beta=0.0):
        if beta == 0.0:
            dtable.fill(0)
        elif beta != 1.0:
            dtable *= self._scalar(beta)
        v, d = dtable.shape
        self._seq_kernels["embedding_grad"](ids, dy, np.int32(d), np.int32(v), dtable)

    def _step_args(self, c, t, sequence) -> tuple:
        n, steps, hs = c.shape
        return (np.int32(steps), np.int32(hs), np.int32(t), np.int32(bool(sequence))), n * hs

    def lstm_cell(self, gates, hw, bias, c, h, hprev, y, t, sequence):
        args, size = self._step_args(c, t, sequence)
        self._seq_kernels["lstm_cell"](hw, bias, *args, gates, c, h, hprev, y, size=size)

    def lstm_cell_grad(self, gates, c, dh, dy, dc, dgates, dgates_t, t, sequence):
        args, size = self._step_args(c, t, sequence)
        self._seq_kernels["lstm_cell_grad"](gates, c, dh, dy, *args, dc, dgates, dgates_t, size=size)

    def gru_cell(self, pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence, w_hh=None):
        if w_hh is not None:  # the reset gate before the product: CuPy array operations, float32 and float64
            self._reset_first("gru_cell", pre)
            return super().gru_cell(pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence, w_hh)
        args, size = self._step_args(hn, t, sequence)
        self._seq_kernels["gru_cell"](hw, bias_ih, bias_hh, *args, pre, hn, h, hprev, y, size=size)

    def gru_cell_grad(self, pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence, w_hh=None):
        if w_hh is not None:
            self._reset_first("gru_cell_grad", pre)
            return super().gru_cell_grad(pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence, w_hh)
        args, size = self._step_args(hn, t, sequence)
        self._seq_kernels["gru_cell_grad"](pre, hn, hprev, dy, *args, dh, dpre, dpre_h, dpre_h_t, size=size)

    def _reset_first(self, name: str, a: Any) -> None:
        if a.dtype not in (np.float32, np.float64):
            raise BackendError(f"cuda {name}: a GRU with linear_before_reset false runs in float32 or float64, got "
                               f"{a.dtype}; use precision fp32 (or linear_before_reset true, PyTorch's GRU)")

    def rnn_cell(self, pre, hw, bias, h, hprev, y, t, sequence):
        args, size = self._step_args(pre, t, sequence)
        self._seq_kernels["rnn_cell"](hw, bias, *args, pre, h, hprev, y, size=size)

    def rnn_cell_grad(self, pre, dh, dy, dpre, dpre_t, t, sequence):
        args, size = self._step_args(pre, t, sequence)
        self._seq_kernels["rnn_cell_grad"](pre, dh, dy, *args, dpre, dpre_t, size=size)

