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

from typing import Any

import numpy as np

Buffer = Any
Pair = tuple[int, int]


class Backend:
    """Base class of every backend; subclasses implement every method below."""

    name: str = "base"
    key: str = "base"
    dtype: np.dtype = np.dtype(np.float32)

    # --- memory contract ------------------------------------------------------------------------------------
    def allocate(self, size: int, dtype: Any) -> Buffer:
        """A flat buffer of ``size`` elements of ``dtype`` (contents undefined)."""
        raise NotImplementedError

    def upload(self, host: np.ndarray, out: Buffer) -> None:
        """Copy a flat host array into a flat buffer of this backend."""
        raise NotImplementedError

    def download(self, buf: Buffer, host: np.ndarray) -> None:
        """Copy a flat buffer of this backend into a flat host array."""
        raise NotImplementedError

    def view(self, buf: Buffer, shape: tuple[int, ...]) -> Buffer:
        """The flat buffer seen with ``shape`` (no copy)."""
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

    def dot(self, x: Buffer, y: Buffer, out: Buffer) -> None:
        """``out[0] = sum(x * y)``."""
        raise NotImplementedError

    def nrm2(self, x: Buffer, out: Buffer) -> None:
        """``out[0] = sqrt(sum(x * x))``."""
        raise NotImplementedError

    def read_scalar(self, buf: Buffer) -> float:
        """The first element of ``buf`` as a Python float (reads back to the host)."""
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
        self.activation("relu", x, out)

    def relu_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy * (y > 0)`` from the output ``y`` (so it works in place)."""
        self.activation_grad("relu", y, dy, dx)

    def sigmoid(self, x: Buffer, out: Buffer) -> None:
        self.activation("sigmoid", x, out)

    def sigmoid_grad(self, y: Buffer, dy: Buffer, dx: Buffer) -> None:
        """``dx = dy * y * (1 - y)``."""
        self.activation_grad("sigmoid", y, dy, dx)

    def tanh(self, x: Buffer, out: Buffer) -> None:
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
    def nll(self, logp: Buffer, labels: Buffer, out: Buffer) -> None:
        """``out[0] = -mean_i logp[i, labels[i]]`` for ``logp`` of shape ``[N, C]`` and ``N`` labels."""
        raise NotImplementedError

    def nll_grad(self, labels: Buffer, dloss: Buffer, dx: Buffer) -> None:
        """``dx = 0; dx[i, labels[i]] = -dloss[0] / N``."""
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
               bias: Buffer | None = None) -> None:
        """Cross-correlation of NCHW ``x`` with ``w`` ``[O, C, kh, kw]`` into ``out`` ``[N, O, oh, ow]``, plus
        ``bias[o]`` on output channel o when given."""
        raise NotImplementedError

    def conv2d_grad_data(self, dy: Buffer, w: Buffer, dx: Buffer, stride: Pair, padding: Pair, ws: dict) -> None:
        """Gradient of :meth:`conv2d` w.r.t. its input, written into ``dx``."""
        raise NotImplementedError

    def conv2d_grad_filter(self, x: Buffer, dy: Buffer, dw: Buffer, stride: Pair, padding: Pair, ws: dict,
                           beta: float = 0.0) -> None:
        """Gradient of :meth:`conv2d` w.r.t. its filter: ``dw = grad + beta * dw``."""
        raise NotImplementedError

    def pool2d(self, x: Buffer, out: Buffer, mask: Buffer | None, mode: str, kernel: Pair, stride: Pair,
               padding: Pair) -> None:
        """Max or average pooling (average counts padding). Max pooling records argmax positions in ``mask``."""
        raise NotImplementedError

    def pool2d_grad(self, dy: Buffer, dx: Buffer, mask: Buffer | None, mode: str, kernel: Pair, stride: Pair,
                    padding: Pair) -> None:
        """Gradient of :meth:`pool2d` w.r.t. its input, written into ``dx``."""
        raise NotImplementedError

    # --- blocks along an axis (Concat, Slice) -----------------------------------------------------------------
    def copy_block(self, part: Buffer, whole: Buffer, part_inner: int, whole_inner: int, offset: int,
                   into_whole: bool) -> None:
        """Seeing ``part`` as [outer, part_inner] and ``whole`` as [outer, whole_inner]: copy ``part`` into
        ``whole[:, offset:offset + part_inner]`` (``into_whole``) or that block of ``whole`` into ``part``."""
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
    def dropout_mask(self, mask: Buffer, ratio: float, seed: int) -> None:
        """Fill ``mask`` with 0 (probability ``ratio``) or ``1 / (1 - ratio)``, reproducibly from ``seed``."""
        raise NotImplementedError

    # --- solver updates (the gradient buffer g may be used as scratch) ---------------------------------------
    def momentum_update(self, w: Buffer, g: Buffer, h: Buffer, lr: float, momentum: float) -> None:
        """``h = momentum * h + lr * g; w -= h``."""
        raise NotImplementedError

    def adam_update(self, w: Buffer, g: Buffer, m: Buffer, v: Buffer, lr: float, beta1: float, beta2: float,
                    eps: float) -> None:
        """``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²; w -= lr * m / (sqrt(v) + eps)`` (``lr`` bias-corrected)."""
        raise NotImplementedError

    def rmsprop_update(self, w: Buffer, g: Buffer, h: Buffer, lr: float, decay: float, eps: float) -> None:
        """``h = decay h + (1-decay) g²; w -= lr * g / (sqrt(h) + eps)``."""
        raise NotImplementedError

    def adagrad_update(self, w: Buffer, g: Buffer, h: Buffer, lr: float, eps: float) -> None:
        """``h += g²; w -= lr * g / (sqrt(h) + eps)``."""
        raise NotImplementedError

    def adadelta_update(self, w: Buffer, g: Buffer, h: Buffer, u: Buffer, lr: float, decay: float,
                        eps: float) -> None:
        """``h = decay h + (1-decay) g²; d = g sqrt((u + eps) / (h + eps)); u = decay u + (1-decay) d²;
        w -= lr * d``."""
        raise NotImplementedError

    # --- optional hooks (defaults suit every backend) -------------------------------------------------------
    def run_step(self, key: Any, step: Any) -> None:
        """Run ``step()``, a whole training step. A backend may record it the first times a ``key`` is seen and
        replay the recording afterwards (the key covers everything the step's launches depend on; None: the step
        must run as it is)."""
        step()

    def peak_memory(self) -> int:
        """Bytes of device memory held at the peak, where the backend can tell (0 otherwise)."""
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key} {self.dtype}>"


OPTIONAL_HOOKS = ("run_step", "peak_memory")
SHORTHANDS = ("relu", "relu_grad", "sigmoid", "sigmoid_grad", "tanh", "tanh_grad")
"""Methods written once here over a primitive (a backend may still override them)."""
PRIMITIVES = tuple(
    name for name, value in vars(Backend).items()
    if callable(value) and not name.startswith("_") and name not in OPTIONAL_HOOKS + SHORTHANDS
)
"""Every method a backend must implement (used by the signature-consistency test)."""
