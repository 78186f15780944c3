"""Batch normalisation over [N, C, ...] input, per channel c:
``y = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c``.

In training mode mean and (biased) variance are the batch's, over N and every axis after C, and the running
statistics move towards them: ``running = (1 - momentum) * running + momentum * batch`` (the running variance
with the unbiased batch variance, as PyTorch keeps it; a batch with one value per channel, which has none, leaves the
running variance as it is). In inference mode (``set_training(False)``) the running
statistics normalise. ``weight`` and ``bias`` (absent with ``affine: false``) are learned; ``running_mean`` and
``running_var`` are weights that are saved and loaded with the model but never trained (their learning rate and
decay multipliers are 0 and their gradient is 0), as Caffe keeps its BatchNorm statistics."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import FillerConfig, Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class BatchNormConfig:
    eps: float = 1e-5
    momentum: float = 0.1
    affine: bool = True

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "eps", _checks.number("BatchNormConfig.eps", self.eps, minimum=0.0, min_open=True))
        s(self, "momentum", _checks.number("BatchNormConfig.momentum", self.momentum, minimum=0.0, maximum=1.0))
        if not isinstance(self.affine, bool):
            raise _checks.ConfigError(f"BatchNormConfig.affine: expected true or false, got {self.affine!r}")


@register_layer("BatchNorm", BatchNormConfig)
class BatchNorm(Worker):
    weight_names: tuple[str, ...] = ("weight", "bias", "running_mean", "running_var")
    untrained_weights = ("running_mean", "running_var")
    input_gradient_needs_parameter_pass = True  # the sums backward_parameters computes
    master_precision_weights = True
    _FILLS = {"weight": 1.0, "bias": 0.0, "running_mean": 0.0, "running_var": 1.0}

    def __init__(self, config: BatchNormConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        if not config.affine:
            self.weight_names = ("running_mean", "running_var")
        self.stats = None  # this batch's mean and variance, per channel
        self.synchronizer = None
        """Set by data-parallel training with synchronised batch normalisation: combines the statistics and the
        backward pass's sums across the ranks, so every rank normalises with the global batch's statistics."""
        self.sums = None  # sum dy and sum dy * xhat, per channel (backward)
        self._sums_used = None  # where the last backward pass put them: self.sums or the weight gradients
        self._used = None  # the statistics the last forward pass normalised with

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        if len(input_shapes[0]) < 2:
            raise ShapeError(f"{self.where}: expected an input [N, C, ...] with a channel axis, got shape "
                             f"{tuple(input_shapes[0])}")

    def weight_shapes(self, input_shapes):
        return [(input_shapes[0][1],)] * len(self.weight_names)

    def default_filler(self, index: int) -> FillerConfig:
        return FillerConfig(type="constant", value=self._FILLS[self.weight_names[index]])

    def updated_in_forward(self) -> tuple[int, ...]:
        """Weights that a training forward pass writes: the running statistics."""
        if not self.training:
            return ()
        return tuple(i for i, n in enumerate(self.weight_names) if n in self.untrained_weights)

    def setup(self, backend, input_shapes):
        c = input_shapes[0][1]
        if self.stats is None or self.stats[0].shape != (c,):
            self.stats = [backend.view(backend.allocate(c, backend.dtype), (c,)) for _ in range(2)]
            self.sums = [backend.view(backend.allocate(c, backend.dtype), (c,)) for _ in range(2)]

    def _split(self, w):
        named = dict(zip(self.weight_names, w))
        return named.get("weight"), named.get("bias"), named["running_mean"], named["running_var"]

    def forward(self, backend, x, w, y):
        gamma, beta, running_mean, running_var = self._split(w)
        eps = self.config.eps
        if self.training:
            mean, var = self.stats
            backend.batch_norm_stats(x[0], mean, var)
            m = self.config.momentum
            count = x[0].size // x[0].shape[1]
            if self.synchronizer is not None:
                count = self.synchronizer.statistics(backend, mean, var, count)
            backend.axpby(m, mean, 1.0 - m, running_mean)
            if count > 1:  # one value per channel has no unbiased variance: the running variance stays
                backend.axpby(m * count / (count - 1), var, 1.0 - m, running_var)
        else:
            mean, var = running_mean, running_var
        self._used = (mean, var)
        backend.batch_norm(x[0], mean, var, gamma, beta, y[0], eps)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        mean, var = self._used
        grads = {n: (g, b) for n, g, b in zip(self.weight_names, dw, beta)}
        # the sums are the weight and bias gradients: written there directly unless those accumulate, or unless
        # data-parallel training sums them across ranks for the input gradient (which must not touch the weights')
        direct = self.synchronizer is None and "weight" in grads and grads["weight"][1] == grads["bias"][1] == 0.0
        sum_dy, sum_dy_xhat = (grads["bias"][0], grads["weight"][0]) if direct else self.sums
        backend.batch_norm_grad_sums(x[0], dy[0], mean, var, sum_dy, sum_dy_xhat, self.config.eps)
        self._sums_used = (sum_dy, sum_dy_xhat)
        for name, g, b in zip(self.weight_names, dw, beta):
            if name == "weight" and not direct:
                backend.axpby(1.0, sum_dy_xhat, b, g)
            elif name == "bias" and not direct:
                backend.axpby(1.0, sum_dy, b, g)
            elif name in self.untrained_weights and b == 0.0:  # the running statistics: no gradient
                backend.fill(0.0, g)

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is None:
            return
        gamma = self._split(w)[0]
        mean, var = self._used
        # the sums are backward_parameters' (a layer with weights, as this one always is, runs it first)
        sum_dy, sum_dy_xhat = self._sums_used
        if self.synchronizer is not None and self.training:
            self.synchronizer.sums(backend, sum_dy, sum_dy_xhat, x[0].shape[0])
        backend.batch_norm_grad(x[0], dy[0], mean, var, gamma, sum_dy, sum_dy_xhat, dx[0], self.config.eps,
                                self.training)
