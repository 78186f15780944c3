"""A leafpy network -> an ONNX model: one entry of :data:`EMITTERS` per layer type, writing the ONNX nodes that
compute what the layer computes (checked in onnxruntime against the native backend, tests/test_onnx_export.py).

Where ONNX's operator differs from leafpy's layer the entry bridges it: AveragePool's count_include_pad always
written (ONNX's default excludes the padding; leafpy's default counts it), BatchNormalization's momentum as 1 minus
leafpy's, SiLU as Sigmoid·Mul below opset 24, recurrent layers in ONNX's layout 0 with Transposes around them and
the gates reordered (LSTM ifgo -> iofc, GRU rzn -> zrh, with linear_before_reset=1, PyTorch's form, which leafpy's
GRU is), Reshape with 0 for the batch entry, the batch dimension of every input left open ("N"). Deconvolution is
ConvTranspose (the same weight layout), global pooling GlobalMaxPool/GlobalAveragePool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..layers import Layer
from ._proto import require_onnx, unique_name
from .importer import GATES_TO_ONNX, reorder_gates

MIN_OPSET = 13
MAX_OPSET = 23


class Emitter:
    """The graph being written: nodes, initializers and fresh names."""

    def __init__(self, opset: int) -> None:
        self.onnx = require_onnx()
        self.opset = opset
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.names: set[str] = set()

    def fresh(self, hint: str) -> str:
        return unique_name(hint, self.names)

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | None = None, *, name: str = "",
             **attrs: Any) -> list[str]:
        outs = list(outputs) if outputs is not None else [self.fresh(f"{name or op}:out")]
        self.nodes.append(self.onnx.helper.make_node(op, list(inputs), outs, name=self.fresh(name or op), **attrs))
        return outs

    def const(self, hint: str, value: Any, dtype: Any = np.float32) -> str:
        name = self.fresh(hint)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.array(value, dtype=dtype, order="C"), name))
        return name


Emit = Callable[[Emitter, Layer, list[str], list[str]], None]
EMITTERS: dict[str, Emit] = {}


def emits(*layer_types: str) -> Callable[[Emit], Emit]:
    def register(fn: Emit) -> Emit:
        for t in layer_types:
            EMITTERS[t] = fn
        return fn
    return register


def weights_of(layer: Layer) -> dict[str, np.ndarray]:
    assert layer.worker is not None
    return {n: t.to_numpy().astype(np.float32) for n, t in zip(layer.worker.weight_names, layer.weights)}


def input_shape(layer: Layer, k: int = 0) -> tuple[int, ...]:
    return tuple(layer.inputs[k].shape)


def _window_attrs(c: Any) -> dict[str, Any]:
    """kernel_shape, strides and pads ([begin..., end...]: ``padding`` and ``pad_end``) of a window layer."""
    return dict(kernel_shape=list(c.filter_shape), strides=list(c.stride),
                pads=list(c.padding) + list(c.pad_end or c.padding))


def _with_weights(e: Emitter, layer: Layer, x: str) -> list[str]:
    w = weights_of(layer)
    args = [x, e.const(f"{layer.name}/weight", w["weight"])]
    if "bias" in w:
        args.append(e.const(f"{layer.name}/bias", w["bias"]))
    return args


@emits("Convolution")
def _conv(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c = layer.config.config
    e.node("Conv", _with_weights(e, layer, ins[0]), outs, name=layer.name, dilations=list(c.dilation),
           group=c.group, **_window_attrs(c))


@emits("Deconvolution")
def _deconv(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    """ConvTranspose: the same weight layout [C, num_output / group, kh, kw]."""
    c = layer.config.config
    attrs = _window_attrs(c)
    spatial = len(c.filter_shape)
    output_padding = list(c.output_padding) or [0] * spatial
    extra = [0] * spatial  # rows past the whole transposed convolution: the bias alone
    for i, (op, stride) in enumerate(zip(output_padding, c.stride)):
        if op >= stride:  # (leafpy takes it below the dilation too; ONNX runtimes only below the stride) the same
            end = attrs["pads"][spatial + i]  # rows, as less padding cut from the end and zeros past it
            attrs["pads"][spatial + i] = max(end - op, 0)
            extra[i], output_padding[i] = max(op - end, 0), 0
    if not any(extra):
        e.node("ConvTranspose", _with_weights(e, layer, ins[0]), outs, name=layer.name, dilations=list(c.dilation),
               group=c.group, output_padding=output_padding, **attrs)
        return
    w = weights_of(layer)
    y = e.node("ConvTranspose", [ins[0], e.const(f"{layer.name}/weight", w["weight"])], name=f"{layer.name}/conv",
               dilations=list(c.dilation), group=c.group, output_padding=output_padding, **attrs)[0]
    pads = e.const(f"{layer.name}/extra", [0] * (2 + spatial) + [0, 0, *extra], np.int64)
    if "bias" not in w:
        e.node("Pad", [y, pads], outs, name=layer.name)
        return
    y = e.node("Pad", [y, pads], name=f"{layer.name}/extra")[0]
    bias = e.const(f"{layer.name}/bias", w["bias"].reshape(-1, *[1] * spatial))
    e.node("Add", [y, bias], outs, name=layer.name)


@emits("Pooling")
def _pool(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c = layer.config.config
    op = "MaxPool" if c.mode == "max" else "AveragePool"
    if c.global_pooling:
        e.node(f"Global{op}", ins, outs, name=layer.name)
        return
    attrs = _window_attrs(c)
    if c.ceil_mode:
        attrs["ceil_mode"] = 1
    if c.mode == "average":  # ONNX's default excludes the padding from the divisor; leafpy's counts it
        attrs["count_include_pad"] = int(c.count_include_pad)
    e.node(op, ins, outs, name=layer.name, **attrs)


@emits("Linear")
def _linear(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c, w = layer.config.config, weights_of(layer)
    rank = len(input_shape(layer))
    x = ins[0]
    if c.axis == 1 or c.axis % rank == 1:
        if rank > 2:
            x = e.node("Flatten", [x], name=f"{layer.name}/flatten", axis=1)[0]
        args = [x, e.const(f"{layer.name}/weight", w["weight"])]
        if "bias" in w:
            args.append(e.const(f"{layer.name}/bias", w["bias"]))
        e.node("Gemm", args, outs, name=layer.name, transB=1)
        return
    axis = c.axis % rank
    if axis != rank - 1:  # features over several trailing axes: flatten them first, keeping the leading ones
        shape = [0] * axis + [-1]
        x = e.node("Reshape", [x, e.const(f"{layer.name}/shape", shape, np.int64)], name=f"{layer.name}/reshape")[0]
    wt = e.const(f"{layer.name}/weight_t", w["weight"].T)
    if "bias" not in w:
        e.node("MatMul", [x, wt], outs, name=layer.name)
        return
    y = e.node("MatMul", [x, wt], name=layer.name)[0]
    e.node("Add", [y, e.const(f"{layer.name}/bias", w["bias"])], outs, name=f"{layer.name}/bias")


@emits("BatchNorm")
def _batch_norm(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c, w = layer.config.config, weights_of(layer)
    channels = w["running_mean"].shape[0]
    scale = w.get("weight", np.ones(channels, np.float32))
    bias = w.get("bias", np.zeros(channels, np.float32))
    args = [ins[0]] + [e.const(f"{layer.name}/{k}", v) for k, v in
                       (("weight", scale), ("bias", bias), ("running_mean", w["running_mean"]),
                        ("running_var", w["running_var"]))]
    e.node("BatchNormalization", args, outs, name=layer.name, epsilon=c.eps, momentum=1.0 - c.momentum)


def _simple(op: str, **fixed: Any) -> Emit:
    def emit(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
        e.node(op, ins, outs, name=layer.name, **fixed)
    return emit


emits("ReLU")(_simple("Relu"))
emits("Sigmoid")(_simple("Sigmoid"))
emits("TanH")(_simple("Tanh"))


@emits("Flatten", "Softmax", "LogSoftmax")
def _on_axis(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    """ONNX's own operator on the layer's axis (from opset 13 Softmax and LogSoftmax take one axis, as leafpy)."""
    e.node(layer.config.type, ins, outs, name=layer.name, axis=layer.config.config.axis)


@emits("LeakyReLU")
def _leaky(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    e.node("LeakyRelu", ins, outs, name=layer.name, alpha=layer.config.config.negative_slope)


@emits("ELU")
def _elu(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    e.node("Elu", ins, outs, name=layer.name, alpha=layer.config.config.alpha)


@emits("GELU")
def _gelu(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    approx = layer.config.config.approximate
    if e.opset >= 20:
        e.node("Gelu", ins, outs, name=layer.name, approximate=approx)
        return
    x, n = ins[0], layer.name
    if approx == "none":  # 0.5 x (1 + erf(x / sqrt 2))
        inner = e.node("Erf", [e.node("Mul", [x, e.const(f"{n}/rsqrt2", 1 / math.sqrt(2))], name=n)[0]], name=n)[0]
    else:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = e.node("Mul", [x, e.node("Mul", [x, x], name=n)[0]], name=n)[0]
        poly = e.node("Add", [x, e.node("Mul", [cube, e.const(f"{n}/c", 0.044715)], name=n)[0]], name=n)[0]
        inner = e.node("Tanh", [e.node("Mul", [poly, e.const(f"{n}/k", math.sqrt(2 / math.pi))], name=n)[0]],
                       name=n)[0]
    one_plus = e.node("Add", [inner, e.const(f"{n}/one", 1.0)], name=n)[0]
    half_x = e.node("Mul", [x, e.const(f"{n}/half", 0.5)], name=n)[0]
    e.node("Mul", [half_x, one_plus], outs, name=n)


@emits("Softplus")
def _softplus(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    """log(1 + exp(beta x)) / beta. leafpy's threshold (x itself where beta x passes it) differs from that by under
    exp(-threshold): nothing in float32 from the default 20 up, so it is written only below 20, as a Where."""
    c, n = layer.config.config, layer.name
    beta, exact = c.beta, c.threshold < SOFTPLUS_THRESHOLD
    scaled = ins[0] if beta == 1.0 else e.node("Mul", [ins[0], e.const(f"{n}/beta", beta)], name=n)[0]
    sp = e.node("Softplus", [scaled], outs if beta == 1.0 and not exact else None, name=n)[0]
    if beta != 1.0:
        sp = e.node("Mul", [sp, e.const(f"{n}/inv_beta", 1.0 / beta)], None if exact else outs, name=n)[0]
    if exact:
        above = e.node("Greater", [scaled, e.const(f"{n}/threshold", c.threshold)], name=n)[0]
        e.node("Where", [above, ins[0], sp], outs, name=n)


SOFTPLUS_THRESHOLD = 20.0
"""Softplus's default threshold, from which exp(-threshold) is below float32's resolution."""


@emits("Clip")
def _clip(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    cfg, n = layer.config.config, layer.name
    e.node("Clip", [ins[0], e.const(f"{n}/min", cfg.lower), e.const(f"{n}/max", cfg.upper)], outs, name=n)


@emits("SiLU", "Swish")
def _silu(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    if e.opset >= 24:
        e.node("Swish", ins, outs, name=layer.name)
        return
    s = e.node("Sigmoid", ins, name=layer.name)[0]
    e.node("Mul", [ins[0], s], outs, name=layer.name)


@emits("Reshape")
def _reshape(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c = layer.config.config
    shape = list(c.shape) if c.whole_shape else [0, *c.shape[1:]]  # 0: the batch entry is the input's
    e.node("Reshape", [ins[0], e.const(f"{layer.name}/shape", shape, np.int64)], outs, name=layer.name)


@emits("Dropout")
def _dropout(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    ratio = e.const(f"{layer.name}/ratio", np.float32(layer.config.config.ratio))
    if len(outs) == 1:
        e.node("Dropout", [ins[0], ratio], outs, name=layer.name)
        return
    mask = e.fresh(f"{layer.name}:mask")  # ONNX's mask is boolean, leafpy's 1 and 0
    e.node("Dropout", [ins[0], ratio], [outs[0], mask], name=layer.name)
    e.node("Cast", [mask], outs[1:], name=f"{layer.name}/mask", to=e.onnx.TensorProto.FLOAT)


@emits("Transpose")
def _transpose(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    e.node("Transpose", ins, outs, name=layer.name, perm=list(layer.config.config.perm))


@emits("MatMul")
def _matmul(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    e.node("MatMul", _with_weights(e, layer, ins[0]) if len(ins) == 1 else ins, outs, name=layer.name)


@emits("Eltwise")
def _eltwise(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c, n = layer.config.config, layer.name
    if c.weight_shape:  # the weight operand, after the inputs
        ins = [*ins, e.const(f"{n}/weight", weights_of(layer)["weight"])]
    if c.operation == "prod":
        acc = ins[0]
        for i, x in enumerate(ins[1:], 1):
            acc = e.node("Mul", [acc, x], outs if i == len(ins) - 1 else None, name=n)[0]
        return
    if c.operation == "max":
        e.node("Max", ins, outs, name=n)
        return
    terms = [x if k == 1.0 else e.node("Mul", [x, e.const(f"{n}/coeff{i}", k)], name=n)[0]
             for i, (x, k) in enumerate(zip(ins, c.coeff or (1.0,) * len(ins)))]
    e.node("Sum", terms, outs, name=n)


@emits("Concat")
def _concat(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    e.node("Concat", ins, outs, name=layer.name, axis=layer.config.config.axis)


@emits("Slice")
def _slice(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c = layer.config.config
    shape = input_shape(layer)
    axis = c.axis % len(shape)
    bounds = (0, *c.slice_points, shape[axis])
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    e.node("Split", [ins[0], e.const(f"{layer.name}/split", sizes, np.int64)], outs, name=layer.name, axis=c.axis)


@emits("LRN")
def _lrn(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    c = layer.config.config
    e.node("LRN", ins, outs, name=layer.name, size=c.local_size, alpha=c.alpha, beta=c.beta, bias=c.k)


@emits("Embedding")
def _embedding(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    ids = e.node("Cast", ins, name=f"{layer.name}/ids", to=e.onnx.TensorProto.INT64)[0]
    e.node("Gather", [e.const(f"{layer.name}/weight", weights_of(layer)["weight"]), ids], outs, name=layer.name,
           axis=0)


@emits("LSTM", "GRU", "RNN")
def _recurrent(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    """ONNX's layout 0 ([T, N, input]) with Transposes around it: onnxruntime's CPU refuses layout 1."""
    kind, c, w, n = layer.config.type, layer.config.config, weights_of(layer), layer.name
    order = GATES_TO_ONNX[kind]
    w_ih, w_hh = reorder_gates(w["weight_ih"], order), reorder_gates(w["weight_hh"], order)
    if kind == "GRU":
        b = np.concatenate([reorder_gates(w["bias_ih"], order), reorder_gates(w["bias_hh"], order)])
    else:
        b = np.concatenate([reorder_gates(w["bias"], order), np.zeros_like(w["bias"])])
    args = [e.node("Transpose", ins, name=f"{n}/time_major", perm=[1, 0, 2])[0],
            e.const(f"{n}/W", w_ih[None]), e.const(f"{n}/R", w_hh[None]), e.const(f"{n}/B", b[None])]
    attrs: dict[str, Any] = dict(hidden_size=c.hidden_size)
    if kind == "GRU":
        attrs["linear_before_reset"] = int(c.linear_before_reset)
    y, y_h, y_c = e.fresh(f"{n}:Y"), e.fresh(f"{n}:Y_h"), e.fresh(f"{n}:Y_c")
    e.node(kind, args, [y, y_h, y_c][:3 if len(outs) > 1 else 2], name=n, **attrs)
    if len(outs) > 1:  # the last cell state Y_c [1, N, H] -> [N, H]
        e.node("Squeeze", [y_c, e.const(f"{n}/cell_axes", [0], np.int64)], outs[1:], name=f"{n}/cell")
        outs = outs[:1]
    axes = e.const(f"{n}/axes", [0 if not c.return_sequences else 1], np.int64)
    if not c.return_sequences:  # Y_h [1, N, H] -> [N, H]
        e.node("Squeeze", [y_h, axes], outs, name=f"{n}/last")
        return
    steps = e.node("Squeeze", [y, axes], name=f"{n}/steps")[0]  # [T, 1, N, H] -> [T, N, H]
    e.node("Transpose", [steps], outs, name=f"{n}/batch_major", perm=[1, 0, 2])


@emits("NegativeLogLikelihood")
def _nll(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    _loss(e, layer, ins, outs, "NegativeLogLikelihoodLoss")


@emits("SoftmaxCrossEntropy")
def _softmax_cross_entropy(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    _loss(e, layer, ins, outs, "SoftmaxCrossEntropyLoss")


def _loss(e: Emitter, layer: Layer, ins: list[str], outs: list[str], kind: str) -> None:
    """The loss node with its reduction, ignore_index and class weights; labels as int64 [N, d...] and a mean or
    sum as leafpy's [1]."""
    n, c = layer.name, layer.config.config
    per_sample = [0, *input_shape(layer)[2:]]
    labels = e.node("Reshape", [ins[1], e.const(f"{n}/per_sample", per_sample, np.int64)], name=f"{n}/labels")[0]
    labels = e.node("Cast", [labels], name=f"{n}/labels", to=e.onnx.TensorProto.INT64)[0]
    args = [ins[0], labels] + ([e.const(f"{n}/weight", c.weight, np.float32)] if c.weight else [])
    attrs: dict = {"reduction": c.reduction}
    if c.ignore_index is not None:
        attrs["ignore_index"] = c.ignore_index
    log_prob = outs[1:] if kind == "SoftmaxCrossEntropyLoss" else []
    if c.reduction == "none":
        e.node(kind, args, outs[:1] + log_prob, name=n, **attrs)
        return
    loss = e.node(kind, args, [e.fresh(f"{n}/loss"), *log_prob], name=n, **attrs)[0]
    e.node("Reshape", [loss, e.const(f"{n}/one", [1], np.int64)], outs[:1], name=f"{n}/shape")


@emits("MeanSquaredError")
def _mse(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    n = layer.name
    target = e.node("Reshape", [ins[1], e.const(f"{n}/shape", [0, *input_shape(layer)[1:]], np.int64)], name=n)[0]
    diff = e.node("Sub", [ins[0], target], name=n)[0]
    sq = e.node("Mul", [diff, diff], name=n)[0]
    mean = e.node("ReduceMean", [sq], name=n, keepdims=0)[0]
    e.node("Reshape", [mean, e.const(f"{n}/one", [1], np.int64)], outs, name=f"{n}/shape")


def emit_layer(e: Emitter, layer: Layer, ins: list[str], outs: list[str]) -> None:
    """The nodes of one layer, reading ``ins`` and writing ``outs``; a container's layers in turn."""
    if layer.worker is None:
        _emit_container(e, layer, ins, outs)
        return
    emit = EMITTERS.get(layer.config.type)
    if emit is None:
        raise ConfigError(f"layer '{layer.name}' ({layer.config.type}): no ONNX export for this layer type yet; "
                          f"exported types: {', '.join(sorted(EMITTERS))}")
    emit(e, layer, ins, outs)


def _emit_container(e: Emitter, seq: Any, ins: list[str], outs: list[str]) -> None:
    steps = seq.wiring.steps
    last = steps[-1].outputs
    names = dict(zip(seq.input_names, ins))
    for i, (child, step) in enumerate(zip(seq.layers, steps)):
        for o in step.outputs:
            names.setdefault(o, outs[last.index(o)] if i == len(steps) - 1 else e.fresh(f"{child.name}:{o}"))
        emit_layer(e, child, [names[b] for b in step.inputs], [names[b] for b in step.outputs])


def _fixes_first_axis(layer: Layer) -> bool:
    """Whether ``layer`` (a container: any of its layers) moves the first axis or fixes its size (a Transpose of
    axis 0, a Reshape of the whole shape not inferring its first entry, a Flatten from axis 0, a Slice or Concat
    along axis 0, whose pieces have fixed sizes): then the first axis is no batch, and the exported inputs keep
    its size."""
    c = layer.config.config
    kind = layer.config.type
    if kind == "Sequential":
        container: Any = layer  # (a Sequential: its layers)
        return any(_fixes_first_axis(child) for child in container.layers)
    if kind in ("Slice", "Concat"):
        return bool(layer.inputs) and c.axis % len(input_shape(layer)) == 0
    return ((kind == "Transpose" and c.perm[0] != 0) or (kind == "Reshape" and c.whole_shape and c.shape[0] != -1)
            or (kind == "Flatten" and c.axis == 0))


PREPARATION_KEY = "leafpy.preparation"
"""The model's metadata entry (``metadata_props``) holding its preparation's JSON (class names, normalisation)."""


def to_model(layer: Layer, opset: int = 17) -> Any:
    """``layer`` as an onnx.ModelProto at ``opset``, checked by onnx's checker."""
    onnx = require_onnx()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ConfigError(f"lp.onnx.export: opset must be an integer from {MIN_OPSET} to {MAX_OPSET}, got {opset!r}")
    if not layer.inputs and layer.worker is not None:
        raise ConfigError(f"layer '{layer.name}': a standalone layer exports after its first forward pass (its input "
                          "shapes are known then); or export the network holding it")
    e = Emitter(opset)
    if layer.worker is None:  # the shapes it is bound at (its last forward pass's), which its outputs' are of
        seq: Any = layer
        in_names = list(seq.input_names)
        in_shapes = [tuple(t.shape) for t in seq.inputs] if seq.inputs else [tuple(s) for s in seq.input_shapes]
    else:
        in_names = [f"input{k}" for k in range(len(layer.inputs))]
        in_shapes = [tuple(t.shape) for t in layer.inputs]
    out_names = [f"output{k}" if len(layer.outputs) > 1 else "output" for k in range(len(layer.outputs))]
    e.names.update(in_names + out_names)
    emit_layer(e, layer, in_names, out_names)
    h = onnx.helper
    float_t = onnx.TensorProto.FLOAT
    open_batch = "N" if not _fixes_first_axis(layer) else None
    inputs = [h.make_tensor_value_info(n, float_t, [open_batch or s[0], *s[1:]]) for n, s in zip(in_names, in_shapes)]
    batch = in_shapes[0][0] if in_shapes and in_shapes[0] and open_batch else None
    # an output's first axis is the batch's, or with an open batch one that follows it (a Flatten from axis 2, a
    # Reshape of the whole shape inferring its first entry): no number then
    outputs = [h.make_tensor_value_info(n, float_t, [("N" if d == batch else f"{n}_{i}") if i == 0 and batch
                                                     else d for i, d in enumerate(t.shape)])
               for n, t in zip(out_names, layer.outputs)]
    graph = h.make_graph(e.nodes, layer.name, inputs, outputs, e.initializers)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], producer_name="leafpy")
    if layer.preparation is not None and layer.preparation.to_text():
        # how the model reads data (class names, the normalisation of its inputs and targets), as a model file
        # records it: leafpy's load reads it back, and other programs find the values there
        h.set_model_props(model, {PREPARATION_KEY: layer.preparation.to_text()})
    model.ir_version = h.find_min_ir_version_for(list(model.opset_import))  # the oldest that holds it: read widely
    onnx.checker.check_model(model)
    return model
