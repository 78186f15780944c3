"""The backend interface: a small memory contract and a closed set of primitives.

Primitives read device buffers (as returned by :meth:`Backend.view`) and write into an ``out`` buffer. They
never allocate behind the caller's back except through a ``ws`` workspace (a dict that the calling layer owns and
keeps between calls) or the backend's own scratch for work that lives within one call (one buffer per use, grown
once and shared by every layer; on the CPU one set per thread, since one backend instance serves every thread),
and never see a SharedTensor. Layers call primitives only, so one layer file serves every backend.

Conventions: 2-D convolution and pooling take NCHW tensors and ``(h, w)`` pairs for kernel, stride and padding.
Softmax-like primitives work over axis 1 of an ``[N, C, ...]`` tensor. Reductions that produce a scalar write it
into a one-element buffer, so nothing is read back to the host inside a step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class Buffer(Protocol):
    """What code outside a backend may rely on in the backend's buffers (a NumPy or CuPy array, a webgpu view):
    a shape, an element count and a dtype. Everything else (indexing, reshaping, the memory itself) is the
    backend's own business, reached only through its primitives."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def size(self) -> int: ...

    @property
    def dtype(self) -> Any: ...


Pair = tuple[int, int]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""The precision settings of a backend: fp32 (exact float32), tf32 (float32 storage, tensor-core products on
inputs rounded to 10 mantissa bits where the device has them), bf16 and fp16 (activations and weight copies in
bfloat16 or float16, float32 master weights and accumulation)."""


def precision_dtype(precision: str, master: Any) -> np.dtype:
    """The activations' dtype under ``precision`` with master dtype ``master``."""
    if precision == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if precision == "fp16":
        return np.dtype(np.float16)
    return np.dtype(master)


def padding_end(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int = 1) -> int:
    """The zero padding after a spatial dimension of ``size`` that a window op with ``out`` outputs reads: the
    smallest that holds every window (0 where the windows end inside the input)."""
    return max(0, (out - 1) * stride + (kernel - 1) * dilation + 1 - size - pad)


def plain_conv(x_shape, w_shape, y_shape, stride, padding, dilation, groups) -> bool:
    """Whether a convolution is one the fast paths of every backend take: one group, no dilation, and every window
    inside the input padded symmetrically by ``padding``."""
    dims = zip(x_shape[2:], y_shape[2:], w_shape[2:], stride, padding)
    return groups == 1 and tuple(dilation) == (1, 1) and all((o - 1) * s + k <= size + 2 * p
                                                             for size, o, k, s, p in dims)


class Backend:
    """Base class of every backend; subclasses implement every method below."""

    name: str = "base"
    key: str = "base"
    dtype: np.dtype = np.dtype(np.float32)
    """The master dtype: weights, weight gradients and the solver's state."""
    precision: str = "fp32"
    """One of :data:`PRECISIONS`."""
    channels_last: bool = False
    """Whether 4-D tensors are laid out channels-last (NHWC) in this backend's buffers (see :meth:`memory_order`)."""
    CHANNELS_LAST_PRECISIONS: tuple[str, ...] = ()
    """The precisions whose 4-D tensors a backend stores channels-last unless told otherwise (``channels_last``
    None: the default where its measurements say it is faster)."""
    adapter_name: str = ""
    """The device a GPU backend runs on, as its driver names it ("" on the CPU)."""
    emulated: bool = False
    """Whether that device is a CPU emulation of a GPU (correct, but far slower than the native backend)."""

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype of activations, their gradients and the weight copies that GEMMs and convolutions read:
        bfloat16 or float16 under bf16 and fp16, else :attr:`dtype`."""
        return precision_dtype(self.precision, self.dtype)

    @property
    def mixed(self) -> bool:
        """Whether activations are stored in a lower precision than the master weights."""
        return self.compute_dtype != np.dtype(self.dtype)

    # --- memory contract ------------------------------------------------------------------------------------
    def allocate(self, size: int, dtype: Any) -> Buffer:
        """A flat buffer of ``size`` elements of ``dtype`` (contents undefined)."""
        raise NotImplementedError

    def upload(self, host: np.ndarray, out: Buffer) -> None:
        """Copy a flat host array into a flat buffer of this backend."""
        raise NotImplementedError

    def upload_batch(self, host: np.ndarray, out: Buffer) -> None:
        """:meth:`upload` of data that is replaced every step (a network's input batch, a tensor marked
        ``SharedTensor.streamed``): a backend may overlap the copy with the step still running on the device (cuda:
        pinned memory on a copy stream). ``host`` may be reused by the caller as soon as this returns."""
        self.upload(host, out)

    def download(self, buf: Buffer, host: np.ndarray) -> None:
        """Copy a flat buffer of this backend into a flat host array."""
        raise NotImplementedError

    def view(self, buf: Buffer, shape: tuple[int, ...]) -> Buffer:
        """The flat buffer seen with ``shape`` (no copy), in the memory order :meth:`memory_order` gives it."""
        raise NotImplementedError

    def memory_order(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """How this backend lays out a tensor of ``shape`` in its flat buffers: None for row-major (C order, the
        host's), else the permutation of the axes that is row-major in memory ((0, 2, 3, 1) for channels-last
        NCHW tensors). Buffers handed to primitives are always seen in the logical shape (strided where permuted);
        a SharedTensor converts at the edges: uploads, downloads, and aliases whose shapes are laid out apart."""
        return None

    def relayout(self, buf: Buffer, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        """Rewrite ``buf`` (holding a tensor of shape ``old``, laid out for it) so that it holds the same values, in
        row-major order, laid out for shape ``new`` (same size). Only backends with a :meth:`memory_order` that is
        not row-major need this."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all submitted work is done."""
        raise NotImplementedError

    # --- BLAS -----------------------------------------------------------------------------------------------
    def gemm(self, a: Buffer, trans_a: bool, b: Buffer, trans_b: bool, out: Buffer,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        """``out = alpha * op(a) @ op(b) + beta * out`` on 2-D buffers."""
        raise NotImplementedError

    def axpby(self, alpha: float, x: Buffer, beta: float, y: Buffer) -> None:
        """``y = alpha * x + beta * y``."""
        raise NotImplementedError

    def scal(self, alpha: float, x: Buffer) -> None:
        """``x *= alpha``."""
        raise NotImplementedError

    def copy(self, x: Buffer, out: Buffer) -> None:
        """``out = x`` (same number of elements)."""
        raise NotImplementedError

    def fill(self, value: float, out: Buffer) -> None:
        """Set every element of ``out`` to ``value``."""
        raise NotImplementedError

    def mul(self, x: Buffer, y: Buffer, out: Buffer) -> None:
        """Elementwise ``out = x * y``."""
        raise NotImplementedError

    def maximum(self, x: Buffer, y: Buffer, out: Buffer) -> None:
        """Elementwise ``out = max(x, y)``, infinities included, NaN where either is NaN; ``out`` may be ``x`` or
        ``y``."""
        raise NotImplementedError

    def dot(self, x: Buffer, y: Buffer, out: Buffer) -> None:
        """``out[0] = sum(x * y)``."""
        raise NotImplementedError

    # --- activations: the lines of pointwise.TABLE ---------------------------------------------------------------
    def activation(self, kind: str, x: Buffer, out: Buffer, params: tuple[float, ...] = ()) -> None:
        """``out = f(x)`` for the activation ``kind`` (a line of :data:`leafpy.backends.pointwise.TABLE`), with
        ``params`` in the order the line names them; ``out`` may be ``x``."""
        raise NotImplementedError

    def activation_grad(self, kind: str, src: Buffer, dy: Buffer, dx: Buffer, params: tuple[float, ...] = ()) -> None:
        """``dx = dy * f'`` for the activation ``kind``, from ``src``: its output y or its input x, whichever the
        line's gradient reads (``Pointwise.reads``); ``dx`` may be ``dy``."""
        raise NotImplementedError

    # shorthands (not primitives of their own)
    def relu(self, x: Buffer, out: Buffer) -> None:
        """``out = max(x, 0)``."""
        self.activation("relu", x, out)

    def relu_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy * (y > 0)`` from the output ``y`` (so it works in place)."""
        self.activation_grad("relu", y, dy, dx)

    def sigmoid(self, x: Buffer, out: Buffer) -> None:
        """``out = 1 / (1 + exp(-x))``."""
        self.activation("sigmoid", x, out)

    def sigmoid_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy * y * (1 - y)``."""
        self.activation_grad("sigmoid", y, dy, dx)

    def tanh(self, x: Buffer, out: Buffer) -> None:
        """``out = tanh(x)``."""
        self.activation("tanh", x, out)

    def tanh_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy * (1 - y * y)``."""
        self.activation_grad("tanh", y, dy, dx)

    def softmax(self, x: Buffer, out: Buffer) -> None:
        """Softmax over axis 1 of ``[N, C, ...]``, separately for each sample and position."""
        raise NotImplementedError

    def softmax_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = y * (dy - sum_c(dy * y))``."""
        raise NotImplementedError

    def log_softmax(self, x: Buffer, out: Buffer) -> None:
        """Log-softmax over axis 1 of ``[N, C, ...]``."""
        raise NotImplementedError

    def log_softmax_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy - exp(y) * sum_c(dy)``."""
        raise NotImplementedError

    # --- losses -------------------------------------------------------------------------------------------------
    def nll(self, logp: Buffer, labels: Buffer, out: Buffer, weight: tuple[float, ...] = (),
            ignore_index: int | None = None, reduction: str = "mean") -> None:
        """The negative log-likelihood of ``logp`` ``[N, C, d...]`` at ``labels`` ``[N, d...]`` (any shape of that
        size), each sample's ``-logp[i, labels[i]]`` weighted by ``weight[labels[i]]`` (all 1 when empty) and by 0
        where ``labels[i] == ignore_index``: ``out`` ``[1]`` the weighted mean (the sum over the sum of the
        weights), ``[1]`` their sum (reduction sum), or ``[N, d...]`` the losses themselves (none)."""
        raise NotImplementedError

    def nll_grad(self, labels: Buffer, dloss: Buffer, dx: Buffer, weight: tuple[float, ...] = (),
                 ignore_index: int | None = None, reduction: str = "mean") -> None:
        """``dx = 0; dx[i, labels[i]] = -w_i * dloss / s`` with the weights ``w_i`` of :meth:`nll`, ``s`` their sum
        (mean) or 1 (sum), and ``dloss`` per sample for reduction none."""
        raise NotImplementedError

    def mse(self, x: Buffer, t: Buffer, diff: Buffer, out: Buffer) -> None:
        """``diff = x - t; out[0] = mean(diff ** 2)``."""
        raise NotImplementedError

    def mse_grad(self, diff: Buffer, dloss: Buffer, dx: Buffer) -> None:
        """``dx = diff * 2 * dloss[0] / diff.size``."""
        raise NotImplementedError

    # --- bias ---------------------------------------------------------------------------------------------------
    def bias_add(self, y: Buffer, b: Buffer) -> None:
        """``y[:, c, ...] += b[c]`` in place."""
        raise NotImplementedError

    def bias_grad(self, dy: Buffer, db: Buffer, beta: float = 0.0) -> None:
        """``db = sum over all axes but 1 of dy + beta * db``."""
        raise NotImplementedError

    # --- batch normalisation: x is [N, C, ...], statistics per channel over N and the other axes -------------
    def batch_norm_stats(self, x: Buffer, mean: Buffer, var: Buffer) -> None:
        """``mean[c]`` and the biased variance ``var[c]`` of channel c of ``x``."""
        raise NotImplementedError

    def batch_norm(self, x: Buffer, mean: Buffer, var: Buffer, gamma: Buffer | None, beta: Buffer | None,
                   y: Buffer, eps: float) -> None:
        """``y = (x - mean[c]) / sqrt(var[c] + eps) * gamma[c] + beta[c]`` (no gamma: 1, no beta: 0)."""
        raise NotImplementedError

    def batch_norm_grad_sums(self, x: Buffer, dy: Buffer, mean: Buffer, var: Buffer, sum_dy: Buffer,
                             sum_dy_xhat: Buffer, eps: float) -> None:
        """Per channel: ``sum_dy = sum dy`` and ``sum_dy_xhat = sum dy * (x - mean) / sqrt(var + eps)``."""
        raise NotImplementedError

    def batch_norm_grad(self, x: Buffer, dy: Buffer, mean: Buffer, var: Buffer, gamma: Buffer | None,
                        sum_dy: Buffer, sum_dy_xhat: Buffer, dx: Buffer, eps: float, batch_stats: bool) -> None:
        """Gradient of :meth:`batch_norm` w.r.t. ``x``: ``a = gamma / sqrt(var + eps)``; with statistics of this
        batch (training) ``dx = a (dy - (sum_dy + xhat sum_dy_xhat) / m)``, m the values per channel; with fixed
        statistics ``dx = a dy``."""
        raise NotImplementedError

    # --- convolution and pooling ----------------------------------------------------------------------------
    def conv2d(self, x: Buffer, w: Buffer, out: Buffer, stride: Pair, padding: Pair, ws: dict,
               bias: Buffer | None = None, dilation: Pair = (1, 1), groups: int = 1) -> None:
        """Cross-correlation of NCHW ``x`` with ``w`` ``[O, C / groups, kh, kw]`` into ``out`` ``[N, O, oh, ow]``,
        plus ``bias[o]`` on output channel o when given. ``padding`` is the zero padding before each spatial
        dimension; the padding after it is whatever the output's size implies (:func:`padding_end`), so asymmetric
        padding needs no argument of its own. ``dilation``: the spacing of the filter's taps; ``groups``: channels
        split into that many groups, output group g reading input group g only (groups == C: depthwise)."""
        raise NotImplementedError

    def conv2d_grad_data(self, dy: Buffer, w: Buffer, dx: Buffer, stride: Pair, padding: Pair, ws: dict,
                         dilation: Pair = (1, 1), groups: int = 1) -> None:
        """Gradient of :meth:`conv2d` w.r.t. its input, written into ``dx``."""
        raise NotImplementedError

    def conv2d_grad_filter(self, x: Buffer, dy: Buffer, dw: Buffer, stride: Pair, padding: Pair, ws: dict,
                           beta: float = 0.0, dilation: Pair = (1, 1), groups: int = 1) -> None:
        """Gradient of :meth:`conv2d` w.r.t. its filter: ``dw = grad + beta * dw``."""
        raise NotImplementedError

    def pool2d(self, x: Buffer, out: Buffer, mask: Buffer | None, mode: str, kernel: Pair, stride: Pair,
               padding: Pair, pad_end: Pair | None = None, count_pad: bool = True) -> None:
        """Max or average pooling. Max pooling records argmax positions in ``mask``. Windows start at ``o * stride -
        padding``; each is clipped to the input (max) or, for average pooling, divided by the count of its positions
        inside ``[-padding, size + pad_end)`` (``count_pad``: Caffe's and PyTorch's count_include_pad) or inside the
        input only (not ``count_pad``); ``pad_end`` None: the same as ``padding``."""
        raise NotImplementedError

    def pool2d_grad(self, dy: Buffer, dx: Buffer, mask: Buffer | None, mode: str, kernel: Pair, stride: Pair,
                    padding: Pair, pad_end: Pair | None = None, count_pad: bool = True) -> None:
        """Gradient of :meth:`pool2d` w.r.t. its input, written into ``dx``."""
        raise NotImplementedError

    # --- blocks along an axis (Concat, Slice) -----------------------------------------------------------------
    def copy_block(self, part: Buffer, whole: Buffer, part_inner: int, whole_inner: int, offset: int,
                   into_whole: bool) -> None:
        """Seeing ``part`` as [outer, part_inner] and ``whole`` as [outer, whole_inner]: copy ``part`` into
        ``whole[:, offset:offset + part_inner]`` (``into_whole``) or that block of ``whole`` into ``part``."""
        raise NotImplementedError

    # --- axes: transposes, broadcasting, batched products (Transpose, Eltwise, MatMul) -------------------------
    def permute(self, x: Buffer, out: Buffer, perm: tuple[int, ...]) -> None:
        """``out = x`` with its axes taken in the order ``perm`` (NumPy's ``transpose``)."""
        raise NotImplementedError

    def broadcast(self, x: Buffer, out: Buffer) -> None:
        """``out`` filled with ``x`` repeated along the axes where it has size 1 or none (NumPy's broadcasting:
        shapes aligned at their last axes)."""
        raise NotImplementedError

    def reduce_to(self, x: Buffer, out: Buffer) -> None:
        """``out`` = the sum of ``x`` over the axes :meth:`broadcast` repeats ``out`` along (its gradient)."""
        raise NotImplementedError

    def matmul(self, a: Buffer, trans_a: bool, b: Buffer, trans_b: bool, out: Buffer) -> None:
        """``out = a @ b`` over stacks of matrices (NumPy's ``matmul`` of 2-D or more operands, the leading axes
        broadcast), ``a`` and ``b`` first transposed in their last two axes where asked."""
        raise NotImplementedError

    # --- local response normalisation (across channels) ------------------------------------------------------
    def lrn(self, x: Buffer, scale: Buffer, out: Buffer, size: int, alpha: float, beta: float, k: float) -> None:
        """Over [N, C, ...]: ``scale = k + alpha / size * sum of x**2 over the size channels centred on each
        channel`` (zero past the edges) and ``out = x * scale**-beta``, as Caffe's LRN across channels."""
        raise NotImplementedError

    def lrn_grad(self, x: Buffer, y: Buffer, scale: Buffer, dy: Buffer, dx: Buffer, size: int, alpha: float,
                 beta: float) -> None:
        """Gradient of :meth:`lrn`: ``dx = dy * scale**-beta - 2 alpha beta / size * x * (the window sum of
        dy * y / scale)``."""
        raise NotImplementedError

    # --- randomness -------------------------------------------------------------------------------------------
    def dropout_mask(self, mask: Buffer, ratio: float, seed: Buffer) -> None:
        """Fill ``mask`` with 0 (probability ``ratio``) or ``1 / (1 - ratio)``, reproducibly from the draw's seed,
        read on the device from ``seed`` (a one-element uint32 buffer written before the step, so a recorded step
        replays with a fresh mask): element i is kept when the murmur3 finaliser of ``i + seed * 0x9E3779B9``
        (32-bit arithmetic) is at least ``ratio * 2**32``, the same on every backend."""
        raise NotImplementedError

    # --- solver updates ---------------------------------------------------------------------------------------
    # ``rate`` is a two-element buffer ``[step rate, apply]``: the step's learning rate (Adam's with its bias
    # correction), written before the step so that a recorded step replays under any schedule, and 1 to apply the
    # update or 0 to skip it (written on the device by :meth:`loss_scale_update`; 1 without loss scaling). A
    # weight's rate is ``rate[0] * lr_mult`` (lr below). With ``rate[1] == 0`` an update writes nothing: weights and
    # history stay bit for bit as they were. The gradient buffer g may be used as scratch.
    def clip_to_norm(self, x: Buffer, sumsq: Buffer, threshold: float) -> None:
        """Gradient clipping on the device: with ``n = sqrt(sumsq[0])`` (the norm of all gradients), ``x *=
        threshold / n`` when ``n > threshold``; nothing comes back to the host, so a clipped step replays."""
        raise NotImplementedError

    def unscale(self, x: Buffer, scale: Buffer) -> None:
        """Loss scaling: ``x *= 1 / scale[0]``, the scale read on the device (the gradients of a loss whose gradient was
        multiplied by it), so a loss-scaled step replays while the scale changes."""
        raise NotImplementedError

    def sum_squares(self, xs: list[Buffer], out: Buffer, ws: dict, scale: Buffer | None = None) -> None:
        """``out[0]`` = the sum of the squares of every element of every buffer in ``xs`` (the gradients' squared
        norm: inf or nan where one of them is), added up on the device. With ``scale`` (loss scaling) each buffer is
        first unscaled in place, as :meth:`unscale` does. ``ws``: the caller's workspace, kept between calls. Written
        once here over unscale, dot and axpby (a launch or three per buffer); a backend may do it in one pass."""
        part = ws.get("sum_squares_part")
        if part is None or part.dtype != out.dtype:
            part = ws["sum_squares_part"] = self.allocate(1, out.dtype)
        self.fill(0.0, out)
        for x in xs:
            if scale is not None:
                self.unscale(x, scale)
            self.dot(x, x, part)
            self.axpby(1.0, part, 1.0, out)

    def loss_scale_update(self, sumsq: Buffer, scale: Buffer, counts: Buffer, rate: Buffer, growth_factor: float,
                          backoff_factor: float, growth_interval: int, dynamic: bool) -> None:
        """Loss scaling's decision after a step, on the device (one thread; nothing comes back to the host).
        ``sumsq[0]`` is the sum of squares of the unscaled gradients (inf or nan where any of them is), ``scale``
        ``[scale]``, ``counts`` ``[good steps, skipped steps]`` and ``rate`` the update's ``[step rate, apply]``.
        Finite: ``rate[1] = 1``; else ``rate[1] = 0`` and the skipped steps grow by one. ``dynamic`` (PyTorch's
        GradScaler): a skipped step multiplies the scale by ``backoff_factor`` and zeroes the good steps; a finite
        one counts a good step, and at ``growth_interval`` good steps the scale is multiplied by ``growth_factor``
        (unless that overflows: then it stays) and the good steps restart from 0. Not ``dynamic`` (a static scale):
        the scale and the good steps stay. The counts are floats, exact up to 2**24."""
        raise NotImplementedError

    def solver_update(self, kind: str, w: Buffer, g: Buffer, rate: Buffer, lr_mult: float,
                      params: tuple[float, ...] = (), s1: Buffer | None = None, s2: Buffer | None = None,
                      s3: Buffer | None = None, copy: Buffer | None = None) -> None:
        """The update rule ``kind`` (a line of :data:`leafpy.backends.updates.TABLE`) over the weight ``w``, its
        gradient ``g`` and the rule's state buffers ``s1``, ``s2``, ``s3`` (as many as the line has, in its order),
        with its hyper-parameters ``params`` (in the line's order): fused where the backend can, generated from
        the line's formula on every backend. ``copy``: a bfloat16/float16 buffer of w's shape that takes the
        updated weight rounded (its compute copy under mixed precision), as ``cast(w, copy)`` after the update
        would, and like w left as it is where the step is skipped."""
        raise NotImplementedError

    # the named rules: the lines of updates.TABLE that Caffe's solvers run, written once here over solver_update
    def momentum_update(self, w: Buffer, g: Buffer, h: Buffer, rate: Buffer, lr_mult: float, momentum: float) -> None:
        """``h = momentum * h + lr * g; w -= h``."""
        self.solver_update("momentum", w, g, rate, lr_mult, (momentum,), h)

    def nesterov_update(self, w: Buffer, g: Buffer, h: Buffer, prev: Buffer, rate: Buffer, lr_mult: float,
                        momentum: float) -> None:
        """``prev = h; h = momentum * h + lr * g; w -= (1 + momentum) * h - momentum * prev``."""
        self.solver_update("nesterov", w, g, rate, lr_mult, (momentum,), h, prev)

    def adam_update(self, w: Buffer, g: Buffer, m: Buffer, v: Buffer, rate: Buffer, lr_mult: float, beta1: float,
                    beta2: float, eps: float, decay: float = 0.0) -> None:
        """``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²; w -= lr * m / (sqrt(v) + eps)`` (``lr`` bias-corrected);
        with ``decay`` (AdamW) first ``w *= 1 - rate[2] * lr_mult * decay`` (the policy's rate, uncorrected)."""
        if decay:
            self.solver_update("adamw", w, g, rate, lr_mult, (beta1, beta2, eps, decay), m, v)
        else:
            self.solver_update("adam", w, g, rate, lr_mult, (beta1, beta2, eps), m, v)

    def rmsprop_update(self, w: Buffer, g: Buffer, h: Buffer, rate: Buffer, lr_mult: float, decay: float,
                       eps: float) -> None:
        """``h = decay h + (1-decay) g²; w -= lr * g / (sqrt(h) + eps)``."""
        self.solver_update("rmsprop", w, g, rate, lr_mult, (decay, eps), h)

    def adagrad_update(self, w: Buffer, g: Buffer, h: Buffer, rate: Buffer, lr_mult: float, eps: float) -> None:
        """``h += g²; w -= lr * g / (sqrt(h) + eps)``."""
        self.solver_update("adagrad", w, g, rate, lr_mult, (eps,), h)

    def adadelta_update(self, w: Buffer, g: Buffer, h: Buffer, u: Buffer, rate: Buffer, lr_mult: float,
                        decay: float, eps: float) -> None:
        """``h = decay h + (1-decay) g²; d = g sqrt((u + eps) / (h + eps)); u = decay u + (1-decay) d²;
        w -= lr * d``."""
        self.solver_update("adadelta", w, g, rate, lr_mult, (decay, eps), h, u)

    # --- sequences: embeddings and recurrent cells --------------------------------------------------------------
    # Ids are integers stored as floats. A recurrent layer over N sequences of T steps (hidden size H) keeps its
    # per-sequence tensors batch-first ([N, T, ...]) and runs one cell primitive per step, in order; step t reads
    # step t - 1's results from those tensors, so nothing but the cells' own outputs travels between steps.
    def embedding(self, ids: Buffer, table: Buffer, out: Buffer) -> None:
        """``out[m] = table[ids[m]]`` for ``ids`` [M], ``table`` [V, D] and ``out`` [M, D]; an id outside [0, V)
        reads the nearest row (clamped: nothing is read or written out of bounds)."""
        raise NotImplementedError

    def embedding_grad(self, ids: Buffer, dy: Buffer, dtable: Buffer, beta: float = 0.0) -> None:
        """``dtable = beta * dtable``, then ``dtable[ids[m]] += dy[m]`` for every m (repeated ids add up; ids
        clamped as in :meth:`embedding`)."""
        raise NotImplementedError

    def lstm_cell(self, gates: Buffer, hw: Buffer, bias: Buffer, c: Buffer, h: Buffer, hprev: Buffer, y: Buffer,
                  t: int, sequence: bool) -> None:
        """Step t of an LSTM (PyTorch's gates i, f, g, o). ``gates`` [N, T, 4H]: at step t the input projection
        x_t W_ihᵀ in, the activated gates out (``a = gates[:, t] + hw + bias``; i, f, o = sigmoid, g = tanh);
        ``hw`` [N, 4H]: h_{t-1} W_hhᵀ; ``c`` [N, T, H]: ``c_t = f c_{t-1} + i g`` (c_{-1} = 0);
        ``h`` [N, H]: ``h_t = o tanh(c_t)``; ``hprev`` [N, T, H]: h_{t-1} at step t (zero at step 0: written at
        steps 0 and t + 1); ``y``: h_t into [N, T, H] at step t (``sequence``) or into [N, H] at the last step."""
        raise NotImplementedError

    def lstm_cell_grad(self, gates: Buffer, c: Buffer, dh: Buffer, dy: Buffer, dc: Buffer, dgates: Buffer,
                       dgates_t: Buffer, t: int, sequence: bool) -> None:
        """Gradient of step t of :meth:`lstm_cell`, run from the last step down to 0. ``dh`` [N, H]: dL/dh_t from
        step t + 1 in (zero at the last step; used as scratch), to which ``dy``'s share is added (step t of
        [N, T, H] with ``sequence``, else all of [N, H] at the last step); ``dc`` [N, H]: dL/dc_t from step t + 1 in
        (zero at the last step), dL/dc_{t-1} out; the pre-activation gate gradients of step t into ``dgates``
        [N, T, 4H] at t and ``dgates_t`` [N, 4H]."""
        raise NotImplementedError

    def rnn_cell(self, pre: Buffer, hw: Buffer, bias: Buffer, h: Buffer, hprev: Buffer, y: Buffer, t: int,
                 sequence: bool) -> None:
        """Step t of a tanh RNN: ``h_t = tanh(pre[:, t] + hw + bias)`` for ``pre`` [N, T, H] (x_t W_ihᵀ in, h_t
        out at step t), ``hw`` [N, H] = h_{t-1} W_hhᵀ, bias [H]; ``h``, ``hprev`` and ``y`` as in :meth:`lstm_cell`."""
        raise NotImplementedError

    def rnn_cell_grad(self, pre: Buffer, dh: Buffer, dy: Buffer, dpre: Buffer, dpre_t: Buffer, t: int,
                      sequence: bool) -> None:
        """Gradient of step t of :meth:`rnn_cell`: ``dpre[:, t] = dpre_t = (dh + dy's share) * (1 - h_t²)`` with
        h_t = ``pre[:, t]``; ``dh`` and ``dy`` as in :meth:`lstm_cell_grad`."""
        raise NotImplementedError

    def gru_cell(self, pre: Buffer, hw: Buffer, bias_ih: Buffer, bias_hh: Buffer, hn: Buffer, h: Buffer,
                 hprev: Buffer, y: Buffer, t: int, sequence: bool, w_hh: Buffer | None = None) -> None:
        """Step t of a GRU (PyTorch's gates r, z, n). ``pre`` [N, T, 3H]: x_t W_ihᵀ in, the activated r, z, n out;
        ``hw`` [N, 3H]: h_{t-1} W_hhᵀ; with ``a = pre[:, t] + bias_ih`` and ``b = hw + bias_hh``: r, z =
        sigmoid(a + b) of their thirds, ``n = tanh(a_n + r b_n)``, ``h_t = (1 - z) n + z h_{t-1}`` (h_{t-1} read
        from ``hprev``, zero at step 0); ``hn`` [N, T, H]: b_n at step t (for the gradient); ``h``, ``hprev`` and
        ``y`` as in :meth:`lstm_cell`. With ``w_hh`` [3H, H] given, the reset gate applies before the product
        (ONNX's default linear_before_reset=0): ``n = tanh(a_n + (r h_{t-1}) W_hnᵀ + bias_hh_n)``, W_hn the last
        H rows of ``w_hh`` (``hw``'s n third is not read), and ``hn`` holds ``r h_{t-1}``."""
        raise NotImplementedError

    def gru_cell_grad(self, pre: Buffer, hn: Buffer, hprev: Buffer, dh: Buffer, dy: Buffer, dpre: Buffer,
                      dpre_h: Buffer, dpre_h_t: Buffer, t: int, sequence: bool, w_hh: Buffer | None = None) -> None:
        """Gradient of step t of :meth:`gru_cell`, run from the last step down to 0: ``dh`` [N, H] holds dL/dh_t
        (from step t + 1; ``dy``'s share is added as in :meth:`lstm_cell_grad`) and gets its direct share of
        dL/dh_{t-1}, ``dh z`` (the caller adds the recurrent product's); the gradients of ``a`` (the input side)
        into ``dpre`` [N, T, 3H] at t, of ``b`` (the hidden side) into ``dpre_h`` [N, T, 3H] at t and
        ``dpre_h_t`` [N, 3H]. With ``w_hh`` (see :meth:`gru_cell`): the n third of ``dpre_h`` and ``dpre_h_t`` is
        zero (W_hn's gradient is dpre's n third by ``hn``, the caller's), and ``dh`` gets ``dh z + r (dn W_hn)``."""
        raise NotImplementedError

    # --- optional hooks (defaults suit every backend) -------------------------------------------------------
    def cast(self, x: Buffer, out: Buffer) -> None:
        """``out = x`` converted to ``out``'s dtype (rounded to nearest even), same number of elements: the
        low-precision copies of fp32 master weights, and the network's output into the fp32 objective. A backend
        whose buffers are all of one dtype needs no more than this copy."""
        if np.dtype(x.dtype) != np.dtype(out.dtype):
            from ..errors import BackendError

            raise BackendError(f"backend '{self.name}': cannot convert {x.dtype} to {out.dtype} (its buffers hold "
                               f"{np.dtype(self.dtype)} only); give it {np.dtype(self.dtype)} tensors")
        self.copy(x, out)

    def full_precision(self) -> Backend:
        """This backend, or a twin on the same device, whose activations are in the master dtype (losses and
        softmax run there under bf16 and fp16)."""
        return self

    def arrange(self, groups: Sequence[Sequence[Any]]) -> None:
        """A solver's hint, given when it is made and when its network's weights change (never while a step is
        recorded): each group's SharedTensors (its weights, the gradients its updates read, each history buffer of
        theirs) are updated together, elementwise, in this order. A backend may lay each group's copies out one
        after another, their values kept (the native backend does; see :meth:`span`). By default nothing changes."""

    def span(self, buffers: Sequence[Buffer]) -> Buffer | None:
        """One flat buffer over ``buffers`` where they lie one after another, in order, in one allocation (as
        :meth:`arrange` may lay them out), so that elementwise work over all of them can be one call; None where
        they do not (the default)."""
        return None

    def run_step(self, key: Any, step: Any) -> None:
        """Run ``step()``, a whole training step. A backend may record it the first times a ``key`` is seen and
        replay the recording afterwards (the key covers everything the step's launches depend on; None: the step
        must run as it is)."""
        step()

    def peak_memory(self) -> int:
        """Bytes of device memory held at the peak, where the backend can tell (0 otherwise)."""
        return 0

    def __repr__(self) -> str:
        mode = "" if self.precision == "fp32" else f" {self.precision}"
        return f"<{type(self).__name__} {self.key} {self.dtype}{mode}>"


OPTIONAL_HOOKS = ("run_step", "peak_memory", "cast", "full_precision", "memory_order", "relayout", "upload_batch",
                  "arrange", "span")
UPDATE_SHORTHANDS = ("momentum_update", "nesterov_update", "adam_update", "rmsprop_update", "adagrad_update",
                     "adadelta_update")
SHORTHANDS = ("relu", "relu_grad", "sigmoid", "sigmoid_grad", "tanh", "tanh_grad", "sum_squares",
              *UPDATE_SHORTHANDS)
"""Methods written once here over a primitive (a backend may still override them)."""
PRIMITIVES = tuple(
    name for name, value in vars(Backend).items()
    if callable(value) and not name.startswith("_") and name not in OPTIONAL_HOOKS + SHORTHANDS
)
"""Every method a backend must implement (used by the signature-consistency test)."""

MEMORY = ("allocate", "upload", "download", "view", "synchronize")
"""The memory contract: never emulated in another precision."""

Writes = tuple[str, ...] | Callable[[dict[str, Any]], tuple[str, ...]]

WRITES: dict[str, Writes] = {
    "gemm": ("out",), "axpby": ("y",), "scal": ("x",), "copy": ("out",), "fill": ("out",), "mul": ("out",),
    "maximum": ("out",), "dot": ("out",),
    "activation": ("out",), "activation_grad": ("dx",),
    "relu": ("out",), "sigmoid": ("out",), "tanh": ("out",),
    "relu_grad": ("dx",), "sigmoid_grad": ("dx",), "tanh_grad": ("dx",),
    "softmax": ("out",), "softmax_grad": ("dx",), "log_softmax": ("out",), "log_softmax_grad": ("dx",),
    "nll": ("out",), "nll_grad": ("dx",), "mse": ("diff", "out"), "mse_grad": ("dx",),
    "bias_add": ("y",), "bias_grad": ("db",),
    "batch_norm_stats": ("mean", "var"), "batch_norm": ("y",),
    "batch_norm_grad_sums": ("sum_dy", "sum_dy_xhat"), "batch_norm_grad": ("dx",),
    "conv2d": ("out",), "conv2d_grad_data": ("dx",), "conv2d_grad_filter": ("dw",),
    "pool2d": ("out", "mask"), "pool2d_grad": ("dx",),
    "copy_block": lambda args: ("whole",) if args["into_whole"] else ("part",),
    "permute": ("out",), "broadcast": ("out",), "reduce_to": ("out",), "matmul": ("out",),
    "lrn": ("scale", "out"), "lrn_grad": ("dx",),
    "dropout_mask": ("mask",),
    "clip_to_norm": ("x",),
    "unscale": ("x",), "loss_scale_update": ("scale", "counts", "rate"),
    "sum_squares": lambda args: ("out", "xs") if args.get("scale") is not None else ("out",),
    # the gradient may serve the updates as scratch; a rule writes w and every state buffer it has
    "solver_update": lambda args: ("w", "g", *(s for s in ("s1", "s2", "s3", "copy") if args.get(s) is not None)),
    "momentum_update": ("w", "g", "h"), "nesterov_update": ("w", "g", "h", "prev"),
    "adam_update": ("w", "g", "m", "v"), "rmsprop_update": ("w", "g", "h"), "adagrad_update": ("w", "g", "h"),
    "adadelta_update": ("w", "g", "h", "u"),
    "embedding": ("out",), "embedding_grad": ("dtable",),
    "lstm_cell": ("gates", "c", "h", "hprev", "y"), "lstm_cell_grad": ("dh", "dc", "dgates", "dgates_t"),
    "rnn_cell": ("pre", "h", "hprev", "y"), "rnn_cell_grad": ("dh", "dpre", "dpre_t"),
    "gru_cell": ("pre", "hn", "h", "hprev", "y"), "gru_cell_grad": ("dh", "dpre", "dpre_h", "dpre_h_t"),
}
"""The operands each primitive writes, by parameter name (a function of the call's arguments where that depends on
them): what a backend that runs a primitive on converted copies of its operands (bf16/fp16 on float32 kernels)
converts back afterwards. Every primitive but the memory contract has an entry (a test checks it against the
signatures)."""


def written(name: str, arguments: dict[str, Any]) -> tuple[str, ...]:
    """The parameters primitive ``name`` writes in a call with these (bound) arguments."""
    entry = WRITES[name]
    return entry(arguments) if callable(entry) else entry


NARROW_OPERANDS: dict[str, tuple[str, ...]] = {"solver_update": ("copy",)}
"""Operands that a primitive takes in bfloat16/float16 on every backend (its 16-bit copy of a result, written by
the backend's cast or by the primitive's own kernel): an emulation never widens them."""


def emulated(name: str, method: Callable, is_low: Callable[[Any], bool],
             widen: Callable[[dict[str, Any]], dict[str, Any]], narrow: Callable[[Any, Any], None],
             context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Callable:
    """Primitive ``name`` (``method``) run on wider copies of its low-precision operands: a call with no operand
    that ``is_low`` runs as it is, without binding its arguments; otherwise ``widen`` makes copies of those operands
    (by parameter name), the method runs on them and ``narrow(copy, operand)`` writes back the ones it writes
    (:data:`WRITES`), both inside ``context()``. Operands of :data:`NARROW_OPERANDS` stay as they are."""
    signature = inspect.signature(method)
    narrow_ones = NARROW_OPERANDS.get(name, ())
    # each operand by name: the parameters' names in order where every one may be given by keyword (every
    # primitive's), else inspect's binding (35 us a call against 2: a bf16 LeNet step makes about a hundred calls)
    params = signature.parameters.values()
    names = tuple(p.name for p in params) if all(
        p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params) else None

    def arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
        if names is None or len(args) > len(names) or any(k in kwargs for k in names[:len(args)]):
            return dict(signature.bind(*args, **kwargs).arguments)  # (its error for a wrong call, too)
        return {**dict(zip(names, args)), **kwargs}

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not any(is_low(a) for a in (*args, *kwargs.values())):
            return method(*args, **kwargs)
        given = arguments(args, kwargs)
        low = {k: a for k, a in given.items() if is_low(a) and k not in narrow_ones}
        if not low:
            return method(*args, **kwargs)
        copies = widen(low)
        with context():
            result = method(**{**given, **copies})
            for k in written(name, given):
                if k in low:
                    narrow(copies[k], low[k])
        return result

    return run
