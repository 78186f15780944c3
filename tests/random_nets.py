"""Random small networks for wiring tests, over every registered layer type.

A case is a network config, its declared inputs (float data, integer ids for an Embedding, class labels for a
NegativeLogLikelihood, a target for a MeanSquaredError) and whether it runs in training or inference mode. The
generator chains blocks chosen by the current blob's rank: convolution, pooling, LRN, BatchNorm, every activation,
Dropout, Reshape, Flatten, Linear (per sample or per time step), LSTM/GRU/RNN, weights shared by name, nested
Sequentials (one or two inputs, nested again), and branches wired by name: a fan-out into two paths joined by an
Eltwise sum, product or maximum (a residual when one path is the identity), paths of different widths joined by a
Concat, a Slice whose parts are processed and joined again (or one part left unread), a skip connection from an
earlier blob. After any block an in-place-capable layer may follow (also as Caffe's named in-place request, an
output named as its input), so in-place runs are tried after every kind of layer; the wiring decides whether they
really run in place. Everything is drawn from ``np.random.default_rng(seed)``: a seed always gives the same case.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

import leafpy as lp
from leafpy.layer_config import lookup
from leafpy.layers import wire
from leafpy.layers.common.matmul import MatMulConfig
from leafpy.layers.loss.negative_log_likelihood import SoftmaxCrossEntropyConfig
from leafpy.layers.utility.transpose import TransposeConfig

DEFAULT_SEEDS = range(80)
"""The seeds the quick tests run; every layer type and every structural feature occurs among them
(test_random_networks.py checks it)."""
IN_PLACE_TYPES = tuple(name for name in lp.layer_types() if not lookup(name).is_container
                       and getattr(lookup(name).impl, "in_place", False))
"""The layer types that may run in place (their workers say so: the registry, not a list kept here)."""
DECONV = 0.3
FAMILIES = ("image", "vector", "sequence", "ids", "labels", "target")


@dataclass
class Input:
    name: str
    shape: tuple[int, ...]
    kind: str = "float"
    """float | ids (integers in [0, bound)) | labels (class indices in [0, bound))."""
    bound: int = 0


@dataclass
class Case:
    """One random network: its config, declared inputs and mode."""

    seed: int
    family: str
    config: lp.LayerConfig
    inputs: list[Input]
    training: bool = False
    features: set[str] = field(default_factory=set)
    """Structural features the generator used (residual, concat, slice, nested, shared, ...), for coverage."""

    def make_inputs(self, rng: np.random.Generator, batch: int | None = None,
                    dtype: type = np.float64) -> list[np.ndarray]:
        """Inputs for one forward pass (ids and labels as integer-valued floats)."""
        out = []
        for inp in self.inputs:
            shape = (batch or inp.shape[0], *inp.shape[1:])
            if inp.kind == "float":
                out.append(rng.standard_normal(shape).astype(dtype))
            else:
                out.append(rng.integers(0, inp.bound, shape).astype(dtype))
        return out

    def layer_types(self) -> set[str]:
        return {lc.type for lc in walk(self.config)}

    def __repr__(self) -> str:
        return f"<random net seed={self.seed} {self.family} training={self.training}>"


def walk(config: lp.LayerConfig) -> Iterator[lp.LayerConfig]:
    """Every layer config in a network, nested ones included (the outermost first)."""
    yield config
    if config.type == "Sequential":
        for lc in config.config.layers:
            yield from walk(lc)


def in_place_positions(config: lp.LayerConfig) -> Iterator[tuple[str, str, bool]]:
    """(type of the layer writing a blob, type of the in-place-capable layer reading it, whether the wiring runs the
    latter in place), for each in-place-capable layer whose input comes from a layer of the same container."""
    for lc in walk(config):
        if lc.type != "Sequential":
            continue
        layers = lc.config.layers
        w = wire(lc.config)
        for step, layer in zip(w.steps, layers):
            if layer.type in IN_PLACE_TYPES and len(step.inputs) == 1 and w.producer[step.inputs[0]] >= 0:
                yield layers[w.producer[step.inputs[0]]].type, layer.type, step.in_place


@dataclass
class Blob:
    name: str
    shape: tuple[int, ...]


class _Builder:
    """Adds layers to one Sequential, keeping track of the current blob and the blobs that may be read again."""

    def __init__(self, gen: _Generator, inputs: list[tuple[str, tuple[int, ...]]], depth: int,
                 force_backward: bool) -> None:
        self.g = gen
        self.rng = gen.rng
        self.depth = depth
        self.cfg = lp.SequentialConfig(inputs=inputs, force_backward=force_backward)
        self.prev_single = True  # the current blob is what a layer without inputs reads
        self.earlier: list[Blob] = []  # named blobs a skip connection may read again

    # --- adding layers ------------------------------------------------------------------------------------------
    def add(self, cfg: object, reads: list[Blob] | None, *, n_out: int = 1, name_out: bool | None = None,
            params: list[lp.WeightConfig] | None = None, out_names: list[str] | None = None) -> list[str]:
        """Add a layer reading ``reads`` (None: the automatic wiring, reading the previous layer's outputs) and
        return its output blob names (explicit or Sequential's automatic ones)."""
        i = len(self.cfg.layers)
        name = self.g.name("l")
        if name_out is None:
            name_out = bool(self.rng.random() < 0.4)
        if out_names is None and name_out:
            out_names = [self.g.name("b") for _ in range(n_out)]
        inputs = [b.name for b in reads] if reads is not None else []
        self.cfg.add_layer(lp.LayerConfig(name, cfg, inputs=inputs, outputs=out_names or [], params=params or []))
        self.prev_single = n_out == 1
        if out_names:
            return out_names
        return [f"SEQUENTIAL_{i}"] if n_out == 1 else [f"SEQUENTIAL_{i}_{k}" for k in range(n_out)]

    def one(self, cfg: object, cur: Blob, shape: tuple[int, ...] | None = None, **kw) -> Blob:
        """A one-input, one-output layer after ``cur``: read by the automatic wiring where it may be."""
        auto = self.prev_single and cur is not None and self.rng.random() < 0.6 and self._is_prev(cur)
        names = self.add(cfg, None if auto else [cur], **kw)
        return Blob(names[0], tuple(shape if shape is not None else cur.shape))

    def _is_prev(self, cur: Blob) -> bool:
        layers = self.cfg.layers
        if not layers:
            return cur.name == self.cfg.inputs[0][0]
        i = len(layers) - 1
        return cur.name in (f"SEQUENTIAL_{i}", *layers[-1].outputs)

    # --- blocks ---------------------------------------------------------------------------------------------
    def chain(self, cur: Blob, blocks: int) -> Blob:
        for _ in range(blocks):
            cur = self.block(cur)
            if self.rng.random() < 0.5:
                cur = self.in_place(cur)
            if self.rng.random() < 0.5:
                self.earlier.append(cur)
            if self.g.side.random() < 0.1:
                cur = self.side_block(cur)
        return cur

    def block(self, cur: Blob) -> Blob:
        r = len(cur.shape)
        kinds = ["act", "act", "bn", "lrn", "dropout", "linear", "reshape", "softmax", "residual", "concat",
                 "slice", "sequential", "sequential", "skip"]
        if r == 4:
            kinds += ["conv"] * 3 + ["pool"] * 3 + ["flatten"]
        if r == 3:
            kinds += ["recurrent"] * 5 + ["flatten"]
        if r == 2:
            kinds += ["shared"]
        if self.depth >= 2:
            kinds = [k for k in kinds if k != "sequential"]
        if self.size(cur) > 60:  # keep the gradient check cheap: shrink big blobs
            kinds += ["shrink"] * 4
        kind = str(self.rng.choice(kinds))
        return getattr(self, f"b_{kind}")(cur)

    @staticmethod
    def size(cur: Blob) -> int:
        return math.prod(cur.shape[1:])

    def b_act(self, cur: Blob) -> Blob:
        return self.one(self.g.activation(), cur)

    def b_bn(self, cur: Blob) -> Blob:
        if len(cur.shape) < 2:
            return cur
        eps = 1e-5 if not self.g.training else 0.1  # a batch of two: keep the normalisation well conditioned
        return self.one(lp.BatchNormConfig(affine=bool(self.rng.random() < 0.7), eps=eps), cur)

    def b_lrn(self, cur: Blob) -> Blob:
        size = int(self.rng.choice([1, 3, 5]))
        cfg = lp.LRNConfig(local_size=size, alpha=float(self.rng.uniform(0.2, 1.5)),
                           beta=float(self.rng.uniform(0.5, 0.9)), k=float(self.rng.uniform(1.0, 2.0)))
        return self.one(cfg, cur)

    def b_dropout(self, cur: Blob) -> Blob:
        return self.one(lp.DropoutConfig(ratio=float(self.rng.choice([0.25, 0.5]))), cur)

    def b_softmax(self, cur: Blob) -> Blob:
        kind = str(self.rng.choice(["Softmax", "LogSoftmax"]))
        if len(cur.shape) == 3 and self.rng.random() < 0.4:  # over the last axis
            self.g.features.add("softmax-axis")
            return self.one((lp.SoftmaxConfig if kind == "Softmax" else lp.LogSoftmaxConfig)(axis=-1), cur)
        return self.one(kind, cur)

    def b_linear(self, cur: Blob) -> Blob:
        out = int(self.rng.integers(2, 6))
        bias = bool(self.rng.random() < 0.7)
        if len(cur.shape) == 3 and self.rng.random() < 0.6:  # per time step
            return self.one(lp.LinearConfig(output_size=out, bias=bias, axis=-1), cur, (*cur.shape[:2], out))
        if len(cur.shape) == 4 and self.rng.random() < 0.3:  # the axes before it kept
            axis = int(self.rng.choice([2, -1]))
            return self.one(lp.LinearConfig(output_size=out, bias=bias, axis=axis), cur,
                            (*cur.shape[:axis % 4], out))
        return self.one(lp.LinearConfig(output_size=out, bias=bias), cur, (cur.shape[0], out))

    def b_shrink(self, cur: Blob) -> Blob:
        if len(cur.shape) == 4 and self.rng.random() < 0.5 and cur.shape[2] >= 2:
            return self.b_pool(cur)
        return self.b_linear(cur)

    def b_deconv(self, cur: Blob) -> Blob:
        n, c, h, w = cur.shape
        f, s = int(self.rng.integers(1, 4)), int(self.rng.integers(1, 3))
        p = int(self.rng.integers(0, f))
        op = 1 if s == 2 and self.rng.random() < 0.4 else 0
        group = c if c > 1 and self.rng.random() < 0.3 else 1
        out = group * int(self.rng.integers(1, 3))
        size = [(d - 1) * s - 2 * p + f + op for d in (h, w)]
        if min(size) < 1:
            p, size = 0, [(d - 1) * s + f + op for d in (h, w)]
        cfg = lp.DeconvolutionConfig(num_output=out, filter_shape=[f], stride=[s], padding=[p], output_padding=[op],
                                     group=group, bias=bool(self.rng.random() < 0.7))
        out_blob = self.one(cfg, cur, (n, out, *size))
        return self.in_place(out_blob, keep_shape=True) if self.rng.random() < 0.5 else out_blob

    def b_conv(self, cur: Blob) -> Blob:
        n, c, h, w = cur.shape
        if self.rng.random() < DECONV:
            return self.b_deconv(cur)
        dims = 2 if self.rng.random() < 0.3 else 1  # one value for both spatial axes, or one each
        f, s, p = ([int(v) for v in self.rng.integers(lo, hi, dims)] for lo, hi in ((1, 4), (1, 3), (0, 2)))
        fh, fw, sh, sw, ph, pw = f[0], f[-1], s[0], s[-1], p[0], p[-1]
        extra: dict = {}
        d, e = 1, [ph, pw]
        if self.rng.random() < 0.5 and fh > 1 and h + 2 * ph >= 2 * fh - 1 and w + 2 * pw >= 2 * fw - 1:
            d = extra["dilation"] = 2
            self.g.features.add("conv-dilated")
        if self.rng.random() < 0.6:  # padding after unlike padding before
            e = extra["pad_end"] = [ph + 1, pw]
            self.g.features.add("conv-pad-end")
        span_h, span_w = (fh - 1) * d + 1, (fw - 1) * d + 1
        if h + ph + e[0] < span_h or w + pw + e[1] < span_w:
            f, extra = [1] * dims, {}
            fh = fw = span_h = span_w = 1
            e = [ph, pw]
        out = int(self.rng.integers(1, 4))
        if c > 1 and self.rng.random() < 0.6:  # grouped: two groups, or depthwise
            extra["group"] = group = c if c % 2 or self.rng.random() < 0.5 else 2
            out = group * (2 if self.rng.random() < 0.7 else 1)
            # depthwise: one output per channel; grouped: several outputs per group
            self.g.features.add("conv-depthwise" if out == c else "conv-grouped")
        cfg = lp.ConvolutionConfig(num_output=out, filter_shape=f, stride=s, padding=p,
                                   bias=bool(self.rng.random() < 0.8), **extra)
        self.g.features.add(f"conv-{dims}d-settings")
        return self.one(cfg, cur, (n, out, (h + ph + e[0] - span_h) // sh + 1, (w + pw + e[1] - span_w) // sw + 1))

    def b_pool(self, cur: Blob) -> Blob:
        n, c, h, w = cur.shape
        if min(h, w) < 2:
            return cur
        s = int(self.rng.integers(1, 3))
        mode = str(self.rng.choice(["max", "average"]))
        f, p = 2, 0
        if self.rng.random() < 0.3:  # a wider window, padded
            f, p = (3, 1) if min(h, w) >= 3 else (2, 1)
            self.g.features.add("pool-padded")
        if self.rng.random() < 0.1:
            self.g.features.add("pool-global")
            return self.one(lp.PoolingConfig(mode=mode, global_pooling=True), cur, (n, c, 1, 1))
        extra: dict = {}
        if self.rng.random() < 0.3:
            extra["ceil_mode"] = True
            self.g.features.add("pool-ceil")
        if (p or extra) and mode == "average" and self.rng.random() < 0.7:
            extra["count_include_pad"] = False
            self.g.features.add("pool-exclude-pad")
        out = []
        for size in (h, w):
            o = (size + 2 * p - f + (s - 1 if extra.get("ceil_mode") else 0)) // s + 1
            out.append(o - 1 if extra.get("ceil_mode") and (o - 1) * s >= size + p else o)
        return self.one(lp.PoolingConfig(mode=mode, filter_shape=[f], stride=[s], padding=[p], **extra), cur,
                        (n, c, *out))

    def b_flatten(self, cur: Blob) -> Blob:
        if len(cur.shape) == 4 and self.rng.random() < 0.3:  # the axis counted from the end (the batch axis kept)
            self.g.features.add("flatten-axis")
            return self.one(lp.FlattenConfig(axis=-3), cur, (cur.shape[0], self.size(cur)))
        return self.one("Flatten", cur, (cur.shape[0], self.size(cur)))

    def b_reshape(self, cur: Blob) -> Blob:
        n, size = cur.shape[0], self.size(cur)
        divisors = [d for d in range(2, 5) if size % d == 0 and size // d >= 1]
        options: list[tuple[int, ...]] = [(n, size), (n, size, 1)]
        if divisors:
            d = int(self.rng.choice(divisors))
            options.append((n, d, size // d))
            rest = size // d
            side = [e for e in range(2, rest + 1) if rest % e == 0 and e * e <= rest]
            if side:
                options.append((n, d, side[-1], rest // side[-1]))
        shape = options[int(self.rng.integers(len(options)))]
        spec = list(shape)
        if len(spec) > 2 and self.rng.random() < 0.5:
            spec[int(self.rng.integers(1, len(spec)))] = -1  # inferred
        self.g.features.add("reshape")
        return self.one(lp.ReshapeConfig(shape=spec), cur, shape)

    def side_block(self, cur: Blob) -> Blob:
        """A MatMul by a square weight over the last axis, or a Transpose of the axes after the batch and the one
        undoing it: the blob's shape is kept, and the main random stream untouched (the side stream decides), so
        the networks the seeds made before these layers existed keep their structure."""
        side, prev_single = self.g.side, self.prev_single
        if len(cur.shape) < 2:
            return cur
        if len(cur.shape) == 2 or side.random() < 0.5:
            k = cur.shape[-1]
            cur = Blob(self.add(MatMulConfig(weight_shape=(k, k)), [cur], name_out=True)[0], cur.shape)
        else:
            rest = list(range(1, len(cur.shape)))
            perm = [0, *rest[1:], rest[0]]
            moved = Blob(self.add(TransposeConfig(perm=perm), [cur], name_out=True)[0],
                         tuple(cur.shape[p] for p in perm))
            back = [0, len(perm) - 1, *range(1, len(perm) - 1)]
            cur = Blob(self.add(TransposeConfig(perm=back), [moved], name_out=True)[0], cur.shape)
        self.prev_single = prev_single
        return cur

    def b_recurrent(self, cur: Blob) -> Blob:
        if len(cur.shape) != 3 or cur.shape[1] > 6:
            return self.b_linear(cur)
        kind = str(self.rng.choice(["LSTM", "GRU", "RNN"]))
        hidden = int(self.rng.integers(1, 4))
        seqs = bool(self.rng.random() < 0.7)
        cfg = {"LSTM": lp.LSTMConfig, "GRU": lp.GRUConfig, "RNN": lp.RNNConfig}[kind](
            hidden_size=hidden, return_sequences=seqs)
        n, t, _ = cur.shape
        return self.one(cfg, cur, (n, t, hidden) if seqs else (n, hidden))

    def b_shared(self, cur: Blob) -> Blob:
        """Two Linear layers of one square weight (and bias) with an activation between them; the second copy may
        sit in a nested container."""
        if len(cur.shape) != 2 or cur.shape[1] > 8:
            return self.b_linear(cur)
        self.g.features.add("shared")
        w = self.g.name("w")
        params = [lp.WeightConfig(name=f"{w}_w"), lp.WeightConfig(name=f"{w}_b")]
        cfg = lp.LinearConfig(output_size=cur.shape[1])
        cur = self.one(cfg, cur, params=params)
        cur = self.one(self.g.activation(), cur)
        if self.depth < 2 and self.rng.random() < 0.4:
            self.g.features.add("shared-nested")
            inner = _Builder(self.g, [("x", cur.shape)], self.depth + 1, False)
            inner.one(cfg, Blob("x", cur.shape), params=params)
            return self.one(inner.cfg, cur)
        return self.one(cfg, cur, params=params)

    def path(self, cur: Blob, change: bool = False) -> Blob:
        """One or two layers after ``cur`` that keep its shape, or with ``change`` may change axis 1's size
        (rank 2 and 4) or the last axis's (rank 3)."""
        r = len(cur.shape)
        out = cur
        for _ in range(int(self.rng.integers(1, 3))):
            choice = str(self.rng.choice(["act", "act", "bn", "lrn", "dropout", "weights", "in_place"]))
            if choice == "weights":
                if r == 4:
                    c = int(self.rng.integers(1, 4)) if change else out.shape[1]
                    f = int(self.rng.choice([1, 3]))
                    group = 1
                    if c > 1 and c == out.shape[1] and self.rng.random() < 0.4:  # two groups, or depthwise
                        group = 2 if c % 2 == 0 else c
                        self.g.features.add("conv-grouped" if group < c else "conv-depthwise")
                    out = self.one(lp.ConvolutionConfig(num_output=c, filter_shape=[f], padding=[f // 2], group=group),
                                   out, (out.shape[0], c, *out.shape[2:]))
                elif r == 3 and self.rng.random() < 0.5 and out.shape[1] <= 6:
                    h = int(self.rng.integers(1, 4)) if change else out.shape[2]
                    kind = str(self.rng.choice(["LSTM", "GRU", "RNN"]))
                    cfg = {"LSTM": lp.LSTMConfig, "GRU": lp.GRUConfig, "RNN": lp.RNNConfig}[kind](hidden_size=h)
                    out = self.one(cfg, out, (*out.shape[:2], h))
                else:
                    k = int(self.rng.integers(1, 5)) if change else out.shape[-1]
                    axis = -1 if r == 3 else 1
                    if r == 4:
                        continue
                    out = self.one(lp.LinearConfig(output_size=k, axis=axis), out, (*out.shape[:-1], k))
            elif choice == "in_place":
                out = self.in_place(out, keep_shape=True)
            else:
                out = getattr(self, f"b_{choice}")(out)
        return out

    def b_residual(self, cur: Blob) -> Blob:
        """cur -> {path a, path b or cur itself} -> Eltwise."""
        a = self.path(cur)
        b = self.path(cur) if self.rng.random() < 0.5 else cur
        reads = [a, b]
        if b is not cur and self.rng.random() < 0.3:
            reads.append(cur)  # three readers
        if self.rng.random() < 0.15:
            reads.append(a)  # one blob read twice by one layer
        self.rng.shuffle(reads)
        op = str(self.rng.choice(["sum", "sum", "prod", "max"]))
        coeff = [float(c) for c in self.rng.choice([-2.0, -0.5, 0.5, 1.0, 1.5], len(reads))] \
            if op == "sum" and self.rng.random() < 0.5 else None
        self.g.features.add(f"eltwise-{op}")
        if cur in reads:
            self.g.features.add("residual")
        cfg = lp.EltwiseConfig(operation=op, coeff=coeff) if coeff else lp.EltwiseConfig(operation=op)
        return Blob(self.add(cfg, reads)[0], cur.shape)

    def b_concat(self, cur: Blob) -> Blob:
        r = len(cur.shape)
        axis = -1 if r == 3 else 1
        if r == 4 and self.rng.random() < 0.3:
            axis = int(self.rng.choice([2, 3]))  # along a spatial axis: every path keeps the shape
        parts = [self.path(cur, change=axis in (1, -1)) for _ in range(int(self.rng.integers(1, 3)))]
        if self.rng.random() < 0.5 or len(parts) == 1:
            parts.append(cur)
        self.rng.shuffle(parts)
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        self.g.features.add("concat")
        return Blob(self.add(lp.ConcatConfig(axis=axis), parts)[0], tuple(shape))

    def b_slice(self, cur: Blob) -> Blob:
        r = len(cur.shape)
        axis = int(self.rng.choice([1, -1] if r == 3 else [1, 2, -1])) if r > 2 else 1
        length = cur.shape[axis]
        if length < 2:
            return self.b_act(cur)
        points = sorted(int(p) for p in self.rng.choice(np.arange(1, length), min(int(self.rng.integers(1, 3)),
                                                                                     length - 1), replace=False))
        bounds = [0, *points, length]
        shapes = []
        for lo, hi in zip(bounds, bounds[1:]):
            s = list(cur.shape)
            s[axis] = hi - lo
            shapes.append(tuple(s))
        self.g.features.add("slice")
        auto = self._is_prev(cur) and self.prev_single and self.rng.random() < 0.5
        names = self.add(lp.SliceConfig(axis=axis, slice_points=points), None if auto else [cur], n_out=len(shapes))
        parts = [Blob(n, s) for n, s in zip(names, shapes)]
        if len(parts) == 2 and self.rng.random() < 0.45:  # straight back together, by the automatic wiring
            self.g.features.add("slice-concat-auto")
            return Blob(self.add(lp.ConcatConfig(axis=axis), None)[0], cur.shape)
        if len(parts) > 1 and self.rng.random() < 0.2:
            parts.pop(int(self.rng.integers(len(parts))))  # a part nobody reads
            self.g.features.add("slice-unread")
        parts = [self.path(p) if self.rng.random() < 0.6 else p for p in parts]
        if len(parts) == 1:
            return parts[0]
        if len({p.shape for p in parts}) == 1 and self.rng.random() < 0.5:
            op = str(self.rng.choice(["sum", "prod", "max"]))
            self.g.features.add(f"eltwise-{op}")
            return Blob(self.add(lp.EltwiseConfig(operation=op), parts)[0], parts[0].shape)
        self.rng.shuffle(parts)
        shape = list(cur.shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        return Blob(self.add(lp.ConcatConfig(axis=axis), parts)[0], tuple(shape))

    def b_skip(self, cur: Blob) -> Blob:
        """Join with an earlier blob of the same shape (a long skip connection), or remember this one."""
        same = [b for b in self.earlier if b.shape == cur.shape and b.name != cur.name]
        if not same:
            self.earlier.append(cur)
            return self.b_act(cur)
        other = same[int(self.rng.integers(len(same)))]
        self.g.features.add("skip")
        return Blob(self.add(lp.EltwiseConfig(operation="sum"), [cur, other])[0], cur.shape)

    def b_sequential(self, cur: Blob) -> Blob:
        """A nested container over cur (and, in some, a second input: cur again or an earlier blob)."""
        second = None
        if self.rng.random() < 0.4:
            same = [b for b in self.earlier if b.shape == cur.shape and b.name != cur.name]
            second = same[0] if same and self.rng.random() < 0.5 else cur
        inputs = [("x", cur.shape)] + ([("y", second.shape)] if second is not None else [])
        inner = _Builder(self.g, inputs, self.depth + 1, False)
        out = inner.chain(Blob("x", cur.shape), int(self.rng.integers(1, 3)))
        if second is not None:
            self.g.features.add("nested-two-inputs")
            if out.shape == second.shape and self.rng.random() < 0.6:
                out = Blob(inner.add(lp.EltwiseConfig(operation="sum"), [out, Blob("y", second.shape)])[0],
                           out.shape)
            else:  # both flattened, then joined
                y = inner.one(self.g.activation(), Blob("y", second.shape))
                flat = [inner.one("Flatten", b, (b.shape[0], self.size(b))) for b in (out, y)]
                out = Blob(inner.add(lp.ConcatConfig(), flat)[0], (out.shape[0], sum(b.shape[1] for b in flat)))
        self.g.features.add("nested" if self.depth == 0 else "nested-deeper")
        reads = [cur] + ([second] if second is not None else [])
        auto = second is None and self._is_prev(cur) and self.prev_single and self.rng.random() < 0.5
        names = self.add(inner.cfg, None if auto else reads)
        return Blob(names[0], out.shape)

    def in_place(self, cur: Blob, keep_shape: bool = False) -> Blob:
        """An in-place-capable layer after cur; sometimes Caffe's named in-place request (output named as the
        input). The wiring decides whether it really runs in place."""
        choices = ["act", "act", "act", "Dropout"] + ([] if keep_shape else ["Reshape", "Flatten"])
        kind = str(self.rng.choice(choices))
        if kind == "act":
            cfg: object = self.g.activation(in_place=True)
        elif kind == "Dropout":
            cfg = lp.DropoutConfig(ratio=0.5)
        elif kind == "Flatten":
            cfg = "Flatten"
        else:
            cfg = lp.ReshapeConfig(shape=[cur.shape[0], -1])
        shape = cur.shape if kind in ("act", "Dropout") else (cur.shape[0], self.size(cur))
        named = not cur.name.startswith("SEQUENTIAL") and cur.name not in [n for n, _ in self.cfg.inputs]
        if kind in ("act", "Dropout") and self.rng.random() < 0.2 and named:
            self.g.features.add("named-in-place")
            self.add(cfg, [cur], out_names=[cur.name])
            return Blob(cur.name, shape)
        return self.one(cfg, cur, shape)


class _Generator:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.side = np.random.default_rng(seed + 1_000_003)  # the layers added after the rest (see side_block)
        self.extra = np.random.default_rng([seed, 1])
        """Draws for Clip among the activations, kept out of ``rng`` so that earlier seeds keep their networks."""
        self.count = 0
        self.features: set[str] = set()
        self.training = False

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def activation(self, in_place: bool = False) -> object:
        names = ["ReLU", "Sigmoid", "TanH", "LeakyReLU", "ELU"]
        if not in_place:
            names += ["GELU", "SiLU", "Swish", "Softplus"]
        kind = str(self.rng.choice(names))
        if kind == "LeakyReLU":
            return lp.LeakyReLUConfig(negative_slope=float(self.rng.choice([0.0, 0.1, 0.3])))
        if kind == "ELU":
            return lp.ELUConfig(alpha=float(self.rng.choice([0.5, 1.0, 1.5])))
        if kind == "GELU":
            return lp.GELUConfig(approximate=str(self.rng.choice(["none", "tanh"])))
        if kind == "Softplus":
            return lp.SoftplusConfig(beta=float(self.rng.choice([1.0, 2.0])))
        if kind == "ReLU" and self.extra.random() < 0.4:  # Clip, drawn aside: the seeds' networks stay as they were
            lower, upper = [(0.0, 6.0), (-1.0, 1.0), (-0.5, 2.0)][int(self.extra.integers(3))]
            return lp.ClipConfig(lower=lower, upper=upper)
        return kind

    def case(self, seed: int) -> Case:
        rng = self.rng
        family = FAMILIES[seed % len(FAMILIES)]
        self.training = bool(rng.random() < 0.3)
        n = 2
        inputs: list[Input] = []
        if family in ("image", "labels", "target"):
            c, h = int(rng.integers(1, 4)), int(rng.integers(4, 8))
            w = h if rng.random() < 0.7 else int(rng.integers(3, 8))
            inputs.append(Input("data", (n, c, h, w)))
        elif family == "vector":
            inputs.append(Input("data", (n, int(rng.integers(2, 7)))))
        elif family == "sequence":
            inputs.append(Input("data", (n, int(rng.integers(2, 5)), int(rng.integers(1, 4)))))
        else:
            shape = (n, int(rng.integers(2, 5))) if rng.random() < 0.7 else (n,)
            inputs.append(Input("ids", shape, "ids", int(rng.integers(3, 9))))
        b = _Builder(self, [(i.name, i.shape) for i in inputs], 0, True)
        cur = Blob(inputs[0].name, inputs[0].shape)
        if family == "ids":
            cur = self.embed(b, cur, inputs[0].bound)
        cur = b.chain(cur, int(rng.integers(2, 6)))
        if family == "labels":
            k = int(rng.integers(2, 5))
            if len(cur.shape) != 2:
                cur = b.one("Flatten", cur, (n, b.size(cur)))
            cur = b.one(lp.LinearConfig(output_size=k), cur, (n, k))
            log_softmax = rng.random() < 0.7
            if log_softmax:
                cur = b.one("LogSoftmax", cur)
            # scores without a LogSoftmax go to the fused loss (its sum, with class weights, for odd k); no draw
            loss = (lp.NegativeLogLikelihoodConfig(num_classes=k) if log_softmax else SoftmaxCrossEntropyConfig(
                num_classes=k, reduction="sum" if k % 2 else "mean", weight=tuple(0.5 + i for i in range(k * (k % 2)))))
            label = (n, 1) if rng.random() < 0.7 else (n,)
            inputs.append(Input("label", label, "labels", k))
            b.cfg.add_input("label", label)
            # without named inputs the loss reads the previous output and the unread declared input "label"
            named = not (b.prev_single and b._is_prev(cur)) or rng.random() < 0.4
            cur = Blob(b.add(loss, [cur, Blob("label", label)] if named else None)[0], (1,))
        elif family == "target":
            # the target has the prediction's shape, or its number of values per sample
            target = cur.shape if len(cur.shape) == 2 or rng.random() < 0.7 else (n, b.size(cur))
            inputs.append(Input("target", target))
            b.cfg.add_input("target", target)
            named = not (b.prev_single and b._is_prev(cur)) or rng.random() < 0.4
            cur = Blob(b.add("MeanSquaredError", [cur, Blob("target", target)] if named else None)[0], (1,))
        if cur.shape == (1,) and rng.random() < 0.5:
            cur = b.in_place(cur, keep_shape=True)  # in place after a loss
        elif len(cur.shape) >= 2 and rng.random() < 0.25:
            cur = b.b_softmax(cur)
        self.features.add(family)
        if rng.random() < 0.3:  # no input gradients: backward is pruned where no weight needs it
            b.cfg.force_backward = False
            self.features.add("pruned")
        return Case(seed, family, lp.LayerConfig("net", b.cfg), inputs, self.training, self.features)

    def embed(self, b: _Builder, ids: Blob, vocab: int) -> Blob:
        d = int(self.rng.integers(1, 4))
        first = b.one(lp.EmbeddingConfig(input_dim=vocab, output_dim=d), ids, (*ids.shape, d))
        if self.rng.random() < 0.4:  # two tables reading the same ids
            self.features.add("ids-fan-out")
            e = int(self.rng.integers(1, 4))
            second = Blob(b.add(lp.EmbeddingConfig(input_dim=vocab, output_dim=e), [ids])[0], (*ids.shape, e))
            shape = (*ids.shape, d + e)
            return Blob(b.add(lp.ConcatConfig(axis=-1), [first, second])[0], shape)
        return first


def random_case(seed: int) -> Case:
    """The random network of ``seed``."""
    return _Generator(seed).case(seed)


def random_network(rng: np.random.Generator) -> tuple[lp.LayerConfig, list[int]]:
    """A network config over one float input, with force_backward, and that input's shape (a case of a float-input
    family drawn from ``rng``)."""
    while True:
        case = random_case(int(rng.integers(2**31)))
        if len(case.inputs) == 1 and case.inputs[0].kind == "float":
            case.config.config.force_backward = True
            return case.config, list(case.inputs[0].shape)


def build(backend: lp.Backend, config: lp.LayerConfig, rng: np.random.Generator, training: bool = False
          ) -> lp.Layer:
    """The network with random weights, in inference mode (Dropout passes through, BatchNorm uses its running
    statistics) unless ``training``: no bias starts at exactly 0, where a ReLU over padded positions would sit on
    its kink and make central differences meaningless; running variances are positive."""
    net = lp.Layer.from_config(backend, config, seed=0)
    net.set_training(training)
    for name, w in zip(net.learnable_weights_names(), net.learnable_weights_data()):
        values = rng.standard_normal(w.shape) * 0.7
        w.set(np.abs(values) + 0.5 if name.endswith("running_var") else values)
    return net


def reset_dropout(net: lp.Layer) -> None:
    """Make every Dropout draw its first mask again on the next forward pass (a gradient check's forward passes
    then all see one mask)."""
    for worker in net.workers():
        if hasattr(worker, "calls") and hasattr(worker, "draw"):
            worker.calls = 0


def untrained(net: lp.Layer) -> tuple[str, ...]:
    """The running statistics among the network's weights (no gradient by design)."""
    return tuple(n for n in net.learnable_weights_names() if n.endswith(("running_mean", "running_var")))
