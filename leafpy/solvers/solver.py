"""Solver and SolverConfig: one training step is forward, objective forward/backward, network backward, then
Caffe's update sequence: clip gradients -> normalize (accumulation) -> regularize (L2) -> the update rule.

Learning-rate policies: Leaf's fixed, step and exp, and Caffe's inv, multistep, poly and sigmoid, with Caffe's
formulas (``iteration`` counts updates).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .. import _checks
from .._exclusive import OneCaller
from ..backends.base import Backend
from ..errors import ConfigError, LeafpyError, SerializationError, ShapeError
from ..layers.container.sequential import batch_free
from ..layers.layer import Layer, LayerConfig, WeightConfig
from ..layers.network import Network
from ..tensor import HOST, SharedTensor, as_numbers, recording

LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid", "cosine")
_SOLVER_TOKENS = itertools.count()


LOSS_SCALE_MODES = ("dynamic", "none")
SCALE_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max) / 2)
"""The loss scales float32 holds as normal numbers (half the largest: one growth must not overflow)."""
LOSS_SCALE_MAX_INTERVAL = 2**24
"""The longest growth interval: loss scaling counts good steps on the device in float32, exact up to 2**24."""

MAX_ITERATION = 2**53
"""The largest iteration count a solver holds: the learning-rate formulas use it as a float, exact up to 2**53."""


@_checks.strict_init
@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """How to train: the network, the objective (a loss over the network's output and the target), the update
    rule and its hyperparameters, the learning-rate policy, clipping, weight decay and gradient accumulation."""

    name: str = ""
    network: LayerConfig | None = None
    objective: LayerConfig | None = None
    solver: str = "momentum"
    minibatch_size: int = 1
    lr_policy: str = "fixed"
    base_lr: float = 0.01
    gamma: float = 0.1
    stepsize: int = 10
    stepvalues: tuple[int, ...] = ()
    power: float = 1.0
    max_iter: int | None = None
    min_lr: float = 0.0
    """The cosine policy's rate at max_iter (and after it)."""
    warmup_iter: int = 0
    warmup_factor: float = 0.0
    """A linear warm-up over the first warmup_iter iterations (0: none), from warmup_factor times the policy's rate
    at warmup_iter up to that rate; from warmup_iter on, the policy's rate."""
    clip_gradients: float | None = None
    weight_decay: float | None = None
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    rms_decay: float = 0.99
    seed: int | None = None
    loss_scale: str | float | None = None
    """fp16 loss scaling: "dynamic", a positive number (a static scale), "none", or None: dynamic when the network's
    backend runs fp16, none otherwise."""
    loss_scale_init: float = 65536.0
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff_factor: float = 0.5
    loss_scale_growth_interval: int = 2000
    """Dynamic loss scaling as PyTorch's GradScaler: start at loss_scale_init; a step with inf or nan gradients is
    skipped and the scale multiplied by the backoff factor; after growth_interval good steps in a row, by the
    growth factor."""

    def __post_init__(self) -> None:
        s = object.__setattr__
        from .registry import update_rules

        if not isinstance(self.name, str):
            raise ConfigError(f"solver.name: expected a string, got {self.name!r}")
        for what in ("network", "objective"):
            v = getattr(self, what)
            if v is not None and not isinstance(v, LayerConfig):
                raise ConfigError(f"solver.{what}: expected a LayerConfig, got {type(v).__name__}")
        s(self, "solver", _checks.choice("solver.solver", self.solver, sorted(update_rules())))
        s(self, "lr_policy", _checks.choice("solver.lr_policy", self.lr_policy, LR_POLICIES))
        s(self, "minibatch_size", _checks.positive_int("solver.minibatch_size", self.minibatch_size))
        s(self, "base_lr", _checks.number("solver.base_lr", self.base_lr, minimum=0.0))
        s(self, "gamma", _checks.number("solver.gamma", self.gamma))  # sigmoid decays with a negative gamma
        s(self, "stepsize", _checks.positive_int("solver.stepsize", self.stepsize))
        if isinstance(self.stepvalues, (str, bytes)) or not isinstance(self.stepvalues, (list, tuple)):
            raise ConfigError(f"solver.stepvalues: expected a list of iterations (multistep's steps), got "
                              f"{self.stepvalues!r:.60}")
        steps = tuple(_checks.non_negative_int(f"solver.stepvalues[{i}]", v) for i, v in enumerate(self.stepvalues))
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"solver.stepvalues: expected increasing iterations, got {list(steps)}")
        s(self, "stepvalues", steps)
        s(self, "power", _checks.number("solver.power", self.power))
        if self.max_iter is not None:
            s(self, "max_iter", _checks.positive_int("solver.max_iter", self.max_iter))
        elif self.lr_policy in ("poly", "cosine"):
            raise ConfigError(f"solver.max_iter: the {self.lr_policy} policy needs max_iter (a positive integer): the "
                              "iteration where its rate reaches its end")
        s(self, "min_lr", _checks.number("solver.min_lr", self.min_lr, minimum=0.0))
        s(self, "warmup_iter", _checks.non_negative_int("solver.warmup_iter", self.warmup_iter))
        s(self, "warmup_factor", _checks.number("solver.warmup_factor", self.warmup_factor, minimum=0.0,
                                                maximum=1.0))
        if self.lr_policy == "multistep" and not steps:
            raise ConfigError("solver.stepvalues: the multistep policy needs stepvalues, e.g. [1000, 2000]")
        self._check_policy()
        if self.clip_gradients is not None:
            s(self, "clip_gradients", _checks.number("solver.clip_gradients", self.clip_gradients, minimum=0.0,
                                                     min_open=True))
        if self.weight_decay is not None:
            s(self, "weight_decay", _checks.number("solver.weight_decay", self.weight_decay, minimum=0.0))
        s(self, "momentum", _checks.number("solver.momentum", self.momentum, minimum=0.0, maximum=1.0,
                                           max_open=True))
        s(self, "beta1", _checks.number("solver.beta1", self.beta1, minimum=0.0, maximum=1.0, max_open=True))
        s(self, "beta2", _checks.number("solver.beta2", self.beta2, minimum=0.0, maximum=1.0, max_open=True))
        s(self, "epsilon", _checks.number("solver.epsilon", self.epsilon, minimum=0.0, min_open=True))
        if self.epsilon < SCALE_RANGE[0]:
            raise ConfigError(f"solver.epsilon: {self.epsilon:g} is below float32's smallest normal number "
                              f"{SCALE_RANGE[0]:g}: the update runs in float32, where it is 0 or loses its digits, "
                              f"and a weight whose gradient is 0 would become 0/0 = nan; 1e-8 is usual")
        s(self, "rms_decay", _checks.number("solver.rms_decay", self.rms_decay, minimum=0.0, maximum=1.0,
                                            max_open=True))
        if self.seed is not None:
            s(self, "seed", _checks.non_negative_int("solver.seed", self.seed))
        scale = self.loss_scale
        if scale is not None and scale not in LOSS_SCALE_MODES:
            if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):  # NumPy's too
                try:
                    scale = float(scale)
                except OverflowError:  # an int beyond float's range
                    scale = math.inf
            else:  # (a string that is not one of the modes, a bool, a list...)
                scale = None
            if scale is None or not math.isfinite(scale) or scale <= 0:
                raise ConfigError(f"solver.loss_scale: expected 'dynamic', 'none' or a positive number (a static "
                                  f"scale), got {self.loss_scale!r}")
            if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
                raise ConfigError(f"solver.loss_scale: {scale:g} is outside float32's range "
                                  f"[{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}] (the scale is kept in float32, where it "
                                  "would be 0 or inf and every step skipped); 65536 is usual for fp16")
            s(self, "loss_scale", float(scale))
        s(self, "loss_scale_init", _checks.number("solver.loss_scale_init", self.loss_scale_init,
                                                  minimum=SCALE_RANGE[0], maximum=SCALE_RANGE[1]))
        s(self, "loss_scale_growth_factor", _checks.number("solver.loss_scale_growth_factor",
                                                           self.loss_scale_growth_factor, minimum=1.0, min_open=True))
        s(self, "loss_scale_backoff_factor", _checks.number("solver.loss_scale_backoff_factor",
                                                            self.loss_scale_backoff_factor, minimum=0.0, maximum=1.0,
                                                            min_open=True, max_open=True))
        s(self, "loss_scale_growth_interval", _checks.positive_int("solver.loss_scale_growth_interval",
                                                                   self.loss_scale_growth_interval))
        if self.loss_scale_growth_interval > LOSS_SCALE_MAX_INTERVAL:
            raise ConfigError(f"solver.loss_scale_growth_interval: expected at most {LOSS_SCALE_MAX_INTERVAL} (the "
                              f"device counts good steps in float32, exact up to 2**24), got "
                              f"{self.loss_scale_growth_interval!r}")

    def _check_policy(self) -> None:
        """Policy settings under which Caffe's formula has no value (a power of zero or of a negative number)."""
        policy, gamma, power = self.lr_policy, self.gamma, self.power
        if policy in ("step", "exp", "multistep") and gamma < 0:
            raise ConfigError(f"solver.gamma: the {policy} policy multiplies the rate by gamma, so gamma must be >= 0, "
                              f"got {gamma!r}")
        if policy == "poly" and power < 0:
            raise ConfigError(f"solver.power: the poly policy's rate base_lr * (1 - iteration/max_iter)^power must "
                              f"reach 0 at max_iter, so power must be >= 0, got {power!r}")
        if policy == "inv" and gamma < 0:  # (max_iter does not end training: nothing would stop it at the pole)
            raise ConfigError(f"solver.gamma: the inv policy's rate base_lr * (1 + gamma*iteration)^-power grows with "
                              f"a negative gamma and has no value once 1 + gamma*iteration <= 0 (iteration "
                              f"{math.ceil(-1.0 / gamma)} with gamma {gamma!r}); use gamma >= 0")

    def learning_rate(self, iteration: int) -> float:
        """The learning rate at ``iteration`` under this config's policy (Caffe's formulas, evaluated so that no
        intermediate value overflows: sigmoid far from its step is 0 or base_lr, as in Caffe; cosine is
        ``min_lr + (base_lr - min_lr) * (1 + cos(pi * iteration / max_iter)) / 2``, min_lr after max_iter), after a
        linear warm-up over the first ``warmup_iter`` iterations. A rate beyond the largest float (a growing exp or
        step policy after many iterations) is a ConfigError naming the iteration."""
        iteration = _checks.non_negative_int("learning_rate: iteration", iteration)
        if iteration < self.warmup_iter:
            f = self.warmup_factor
            return self._policy_rate(self.warmup_iter) * (f + (1.0 - f) * iteration / self.warmup_iter)
        return self._policy_rate(iteration)

    def _policy_rate(self, iteration: int) -> float:
        base, gamma, it = self.base_lr, self.gamma, iteration
        policy = self.lr_policy
        if policy == "fixed":
            return base
        if policy == "cosine":
            last = self.max_iter if self.max_iter is not None else 1
            return self.min_lr + (base - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(it, last) / last))
        if policy == "step":
            rate = _times_power(base, gamma, it // self.stepsize)
        elif policy == "exp":
            rate = _times_power(base, gamma, it)
        elif policy == "inv":
            inner = 1.0 + gamma * it
            if inner <= 0.0:
                raise ConfigError(f"solver.gamma: the inv policy has no rate at iteration {it} (1 + gamma*iteration "
                                  f"= {inner:g} <= 0 with gamma {gamma!r}); use gamma >= 0")
            rate = _times_power(base, inner, -self.power)
        elif policy == "multistep":
            rate = _times_power(base, gamma, sum(1 for v in self.stepvalues if it >= v))
        elif policy == "poly":
            last = self.max_iter if self.max_iter is not None else 1
            rate = _times_power(base, max(0.0, 1.0 - it / last), self.power)
        else:  # sigmoid: base / (1 + e^z), z = -gamma*(it - stepsize), without overflowing e^z
            z = -gamma * (it - self.stepsize)
            rate = base / (1.0 + math.exp(z)) if z <= 0 else base * math.exp(-z) / (1.0 + math.exp(-z))
        if not math.isfinite(rate):
            raise ConfigError(f"solver: the {policy} policy's learning rate exceeds the largest float at iteration "
                              f"{it} (base_lr {base!r}, gamma {gamma!r}, power {self.power!r}); use a gamma <= 1, "
                              "or train fewer epochs (max_iter ends no run)")
        return rate

    def zero_rate(self, first: int, last: int) -> tuple[int, str] | None:
        """Where the rate of iterations ``first``..``last`` (a run's) falls to 0 and stays there: (the first such
        iteration, why, with the setting to change), or None where the rate at ``last`` is not 0, or base_lr is 0
        (a rate of 0 asked for). max_iter ends no run, so a cosine policy with min_lr 0 or a poly policy trains at
        0 past it, and a warm-up past max_iter rises to 0; a falling rate may also underflow. Such rates, once 0,
        stay 0, so the first zero is found by bisection (a warm-up from warmup_factor 0 is 0 at iteration 0 alone:
        not found unless every iteration's is 0)."""
        def zero(it: int) -> bool:
            try:
                return self.learning_rate(it) == 0.0
            except ConfigError:  # (a rate past the largest float: an error when the run reaches it)
                return False

        if self.base_lr == 0.0 or last < first or not zero(last):
            return None
        lo, hi = first, last
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if zero(mid) else (mid + 1, hi)
        policy, end = self.lr_policy, self.max_iter
        if policy in ("cosine", "poly") and end is not None and (lo >= end or self.warmup_iter >= end):
            why = f"the {policy} policy reaches {'min_lr 0' if policy == 'cosine' else '0'} at max_iter {end}"
            fixes = []
            if self.warmup_iter >= end:
                why += f", and the warm-up rises to the rate at warmup_iter {self.warmup_iter}, past it"
                fixes.append("warmup_iter below max_iter")
            if last + 1 > end:
                fixes.append(f"max_iter to the run's iterations ({last + 1})")
            return lo, f"{why}; set {' and '.join(fixes)}" + (", or min_lr above 0" if policy == "cosine" else "")
        return lo, (f"the {policy} policy's rate reaches 0 there (base_lr {self.base_lr!r}, gamma {self.gamma!r}, "
                    f"power {self.power!r}: a factor of 0, or a rate below the smallest float); check the "
                    "schedule's settings")


def _times_power(base: float, x: float, p: float) -> float:
    """``base * x**p`` for x >= 0, through logarithms where the power alone would overflow (inf then)."""
    if base == 0.0:
        return 0.0
    if x == 0.0:
        return base * (0.0 if p > 0 else 1.0 if p == 0 else math.inf)
    try:
        return base * math.pow(x, p)
    except OverflowError:
        log = math.log(base) + p * math.log(x)
        return math.inf if log > 709.0 else math.exp(log)


class UpdateRule:
    """An update rule: per weight, a list of history tensors (named for checkpoints) and the update itself, by
    default the line ``formula`` of :data:`leafpy.backends.updates.TABLE` with the config fields ``hyper`` as its
    hyper-parameters."""

    name: ClassVar[str] = ""
    state_names: ClassVar[tuple[str, ...]] = ()
    formula: ClassVar[str] = ""
    """The line of updates.TABLE that :meth:`update` runs (the rule's name where empty)."""
    hyper: ClassVar[tuple[str, ...]] = ()
    """The config fields that give the line's hyper-parameters, in its order (a rule with decoupled weight decay
    gets the decay after them)."""
    skips_on_device: ClassVar[bool] = False
    """Whether :meth:`update` writes nothing when ``rate[1]`` is 0, as the backends' update primitives do (they read
    that flag on the device). Under loss scaling, a rule without it has its skipped steps decided on the host (the
    flag read back each step), so its steps are not recorded for replay."""

    def __init__(self, config: SolverConfig) -> None:
        self.config = config
        self.params = tuple(getattr(config, f) for f in self.hyper)
        """The values of ``hyper`` (the config is frozen)."""

    def step_rate(self, lr: float, iteration: int) -> float:
        """The rate the update kernels read at ``iteration`` for the policy's rate ``lr`` (Adam folds its bias
        correction in). The solver writes it into a device buffer before each step, so values that change every
        step never enter a recorded step."""
        return lr

    def update(self, backend: Backend, w: Any, g: Any, state: list[Any], rate: Any, lr_mult: float,
               decay: float = 0.0, copy: Any = None) -> None:
        """Update the weight ``w`` from its gradient ``g`` (device buffers; ``state`` the rule's history buffers);
        ``rate`` is the buffer ``[step rate, apply]``: :meth:`step_rate`, scaled by the weight's ``lr_mult``, and
        0 where the step is skipped (loss scaling saw inf or nan gradients), when the backend's update primitive
        writes nothing. A rule with ``decoupled_weight_decay`` gets ``[step rate, apply, lr]`` (lr: the policy's
        rate) and ``decay`` (weight_decay times the weight's decay_mult) to apply itself; the others get gradients
        with the decay in. ``copy``: the weight's bf16/fp16 copy, to be written with it (``Backend.solver_update``);
        a rule that overrides this method without taking ``copy`` has the solver cast the copy after it."""
        params = self.params + (decay,) if self.decoupled_weight_decay else self.params
        held = dict(zip(("s1", "s2", "s3"), state))
        backend.solver_update(self.formula or self.name, w, g, rate, lr_mult, params, copy=copy, **held)

    decoupled_weight_decay: ClassVar[bool] = False
    """The rule applies weight decay to the weights itself (AdamW's ``w -= lr·decay·w``), instead of the solver
    adding ``decay·w`` to the gradient first (L2 regularisation, Caffe's)."""


def _check_loss(objective: Network[Layer]) -> None:
    """An objective's first output is the loss the solver minimises: one value (an objective ending in, say, a
    Sigmoid would train on its first element and report it as the loss)."""
    out = objective.outputs[0]
    if out.size != 1:
        raise ConfigError(f"solver.objective: its output ({objective.layer.name!r}) has shape {list(out.shape)}, "
                          "where a loss is one value; end the objective with a loss layer (NegativeLogLikelihood, "
                          "SoftmaxCrossEntropy, MeanSquaredError), or write objective: nll, softmax_cross_entropy or "
                          "mse in a run file")


def _network_of(where: str, given: Network[Layer] | Layer) -> Network[Layer]:
    """The Network of ``given`` (a Network, or a Layer: the Network that runs it as the outermost layer)."""
    if isinstance(given, Network):
        return given
    if isinstance(given, Layer):
        return given.network
    raise ConfigError(f"{where}: expected a Network or a Layer (lp.Layer.from_config), got {type(given).__name__}")


def _last_layer(config: LayerConfig) -> LayerConfig:
    """The layer whose output a container's last layer gives, looking inside nested containers."""
    while config.type == "Sequential" and config.config.layers:
        config = config.config.layers[-1]
    return config


def _check_loss_input(network: LayerConfig, objective: LayerConfig) -> None:
    """NegativeLogLikelihood reads log-probabilities: a Softmax output (probabilities) would train on a loss of
    ``-p`` without a word; and the objective gives one loss (a loss with reduction none gives one per sample)."""
    last, loss = _last_layer(network), objective
    while loss.type == "Sequential" and loss.config.layers:
        loss = loss.config.layers[0]
    if last.type == "Softmax" and loss.type == "NegativeLogLikelihood":
        raise ConfigError(f"objective layer '{loss.name}' (NegativeLogLikelihood) reads log-probabilities, but the "
                          f"network ends in layer '{last.name}' (Softmax), which gives probabilities; make it a "
                          f"LogSoftmax (type: LogSoftmax)")
    final = _last_layer(objective)
    if getattr(final.config, "reduction", "mean") == "none":
        raise ConfigError(f"objective layer '{final.name}' ({final.type}): reduction 'none' gives one loss per sample, "
                          "and training minimizes one loss; use reduction mean (the default) or sum")


class Solver:
    """Trains ``network`` against ``objective``; see the module docstring for the step. Both are held as
    :class:`~leafpy.layers.network.Network` objects (given as Networks or as their outermost Layers): the solver
    stages batches into them, runs them and updates the network's parameters through them, and through nothing
    else."""

    def __init__(self, network: Network[Layer] | Layer, objective: Network[Layer] | Layer,
                 config: SolverConfig) -> None:
        from .registry import update_rules

        self.network = network
        self.objective = objective
        self.config = config
        self.iteration = 0
        self._token = next(_SOLVER_TOKENS)  # unique for the process's life (id() is reused after deletion)
        self._one = OneCaller(f"the solver of network '{self._network.name}'")  # one thread at a time: train_minibatch
        self.rule: UpdateRule = update_rules()[config.solver](config)
        self._calls = 0  # train_minibatch calls since the last update
        be = self._network.backend
        weights = self._network.parameters().data
        dtype = be.dtype
        self.state: list[list[SharedTensor]] = [[SharedTensor(w.shape, dtype) for _ in self.rule.state_names]
                                                for w in weights]
        self._accum = [SharedTensor(w.shape, dtype) for w in weights] if config.minibatch_size > 1 else []
        self._ws: dict = {}  # the backend's workspace for the gradients' sum of squares (Backend.sum_squares)
        self._slots: list[tuple[Layer, int] | None] = []  # see _copy_slots
        self._slots_of: Any = None
        self._runs: list[list[int]] = []  # see _update_runs
        self._order_of: Any = None
        self._arranged = False
        # [the step's rate (rule.step_rate), uploaded before each step when it changed; 1 to apply the update or 0
        # to skip it, written on the device under loss scaling; for a rule with decoupled weight decay, the policy's
        # rate]
        self._rate = SharedTensor((3 if self.rule.decoupled_weight_decay else 2,), dtype)
        self._rate_value: tuple[float, float] | None = None
        self._workers_of: Network[Layer] | None = None
        self._worker_list: list[Any] = []
        self._norm = SharedTensor((1,), dtype)
        self._generation = 0
        self._computed_checks: tuple[tuple, bool] | None = None  # (binding, what _checks_computed found for it)
        self._has_loss = False
        self.gradient_reducer: Callable[[list[SharedTensor]], None] | None = None
        """Called with the gradients just before each update (data-parallel training sums them across ranks there:
        see leafpy.distributed.DataParallel). A step with one is recorded and replayed only where it has
        ``replay_key()`` returning what its launches depend on (None: run eagerly)."""
        self.accumulation_scale = 1.0
        """The factor of each call's gradient in the accumulated sum (minibatch_size > 1; data-parallel training
        weights each rank's calls by their share of the global batch)."""
        self.trainer_state: dict[str, Any] = {}
        """What a training loop needs to continue where it stopped (epoch, batch within it...): plain JSON values,
        saved and restored with the checkpoint."""
        self._boundary: tuple[SharedTensor, SharedTensor] | None = None  # fp32 output and gradient for the objective
        self._seeded = False  # whether the objective's output gradient holds 1.0 from the host (no loss scaling)
        # loss scaling's state lives on the device, where each step reads and updates it: [scale] and [good steps,
        # skipped steps since _skipped_before] (floats, exact up to 2**24); read back only when asked for
        self._scale = SharedTensor((1,), dtype)
        self._scale_counts = SharedTensor((2,), dtype)
        self._skipped_before = 0
        self.loss_scale = self._initial_scale()
        self.loss_scale_good_steps = 0
        self.skipped_steps = 0
        self._update_runs(self._update_grads())  # laid out now, before views of the weights are taken

    @property
    def pending_calls(self) -> int:
        """``train_minibatch`` calls whose gradients wait for the next update (under ``minibatch_size`` > 1)."""
        return self._calls

    @property
    def loss_scale(self) -> float:
        """The factor the loss's gradient is multiplied by (1.0 without loss scaling). Kept on the device and read
        back when asked for; setting it writes the device's copy before the next step."""
        return float(self._scale.to_numpy()[0])

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scale.set(np.array([value], dtype=np.float64))

    @property
    def loss_scale_good_steps(self) -> int:
        """Updates in a row with finite gradients since the scale last changed (dynamic loss scaling)."""
        return int(self._scale_counts.to_numpy()[0])

    @loss_scale_good_steps.setter
    def loss_scale_good_steps(self, value: int) -> None:
        counts = self._scale_counts.to_numpy()
        counts[0] = value
        self._scale_counts.set(counts)

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for inf or nan gradients (with loss scaling); the iteration counter still advanced."""
        return self._skipped_before + int(self._scale_counts.to_numpy()[1])

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        counts = self._scale_counts.to_numpy()
        counts[1] = 0  # the device counts from here, exactly for 2**24 skipped steps
        self._scale_counts.set(counts)
        self._skipped_before = int(value)

    @staticmethod
    def from_config(network_backend: Backend, objective_backend: Backend, config: SolverConfig) -> Solver:
        """Build the network and objective of ``config`` on their backends."""
        if not isinstance(config, SolverConfig):
            raise ConfigError(f"Solver.from_config: expected a SolverConfig, got {type(config).__name__}")
        if config.network is None or config.objective is None:
            raise ConfigError("solver.network and solver.objective: both must be given (LayerConfigs)")
        _check_loss_input(config.network, config.objective)
        network = Layer.from_config(network_backend, config.network, seed=config.seed)
        # losses and softmax in the master precision: under bf16 and fp16 the objective runs on a full-precision twin
        objective = Layer.from_config(objective_backend.full_precision(), config.objective)
        return Solver(network, objective, config)

    def _initial_scale(self) -> float:
        mode, cfg = self.loss_scaling(), self.config
        return cfg.loss_scale_init if mode == "dynamic" else cfg.loss_scale if mode == "static" else 1.0  # type: ignore

    def loss_scaling(self) -> str:
        """"dynamic", "static" or "none": the config's loss_scale, where None means dynamic under fp16."""
        mode = self.config.loss_scale
        if mode is None:
            return "dynamic" if self._network.backend.precision == "fp16" else "none"
        return "static" if isinstance(mode, float) else mode

    @property
    def network(self) -> Network[Layer]:
        """The network being trained (its outermost layer, usually a Sequential: ``solver.network.layer``)."""
        return self._network

    @network.setter
    def network(self, network: Network[Layer] | Layer) -> None:
        net = _network_of("solver.network", network)
        net.layer.check_shared_multipliers()
        self._network = net

    @property
    def objective(self) -> Network[Layer]:
        """The objective's network (the loss over the network's output and the target)."""
        return self._objective

    @objective.setter
    def objective(self, objective: Network[Layer] | Layer) -> None:
        net = _network_of("solver.objective", objective)
        if net.num_inputs != 2:
            raise ConfigError(f"solver.objective: expected a layer with two inputs (the network output, then "
                              f"the target), got {objective!r}")
        if net.outputs:
            _check_loss(net)
        net.require_input_gradients([True, False])
        self._objective = net
        self._objective_dtype: np.dtype | None = None  # what its first input is staged in (found at the next step)

    # --- training -----------------------------------------------------------------------------------------
    def _stage(self, data: Any, target: Any) -> None:
        """Feed the batch to the network and the target to the objective, whose first input reads the network's
        output (and writes its gradient) with no copy."""
        net, obj = self._network, self._objective
        rebound = net.feed([data])
        net.validate(net.inputs)  # ids read straight from the batch (a replayed step runs no layer's own check)
        if not isinstance(target, SharedTensor):
            target = as_numbers(target, "Solver.train_minibatch: target")
        out, dout = net.outputs[0], net.output_grads[0]
        wanted = self._objective_dtype
        if wanted is None:  # (a walk over the objective's layers: once, not every step)
            wanted = self._objective_dtype = obj.input_dtype(0)
        if out.dtype != wanted:  # a bf16/fp16 output: cast at the boundary into the fp32 objective, and back
            b = self._boundary
            if b is None or b[0].shape != out.shape:
                b = self._boundary = (SharedTensor(out.shape, wanted), SharedTensor(out.shape, wanted))
            out, dout = b
        else:
            self._boundary = None
        obj.connect(0, out, dout)
        if obj.feed([None, target]) or rebound:
            self._seeded = False
            self._generation += 1
        if not self._seeded:
            _check_loss(obj)
        if not self._seeded and self.loss_scaling() == "none":  # the loss's gradient: 1 (scaled: see _seed)
            obj.output_grads[0].set(np.ones(obj.output_grads[0].shape))
            self._seeded = True
        obj.validate()

    def _seed(self) -> None:
        """Under loss scaling, the loss's gradient (the objective's output gradient) = the scale, copied on the
        device inside the step: a recorded step replays while the scale changes."""
        obe = self._objective.backend
        seed = self._objective.output_grads[0]
        out = seed.write(obe)
        obe.fill(0.0, out)
        obe.bias_add(obe.view(out, (seed.size, 1)), self._scale.read(obe))

    def _compute(self) -> None:
        net, obj = self._network, self._objective
        net.run_forward()
        if self._boundary is not None:
            obe, nbe = obj.backend, net.backend
            obe.cast(net.outputs[0].read(obe), self._boundary[0].write(obe))
        obj.run_forward()
        obj.run_backward()
        if self._boundary is not None:
            nbe.cast(self._boundary[1].read(nbe), net.output_grads[0].write(nbe))
        net.run_backward()

    def _workers(self) -> list[Any]:
        """The network's workers (a network keeps them for its life; walking it each step costs a replayed step's
        time)."""
        if self._workers_of is not self._network:
            self._worker_list = self._network.workers()
            self._workers_of = self._network
        return self._worker_list

    def _parameters(self) -> tuple[list[SharedTensor], list[SharedTensor], list[WeightConfig]]:
        """The network's weights, their gradients and their configs (the network gathers them once per binding)."""
        data, grads, _, configs = self._network.parameters()
        return data, grads, configs

    def _set_rate(self, rate: float, lr: float) -> None:
        """Put the step's rate (and the policy's) into their device buffer before the step (uploaded when they
        changed)."""
        be = self._network.backend
        if (rate, lr) != self._rate_value:  # apply: 1 (loss scaling sets it on the device within the step)
            be.upload(np.array([rate, 1.0, lr][:self._rate.size], dtype=be.dtype), self._rate.write(be))
            self._rate_value = (rate, lr)
        else:
            self._rate.read(be)

    def _replayable(self) -> bool:
        """Whether a step's device launches depend only on its key (so a backend may record and replay it): the
        rate, dropout's seeds, the clipping factor and loss scaling's scale and decision live in device buffers,
        so any policy, rule, dropout, clipping and loss scaling replays, and so do NCCL's sums between ranks; not
        sums through the host (see gradient_reducer), nor a loss-scaled step of a rule that cannot skip on the
        device (UpdateRule.skips_on_device)."""
        scaled_ok = self.loss_scaling() == "none" or self.rule.skips_on_device
        return scaled_ok and self._reducer_key() is not None and not self._checks_computed()

    def _checks_computed(self) -> bool:
        """Whether a layer checks ids or labels that the step computes in host memory (Layer.checks_computed; a
        device's computed ids are clamped on the device, replayed or not): such a step runs its layers' passes,
        and their checks, every time (found once for each binding)."""
        net, obj = self._network, self._objective
        binding = (self._generation, net.generation, obj.generation)
        found = self._computed_checks
        if found is None or found[0] != binding:
            found = self._computed_checks = (binding, any(
                n.backend.key == HOST and n.layer.checks_computed(n.inputs) for n in (net, obj)))
        return found[1]

    def _reducer_key(self) -> tuple | None:
        """The gradient reducer's part of a recorded step's key (() without one), None where it cannot be recorded."""
        reducer = self.gradient_reducer
        if reducer is None:
            return ()
        key = getattr(reducer, "replay_key", lambda: None)()
        return None if key is None else (key,)

    def train_minibatch(self, data: Any, target: Any) -> SharedTensor:
        """One forward/backward pass and (every minibatch_size-th call) one update; returns the network output.

        The update works in the gradient buffers, so after an update they no longer hold the raw gradients. The
        returned output is the network's own buffer, valid until its next call. A solver (and its network) serves
        one thread at a time: a second thread calling while a step runs gets a LeafpyError; give each thread its
        own solver (``Solver.from_config``) or serialise the calls."""
        with self._one("train_minibatch"), self._network.exclusive("train_minibatch"), \
                self._objective.exclusive("train_minibatch"):
            return self._train_minibatch(data, target)

    def _train_minibatch(self, data: Any, target: Any) -> SharedTensor:
        self._network.set_training(True)
        be = self._network.backend
        k = self.config.minibatch_size
        first = self._calls == 0
        update_now = k == 1 or self._calls + 1 == k
        # per-step values go to the device before staging, which may queue work that an upload would submit first
        if update_now:
            lr = self.config.learning_rate(self.iteration)
            self._set_rate(self.rule.step_rate(lr, self.iteration), lr)
        workers = self._workers()
        for worker in workers:
            worker.before_step(be)
        try:
            self._stage(data, target)
        except BaseException:  # a refused batch leaves no trace: the draws made for it are taken back
            for worker in workers:
                worker.after_step(ran=False)
            raise

        scaling = self.loss_scaling()

        def step() -> None:
            if scaling != "none":
                self._seed()
            self._compute()
            grads = self._parameters()[1]
            if k > 1:
                for g, acc in zip(grads, self._accum):
                    if first:  # overwritten, never read: a skipped step may have left inf or nan there
                        a = acc.write(be)
                        be.copy(g.read(be), a)
                        if self.accumulation_scale != 1.0:
                            be.scal(self.accumulation_scale, a)
                    else:
                        be.axpby(self.accumulation_scale, g.read(be), 1.0, acc.read_write(be))
                if not update_now:
                    return
                grads = self._accum
            if self.gradient_reducer is not None:
                self.gradient_reducer(list(grads))
            if scaling != "none":
                self._unscale(grads, scaling == "dynamic")
                if not self.rule.skips_on_device and not self._rate.to_numpy()[1]:
                    return  # a rule that cannot see the flag: skipped here
            self._update(grads)

        # a step whose launches depend only on the bindings and the accumulation phase may be recorded and replayed
        # by the backend (the rate is data, in self._rate)
        phase = (first, update_now, self.accumulation_scale) if k > 1 else ()
        self._update_runs(self._update_grads())  # a new binding is laid out before a step records its buffers
        copies = [slot for slot in self._copy_slots() if slot is not None]
        for layer, i in copies:  # a weight set since the last update (loaded, restored) reaches its copy
            layer.refresh_copy(i)
        # (the networks' bindings too: one rebound between steps, as require_input_gradients does, may run layers the
        # recording pruned, which no tensor it touched would tell)
        key = (self._token, self._generation, self._network.generation, self._objective.generation, *phase,
               *(self._reducer_key() or ()))
        try:
            be.run_step(key if self._replayable() else None, step)
        except BaseException:  # (Ctrl-C, a layer's refusal) before the update: retrying the batch draws the same
            for worker in workers:
                worker.after_step(ran=False)
            raise
        if update_now:
            for layer, i in copies:
                layer.copy_updated(i)
        for worker in workers:
            worker.after_step(ran=True)
        if k > 1:
            self._calls = 0 if update_now else self._calls + 1
        if update_now:
            self.iteration += 1  # a skipped step counts too, as PyTorch's schedulers count it
        self._has_loss = True
        return self._network.outputs[0]

    def loss(self) -> float:
        """The objective's value for the last minibatch (reads it back to the host). Before this solver has trained
        a minibatch (a new solver, or one just loaded from a checkpoint) there is none: a LeafpyError."""
        if not self._has_loss:
            raise LeafpyError("Solver.loss: no minibatch has been trained by this solver yet, so there is no loss; "
                              "call train_minibatch first")
        return float(self._objective.outputs[0].to_numpy().reshape(-1)[0])

    def _update(self, grads: Sequence[SharedTensor]) -> None:
        cfg = self.config
        be = self._network.backend
        runs = self._update_runs(grads)
        weights, _, configs = self._parameters()
        g_bufs = [g.read_write(be) for g in grads]
        if cfg.clip_gradients is not None:  # the norm of the weights that move (a frozen one's gradient, as in
            self._clip(be, [g_bufs[i] for run in runs for i in run], cfg.clip_gradients)  # Caffe and PyTorch: none)
        if cfg.minibatch_size > 1:
            for g in g_bufs:
                be.scal(1.0 / cfg.minibatch_size, g)
        rate = self._rate.read(be)
        own_copy = type(self.rule).update is UpdateRule.update  # a rule of its own may not take ``copy``
        slots = self._copy_slots()
        for run in runs:
            wc = configs[run[0]]
            decay = (cfg.weight_decay or 0.0) * wc.decay_mult
            w_bufs = [weights[i].read_write(be) for i in run]
            states = [[s.read_write(be) for s in self.state[i]] for i in run]
            lows = [self._copy_of(slots[i], be) for i in run]
            run_grads = [g_bufs[i] for i in run]
            parts = list(zip(w_bufs, run_grads, states, lows))
            if len(run) > 1:  # alike weights whose buffers lie one after another: one update over all of them
                joined = [be.span(list(column)) for column in (w_bufs, run_grads, *zip(*states))]
                if all(j is not None for j in joined):
                    parts = [(joined[0], joined[1], joined[2:], None)]
            for wb, g, st, low in parts:
                if decay and not self.rule.decoupled_weight_decay:
                    be.axpby(decay, wb, 1.0, g)
                extra = {"decay": decay} if self.rule.decoupled_weight_decay else {}
                if own_copy:
                    self.rule.update(be, wb, g, st, rate, wc.lr_mult, copy=low, **extra)
                else:
                    self.rule.update(be, wb, g, st, rate, wc.lr_mult, **extra)
                    if low is not None:
                        be.cast(wb, low)

    @staticmethod
    def _copy_of(slot: tuple[Layer, int] | None, be: Backend) -> Any:
        """The buffer of a weight's 16-bit copy that its update writes, or None."""
        if slot is None:
            return None
        copy = slot[0].weight_copies[slot[1]]
        assert copy is not None
        return copy.write(be)

    def _update_runs(self, grads: Sequence[SharedTensor]) -> list[list[int]]:
        """The weights updated, in runs of weights alike, in the order their updates run: those that move (a weight
        with lr_mult 0, such as BatchNorm's running statistics, has nothing to launch), alike in lr_mult and
        decay_mult next to each other (the updates are independent). A run joins weights without a 16-bit copy
        under a rule that runs the table's formula (UpdateRule.update); others are runs of one. Once per binding,
        and never while a step is recorded, the backend is told (Backend.arrange) so that it may lay the weights,
        these gradients and each history buffer out in this order: where a run's buffers then lie one after another
        (Backend.span), its update is one call (the native backend's, each step, from the first)."""
        params = self._network.parameters()
        key = (params, grads[0] if grads else None)
        if self._order_of != key:
            configs, slots = params[3], self._copy_slots()
            moving = [i for i, wc in enumerate(configs) if wc.lr_mult != 0.0]
            order = sorted(moving, key=lambda i: (configs[i].lr_mult, configs[i].decay_mult, slots[i] is not None))
            joins = type(self.rule).update is UpdateRule.update
            runs: list[list[int]] = []
            for i in order:
                prev = runs[-1][-1] if runs else None
                if (joins and prev is not None and slots[i] is None and slots[prev] is None
                        and (configs[i].lr_mult, configs[i].decay_mult) == (configs[prev].lr_mult,
                                                                             configs[prev].decay_mult)):
                    runs[-1].append(i)
                else:
                    runs.append([i])
            self._runs, self._order_of, self._arranged = runs, key, False
        if not self._arranged and not recording():  # a recorded step binds the buffers it saw: arranged outside
            order = [i for run in self._runs for i in run]
            groups = [[params[0][i] for i in order], [grads[i] for i in order]]
            groups += [[self.state[i][k] for i in order] for k in range(len(self.rule.state_names))]
            self._network.backend.arrange(groups)
            self._arranged = True
        return self._runs

    def _update_grads(self) -> list[SharedTensor]:
        """The gradients the update reads: the network's, or the accumulated ones (minibatch_size > 1)."""
        return list(self._accum) if self.config.minibatch_size > 1 else list(self._parameters()[1])

    def _copy_slots(self) -> list[tuple[Layer, int] | None]:
        """Per learnable weight (in the order of the network's parameters), the (layer, index) of its bf16/fp16
        copy where it has exactly one: the update writes that copy with the weight (one pass, and no cast in the
        next forward pass); None where it has none (float32) or several (a weight shared by name)."""
        params = self._network.parameters()
        if self._slots_of is not params:
            held: dict[int, list[tuple[Layer, int]]] = {}
            for layer, i in self._network.layer.weight_copy_slots():
                held.setdefault(id(layer.weights[i]), []).append((layer, i))
            found = [held.get(id(w), []) for w in params.data]
            self._slots = [f[0] if len(f) == 1 else None for f in found]
            for slot in self._slots:
                if slot is not None:
                    slot[0].updated_copies.add(slot[1])
            self._slots_of = params
        return self._slots

    def _unscale(self, grads: Sequence[SharedTensor], dynamic: bool) -> None:
        """Divide the gradients by the loss scale and decide on the device whether this step's update applies (any
        inf or nan makes the sum of their squares inf or nan: the update rule then writes nothing); the scale and
        its counts follow (Backend.loss_scale_update). Nothing comes back to the host."""
        cfg = self.config
        be = self._network.backend
        g_bufs = [g.read_write(be) for g in grads]
        moving = {i for run in self._update_runs(grads) for i in run}
        if len(moving) < len(g_bufs):  # a frozen weight's gradient: unscaled, but an inf there skips no step
            scale = self._scale.read(be)
            for i, g in enumerate(g_bufs):
                if i not in moving:
                    be.unscale(g, scale)
            g_bufs = [g_bufs[i] for i in sorted(moving)]
        scale = self._scale.read_write(be)
        be.loss_scale_update(self._sum_squares(be, g_bufs, scale), scale, self._scale_counts.read_write(be),
                             self._rate.read_write(be), cfg.loss_scale_growth_factor, cfg.loss_scale_backoff_factor,
                             cfg.loss_scale_growth_interval, dynamic)

    def _sum_squares(self, be: Backend, g_bufs: list[Any], scale: Any = None) -> Any:
        """The sum of the squares of every gradient, added up on the device (inf or nan where any gradient has one),
        each gradient first unscaled where ``scale`` is given: the one-element buffer it is in. Nothing comes back
        to the host."""
        total = self._norm.write(be)
        be.sum_squares(g_bufs, total, self._ws, scale)
        return total

    def _clip(self, be: Backend, g_bufs: list[Any], threshold: float) -> None:
        total = self._sum_squares(be, g_bufs)  # the scaling reads the norm on the device
        for g in g_bufs:
            be.clip_to_norm(g, total, threshold)

    def learning_rate(self) -> float:
        """The learning rate the next update will use."""
        return self.config.learning_rate(self.iteration)

    FIXED_ON_RESUME: ClassVar[tuple[str, ...]] = ("network", "objective", "solver", "minibatch_size")
    """Settings a resumed solver keeps from its checkpoint: they shape its state (weights, the update rule's
    history, the accumulation buffers). Every other setting may change between runs."""

    def reconfigure(self, config: SolverConfig, source: str = "the run file") -> list[str]:
        """Take ``config``'s settings, as Caffe does when it resumes (the settings come from the run file, the
        state from the checkpoint): learning-rate policy, momentum, weight decay, clipping, max_iter... A change
        of anything in FIXED_ON_RESUME is a ConfigError naming the field. Returns the names of changed fields."""
        if not isinstance(config, SolverConfig):
            raise ConfigError(f"Solver.reconfigure: expected a SolverConfig, got {type(config).__name__}")
        def differs(name: str) -> bool:  # a network or objective declared for another batch size is the same one
            new, old = getattr(config, name), getattr(self.config, name)
            return batch_free(new) != batch_free(old) if name in ("network", "objective") else new != old

        changed = [f.name for f in dataclasses.fields(SolverConfig) if f.name != "name" and differs(f.name)]
        fixed = [name for name in changed if name in self.FIXED_ON_RESUME]
        if fixed:
            name = fixed[0]
            if name in ("network", "objective"):
                detail = f"the {name} differs from the one the checkpoint was trained with"
            else:
                detail = (f"{name} is {getattr(self.config, name)!r} in the checkpoint, {getattr(config, name)!r} "
                          f"in {source}")
            raise ConfigError(f"solver.{name}: cannot change when resuming: {detail}; resume with the setting the "
                              "checkpoint was trained with, or start a new run")
        if changed:
            from .registry import update_rules

            before = self.loss_scaling()
            self.config = config
            mode = self.loss_scaling()
            if mode != before or mode == "static":  # the new setting's scale; a dynamic scale carries on
                self.loss_scale, self.loss_scale_good_steps = self._initial_scale(), 0
            self.rule = update_rules()[config.solver](config)
            self._seeded = False  # the loss's gradient and the update's apply flag are set anew
            self._rate_value = None
            self._generation += 1  # recorded steps hold the old constants (momentum, decay, clipping): record anew
        return changed

    # --- state and checkpoints ------------------------------------------------------------------------------
    SNAPSHOT_KEYS: ClassVar[tuple[str, ...]] = ("iteration", "pending_calls", "history", "accumulated", "random",
                                                "trainer_state", "loss_scale")
    OPTIONAL_SNAPSHOT_KEYS: ClassVar[tuple[str, ...]] = ("loss_scale",)
    """Entries :meth:`restore` does without (a state saved before they existed): no loss scale means 1.0, no steps
    skipped."""

    def snapshot(self) -> dict[str, Any]:
        """Everything a checkpoint holds besides the config and the network's weights, as plain values (arrays are
        host copies): ``iteration`` (updates done), ``pending_calls`` (gradient-accumulation calls since the last
        update), ``history`` (weight name -> the update rule's state name -> array, e.g. ``{"fc1/weight":
        {"history": ...}}``), ``accumulated`` (weight name -> the gradients summed over the pending calls; empty
        when none is pending), ``random`` (per random layer such as Dropout, in network order: its ``seed`` and
        the ``calls`` drawn so far), ``trainer_state`` (the training loop's JSON values) and ``loss_scale`` (its
        ``scale``, the ``good_steps`` since it last changed and the ``skipped_steps``; None without loss scaling).
        :meth:`restore` takes it back."""
        names = self._network.learnable_weights_names()
        return {
            "iteration": int(self.iteration),
            "pending_calls": int(self._calls),
            "history": {n: {s: t.to_numpy() for s, t in zip(self.rule.state_names, tensors)}
                        for n, tensors in zip(names, self.state)},
            "accumulated": {n: t.to_numpy() for n, t in zip(names, self._accum)} if self._calls else {},
            "random": [{"seed": int(w.seed), "calls": int(w.calls)} for w in self._random_workers()],
            "trainer_state": copy.deepcopy(self.trainer_state),
            "loss_scale": None if self.loss_scaling() == "none" else {
                "scale": float(self.loss_scale), "good_steps": int(self.loss_scale_good_steps),
                "skipped_steps": int(self.skipped_steps)},
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, a :meth:`snapshot` of this solver or of one built from the same config (the
        network's weights are set separately: ``solver.network.load_weights``). Every entry is checked before
        anything is set: a missing or unknown name is a ConfigError, an array of the wrong shape a ShapeError,
        each naming the entry, what was expected and what was given."""
        with self._one("restore"):
            self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        where = "Solver.restore"
        if not isinstance(state, Mapping):
            raise ConfigError(f"{where}: expected a mapping as Solver.snapshot() returns, got {type(state).__name__}")
        keys = set(self.SNAPSHOT_KEYS)
        absent = sorted(keys - set(state) - set(self.OPTIONAL_SNAPSHOT_KEYS))
        unknown = sorted(set(state) - keys, key=str)
        if absent or unknown:
            detail = f"missing: {', '.join(absent)}" if absent else f"unknown: {', '.join(map(str, unknown))}"
            raise ConfigError(f"{where}: expected the entries {', '.join(self.SNAPSHOT_KEYS)}; {detail}")
        it, calls, k = state["iteration"], state["pending_calls"], self.config.minibatch_size
        if isinstance(it, bool) or not isinstance(it, (int, np.integer)) or not 0 <= it <= MAX_ITERATION:
            raise ConfigError(f"{where}: the state's iteration is {it!r}, expected an integer in [0, {MAX_ITERATION}]")
        if isinstance(calls, bool) or not isinstance(calls, (int, np.integer)) or not 0 <= calls < k:
            raise ConfigError(f"{where}: the state has {calls!r} gradient-accumulation calls pending, expected fewer "
                              f"than its minibatch_size ({k})")
        names = self._network.learnable_weights_names()
        assignments: list[tuple[SharedTensor, np.ndarray]] = []

        def take(what: str, given: Any, tensors: Sequence[SharedTensor], labels: Sequence[str],
                 required: bool = True) -> None:
            if not isinstance(given, Mapping):
                raise ConfigError(f"{where}: {what} must be a mapping of names to arrays, got {type(given).__name__}")
            extra = [key for key in given if key not in labels]
            if extra:
                raise ConfigError(f"{where}: {what} has {extra[0]!r}, which this solver does not have (expected: "
                                  f"{', '.join(labels) or 'none'})")
            absent = [label for label in labels if label not in given]
            if absent and required:
                raise ConfigError(f"{where}: {what} is missing {absent[0]!r} (expected: {', '.join(labels)})")
            for label, t in zip(labels, tensors):
                arr = as_numbers(given[label], f"{where}: {what} {label!r}")
                if arr.shape != t.shape:
                    raise ShapeError(f"{where}: {what} {label!r} has shape {arr.shape}, expected {t.shape}")
                assignments.append((t, arr))

        history = state["history"]
        # names only (each weight's entry is checked below); a rule without state stores none
        take("history", history, [], names, required=bool(self.rule.state_names))
        for n, tensors in zip(names, self.state):
            take(f"history of {n!r}", history.get(n, {}), tensors, self.rule.state_names)
        for _, arr in assignments:  # (the rule's history: a state to continue from, as a checkpoint's must be)
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ConfigError(f"{where}: the history holds non-finite values (NaN or inf), from which no update "
                                  "can continue; restore a snapshot taken before")
        if calls:
            take("accumulated", state["accumulated"], self._accum, names)
        random = state["random"]
        workers = self._random_workers()
        if not isinstance(random, Sequence) or not all(
                isinstance(r, Mapping) and _checks.counter(r.get("seed"), 2**64 - 1)
                and _checks.counter(r.get("calls"), MAX_ITERATION) for r in random):
            raise ConfigError(f"{where}: random must be a list of {{'seed': int, 'calls': int}} (one per random "
                              f"layer, the seed a 64-bit count, calls in [0, {MAX_ITERATION}]), got {random!r:.200}")
        if len(random) != len(workers):  # an empty list would start every random layer's draws again
            raise ConfigError(f"{where}: random has {len(random)} entries, the network has {len(workers)} random "
                              "layers (each needs its seed and draws, to continue where it stopped)")
        trainer_state = state["trainer_state"]
        if not isinstance(trainer_state, Mapping):
            raise ConfigError(f"{where}: trainer_state must be a mapping (JSON object), got "
                              f"{type(trainer_state).__name__}")
        from ..serialization.models import trainer_state_json

        text = trainer_state_json(trainer_state, f"{where}: trainer_state")  # (what a checkpoint could hold)
        trainer_state = json.loads(text) if text else {}
        scaling = state.get("loss_scale") or {"scale": self._initial_scale(), "good_steps": 0, "skipped_steps": 0}
        scale = scaling.get("scale") if isinstance(scaling, Mapping) else None
        if not isinstance(scaling, Mapping) or isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0 \
                or not all(_checks.counter(scaling.get(f)) for f in ("good_steps", "skipped_steps")):
            raise ConfigError(f"{where}: loss_scale must be {{'scale': a positive number, 'good_steps': int, "
                              f"'skipped_steps': int}}, got {scaling!r:.200}")
        for t, arr in assignments:
            t.set(arr)
        for w, r in zip(workers, random):
            w.seed, w.calls = int(r["seed"]), int(r["calls"])
        self.iteration = int(it)
        self._calls = int(calls)
        self.trainer_state = copy.deepcopy(dict(trainer_state))
        # a dynamic scale carries on; a static one, or none, is the config's (a state saved under another setting)
        self.loss_scale = float(scale) if self.loss_scaling() == "dynamic" else self._initial_scale()
        self.loss_scale_good_steps = int(scaling["good_steps"])
        self.skipped_steps = int(scaling["skipped_steps"])
        # gradients accumulated before the state was taken carry the loss scale they were computed under (1 without
        # loss scaling): under another scale (another precision or setting on resume) they are rescaled to it
        saved = float(scale) if state.get("loss_scale") else 1.0
        now = self.loss_scale if self.loss_scaling() != "none" else 1.0
        if calls and now != saved:
            be = self._network.backend
            for t in self._accum:
                be.scal(now / saved, t.read_write(be))

    def _random_workers(self) -> list[Any]:
        return [w for w in self._network.workers() if hasattr(w, "draws_random")]

    def save_checkpoint(self, path: str) -> None:
        """Write config, weights, iteration and update-rule state to ``path`` (atomically)."""
        from .. import serialization

        _checks.path("Solver.save_checkpoint: path", path)
        with self._one("save_checkpoint"), self._network.exclusive("save_checkpoint"):
            weights, state = self._network.named_weights(), self.snapshot()
        serialization.save_checkpoint(path, self._saved_config(), weights, state)

    def _saved_config(self) -> SolverConfig:
        """The config a checkpoint holds: this one, naming the networks trained where it names none (a solver
        of networks built by hand), so that :meth:`load_checkpoint` builds them again."""
        config = self.config
        if config.network is not None and config.objective is not None:
            return config
        return dataclasses.replace(config, network=config.network or self._network.config,
                                   objective=config.objective or self._objective.config)

    @staticmethod
    def load_checkpoint(network_backend: Backend, objective_backend: Backend, path: str) -> Solver:
        """Resume a solver saved with :meth:`save_checkpoint`."""
        from .. import serialization

        path = _checks.path("Solver.load_checkpoint: path", path)
        saved = serialization.read_checkpoint(path, SolverConfig)
        with serialization.reading(path, "SolverCheckpoint"):
            solver = Solver.from_config(network_backend, objective_backend, saved.config)
            solver.network.load_weights(saved.weights)
            solver.restore(saved.state)
        solver.check_restored(path)
        return solver

    def check_restored(self, source: str = "checkpoint") -> None:
        """Check the counters a checkpoint restored (``source`` names it in the error): the iteration within
        [0, MAX_ITERATION] and the gradient-accumulation calls pending fewer than ``minibatch_size`` (more would
        never reach the update). Raises SerializationError."""
        it, calls, k = self.iteration, self._calls, self.config.minibatch_size
        if isinstance(it, bool) or not isinstance(it, int) or not 0 <= it <= MAX_ITERATION:
            raise SerializationError(f"{source}: the checkpoint's iteration is {it!r}, expected an integer in "
                                     f"[0, {MAX_ITERATION}]; the file is damaged or not a leafpy checkpoint")
        if isinstance(calls, bool) or not isinstance(calls, int) or not 0 <= calls < k:
            raise SerializationError(f"{source}: the checkpoint has {calls!r} gradient-accumulation calls pending, "
                                     f"expected fewer than its minibatch_size ({k}); the file is damaged")

