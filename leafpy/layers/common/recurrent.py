"""LSTM, GRU and RNN over batch-first sequences [N, T, input_size], with PyTorch's formulas and weight layouts.

LSTM (gates i, f, g, o, in PyTorch's order): ``a = x_t W_ihᵀ + h_{t-1} W_hhᵀ + b``; i, f, o = sigmoid, g = tanh of
their quarter of ``a``; ``c_t = f c_{t-1} + i g``; ``h_t = o tanh(c_t)``. GRU (gates r, z, n): with
``a = x_t W_ihᵀ + b_ih`` and ``b = h_{t-1} W_hhᵀ + b_hh``, r, z = sigmoid(a + b) of their thirds,
``n = tanh(a_n + r b_n)``, ``h_t = (1 - z) n + z h_{t-1}``. RNN: ``h_t = tanh(x_t W_ihᵀ + h_{t-1} W_hhᵀ + b)``.
The state starts at zero. Weights: ``weight_ih`` [G·H, input_size], ``weight_hh`` [G·H, H] (G = 4 for the LSTM, 3
for the GRU, 1 for the RNN); the LSTM and the RNN have one ``bias`` [G·H], PyTorch's ``b_ih + b_hh`` (which
always appear summed there), the GRU PyTorch's two, ``bias_ih`` and ``bias_hh`` [3H]. ``return_sequences``:
output every step's h [N, T, H] (true, the default) or the last one [N, H]. GRU ``linear_before_reset: false``
(ONNX's default GRU; true, PyTorch's, is the default here): ``n = tanh(a_n + (r h_{t-1}) W_hnᵀ + b_hn)``, the reset
gate applied before the product, which then is one more GEMM per step (its gradient too).
``return_cell_state`` (LSTM only): a second output, the last step's cell state c [N, H] (ONNX's Y_c). One layer is
one recurrent layer; stack them in the network for more (with Dropout between if wanted).

How it runs: one GEMM projects the whole sequence's inputs ([N·T, input_size] by weight_ihᵀ); then each step is
one GEMM for h_{t-1} W_hhᵀ and one fused cell primitive. Backward runs through time with one GEMM and one cell
gradient per step, then the weight gradients and the input gradient are one GEMM each over the whole sequence.
Every buffer is allocated once per shape, and no step reads anything back to the host, so steps replay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class LSTMConfig:
    hidden_size: int
    return_sequences: bool = True
    return_cell_state: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.return_cell_state, bool) or (self.return_cell_state and name != "LSTMConfig"):
            raise _checks.ConfigError(f"{name}.return_cell_state: expected true (a second output: the last cell "
                                      f"state, LSTM only) or false, got {self.return_cell_state!r}")
        object.__setattr__(self, "hidden_size", _checks.positive_int(f"{name}.hidden_size", self.hidden_size))
        if not isinstance(self.return_sequences, bool):
            raise _checks.ConfigError(f"{name}.return_sequences: expected true (every step's output) or false "
                                      f"(the last step's), got {self.return_sequences!r}")


@dataclass(frozen=True, kw_only=True)
class RNNConfig(LSTMConfig):
    pass


@dataclass(frozen=True, kw_only=True)
class GRUConfig(LSTMConfig):
    linear_before_reset: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.linear_before_reset, bool):
            raise _checks.ConfigError(f"GRUConfig.linear_before_reset: expected true (PyTorch's GRU: n = tanh(a_n + "
                                      f"r (h W_hnᵀ + b_hn))) or false (ONNX's default: n = tanh(a_n + (r h) W_hnᵀ + "
                                      f"b_hn)), got {self.linear_before_reset!r}")


class _Recurrent(Worker):
    weight_names: tuple[str, ...] = ("weight_ih", "weight_hh", "bias")
    gates = 1
    hidden_grads = "dpre"
    """The workspace of pre-activation gradients whose product with h_{t-1} is weight_hh's gradient."""
    direct_share = 0.0
    """1 where the cell adds its own share of dL/dh_{t-1} to dh before the recurrent product is added."""

    def __init__(self, config: LSTMConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.num_outputs = 2 if config.return_cell_state else 1
        self._bufs: dict = {}
        self._w_hh = None
        self._grads_fresh = False

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        shape = tuple(input_shapes[0])
        if len(shape) != 3 or 0 in shape:
            raise ShapeError(f"{self.where}: expected a batch-first sequence [N, T, input_size], got {shape}; a "
                             "single feature per step is [N, T, 1] (a Reshape layer can make it)")

    def output_shapes(self, input_shapes):
        n, t, _ = input_shapes[0]
        h = self.config.hidden_size
        return [(n, t, h) if self.config.return_sequences else (n, h)] + [(n, h)] * (self.num_outputs - 1)

    def weight_shapes(self, input_shapes):
        h, g = self.config.hidden_size, self.gates
        return [(g * h, input_shapes[0][2]), (g * h, h)] + [(g * h,)] * (len(self.weight_names) - 2)

    def _buf(self, backend, name: str, shape: tuple[int, ...]):
        """A workspace of this layer, allocated once per shape."""
        b = self._bufs.get(name)
        if b is None or b.shape != shape:
            b = self._bufs[name] = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)
        return b

    def _shapes(self, x):
        n, t, d = x.shape
        return n, t, d, self.config.hidden_size, self.gates * self.config.hidden_size

    def forward(self, backend, x, w, y):
        n, t, d, h, gh = self._shapes(x[0])
        pre = self._buf(backend, "pre", (n, t, gh))
        hprev = self._buf(backend, "hprev", (n, t, h))
        hw = self._buf(backend, "hw", (n, gh))
        ht = self._buf(backend, "h", (n, h))
        self._w_hh = w[1]  # the backward pass through time multiplies by the weights this pass used
        backend.gemm(x[0].reshape(n * t, d), False, w[0], True, pre.reshape(n * t, gh))
        for step in range(t):
            if step == 0:
                backend.fill(0.0, hw)
            else:
                backend.gemm(ht, False, w[1], True, hw)
            self._cell(backend, pre, hw, w[2:], ht, hprev, y[0], step)
        if len(y) > 1:  # the last cell state: c[:, T - 1]
            backend.copy_block(y[1], self._bufs["c"], h, t * h, (t - 1) * h, False)
        self._grads_fresh = False

    def _through_time(self, backend, dy: list) -> None:
        """dL/d(pre-activations) of every step into the workspace "dpre" [N, T, G·H]."""
        pre = self._bufs["pre"]
        n, t, gh = pre.shape
        h = self.config.hidden_size
        dpre = self._buf(backend, "dpre", (n, t, gh))
        dpre_t = self._buf(backend, "dpre_t", (n, gh))
        dh = self._buf(backend, "dh", (n, h))
        self._start_backward(backend, n, h, dy)
        for step in reversed(range(t)):
            if step == t - 1:
                backend.fill(0.0, dh)
            else:
                backend.gemm(dpre_t, False, self._w_hh, False, dh, 1.0, self.direct_share)
            self._cell_grad(backend, dh, dy[0], dpre, dpre_t, step)
        self._grads_fresh = True

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        self._through_time(backend, dy)
        n, t, d, h, gh = self._shapes(x[0])
        dpre = self._bufs["dpre"].reshape(n * t, gh)
        dhid = self._bufs[self.hidden_grads].reshape(n * t, gh)
        backend.gemm(dpre, True, x[0].reshape(n * t, d), False, dw[0], 1.0, beta[0])
        backend.gemm(dhid, True, self._bufs["hprev"].reshape(n * t, h), False, dw[1], 1.0, beta[1])
        backend.bias_grad(dpre, dw[2], beta[2])
        if len(dw) > 3:
            backend.bias_grad(dhid, dw[3], beta[3])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is None:
            return
        if not self._grads_fresh:  # not computed by backward_parameters for this backward pass
            self._w_hh = w[1]
            self._through_time(backend, dy)
        self._grads_fresh = False
        n, t, d, h, gh = self._shapes(x[0])
        backend.gemm(self._bufs["dpre"].reshape(n * t, gh), False, w[0], False, dx[0].reshape(n * t, d))

    def _start_backward(self, backend, n: int, h: int, dy: list) -> None:
        pass

    def _cell(self, backend, pre, hw, biases, ht, hprev, y, step) -> None:
        raise NotImplementedError

    def _cell_grad(self, backend, dh, dy, dpre, dpre_t, step) -> None:
        raise NotImplementedError


@register_layer("LSTM", LSTMConfig)
class LSTM(_Recurrent):
    gates = 4

    def _cell(self, backend, pre, hw, biases, ht, hprev, y, step):
        n, t, _ = pre.shape
        c = self._buf(backend, "c", (n, t, self.config.hidden_size))
        backend.lstm_cell(pre, hw, biases[0], c, ht, hprev, y, step, self.config.return_sequences)

    def _start_backward(self, backend, n, h, dy):
        dc = self._buf(backend, "dc", (n, h))
        if len(dy) > 1 and dy[1] is not None:  # the last cell state's own gradient
            backend.copy(dy[1], dc)
        else:
            backend.fill(0.0, dc)

    def _cell_grad(self, backend, dh, dy, dpre, dpre_t, step):
        backend.lstm_cell_grad(self._bufs["pre"], self._bufs["c"], dh, dy, self._bufs["dc"], dpre, dpre_t, step,
                               self.config.return_sequences)


@register_layer("RNN", RNNConfig)
class RNN(_Recurrent):
    gates = 1

    def _cell(self, backend, pre, hw, biases, ht, hprev, y, step):
        backend.rnn_cell(pre, hw, biases[0], ht, hprev, y, step, self.config.return_sequences)

    def _cell_grad(self, backend, dh, dy, dpre, dpre_t, step):
        backend.rnn_cell_grad(self._bufs["pre"], dh, dy, dpre, dpre_t, step, self.config.return_sequences)


@register_layer("GRU", GRUConfig)
class GRU(_Recurrent):
    weight_names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    gates = 3
    hidden_grads = "dpre_h"
    direct_share = 1.0

    @property
    def _reset_first(self):
        """W_hh where the reset gate applies before the product (linear_before_reset false), else None."""
        return None if self.config.linear_before_reset else self._w_hh

    def _cell(self, backend, pre, hw, biases, ht, hprev, y, step):
        n, t, _ = pre.shape
        hn = self._buf(backend, "hn", (n, t, self.config.hidden_size))
        backend.gru_cell(pre, hw, biases[0], biases[1], hn, ht, hprev, y, step, self.config.return_sequences,
                         self._reset_first)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        super().backward_parameters(backend, x, y, dy, dw, beta)
        if not self.config.linear_before_reset:
            self._reset_first_grads(backend, dw)

    def _reset_first_grads(self, backend, dw) -> None:
        """W_hn's and b_hn's gradients where the reset gate applies before the product: dn (dpre's n third) by
        ``hn`` (r h_{t-1}) and summed, added to the n rows of dw[1] and dw[3] (zero so far: dpre_h's n third is)."""
        n, t, gh = self._bufs["pre"].shape
        h = gh // 3
        dn = self._buf(backend, "dn", (n * t, h))
        backend.copy_block(dn, self._bufs["dpre"].reshape(n * t, gh), h, gh, 2 * h, False)
        for k, size, grad in ((1, h * h, "dw_hn"), (3, h, "db_hn")):
            new = self._buf(backend, grad, (1, size))
            if k == 1:
                backend.gemm(dn, True, self._bufs["hn"].reshape(n * t, h), False, new.reshape(h, h))
            else:
                backend.bias_grad(dn, new.reshape(h))
            rows = self._buf(backend, grad + "_rows", (1, size))
            backend.copy_block(rows, dw[k], size, 3 * size, 2 * size, False)
            backend.axpby(1.0, new, 1.0, rows)
            backend.copy_block(rows, dw[k], size, 3 * size, 2 * size, True)

    def _start_backward(self, backend, n, h, dy):
        pre = self._bufs["pre"]
        self._buf(backend, "dpre_h", pre.shape)

    def _cell_grad(self, backend, dh, dy, dpre, dpre_t, step):
        b = self._bufs
        backend.gru_cell_grad(b["pre"], b["hn"], b["hprev"], dh, dy, dpre, b["dpre_h"], dpre_t, step,
                              self.config.return_sequences, self._reset_first)
