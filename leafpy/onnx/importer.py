"""ONNX graph -> a leafpy Sequential of LayerConfigs with named wiring, and its weights.

Each ONNX operator is one entry of :data:`OPS` (the ``@op`` decorator): the attributes it understands and a
function that turns one node into layers. An attribute value a layer cannot compute, or an operator with no entry,
is a ConfigError naming the node, the operator, the attribute and what is supported, never a silently different
function. A new layer feature is one entry (or one accepted attribute value) more. A node that breaks ONNX's own
schema of its operator (an attribute of another type, a required attribute or input missing; see :class:`Node`)
is a SerializationError: a malformed model.

Blob shapes are followed through the graph with the layers' own ``output_shapes`` (the batch taken from the graph's
inputs, or ``batch_size`` where the graph leaves it open), so every layer is checked as it is added.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _checks
from .._memory import available_memory
from ..errors import ConfigError, LeafpyError, SerializationError, ShapeError
from ..layer_config import lookup
from ..layers import (
    BatchNormConfig,
    ClipConfig,
    ConcatConfig,
    ConvolutionConfig,
    DeconvolutionConfig,
    DropoutConfig,
    EltwiseConfig,
    ELUConfig,
    EmbeddingConfig,
    FlattenConfig,
    GELUConfig,
    GRUConfig,
    LayerConfig,
    LeakyReLUConfig,
    LinearConfig,
    LogSoftmaxConfig,
    LRNConfig,
    LSTMConfig,
    NegativeLogLikelihoodConfig,
    PoolingConfig,
    ReshapeConfig,
    RNNConfig,
    SequentialConfig,
    SliceConfig,
    SoftmaxConfig,
    SoftplusConfig,
)
from ..layers.activation.clip import F32_MAX
from ..layers.common.matmul import MatMulConfig
from ..layers.loss.negative_log_likelihood import REDUCTIONS, SoftmaxCrossEntropyConfig
from ..layers.utility.transpose import TransposeConfig
from ._proto import opset_of, require_onnx, to_array, unique_name

Converter = Callable[["Graph", "Node"], None]


@dataclass(frozen=True)
class OpEntry:
    convert: Converter
    attributes: tuple[str, ...]


OPS: dict[str, OpEntry] = {}


def op(*names: str, attributes: Sequence[str] = ()) -> Callable[[Converter], Converter]:
    """Register a converter for the ONNX operators ``names``, accepting ``attributes`` (others are refused)."""

    def register(fn: Converter) -> Converter:
        for n in names:
            OPS[n] = OpEntry(fn, tuple(attributes))
        return fn

    return register


def supported_operators() -> list[str]:
    return sorted(OPS)


ATTRIBUTE_TYPES = {"FLOAT": "a number (FLOAT)", "INT": "an integer (INT)", "STRING": "a string (STRING)",
                   "TENSOR": "a tensor (TENSOR)", "FLOATS": "a list of numbers (FLOATS)",
                   "INTS": "a list of integers (INTS)", "STRINGS": "a list of strings (STRINGS)",
                   "TENSORS": "a list of tensors (TENSORS)", "UNDEFINED": "of no type (UNDEFINED)"}
"""ONNX's attribute types as messages name them."""

WIDENED = {("INT", "FLOAT"), ("INTS", "FLOATS")}
"""An attribute of the first type read where ONNX's schema declares the second: the same values, so taken."""

MALFORMED = "a malformed model; re-export it (onnx.checker.check_model(model) reports such errors)"


@dataclass(frozen=True)
class Schema:
    """What ONNX's schema of an operator asks of a node: its attributes' types by name ("INTS"), the attributes it
    requires, and the names of its inputs and outputs that are no optional ones, by position."""

    types: dict[str, str] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    inputs: dict[int, str] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)


@functools.cache
def schema_of(op_type: str, opset: int) -> Schema:
    """ONNX's schema of ``op_type`` (default domain) at ``opset``; the types include attributes that only other
    versions of the operator declare (leafpy reads BatchNormalization's ``spatial`` at any opset). Empty for an
    operator ONNX does not define; only the types for one it defines after ``opset`` only (Gelu in a model at 17)."""
    from onnx.defs import OpSchema, SchemaError, get_schema

    def version(v: int | None) -> Any:
        try:
            return get_schema(op_type) if v is None else get_schema(op_type, v)
        except SchemaError:
            return None

    at = version(opset)
    types: dict[str, str] = {}
    older = at
    while older is not None:  # this version, then the older ones
        for k, a in older.attributes.items():
            types.setdefault(k, a.type.name)
        older = version(older.since_version - 1) if older.since_version > 1 else None
    for k, a in getattr(version(None), "attributes", {}).items():  # then the newest
        types.setdefault(k, a.type.name)
    if at is None:
        return Schema(types)
    single = OpSchema.FormalParameterOption.Single
    return Schema(types, frozenset(k for k, a in at.attributes.items() if a.required),
                  {i: f.name for i, f in enumerate(at.inputs) if f.option == single},
                  {i: f.name for i, f in enumerate(at.outputs) if f.option == single})


class Node:
    """One ONNX node with its attributes decoded, and the error messages that name it.

    Each attribute is checked against the type ONNX's schema of the operator declares for it (``strides`` INTS,
    ``group`` INT, ``auto_pad`` STRING, ...), strings decoded as UTF-8, and the attributes, inputs and outputs the
    schema requires must be there: a node that breaks these is a SerializationError naming the node and the
    attribute or input, so the converters read values of the declared types and find what they need."""

    def __init__(self, proto: Any, index: int, opset: int) -> None:
        self.proto = proto
        self.op = proto.op_type
        self.name = proto.name or f"{proto.op_type}_{index}"
        schema = schema_of(self.op, opset) if proto.domain in ("", "ai.onnx") else Schema()
        self.attrs: dict[str, Any] = {}
        for a in proto.attribute:
            if a.name in self.attrs:
                raise SerializationError(f"{self.where}: attribute {a.name!r} is given twice: {MALFORMED}")
            self.attrs[a.name] = self._decode(a, schema.types.get(a.name))
        missing = sorted(schema.required - self.attrs.keys())
        if missing:
            kind = schema.types[missing[0]]
            raise SerializationError(f"{self.where}: attribute {missing[0]!r} is missing; ONNX's {self.op} requires "
                                     f"it ({ATTRIBUTE_TYPES.get(kind, kind)}): {MALFORMED}")
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        for what, names, given in (("input", schema.inputs, self.inputs), ("output", schema.outputs, self.outputs)):
            for i, formal in names.items():
                if i >= len(given) or not given[i]:
                    raise SerializationError(f"{self.where}: {what} {i} ({formal}) is missing; ONNX's {self.op} "
                                             f"requires it: {MALFORMED}")
        self.lifted = False
        """A window operator on a 1-D input, computed as on an image of height 1 (see _spatial_input)."""

    def _decode(self, a: Any, wanted: str | None) -> Any:
        """The value of attribute ``a``, of the type ``wanted`` (ONNX's schema's; None: not declared there), strings
        as str."""
        onnx = require_onnx()
        kinds = onnx.AttributeProto.AttributeType
        kind = kinds.Name(a.type) if a.type in kinds.values() else f"type {a.type}"
        if kind == "UNDEFINED" or (wanted is not None and kind != wanted and (kind, wanted) not in WIDENED):
            takes = f", where ONNX's {self.op} takes {ATTRIBUTE_TYPES.get(wanted, wanted)}" if wanted else ""
            raise SerializationError(f"{self.where}: attribute {a.name!r} is {ATTRIBUTE_TYPES.get(kind, kind)}"
                                     f"{takes}: {MALFORMED}")
        try:
            value = onnx.helper.get_attribute_value(a)
        except (ValueError, TypeError) as e:
            raise SerializationError(f"{self.where}: attribute {a.name!r} cannot be read ({e}): {MALFORMED}") from None
        if (kind, wanted) in WIDENED:
            return float(value) if kind == "INT" else [float(v) for v in value]
        if kind == "STRING":
            return self._text(a.name, value)
        if kind == "STRINGS":
            return [self._text(a.name, v) for v in value]
        return value

    def _text(self, attribute: str, value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise SerializationError(f"{self.where}: attribute {attribute!r} holds bytes that are no UTF-8 text "
                                     f"({value[:40]!r}): {MALFORMED}") from None

    @property
    def where(self) -> str:
        return f"ONNX node '{self.name}' ({self.op})"

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def refuse(self, attribute: str, value: Any, supported: str) -> ConfigError:
        return ConfigError(f"{self.where}: {attribute}={value!r} is not supported; leafpy supports {supported}")

    def require(self, attribute: str, ok: Callable[[Any], bool], supported: str, default: Any = None) -> Any:
        """The attribute's value (or ``default``), refused unless ``ok(value)``."""
        value = self.attr(attribute, default)
        if not ok(value):
            raise self.refuse(attribute, value, supported)
        return value

    def has_input(self, k: int) -> bool:
        return k < len(self.inputs) and bool(self.inputs[k])

    def used_outputs(self, graph: Graph) -> list[int]:
        return [k for k, o in enumerate(self.outputs) if o and graph.is_used(o)]


SEEN_AS = {"x": (1, 0, 2), "steps": (1, 0, 2), "Y2": (1, 2, 0, 3), "Y2t": (1, 0, 2, 3)}
"""The axes of a batch-first blob that ONNX's time-major view of it (``Graph.time_major``'s kinds) reads, in order."""


@dataclass
class Graph:
    """The conversion's state: constants, blob shapes, aliases, the layers and weights made so far."""

    model: Any
    constants: dict[str, np.ndarray]
    batch_size: int
    feeds: frozenset[str] = frozenset()
    """Graph inputs whose values are given (the test backend's run-time weights): usable as constants too."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    alias: dict[str, str] = field(default_factory=dict)
    layers: list[LayerConfig] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    used_inputs: list[str] = field(default_factory=list)
    readers: dict[str, int] = field(default_factory=dict)
    layer_names: set[str] = field(default_factory=set)
    time_major: dict[str, tuple[str, str]] = field(default_factory=dict)
    """ONNX values that are a leafpy blob seen time-major, around a layout-0 recurrent node: value -> (blob,
    what it is: "x" [T, N, I] the blob transposed; "Y" [T, 1, N, H]; "Y_h" [1, N, H]; "steps" [T, N, H]; both
    directions' steps [N, T, 2, H] as "Y2" [T, 2, N, H] and "Y2t" [T, N, 2, H])."""
    stacked: dict[str, list[str]] = field(default_factory=dict)
    """ONNX values that join one-direction last states ("Y_h" values of ``time_major``) along axis 0, as PyTorch
    writes a stacked recurrent network's h_n [layers, N, H]: value -> those values, in order (made a blob only
    where something reads it whole; h_n[k] is the k-th state's blob)."""

    @property
    def opset(self) -> int:
        return opset_of(self.model)

    def is_used(self, name: str) -> bool:
        return self.readers.get(name, 0) > 0 or name in {o.name for o in self.model.graph.output}

    def resolve(self, name: str) -> str:
        seen = set()
        while name in self.alias:
            if name in seen:
                raise SerializationError(f"ONNX value {name!r} names itself through Identity-like nodes (a cycle): "
                                         f"{MALFORMED}")
            seen.add(name)
            name = self.alias[name]
        return name

    def blob(self, node: Node, k: int) -> str:
        """Input ``k`` of ``node`` as a computed blob (a graph input or a layer's output)."""
        if not node.has_input(k):
            raise ConfigError(f"{node.where}: input {k} is missing")
        name = self.resolve(node.inputs[k])
        if name in self.shapes:
            return name
        if name in self.input_shapes:
            if name not in self.used_inputs:
                self.used_inputs.append(name)
            self.shapes[name] = self.input_shapes[name]
            return name
        if name in self.time_major:
            return self._time_major_blob(node, name)
        if name in self.stacked:
            states = [self._time_major_blob(node, state) if state not in self.shapes else state
                      for state in self.stacked[name]]
            self.add(node, ConcatConfig(axis=0), states, [name], suffix="_states")
            return name
        if name in self.constants:
            raise ConfigError(f"{node.where}: input {k} ({name!r}) is a constant; leafpy computes this operator on "
                              "computed tensors (a constant operand here needs broadcasting, not supported yet)")
        raise ConfigError(f"{node.where}: input {k} ({name!r}) is not produced by any earlier node or graph input")

    def _time_major_blob(self, node: Node, name: str) -> str:
        """A value held time-major (see ``time_major``) as a blob of its ONNX shape, through a Transpose layer:
        "x" and "steps" [T, N, ...], "Y" [T, 1, N, H], "Y_h" [1, N, H], "Y2" [T, 2, N, H], "Y2t" [T, N, 2, H]."""
        blob, kind = self.time_major[name]
        shape = self.shapes[blob]
        if kind in ("Y2", "Y2t"):  # [N, T, 2, H] seen as [T, 2, N, H] or [T, N, 2, H]
            self.add(node, TransposeConfig(perm=SEEN_AS[kind]), [blob], [name], suffix="_time_major")
            return name
        if kind == "Y_h":
            self.add(node, ReshapeConfig(shape=(shape[0], 1, shape[1])), [blob], [name + ":directions"],
                     suffix="_directions")
            blob = name + ":directions"
        steps = name + ":steps" if kind == "Y" else name
        self.add(node, TransposeConfig(perm=(1, 0, 2)), [blob], [steps], suffix="_time_major")
        if kind == "Y":
            t, n, h = self.shapes[steps]
            self.add(node, ReshapeConfig(shape=(t, 1, n, h)), [steps], [name], suffix="_directions")
        return name

    def const(self, node: Node, k: int, what: str) -> np.ndarray | None:
        """Input ``k`` of ``node`` as a constant (None where the optional input is absent)."""
        if not node.has_input(k):
            return None
        name = self.resolve(node.inputs[k])
        if name in self.constants:
            return self.numbers(node, name, f"input {k} ({name!r}, the {what})")
        raise ConfigError(f"{node.where}: input {k} ({name!r}, the {what}) must be a constant (an initializer or "
                          "a Constant node); leafpy holds it as a layer's weight")

    def numbers(self, node: Node, name: str, what: str) -> np.ndarray:
        """The constant ``name`` (``what`` ``node`` reads) as numbers: a tensor of strings or complex numbers is
        refused naming it (ONNX's operators leafpy imports compute on real numbers)."""
        value = self.constants[name]
        if value.dtype.kind in "biuf" or value.dtype.type.__module__.startswith("ml_dtypes"):  # bfloat16, float8
            return value
        held = {"O": "strings", "S": "strings", "U": "strings", "c": "complex numbers"}.get(value.dtype.kind,
                                                                                            str(value.dtype))
        raise SerializationError(f"{node.where}: {what} holds {held}; ONNX's {node.op} takes real numbers there: "
                                 f"{MALFORMED}")

    def shape(self, blob: str) -> tuple[int, ...]:
        return self.shapes[blob]

    def layer_name(self, node: Node, suffix: str = "") -> str:
        base = re.sub(r"[^A-Za-z0-9_.\-]+", "_", node.name + suffix).strip("_.") or f"{node.op}"
        return unique_name(base, self.layer_names)

    def add(self, node: Node, layer_type: Any, inputs: Sequence[str], outputs: Sequence[str], *,
            weights: dict[str, np.ndarray] | None = None, suffix: str = "") -> str:
        """Append a layer reading ``inputs`` and writing ``outputs``; its output shapes are computed (and its
        input shapes checked) by the layer type itself. Returns the layer's name."""
        name = self.layer_name(node, suffix)
        cfg = LayerConfig(name, layer_type, inputs=list(inputs), outputs=list(outputs))
        worker = lookup(cfg.type).impl(cfg.config, name)
        shapes = [self.shapes[b] for b in inputs]
        try:
            worker.check_inputs(shapes)
            out_shapes = worker.output_shapes(shapes)
        except ShapeError as e:
            raise ConfigError(f"{node.where}: as leafpy's {cfg.type} layer: {e}") from None
        for o, s in zip(outputs, out_shapes):
            self.shapes[o] = tuple(int(d) for d in s)
        for local, value in (weights or {}).items():
            self.weights[f"{name}/{local}"] = np.ascontiguousarray(value, dtype=np.float32)
        self.layers.append(cfg)
        return name


# ----------------------------------------------------------------------------------------------------------------
# helpers for window operators
# ----------------------------------------------------------------------------------------------------------------
def _spatial_input(g: Graph, n: Node) -> tuple[str, tuple[int, ...]]:
    """The input of a window operator as an image [N, C, H, W]: a 1-D input [N, C, L] as an image of height 1
    (its attributes widened to match; :func:`_add_window` brings the output back)."""
    x = g.blob(n, 0)
    shape = g.shape(x)
    if len(shape) == 3:
        x = _as_image(g, n, x, shape)
        shape = g.shape(x)
    if len(shape) != 4:
        raise ConfigError(f"{n.where}: input of shape {shape}: leafpy's window operators take 2-D images "
                          "[N, C, H, W] and 1-D inputs [N, C, L] (3-D is not supported)")
    return x, shape


def _as_image(g: Graph, n: Node, x: str, shape: tuple[int, ...]) -> str:
    for name, fill in (("kernel_shape", 1), ("strides", 1), ("dilations", 1), ("output_padding", 0),
                       ("output_shape", 1)):
        if name in n.attrs:
            n.attrs[name] = [fill, *n.attrs[name]]
    if "pads" in n.attrs:
        pads = list(n.attrs["pads"])
        if len(pads) != 2:
            raise n.refuse("pads", pads, "two pads [begin, end] for a 1-D input")
        n.attrs["pads"] = [0, pads[0], 0, pads[1]]
    n.lifted = True
    image = f"{n.outputs[0]}:image"
    g.add(n, ReshapeConfig(shape=(shape[0], shape[1], 1, shape[2])), [x], [image], suffix="_as_image")
    return image


def _add_window(g: Graph, n: Node, cfg: Any, x: str, weights: dict[str, np.ndarray] | None = None) -> None:
    """The window layer, its output brought back to [N, C, L] where the input was 1-D."""
    if not n.lifted:
        g.add(n, cfg, [x], [n.outputs[0]], weights=weights)
        return
    image = f"{n.outputs[0]}:image_out"
    g.add(n, cfg, [x], [image], weights=weights)
    shape = g.shape(image)
    g.add(n, ReshapeConfig(shape=(shape[0], shape[1], shape[3])), [image], [n.outputs[0]], suffix="_as_1d")


def _same_pads(n: Node, auto: str, totals: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """auto_pad SAME_UPPER (the odd row or column at the end) or SAME_LOWER (at the start): ``totals`` split into
    (begin, end) per spatial dimension."""
    if any(t < 0 for t in totals):
        raise n.refuse("auto_pad", auto, "SAME_* where the padding it asks for is not negative (here "
                       f"{list(totals)} rows/columns); NOTSET with pads, VALID")
    small = tuple(t // 2 for t in totals)
    large = tuple(t - t // 2 for t in totals)
    return (small, large) if auto == "SAME_UPPER" else (large, small)


def _pads(n: Node, shape: tuple[int, ...], kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int] = (1, 1)) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``pads`` (or ``auto_pad``, computed from the static input shape) as (padding, pad_end): the rows/columns
    before and after each spatial dimension."""
    auto = n.attr("auto_pad", "NOTSET")
    for attribute, values in (("strides", strides), ("dilations", dilations)):
        if len(values) != 2 or min(values) < 1:
            raise n.refuse(attribute, list(values[1:] if n.lifted else values), "one positive size per spatial "
                           "dimension")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        return _same_pads(n, auto, [max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
                                    for size, k, s, d in zip(shape[2:], kernel, strides, dilations)])
    if auto not in ("NOTSET", "VALID"):
        raise n.refuse("auto_pad", auto, "NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    pads = [int(p) for p in n.attr("pads", [0, 0, 0, 0])] if auto == "NOTSET" else [0, 0, 0, 0]
    if len(pads) != 4 or min(pads) < 0:
        raise n.refuse("pads", pads, "four pads [h_begin, w_begin, h_end, w_end], none negative")
    return tuple(pads[:2]), tuple(pads[2:])


def _kernel(n: Node, filters: Sequence[int] | None) -> tuple[int, ...]:
    """``kernel_shape`` (by default ``filters``, the filters' spatial shape, which a given one must match), one size
    of at least 1 per spatial dimension of the image."""
    kernel = tuple(n.attr("kernel_shape", filters))
    shown = list(kernel[1:] if n.lifted else kernel)
    if len(kernel) != 2:
        raise n.refuse("kernel_shape", shown, "one size for a 1-D input" if n.lifted else "two sizes [kh, kw] for a "
                       "2-D image")
    if min(kernel) < 1:
        raise ConfigError(f"{n.where}: kernel_shape={shown} is an empty window; every size of the kernel must be at "
                          "least 1")
    if filters is not None and kernel != tuple(filters):
        raise ConfigError(f"{n.where}: kernel_shape={shown} does not match the filters' spatial shape "
                          f"{list(filters[1:] if n.lifted else filters)}; leave kernel_shape out, or give the filters' "
                          "shape")
    return kernel


def _ones(value: Any) -> bool:
    return value is None or all(v == 1 for v in value)


def _config(n: Node, config_class: Any, **fields: Any) -> Any:
    """``config_class(**fields)``, a value it refuses reported as the node's."""
    try:
        return config_class(**fields)
    except ConfigError as e:
        raise ConfigError(f"{n.where}: as leafpy's {config_class.__name__}: {e}") from None


def _filters(g: Graph, n: Node, group: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Conv's and ConvTranspose's filters (4-D: 2-D images) and optional bias."""
    w = g.const(n, 1, "filters")
    assert w is not None  # input 1 is required: g.const raised otherwise
    if n.lifted and w.ndim == 3:
        w = w[:, :, None, :]
    if w.ndim != 4:
        raise ConfigError(f"{n.where}: filters of shape {w.shape}: leafpy convolves 2-D images (4-D filters)")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise n.refuse("group", group, "a positive group")
    return w, g.const(n, 2, "bias")


def _weights(w: np.ndarray, b: np.ndarray | None) -> dict[str, np.ndarray]:
    return {"weight": w} if b is None else {"weight": w, "bias": b}


# ----------------------------------------------------------------------------------------------------------------
# the operators
# ----------------------------------------------------------------------------------------------------------------
@op("Conv", attributes=("kernel_shape", "strides", "pads", "dilations", "group", "auto_pad"))
def conv(g: Graph, n: Node) -> None:
    x, shape = _spatial_input(g, n)
    group = n.attr("group", 1)
    w, b = _filters(g, n, group)
    if w.shape[1] * group != shape[1]:
        raise ConfigError(f"{n.where}: filters of shape {w.shape} with group {group} read {w.shape[1] * group} "
                          f"channels; the input has {shape[1]} (shape {shape})")
    kernel = _kernel(n, w.shape[2:])
    strides = tuple(n.attr("strides", [1, 1]))
    dilations = tuple(n.attr("dilations", [1, 1]))
    begin, end = _pads(n, shape, kernel, strides, dilations)
    cfg = _config(n, ConvolutionConfig, num_output=w.shape[0], filter_shape=kernel, stride=strides, padding=begin,
                  pad_end=end, dilation=dilations, group=group, bias=b is not None)
    _add_window(g, n, cfg, x, _weights(w, b))


@op("ConvTranspose", attributes=("kernel_shape", "strides", "pads", "dilations", "group", "auto_pad",
                                 "output_padding", "output_shape"))
def conv_transpose(g: Graph, n: Node) -> None:
    x, shape = _spatial_input(g, n)
    group = n.attr("group", 1)
    w, b = _filters(g, n, group)
    if w.shape[0] != shape[1]:
        raise ConfigError(f"{n.where}: filters of shape {w.shape} read {w.shape[0]} channels; the input has "
                          f"{shape[1]} (shape {shape})")
    kernel = _kernel(n, w.shape[2:])
    strides = tuple(n.attr("strides", [1, 1]))
    dilations = tuple(n.attr("dilations", [1, 1]))
    extra = tuple(n.attr("output_padding", [0, 0]))
    full = [s * (size - 1) + e + (k - 1) * d + 1 for size, k, s, d, e in zip(shape[2:], kernel, strides, dilations,
                                                                             extra)]
    wanted = n.attr("output_shape")
    wanted = list(wanted)[-2:] if wanted is not None else None
    auto = n.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        target = wanted or [size * s for size, s in zip(shape[2:], strides)]
        begin, end = _same_pads(n, auto, [f - t for f, t in zip(full, target)])
    else:
        begin, end = _pads(n, shape, kernel, strides)
        if wanted is not None:  # rows/columns beyond the computed output: output padding (the bias alone)
            more = [t - (f - p - q) for t, f, p, q in zip(wanted, full, begin, end)]
            if min(more) < 0:
                raise n.refuse("output_shape", wanted, "an output_shape at least the computed output "
                               f"{[f - p - q for f, p, q in zip(full, begin, end)]} (smaller, ONNX's specification "
                               "and its reference place the cut differently); or give pads")
            extra = tuple(e + m for e, m in zip(extra, more))
    cfg = _config(n, DeconvolutionConfig, num_output=w.shape[1] * group, filter_shape=kernel, stride=strides,
                  padding=begin, pad_end=end, output_padding=extra, dilation=dilations, group=group,
                  bias=b is not None)
    _add_window(g, n, cfg, x, _weights(w, b))


def _pool(g: Graph, n: Node, mode: str) -> None:
    x, shape = _spatial_input(g, n)
    if len(n.used_outputs(g)) > 1 or (len(n.outputs) > 1 and n.outputs[1]):
        raise ConfigError(f"{n.where}: the Indices output is not supported; leafpy's Pooling gives the pooled values")
    kernel = _kernel(n, None)
    strides = tuple(n.attr("strides", [1] * len(kernel)))
    n.require("storage_order", lambda v: v == 0, "storage_order=0 (row-major)", 0)
    begin, end = _pads(n, shape, kernel, strides)
    if not _ones(n.attr("dilations")):
        _dilated_pool(g, n, mode, x, shape, kernel, strides, begin + end)
        return
    if any(p >= k for p, k in zip(begin + end, kernel + kernel)):
        raise n.refuse("pads", list(begin + end), "padding smaller than the kernel")
    cfg = _config(n, PoolingConfig, mode=mode, filter_shape=kernel, stride=strides, padding=begin, pad_end=end,
                  ceil_mode=bool(n.attr("ceil_mode", 0)), count_include_pad=bool(n.attr("count_include_pad", 0)))
    _add_window(g, n, cfg, x)


def _dilated_pool(g: Graph, n: Node, mode: str, x: str, shape: tuple[int, ...], kernel: tuple[int, ...],
                  strides: tuple[int, ...], pads: tuple[int, ...]) -> None:
    """Dilated pooling with stride 1 and no padding, as its window's positions: one Slice per position (the input
    shifted by it), combined by an Eltwise max, or a sum weighted 1 / (positions) for average pooling."""
    dilations = tuple(n.attr("dilations"))
    if not _ones(strides) or any(pads):
        raise n.refuse("dilations", list(dilations), "dilations of 1, or dilated pooling with strides of 1 and no "
                       "padding")
    size = [d - (k - 1) * r for d, k, r in zip(shape[2:], kernel, dilations)]
    if min(size) < 1:
        raise n.refuse("dilations", list(dilations), f"a dilated window inside the input (shape {shape})")
    pieces = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            rows, piece = f"{n.outputs[0]}:rows{i}_{j}", f"{n.outputs[0]}:window{i}_{j}"
            _cut(g, n, x, 2, i * dilations[0], i * dilations[0] + size[0], rows)
            _cut(g, n, g.resolve(rows), 3, j * dilations[1], j * dilations[1] + size[1], piece)
            pieces.append(g.resolve(piece))
    out = f"{n.outputs[0]}:image_out" if n.lifted else n.outputs[0]
    if len(pieces) == 1:
        g.alias[out] = pieces[0]
    else:
        average = (1.0 / len(pieces),) * len(pieces)
        cfg = EltwiseConfig(operation="max") if mode == "max" else EltwiseConfig(coeff=average)
        g.add(n, cfg, pieces, [out], suffix="_window")
    if n.lifted:
        image = g.shape(g.resolve(out))
        g.add(n, ReshapeConfig(shape=(image[0], image[1], image[3])), [g.resolve(out)], [n.outputs[0]],
              suffix="_as_1d")


@op("MaxPool", attributes=("kernel_shape", "strides", "pads", "auto_pad", "ceil_mode", "dilations", "storage_order"))
def max_pool(g: Graph, n: Node) -> None:
    _pool(g, n, "max")


@op("AveragePool", attributes=("kernel_shape", "strides", "pads", "auto_pad", "ceil_mode", "dilations",
                               "count_include_pad"))
def average_pool(g: Graph, n: Node) -> None:
    _pool(g, n, "average")


@op("GlobalMaxPool", "GlobalAveragePool")
def global_pool(g: Graph, n: Node) -> None:
    x, _ = _spatial_input(g, n)
    cfg = PoolingConfig(mode="max" if n.op == "GlobalMaxPool" else "average", global_pooling=True)
    _add_window(g, n, cfg, x)


@op("Gemm", attributes=("alpha", "beta", "transA", "transB"))
def gemm(g: Graph, n: Node) -> None:
    """A Linear layer (after a Transpose where transA=1); a bias C of other shapes than one per output added by an
    Eltwise layer holding it (broadcast)."""
    a = g.blob(n, 0)
    if len(g.shape(a)) != 2:
        raise ConfigError(f"{n.where}: input A of shape {g.shape(a)}: Gemm takes a matrix [N, K]")
    if n.require("transA", lambda v: v in (0, 1), "transA 0 or 1", 0):
        rows = f"{n.outputs[0]}:a"
        g.add(n, TransposeConfig(perm=(1, 0)), [a], [rows], suffix="_transA")
        a = rows
    b = g.const(n, 1, "weight matrix")
    assert b is not None
    transposed = n.require("transB", lambda v: v in (0, 1), "transB 0 or 1", 0)
    w = (b if transposed else b.T) * float(n.attr("alpha", 1.0))
    c = g.const(n, 2, "bias")
    beta = float(n.attr("beta", 1.0))
    weights = {"weight": w}
    if c is None:
        g.add(n, LinearConfig(output_size=w.shape[0], bias=False), [a], [n.outputs[0]], weights=weights)
        return
    if c.size in (1, w.shape[0]) and (c.ndim < 2 or c.shape[0] == 1):  # one bias per output
        weights["bias"] = np.broadcast_to(c.reshape(-1), (w.shape[0],)) * beta
        g.add(n, LinearConfig(output_size=w.shape[0]), [a], [n.outputs[0]], weights=weights)
        return
    product = f"{n.outputs[0]}:product"
    g.add(n, LinearConfig(output_size=w.shape[0], bias=False), [a], [product], weights=weights)
    _with_constant(g, n, "sum", [product], np.asarray(c * beta), n.outputs[0])


def _with_constant(g: Graph, n: Node, operation: str, blobs: list[str], value: np.ndarray, out: str,
                   coeff: tuple[float, ...] = ()) -> None:
    """An Eltwise layer combining ``blobs`` and the constant ``value`` (its weight, broadcast)."""
    value = np.asarray(value, np.float32)
    shape = value.shape or (1,)
    cfg = _config(n, EltwiseConfig, operation=operation, coeff=coeff, weight_shape=shape)
    g.add(n, cfg, blobs, [out], weights={"weight": value.reshape(shape)}, suffix="_constant" * (out != n.outputs[0]))


def _matrix(g: Graph, n: Node, x: str, shape: tuple[int, ...], out: str) -> str:
    """A 1-D operand as a matrix [1, K] (``whole_shape``: its one axis is no batch)."""
    g.add(n, ReshapeConfig(shape=shape, whole_shape=True), [x], [out], suffix="_matrix")
    return out


@op("MatMul")
def matmul(g: Graph, n: Node) -> None:
    """A constant matrix B [K, M] on A [N, ..., K]: a Linear layer; otherwise a MatMul layer (B the second input,
    or its weight where constant; 1-D operands made matrices and the added axis taken away again)."""
    a = g.blob(n, 0)
    name_b = g.resolve(n.inputs[1]) if n.has_input(1) else ""
    b = g.numbers(n, name_b, f"input 1 ({name_b!r}, B)") if name_b in g.constants else None
    rank = len(g.shape(a))
    if b is not None and b.ndim == 2 and rank >= 2:
        linear = LinearConfig(output_size=b.shape[1], bias=False, axis=1 if rank == 2 else -1)
        g.add(n, linear, [a], [n.outputs[0]], weights={"weight": b.T})
        return
    a_shape = g.shape(a)
    if rank == 1:
        a = _matrix(g, n, a, (1, a_shape[0]), f"{n.outputs[0]}:a")
    inputs, weights = [a], {}
    if b is not None:
        b_shape = b.shape
        b = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
        weights = {"weight": b}
        cfg = MatMulConfig(weight_shape=b.shape)
    else:
        bb = g.blob(n, 1)
        b_shape = g.shape(bb)
        inputs.append(bb if len(b_shape) > 1 else _matrix(g, n, bb, (b_shape[0], 1), f"{n.outputs[0]}:b"))
        cfg = MatMulConfig()
    drop = [k for k, r in ((-2, rank), (-1, len(b_shape))) if r == 1]
    product = n.outputs[0] if not drop else f"{n.outputs[0]}:product"
    try:
        g.add(n, cfg, inputs, [product], weights=weights)
    except ConfigError as e:
        raise ConfigError(f"{e} (A of shape {a_shape}, B of shape {b_shape})") from None
    if drop:
        shape = g.shape(product)
        out = [d for k, d in enumerate(shape) if k - len(shape) not in drop] or [1]
        keep = len(out) == len(shape) - len(drop) and out[0] == shape[0] and len(out) > 1
        g.add(n, ReshapeConfig(shape=tuple(out), whole_shape=not keep), [product], [n.outputs[0]], suffix="_vector")


@op("BatchNormalization", attributes=("epsilon", "momentum", "training_mode", "spatial"))
def batch_norm(g: Graph, n: Node) -> None:
    x = g.blob(n, 0)
    n.require("training_mode", lambda v: v == 0, "training_mode=0 (inference: the running statistics)", 0)
    n.require("spatial", lambda v: v == 1, "spatial=1", 1)
    if len(n.used_outputs(g)) > 1:
        raise ConfigError(f"{n.where}: the running-statistics outputs are not supported; leafpy keeps them inside")
    momentum = n.require("momentum", lambda v: 0.0 <= v <= 1.0, "a momentum in [0, 1]", 0.9)
    names = ("weight", "bias", "running_mean", "running_var")
    weights = {k: g.const(n, i + 1, k) for i, k in enumerate(names)}
    cfg = BatchNormConfig(eps=float(n.attr("epsilon", 1e-5)), momentum=1.0 - float(momentum))
    g.add(n, cfg, [x], [n.outputs[0]], weights=weights)  # type: ignore[arg-type]


def _activation(layer_type: Callable[[Node], Any]) -> Converter:
    def convert(g: Graph, n: Node) -> None:
        g.add(n, layer_type(n), [g.blob(n, 0)], [n.outputs[0]])
    return convert


op("Relu")(_activation(lambda n: "ReLU"))
op("Sigmoid")(_activation(lambda n: "Sigmoid"))
op("Tanh")(_activation(lambda n: "TanH"))
op("Softplus")(_activation(lambda n: SoftplusConfig()))
op("LeakyRelu", attributes=("alpha",))(_activation(lambda n: LeakyReLUConfig(negative_slope=n.require(
    "alpha", lambda v: v >= 0, "alpha >= 0", 0.01))))
op("Elu", attributes=("alpha",))(_activation(lambda n: ELUConfig(alpha=n.require(
    "alpha", lambda v: v >= 0, "alpha >= 0", 1.0))))
op("Gelu", attributes=("approximate",))(_activation(lambda n: GELUConfig(approximate=n.require(
    "approximate", lambda v: v in ("none", "tanh"), "none, tanh", "none"))))


@op("Clip", attributes=("min", "max"))
def clip(g: Graph, n: Node) -> None:
    """Clip (ReLU6 and Hardtanh in PyTorch's exports): the bounds as constant inputs (opset 11 and later) or
    attributes (before); an absent one leaves that side open."""
    bounds = []
    for k, key, open_side in ((1, "min", -F32_MAX), (2, "max", F32_MAX)):
        value = g.const(n, k, f"{key} bound")
        if value is None:
            value = n.attr(key, open_side)
        v = np.asarray(value, dtype=np.float64)
        if v.size != 1 or not np.isfinite(v).all():
            raise ConfigError(f"{n.where}: the {key} bound must be one finite number, got {value!r}")
        bounds.append(float(np.clip(v.reshape(()), -F32_MAX, F32_MAX)))
    g.add(n, ClipConfig(lower=bounds[0], upper=bounds[1]), [g.blob(n, 0)], [n.outputs[0]])


@op("Softmax", "LogSoftmax", attributes=("axis",))
def softmax(g: Graph, n: Node) -> None:
    """From opset 13 over one axis (leafpy's ``axis``). Before, over the input flattened to [outer, inner] at the
    axis: one axis where at most one of the trailing dimensions exceeds 1, else (the axis after the batch) a
    Reshape to [..., inner], the softmax over its last axis, and a Reshape back."""
    x = g.blob(n, 0)
    shape = g.shape(x)
    rank = len(shape)
    new = g.opset >= 13
    axis = n.attr("axis", -1 if new else 1)
    if not -rank <= axis < rank:
        raise n.refuse("axis", axis, f"an axis from {-rank} to {rank - 1} for this input of shape {shape}")
    axis %= rank
    config_class = SoftmaxConfig if n.op == "Softmax" else LogSoftmaxConfig
    wide = [a for a in range(axis, rank) if shape[a] > 1]
    if new or len(wide) <= 1:
        g.add(n, config_class(axis=axis if new or not wide else wide[0]), [x], [n.outputs[0]])
        return
    if axis == 0:
        raise n.refuse("axis", axis, f"before opset 13, an axis after the batch (axis 0 of {shape} flattens the "
                       "batch with the rest, which leafpy's layers keep apart)")
    rows = f"{n.outputs[0]}:rows"
    g.add(n, ReshapeConfig(shape=(*shape[:axis], math.prod(shape[axis:]))), [x], [rows], suffix="_flatten")
    g.add(n, config_class(axis=-1), [rows], [f"{rows}:{n.op}"])
    g.add(n, ReshapeConfig(shape=shape), [f"{rows}:{n.op}"], [n.outputs[0]], suffix="_unflatten")


def _onnx_reshape(shape: tuple[int, ...], target: Sequence[int], allowzero: int) -> list[int]:
    out = [shape[i] if d == 0 and not allowzero and i < len(shape) else int(d) for i, d in enumerate(target)]
    if out.count(-1) == 1:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = math.prod(shape) // known if known else 0
    return out


@op("Reshape", attributes=("allowzero",))
def reshape(g: Graph, n: Node) -> None:
    held = g.time_major.get(g.resolve(n.inputs[0])) if n.inputs else None
    target = g.const(n, 1, "shape")
    assert target is not None
    if held is not None and held[1] == "Y2t" and target.size == 3:  # [T, N, 2, H] to [T, N, 2H]: the steps,
        batch, steps, directions, hidden = g.shapes[held[0]]  # batch-first [N, T, 2H]
        t, middle, last = target.astype(np.int64).tolist()
        zero = 0 if not n.attr("allowzero", 0) else None  # (0: the input's size there, unless allowzero)
        if t in (steps, zero) and middle in (batch, zero, -1) and last in (-1, directions * hidden) \
                and [t, middle, last].count(-1) <= 1:
            joined = f"{n.outputs[0]}:steps"
            g.add(n, ReshapeConfig(shape=(batch, steps, directions * hidden)), [held[0]], [joined])
            g.time_major[n.outputs[0]] = (joined, "steps")
            return
    x = g.blob(n, 0)
    shape = g.shape(x)
    out = _onnx_reshape(shape, target.astype(np.int64).tolist(), n.attr("allowzero", 0))
    if math.prod(out) != math.prod(shape) or not out:
        raise ConfigError(f"{n.where}: cannot reshape {shape} ({math.prod(shape)} values) to {target.tolist()}")
    if 0 in out:
        raise ConfigError(f"{n.where}: reshaping {shape} to {target.tolist()} gives {out}: leafpy's tensors have no "
                          "empty axes")
    if list(out) == list(shape):  # no change (a loss's [1] kept [1]; the batch entry kept, as the Reshape layer would
        g.alias[n.outputs[0]] = x  # keep it): no layer, so the graph's outputs stay the layer's own
        return
    # the batch kept where it stays first; else the whole shape (the first axis of this graph is no batch, or the
    # network then runs at this batch size only)
    whole = out[0] != shape[0]
    if whole:  # an inferred entry stays inferred, so the network takes other sizes of the first axis
        out = [-1 if t == -1 else d for t, d in zip(target.tolist(), out)]
    g.add(n, ReshapeConfig(shape=tuple(out), whole_shape=whole), [x], [n.outputs[0]])


@op("Flatten", attributes=("axis",))
def flatten(g: Graph, n: Node) -> None:
    g.add(n, FlattenConfig(axis=int(n.attr("axis", 1))), [g.blob(n, 0)], [n.outputs[0]])


@op("Dropout", attributes=("ratio", "seed", "is_test"))
def dropout(g: Graph, n: Node) -> None:
    x = g.blob(n, 0)
    training = g.const(n, 2, "training_mode")
    given = g.const(n, 1, "ratio")
    for k, value in ((1, given), (2, training)):
        if value is not None and value.size != 1:
            raise SerializationError(f"{n.where}: input {k} ({n.inputs[k]!r}) holds {value.size} values; ONNX's "
                                     f"Dropout takes one (a scalar) there: {MALFORMED}")
    ratio = float(given.reshape(())) if given is not None else float(n.attr("ratio", 0.5))
    if training is not None and bool(training.reshape(())) and ratio != 0.0:
        raise ConfigError(f"{n.where}: training_mode=True is not supported at import: leafpy's Dropout draws its "
                          "own masks when the network trains (set_training(True)); ratio 0 is the identity")
    mask = 1 in n.used_outputs(g)
    g.add(n, DropoutConfig(ratio=ratio, mask_output=mask), [x], n.outputs[:1 + mask])


@op("Identity", "Cast", attributes=("to", "saturate", "round_mode"))
def identity(g: Graph, n: Node) -> None:
    """No layer: the output names the input (Cast too: leafpy computes in floating point throughout, and ids and
    labels travel as floats, exact up to 2**24)."""
    name = g.resolve(n.inputs[0])
    if name in g.constants and name not in g.feeds:
        g.constants[n.outputs[0]] = g.constants[name]
    else:
        g.blob(n, 0)
    g.alias[n.outputs[0]] = name


def _bias_of_linear(g: Graph, n: Node) -> bool:
    """Add(MatMul's output, a constant vector) as the bias of the Linear layer the MatMul became (how exporters
    write a Linear layer on [N, T, K]). True where it was folded."""
    if n.op != "Add" or len(n.inputs) != 2:
        return False
    names = [g.resolve(i) for i in n.inputs]
    consts = [k for k, name in enumerate(names) if name in g.constants and name not in g.feeds]
    if len(consts) != 1:
        return False
    bias = g.numbers(n, names[consts[0]], f"input {consts[0]} ({names[consts[0]]!r}, a constant operand)")
    blob = names[1 - consts[0]]
    found = [i for i, lc in enumerate(g.layers) if lc.outputs == (blob,)]
    if not found or g.readers.get(blob, 0) != 1 or blob in {o.name for o in g.model.graph.output}:
        return False
    i = found[0]
    lc = g.layers[i]
    size = lc.config.output_size if lc.type == "Linear" else -1
    if lc.type != "Linear" or lc.config.bias or bias.shape not in ((size,), (1, size)):
        return False
    g.layers[i] = LayerConfig(lc.name, dataclasses.replace(lc.config, bias=True), inputs=lc.inputs,
                              outputs=lc.outputs)
    g.weights[f"{lc.name}/bias"] = np.ascontiguousarray(bias.reshape(-1), dtype=np.float32)
    g.alias[n.outputs[0]] = blob
    return True


def _is_operand_constant(g: Graph, n: Node, k: int, first: str | None) -> bool:
    """Whether input ``k`` of an elementwise node is held as the Eltwise layer's weight: a constant of the model,
    or a value given at run time (a node test's input) that cannot be a network input beside ``first`` (another
    rank or first axis)."""
    name = g.resolve(n.inputs[k])
    if name not in g.constants:
        return False
    if name not in g.feeds:
        return True
    shape = g.input_shapes[name]
    return first is None or len(shape) != len(g.shape(first)) or shape[0] != g.shape(first)[0]


@op("Add", "Sum", "Mul", "Max", "Sub")
def eltwise(g: Graph, n: Node) -> None:
    """An Eltwise layer (inputs broadcast as NumPy does); one constant operand becomes the layer's weight."""
    if _bias_of_linear(g, n):
        return
    order = sorted(range(len(n.inputs)), key=lambda k: g.resolve(n.inputs[k]) in g.constants
                   and g.resolve(n.inputs[k]) not in g.feeds)
    first = g.blob(n, order[0])
    held = [k for k in order[1:] if _is_operand_constant(g, n, k, first)]
    computed = [order[0]] + [k for k in order[1:] if k not in held]
    if len(held) > 1:
        raise ConfigError(f"{n.where}: {len(held)} constant operands ({[n.inputs[k] for k in held]}): leafpy's "
                          "Eltwise holds one constant (its weight); fold the constants into one")
    blobs = [first] + [g.blob(n, k) for k in computed[1:]]
    if len(blobs) == 1 and not held:
        g.alias[n.outputs[0]] = blobs[0]
        return
    operation = {"Add": "sum", "Sum": "sum", "Sub": "sum", "Mul": "prod", "Max": "max"}[n.op]
    signs = (1.0, -1.0) if n.op == "Sub" else ()
    coeff = tuple(signs[k] for k in computed + held) if signs else ()
    if held:
        name = g.resolve(n.inputs[held[0]])
        value = g.numbers(n, name, f"input {held[0]} ({name!r}, a constant operand)")
        _with_constant(g, n, operation, blobs, value, n.outputs[0], coeff)
        return
    g.add(n, EltwiseConfig(operation=operation, coeff=coeff), blobs, [n.outputs[0]])


@op("Concat", attributes=("axis",))
def concat(g: Graph, n: Node) -> None:
    states = [g.resolve(name) for name in n.inputs]
    if int(n.attr("axis")) == 0 and len(states) > 1 and all(g.time_major.get(s, ("", ""))[1] == "Y_h"
                                                            for s in states):
        g.stacked[n.outputs[0]] = states  # a stacked network's h_n: no layer until something reads it whole
        return
    blobs = [g.blob(n, k) for k in range(len(n.inputs))]
    g.add(n, ConcatConfig(axis=int(n.attr("axis"))), blobs, [n.outputs[0]])


def _slice_layer(g: Graph, n: Node, x: str, axis: int, points: list[int], outputs: list[str]) -> None:
    if not points:
        g.alias[outputs[0]] = x
        return
    g.add(n, SliceConfig(axis=axis, slice_points=tuple(points)), [x], outputs)


@op("Split", attributes=("axis", "split", "num_outputs"))
def split(g: Graph, n: Node) -> None:
    x = g.blob(n, 0)
    shape = g.shape(x)
    axis = int(n.attr("axis", 0)) % len(shape)
    given = g.const(n, 1, "split sizes")
    sizes = given.tolist() if given is not None else n.attr("split")
    k = len(n.outputs)
    if sizes is None:
        each = math.ceil(shape[axis] / k)
        sizes = [min(each, shape[axis] - i * each) for i in range(k)]
    elif len(sizes) != k or sum(int(v) for v in sizes) != shape[axis]:
        raise SerializationError(f"{n.where}: split sizes {list(sizes)} for {k} outputs of an axis of "
                                 f"{shape[axis]}: ONNX needs one size per output, adding up to the axis; "
                                 f"{MALFORMED}")
    points = np.cumsum(np.asarray(sizes, np.int64)).tolist()[:-1]
    if any(b <= a for a, b in zip([0, *points], [*points, shape[axis]])):
        raise ConfigError(f"{n.where}: split sizes {list(sizes)}: leafpy's Slice cuts pieces of at least one "
                          "element")
    outs = [o or f"{n.name}:unused{i}" for i, o in enumerate(n.outputs)]
    _slice_layer(g, n, x, axis, points, outs)


@op("Slice")
def slice_(g: Graph, n: Node) -> None:
    x = g.blob(n, 0)
    shape = g.shape(x)
    starts, ends = g.const(n, 1, "starts"), g.const(n, 2, "ends")
    assert starts is not None and ends is not None
    axes = g.const(n, 3, "axes")
    steps = g.const(n, 4, "steps")
    axes_l = list(range(len(starts))) if axes is None else [int(a) % len(shape) for a in axes]
    steps_l = [1] * len(axes_l) if steps is None else [int(s) for s in steps]
    cut = []
    for a, s, e, st in zip(axes_l, starts.tolist(), ends.tolist(), steps_l):
        size = shape[a]
        s = min(max(s + size if s < 0 else s, 0), size)
        e = min(max(e + size if e < 0 else e, 0), size)
        if st != 1:
            raise ConfigError(f"{n.where}: steps {steps_l}: leafpy's Slice takes contiguous pieces (step 1)")
        if (s, e) != (0, size):
            cut.append((a, s, e))
    if len(cut) > 1 or (cut and cut[0][1] >= cut[0][2]):
        raise ConfigError(f"{n.where}: slicing {cut} of {shape}: leafpy's Slice cuts one non-empty range along one "
                          "axis")
    if not cut:
        g.alias[n.outputs[0]] = x
        return
    _cut(g, n, x, *cut[0], n.outputs[0])


def _cut(g: Graph, n: Node, x: str, axis: int, start: int, end: int, piece: str) -> None:
    """The range [start, end) of ``x`` along ``axis`` as blob ``piece``: a Slice whose other pieces go unread."""
    size = g.shape(x)[axis]
    outs = [f"{piece}:before", piece, f"{piece}:after"][1 if start == 0 else 0:2 if end == size else 3]
    _slice_layer(g, n, x, axis, [p for p in (start, end) if 0 < p < size], outs)


@op("LRN", attributes=("size", "alpha", "beta", "bias"))
def lrn(g: Graph, n: Node) -> None:
    x = g.blob(n, 0)
    size = n.require("size", lambda v: v % 2 == 1, "an odd size (a window centred on each channel)")
    cfg = LRNConfig(local_size=size, alpha=float(n.attr("alpha", 1e-4)), beta=float(n.attr("beta", 0.75)),
                    k=float(n.attr("bias", 1.0)))
    g.add(n, cfg, [x], [n.outputs[0]])


def _pick(g: Graph, n: Node) -> bool:
    """Gather of one constant index along an axis after the batch of a computed blob (``y[:, -1]``): a Slice, and
    a Reshape dropping the axis for a scalar index. True where it applied."""
    name = g.resolve(n.inputs[0])
    given = g.resolve(n.inputs[1]) if n.has_input(1) else ""
    if name in g.constants or given not in g.constants or given in g.feeds:
        return False
    index = g.numbers(n, given, f"input 1 ({given!r}, the indices)")
    if index.size != 1:
        return False
    if name in g.stacked and int(n.attr("axis", 0)) == 0:  # h_n[k] of a stacked network: the k-th layer's state
        states = g.stacked[name]
        k = int(index.reshape(-1)[0])
        if not -len(states) <= k < len(states):
            raise ConfigError(f"{n.where}: index {k} of the {len(states)} layers' last states")
        g.alias[n.outputs[0]] = g.time_major[states[k]][0] if index.ndim == 0 else states[k]
        return True
    held = g.time_major.get(name)
    if held is not None and held[1] == "Y_h" and index.ndim == 0 and int(n.attr("axis", 0)) == 0 \
            and int(index) in (0, -1):  # one direction's last h, [1, N, H] (PyTorch's h[-1]): the [N, H] blob
        g.alias[n.outputs[0]] = held[0]
        return True
    x = g.blob(n, 0)
    shape = g.shape(x)
    axis = int(n.attr("axis", 0)) % len(shape)
    if axis == 0:
        return False
    i = int(index.reshape(-1)[0]) % shape[axis]
    piece = f"{n.outputs[0]}:piece" if index.ndim == 0 else n.outputs[0]
    _cut(g, n, x, axis, i, i + 1, piece)
    if index.ndim == 0:
        out = tuple(d for k, d in enumerate(shape) if k != axis)
        g.add(n, ReshapeConfig(shape=out), [g.resolve(piece)], [n.outputs[0]], suffix="_squeeze")
    return True


@op("Gather", attributes=("axis",))
def gather(g: Graph, n: Node) -> None:
    """Indices (computed) into a constant table: an Embedding over the table seen as rows of its ``axis``, and a
    Reshape (and a Transpose, for an axis after the first) giving ONNX's output shape."""
    if _pick(g, n):
        return
    name, given = g.resolve(n.inputs[0]), g.resolve(n.inputs[1]) if n.has_input(1) else ""
    if name not in g.constants and given in g.constants and given not in g.feeds:  # (what _pick did not take)
        raise ConfigError(f"{n.where}: takes index {g.constants[given].reshape(-1).tolist()[:4]} along axis "
                          f"{int(n.attr('axis', 0))} of a computed value, where leafpy takes one constant index on an "
                          "axis after the first (y[:, -1]); the first axis is the batch, or for a recurrent layer's "
                          "h_n of several layers or directions (h_n[-1]) or a time-major output (y[-1]) the layers "
                          "or steps: export the last step of a batch-first output instead (y[:, -1])")
    table = g.const(n, 0, "table")
    assert table is not None
    axis = n.require("axis", lambda v: -table.ndim <= v < table.ndim, f"an axis of the table (shape {table.shape})",
                     0) % table.ndim
    rows = np.moveaxis(table, axis, 0)
    ids = g.blob(n, 1)
    index_shape = g.shape(ids)
    if g.resolve(n.inputs[1]) in g.feeds and (g.constants[g.resolve(n.inputs[1])] < 0).any():
        raise ConfigError(f"{n.where}: negative indices: leafpy's Embedding takes indices from 0 to "
                          f"{rows.shape[0] - 1}")
    cfg = EmbeddingConfig(input_dim=rows.shape[0], output_dim=math.prod(rows.shape[1:]))
    looked = n.outputs[0] if rows.ndim == 2 and axis == 0 else f"{n.outputs[0]}:rows"
    g.add(n, cfg, [ids], [looked], weights={"weight": rows.reshape(rows.shape[0], -1)})
    if looked == n.outputs[0]:
        return
    shape = (*index_shape, *rows.shape[1:])  # the indices' axes, then the table's other axes in their order
    if axis == 0:
        g.add(n, ReshapeConfig(shape=shape, whole_shape=len(shape) == 1 or shape[0] != index_shape[0]),
              [looked], [n.outputs[0]], suffix="_shape")
        return
    g.add(n, ReshapeConfig(shape=shape, whole_shape=True), [looked], [f"{looked}:shaped"], suffix="_shape")
    k = len(index_shape)
    perm = (*range(k, k + axis), *range(k), *range(k + axis, len(shape)))
    g.add(n, TransposeConfig(perm=perm), [f"{looked}:shaped"], [n.outputs[0]], suffix="_axis")


# gate blocks: ONNX's order -> leafpy's (LSTM iofc -> ifgo, GRU zrh -> rzn)
GATES_FROM_ONNX = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
GATES_TO_ONNX = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}


def reorder_gates(a: np.ndarray, order: list[int]) -> np.ndarray:
    """``a`` [G*H, ...] with its G row blocks taken in ``order``."""
    blocks = np.split(a, len(order))
    return np.concatenate([blocks[i] for i in order])


def _check_recurrent(g: Graph, n: Node) -> None:
    """Refuse the settings leafpy's recurrent layers do not compute."""
    n.require("direction", lambda v: v in ("forward", "reverse", "bidirectional"), "forward, reverse, bidirectional",
              "forward")
    n.require("clip", lambda v: v is None, "no clip")
    n.require("input_forget", lambda v: v == 0, "input_forget=0", 0)
    defaults = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[n.op]
    directions = 1 + (n.attr("direction") == "bidirectional")
    n.require("activations", lambda v: v is None or list(v) == defaults * directions,
              f"the default activations {defaults}")
    if n.op == "GRU":
        n.require("linear_before_reset", lambda v: v in (0, 1), "linear_before_reset 0 (ONNX's default) or 1 "
                  "(PyTorch's GRU)", 0)
    for k, what in ((4, "sequence_lens"), (5, "initial_h"), (6, "initial_c"), (7, "P (peepholes)")):
        if n.has_input(k) and not (k in (5, 6) and n.inputs[k] in g.constants and not g.constants[n.inputs[k]].any()):
            raise ConfigError(f"{n.where}: input {what} is not supported; leafpy's recurrent layers run whole "
                              "sequences from a zero state")
    if not n.used_outputs(g):
        raise ConfigError(f"{n.where}: none of its outputs is read")


def _direction_weights(g: Graph, n: Node, d: int) -> dict[str, np.ndarray]:
    """Direction ``d``'s ONNX weights in leafpy's gate order and layout."""
    w, r, b = g.const(n, 1, "W"), g.const(n, 2, "R"), g.const(n, 3, "B")
    assert w is not None and r is not None  # inputs 1 and 2 are required: g.const raised otherwise
    order = GATES_FROM_ONNX[n.op]
    w_ih, w_hh = reorder_gates(w[d], order), reorder_gates(r[d], order)
    gh = w_ih.shape[0]
    bias = np.zeros(2 * gh, np.float32) if b is None else b[d]
    b_ih, b_hh = reorder_gates(bias[:gh], order), reorder_gates(bias[gh:], order)
    weights = {"weight_ih": w_ih, "weight_hh": w_hh}
    if n.op == "GRU":
        weights.update(bias_ih=b_ih, bias_hh=b_hh)
    else:
        weights["bias"] = b_ih + b_hh
    return weights


def _reverse_time(g: Graph, n: Node, x: str, out: str) -> str:
    """``x`` [N, T, ...] with its steps in reverse order (a Slice into steps, joined back to front)."""
    steps = g.shape(x)[1]
    if steps == 1:
        return x
    pieces = [f"{out}:step{t}" for t in range(steps)]
    _slice_layer(g, n, x, 1, list(range(1, steps)), pieces)
    g.add(n, ConcatConfig(axis=1), pieces[::-1], [out], suffix="_reversed")
    return out


def _join(g: Graph, n: Node, parts: list[str], axis: int, out: str) -> None:
    """``parts`` each given a directions axis of size 1 at ``axis`` and joined along it as blob ``out``."""
    shaped = []
    for i, p in enumerate(parts):
        shape = g.shape(p)
        shaped.append(f"{out}:direction{i}")
        g.add(n, ReshapeConfig(shape=(*shape[:axis], 1, *shape[axis:])), [p], [shaped[-1]], suffix=f"_direction{i}")
    if len(shaped) == 1:
        g.alias[out] = shaped[0]
        return
    g.add(n, ConcatConfig(axis=axis), shaped, [out], suffix="_directions")


def _transposed(g: Graph, n: Node, x: str, perm: tuple[int, ...], out: str) -> None:
    g.add(n, TransposeConfig(perm=perm), [x], [out], suffix="_layout0")


@op("LSTM", "GRU", "RNN", attributes=("hidden_size", "direction", "layout", "linear_before_reset", "activations",
                                      "clip", "input_forget", "activation_alpha", "activation_beta"))
def recurrent(g: Graph, n: Node) -> None:
    """One leafpy layer per direction over the batch-first sequence (a reverse direction reads and writes the steps
    back to front); ONNX's layout 0 through Transpose layers, made only where needed: a Transpose of a batch-first
    sequence in, outputs of one direction brought back by Squeeze (and Transpose), as exporters write them, need
    none (see ``Graph.time_major``)."""
    _check_recurrent(g, n)
    layout = n.require("layout", lambda v: v in (0, 1), "layout 0 (time-major) or 1 (batch first)", 0)
    direction = n.attr("direction", "forward")
    used = n.used_outputs(g)
    if layout == 0 and _time_major_input(g, n):
        x = g.time_major[g.resolve(n.inputs[0])][0]
    elif layout == 0:
        x = f"{n.inputs[0]}:batch_first"
        _transposed(g, n, g.blob(n, 0), (1, 0, 2), x)
    else:
        x = g.blob(n, 0)
    hidden = int(n.attr("hidden_size", g.const(n, 2, "R").shape[-1]))  # type: ignore[union-attr]
    config_class = {"LSTM": LSTMConfig, "GRU": GRUConfig, "RNN": RNNConfig}[n.op]
    sequences = 0 in used
    cell = 2 in used
    outs: list[tuple[str, ...]] = []  # per direction: every step's h [N, T, H], the last h [N, H], the last c
    for d, reverse in enumerate({"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]):
        tag = f"{n.outputs[used[0]]}:{n.op}{d}"
        src = _reverse_time(g, n, x, f"{tag}:input") if reverse else x
        more: dict[str, bool] = {"return_cell_state": True} if cell else {}
        if n.op == "GRU":
            more["linear_before_reset"] = bool(n.attr("linear_before_reset", 0))
        g.add(n, config_class(hidden_size=hidden, return_sequences=sequences, **more), [src],
              [tag, f"{tag}:c"][:1 + cell], weights=_direction_weights(g, n, d),
              suffix=f"_{'reverse' if reverse else 'forward'}" * (d > 0))
        if not sequences or 1 not in used:
            seq = _reverse_time(g, n, tag, f"{tag}:forward_order") if reverse and sequences else tag
            outs.append((seq, tag, f"{tag}:c"))
            continue
        steps = g.shape(tag)[1]
        last = f"{tag}:last"
        _cut(g, n, tag, 1, steps - 1, steps, f"{last}:step")
        g.add(n, ReshapeConfig(shape=(g.shape(tag)[0], hidden)), [g.resolve(f"{last}:step")], [last], suffix="_last")
        outs.append((_reverse_time(g, n, tag, f"{tag}:forward_order") if reverse else tag, last, f"{tag}:c"))
    for k in used:
        if layout == 0 and len(outs) == 1:  # read back through Squeeze (and Transpose): see squeeze(), transpose()
            g.time_major[n.outputs[k]] = (outs[0][k], "Y" if k == 0 else "Y_h")
            continue
        if layout == 0 and k == 0:  # both directions' steps, batch-first [N, T, 2, H]: read back through Transpose,
            joined = f"{n.outputs[0]}:joined"  # Reshape and Transpose (see transpose(), reshape())
            _join(g, n, [o[0] for o in outs], 2, joined)
            g.time_major[n.outputs[0]] = (joined, "Y2")
            continue
        axis = (2, 1, 1)[k]  # Y [N, T, D, H], Y_h and Y_c [N, D, H] in layout 1
        target = n.outputs[k] if layout == 1 else f"{n.outputs[k]}:batch_first"
        _join(g, n, [o[k] for o in outs], axis, target)
        if layout == 0:  # Y [T, D, N, H], Y_h and Y_c [D, N, H]
            _transposed(g, n, g.resolve(target), ((1, 2, 0, 3), (1, 0, 2), (1, 0, 2))[k], n.outputs[k])


def _time_major_input(g: Graph, n: Node) -> bool:
    name = g.resolve(n.inputs[0]) if n.inputs else ""
    return g.time_major.get(name, ("", ""))[1] in ("x", "steps")  # [T, N, ...]: a batch-first blob transposed


def _axes(g: Graph, n: Node) -> list[int] | None:
    given = g.const(n, 1, "axes")
    axes = given.tolist() if given is not None else n.attr("axes")
    return None if axes is None else [int(a) for a in axes]


@op("Transpose", attributes=("perm",))
def transpose(g: Graph, n: Node) -> None:
    """A Transpose layer; around a layout-0 recurrent layer none (leafpy keeps sequences batch-first), and a swap
    of two neighbouring axes after the batch (a channel shuffle) as Slice, Reshape and Concat layers, which move
    the values without the batch axis leaving its place."""
    name = g.resolve(n.inputs[0])
    held = g.time_major.get(name)
    x = name if held is not None else g.blob(n, 0)
    shape = g.shapes.get(x) or g.shapes[held[0]]  # type: ignore[index]
    perm = list(n.attr("perm") or reversed(range(len(shape))))
    if perm == [1, 0, 2] and held is not None and held[1] == "steps":
        g.alias[n.outputs[0]] = held[0]
        return
    if perm == [1, 0, 2] and held is None and len(shape) == 3:
        g.time_major[n.outputs[0]] = (name, "x")
        return
    if perm == [0, 2, 1, 3] and held is not None and held[1] == "Y2":
        g.time_major[n.outputs[0]] = (held[0], "Y2t")
        return
    x = g.blob(n, 0)
    shape = g.shape(x)
    if sorted(perm) != list(range(len(shape))):
        raise n.refuse("perm", perm, f"a permutation of the {len(shape)} axes of the input (shape {shape})")
    swapped = [k for k, p in enumerate(perm) if p != k]
    if len(swapped) == 2 and swapped[0] >= 1 and swapped[1] == swapped[0] + 1:
        _swap_axes(g, n, x, swapped[0])
        return
    g.add(n, TransposeConfig(perm=tuple(perm)), [x], [n.outputs[0]])


def _swap_axes(g: Graph, n: Node, x: str, k: int) -> None:
    """Axes k and k + 1 of ``x`` swapped: ``x`` cut into its pieces along k, each seen with that axis (of size 1)
    after k + 1, and the pieces put side by side along k + 1 (exact: values are moved, none computed)."""
    shape = g.shape(x)
    pieces = [f"{n.outputs[0]}:piece{i}" for i in range(shape[k])]
    _slice_layer(g, n, x, k, list(range(1, shape[k])), pieces)
    moved = (*shape[:k], shape[k + 1], 1, *shape[k + 2:])
    turned = []
    for i, piece in enumerate(pieces):
        turned.append(f"{piece}:turned")
        g.add(n, ReshapeConfig(shape=moved), [g.resolve(piece)], [turned[-1]], suffix=f"_piece{i}")
    if len(turned) == 1:
        g.alias[n.outputs[0]] = turned[0]
        return
    g.add(n, ConcatConfig(axis=k + 1), turned, [n.outputs[0]])


@op("Squeeze", "Unsqueeze", attributes=("axes",))
def squeeze(g: Graph, n: Node) -> None:
    """A recurrent layer's time-major output brought back, or a Reshape."""
    name = g.resolve(n.inputs[0])
    axes = _axes(g, n)
    held = g.time_major.get(name)
    if held is not None and n.op == "Squeeze":
        if held[1] == "Y_h" and axes == [0]:
            g.alias[n.outputs[0]] = held[0]
            return
        if held[1] == "Y" and axes == [1]:
            g.time_major[n.outputs[0]] = (held[0], "steps")
            return
    x = g.blob(n, 0)
    shape = list(g.shape(x))
    if axes is None and n.op == "Squeeze":
        axes = [i for i, d in enumerate(shape) if d == 1]
    if axes is None:
        raise n.refuse("axes", axes, "the axes to insert")
    if n.op == "Squeeze":
        rank = len(shape)
        out = [d for i, d in enumerate(shape) if i not in {a % rank for a in axes}]
    else:
        rank = len(shape) + len(axes)
        out = shape[:]
        for a in sorted(a % rank for a in axes):
            out.insert(a, 1)
    if math.prod(out) != math.prod(shape) or not out:
        raise n.refuse("axes", axes, "axes of size 1, leaving one axis or more")
    # the first axis as a batch where it stays first; else the whole shape (the network then runs at this batch
    # size only, or the graph's first axis is no batch)
    g.add(n, ReshapeConfig(shape=tuple(out), whole_shape=out[0] != shape[0] or 0 in [a % rank for a in axes]),
          [x], [n.outputs[0]])


def _loss_config(g: Graph, n: Node, config_class: type, scores: str, **more: Any) -> Any:
    """The loss layer's config from the node's reduction, ignore_index and class weights (input 2, a constant)."""
    shape = g.shape(scores)
    if len(shape) < 2:
        raise ConfigError(f"{n.where}: input of shape {shape}: leafpy's loss takes [N, C] or [N, C, d1, ...]")
    reduction = n.require("reduction", lambda v: v in REDUCTIONS, ", ".join(REDUCTIONS), "mean")
    weight = g.const(n, 2, "class weights")
    if weight is not None and weight.shape != (shape[1],):
        raise ConfigError(f"{n.where}: class weights of shape {weight.shape}: expected one per class ([{shape[1]}])")
    return config_class(num_classes=shape[1], reduction=reduction, ignore_index=n.attr("ignore_index"),
                        weight=() if weight is None else tuple(float(v) for v in weight), **more)


@op("NegativeLogLikelihoodLoss", attributes=("reduction", "ignore_index"))
def nll(g: Graph, n: Node) -> None:
    x, labels = g.blob(n, 0), g.blob(n, 1)
    g.add(n, _loss_config(g, n, NegativeLogLikelihoodConfig, x), [x, labels], [n.outputs[0]])


@op("SoftmaxCrossEntropyLoss", attributes=("reduction", "ignore_index"))
def softmax_cross_entropy(g: Graph, n: Node) -> None:
    x, labels = g.blob(n, 0), g.blob(n, 1)
    log_prob = 1 in n.used_outputs(g)
    config = _loss_config(g, n, SoftmaxCrossEntropyConfig, x, log_prob=log_prob)
    g.add(n, config, [x, labels], n.outputs[:1 + log_prob])


def constant_value(n: Node) -> np.ndarray:
    """The value a Constant node holds (a ConfigError where it holds none leafpy reads)."""
    if "value" in n.attrs:
        return to_array(next(a.t for a in n.proto.attribute if a.name == "value"))
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in n.attrs:
            return np.asarray(n.attrs[key], dtype)
    raise ConfigError(f"{n.where}: a Constant without a value leafpy reads (value, value_float(s), value_int(s))")


@op("Constant", attributes=("value", "value_float", "value_floats", "value_int", "value_ints"))
def constant(g: Graph, n: Node) -> None:
    g.constants[n.outputs[0]] = constant_value(n)


# ----------------------------------------------------------------------------------------------------------------
# the graph
# ----------------------------------------------------------------------------------------------------------------
def _input_shape(vi: Any, batch_size: int) -> tuple[int, ...]:
    dims = vi.type.tensor_type.shape.dim
    shape = []
    for i, d in enumerate(dims):
        if d.HasField("dim_value") and d.dim_value > 0:
            shape.append(int(d.dim_value))
        elif i == 0:
            shape.append(batch_size)
        else:
            raise ConfigError(f"ONNX graph input {vi.name!r}: dimension {i} is {d.dim_param or 'unknown'}; leafpy "
                              "needs a fixed size for every dimension but the batch (the first)")
    if not shape:
        raise ConfigError(f"ONNX graph input {vi.name!r}: a scalar or a shape left unknown; leafpy needs [N, ...]")
    return tuple(shape)


def _scalar(name: str, constants: dict[str, np.ndarray], made: dict[str, Any], opset: int) -> float | None:
    """The value of ``name`` where it is one number: an initializer, or a Constant node's (None otherwise; a
    Constant leafpy cannot read is reported where it is converted)."""
    if name in constants:
        v = np.asarray(constants[name])
    elif name in made and made[name].op_type == "Constant" and made[name].domain in ("", "ai.onnx"):
        try:
            v = constant_value(Node(made[name], 0, opset))
        except LeafpyError:
            return None
    else:
        return None
    return float(v.reshape(-1)[0]) if v.size == 1 and v.dtype.kind == "f" else None


def fuse_gelu(nodes: list[Any], constants: dict[str, np.ndarray], outputs: set[str], opset: int) -> list[Any]:
    """``nodes`` with each GELU written out as its erf formula, 0.5·x·(1 + erf(x/√2)) (how exporters write GELU
    below opset 20: PyTorch's x/√2 → Erf → +1 → ·x → ·0.5, leafpy's own ·(1/√2) and (0.5·x)·(...)), or as its tanh
    form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), replaced by one Gelu node (``approximate="tanh"`` for the
    second), which leafpy computes as its GELU layer (the formula's constants as weights would be trained). Only
    where every value in between has no other reader and is no graph output; other uses of Erf stay unsupported."""
    onnx = require_onnx()
    made = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def plain(n: Any, op: str) -> bool:
        return n is not None and n.op_type == op and n.domain in ("", "ai.onnx") and not n.attribute

    def sole(name: str) -> Any:
        r = readers.get(name, [])
        return r[0] if len(r) == 1 and name not in outputs else None

    def split(n: Any, value: float) -> str | None:
        """The other input of a two-input node one of whose inputs is the constant ``value``."""
        if len(n.input) != 2:
            return None
        for k in (0, 1):
            c = _scalar(n.input[k], constants, made, opset)
            if c is not None and abs(c - value) <= 1e-6 * abs(value):
                return n.input[1 - k]
        return None

    replaced: dict[int, Any] = {}  # id of the formula's last node -> the Gelu node
    dropped: set[int] = set()

    def halved(x: str, core: Any, before: list[Any], **attributes: Any) -> None:
        """Where ``core``'s output (erf's or tanh's) goes on as 0.5·x·(1 + it), in PyTorch's order (x·(1 + it))·0.5
        or leafpy's (0.5·x)·(1 + it), every node from ``before`` on becomes one Gelu node."""
        add = sole(core.output[0])
        if not plain(add, "Add") or split(add, 1.0) != core.output[0]:
            return
        mul = sole(add.output[0])
        if not plain(mul, "Mul") or len(mul.input) != 2:
            return
        other = mul.input[0] if mul.input[1] == add.output[0] else mul.input[1]
        half = made.get(other)
        if other == x:
            last = sole(mul.output[0])
            if not plain(last, "Mul") or split(last, 0.5) != mul.output[0]:
                return
            formula = [*before, core, add, mul, last]
        elif plain(half, "Mul") and split(half, 0.5) == x and sole(other) is mul:
            last = mul
            formula = [*before, core, add, half, mul]
        else:
            return
        if any(id(n) in dropped for n in formula):
            return
        dropped.update(id(n) for n in formula)
        replaced[id(last)] = onnx.helper.make_node("Gelu", [x], [last.output[0]], name=core.name or last.name,
                                                   **attributes)
    for erf in nodes:
        if not plain(erf, "Erf") or len(erf.input) != 1 or not erf.output or sole(erf.input[0]) is not erf:
            continue
        scale: Any = made.get(erf.input[0])
        x = None
        if plain(scale, "Div") and len(scale.input) == 2:
            c = _scalar(scale.input[1], constants, made, opset)
            x = scale.input[0] if c is not None and abs(c - math.sqrt(2)) <= 1e-6 else None
        elif plain(scale, "Mul"):
            x = split(scale, 1 / math.sqrt(2))
        if x is not None:
            halved(x, erf, [scale])

    def of(name: str | None, reader: Any, op: str) -> Any:
        """The node making ``name`` where it is a plain ``op`` whose output only ``reader`` reads."""
        if name is None:
            return None
        n = made.get(name)
        return n if plain(n, op) and sole(name) is reader else None

    def cubed(name: str | None, reader: Any) -> tuple[str, list[Any]] | None:
        """(x, its nodes) where ``name`` is x·(x·x) or (x·x)·x made for ``reader`` alone (PyTorch's and leafpy's)."""
        cube = of(name, reader, "Mul")
        if cube is None or len(cube.input) != 2:
            return None
        for k in (0, 1):
            square = of(cube.input[1 - k], cube, "Mul")
            if square is not None and list(square.input) == [cube.input[k]] * 2:
                return cube.input[k], [square, cube]
        return None

    for tanh in nodes:  # the tanh form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), as GELU(approximate="tanh")
        if not plain(tanh, "Tanh") or len(tanh.input) != 1 or not tanh.output:
            continue
        scale = of(tanh.input[0], tanh, "Mul")
        inner = of(split(scale, math.sqrt(2 / math.pi)), scale, "Add") if scale is not None else None
        if inner is None or len(inner.input) != 2:
            continue
        x, found = None, []
        for k in (0, 1):
            term = of(inner.input[1 - k], inner, "Mul")
            cube = cubed(split(term, 0.044715), term) if term is not None else None
            if cube is not None and cube[0] == inner.input[k]:
                x, found = inner.input[k], [*cube[1], term]
                break
        if x is not None:
            halved(x, tanh, [*found, inner, scale], approximate="tanh")
    if not replaced:
        return nodes
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped or id(n) in replaced]


def convert(model: Any, *, batch_size: int = 1, feeds: dict[str, np.ndarray] | None = None,
            name: str = "onnx") -> tuple[LayerConfig, dict[str, np.ndarray]]:
    """The network of ``model`` as a Sequential LayerConfig named ``name`` and its weights by name.
    ``feeds``: values of graph inputs known now (used where an operator needs a constant, as the ONNX backend
    tests give weights as inputs; the inputs read as data stay the network's inputs, with the feeds' shapes)."""
    feeds = feeds or {}
    graph = model.graph
    if not graph.output:
        raise SerializationError(f"ONNX graph {graph.name!r}: no graph outputs; a model names the values it computes "
                                 f"as its graph's outputs: {MALFORMED}")
    constants = {t.name: to_array(t) for t in graph.initializer}
    g = Graph(model, constants, batch_size, frozenset(feeds))
    for vi in graph.input:
        if vi.name in constants:
            continue
        if not vi.type.HasField("tensor_type"):
            raise ConfigError(f"ONNX graph input {vi.name!r}: a {vi.type.WhichOneof('value') or 'value of no type'}; "
                              "leafpy's networks take tensors")
        if vi.name in feeds:
            g.constants[vi.name] = np.asarray(feeds[vi.name])
            g.input_shapes[vi.name] = tuple(np.shape(feeds[vi.name])) or (1,)
        else:
            g.input_shapes[vi.name] = _input_shape(vi, batch_size)
    nodes = fuse_gelu(list(graph.node), constants, {o.name for o in graph.output}, g.opset)
    for node in nodes:
        for i in node.input:
            g.readers[i] = g.readers.get(i, 0) + 1
    given = {vi.name: "a graph input" for vi in graph.input} | {t: "an initializer" for t in constants}
    for i, proto in enumerate(nodes):
        node = Node(proto, i, g.opset)
        _check_single_assignment(node, given)
        if _fold(g, node):
            continue
        entry = OPS.get(node.op) if proto.domain in ("", "ai.onnx") else None
        if entry is None:
            raise ConfigError(f"{node.where}: operator {proto.domain + '.' if proto.domain else ''}{node.op} is not "
                              f"supported; leafpy imports: {', '.join(supported_operators())}")
        for a in node.attrs:
            if a not in entry.attributes:
                raise ConfigError(f"{node.where}: attribute {a!r} is not supported; leafpy reads "
                                  f"{', '.join(entry.attributes) or 'no attributes'} for {node.op}")
        entry.convert(g, node)
    _finish_outputs(g)
    if not g.used_inputs:
        raise ConfigError("ONNX graph: no computed input reaches a layer; leafpy needs a network with an input")
    used = [i for i in g.input_shapes if i in g.used_inputs]  # in the graph's order, not the order of first use
    seq = SequentialConfig(inputs=[(i, g.input_shapes[i]) for i in used])
    for lc in g.layers:
        seq.add_layer(lc)
    return LayerConfig(name, seq), g.weights


def _check_single_assignment(n: Node, given: dict[str, str]) -> None:
    """Refuse a node whose output is one of its inputs, or a value already given (a graph input, an initializer, an
    earlier node's output): ONNX graphs give each value once, and an output that is its own input is a cycle."""
    for k, o in enumerate(n.outputs):
        if not o:
            continue
        if o in n.inputs:
            raise SerializationError(f"{n.where}: output {k} ({o!r}) is also its input, a cycle; each value of an "
                                     f"ONNX graph is given once: {MALFORMED}")
        if o in given:
            raise SerializationError(f"{n.where}: output {k} ({o!r}) is already {given[o]}; each value of an ONNX "
                                     f"graph is given once: {MALFORMED}")
        given[o] = f"the output of ONNX node '{n.name}' ({n.op})"


FOLDED = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Expand", "Reshape", "Cast", "Slice",
                    "Add", "Sub", "Mul", "Div", "ConstantOfShape", "Range", "Transpose", "Identity", "Equal", "Where",
                    "Size", "Neg", "Sqrt"})
"""Operators computed at import when their inputs are constants (the shape arithmetic exporters write, such as the
zero initial states of a recurrent layer expanded to the batch)."""


def _fold(g: Graph, n: Node) -> bool:
    """Compute ``n`` now when every input is a constant of the model (not a run-time input), or when it is Shape
    of a blob (whose shape is known: the batch as declared). True where it did."""
    names = [g.resolve(i) for i in n.inputs if i]
    held = g.time_major.get(names[0]) if names else None
    known = {**g.input_shapes, **g.shapes}  # graph inputs not read yet included
    if n.op == "Shape" and names and (names[0] in known or (held is not None and held[1] in SEEN_AS)):
        shape = np.array(known[names[0]] if held is None else np.array(known[held[0]])[list(SEEN_AS[held[1]])],
                         np.int64)
        g.constants[n.outputs[0]] = shape[n.attr("start", 0):n.attr("end", len(shape))]
        return True
    if n.op not in FOLDED or not names or any(i not in g.constants or i in g.feeds for i in names):
        return False
    onnx = require_onnx()
    from onnx.reference import ReferenceEvaluator

    _check_fold_memory(n, [g.constants[i] for i in names])
    h = onnx.helper
    values = {i: g.constants[i] for i in names}
    inputs = [h.make_tensor_value_info(i, h.np_dtype_to_tensor_dtype(v.dtype), v.shape) for i, v in values.items()]
    proto = onnx.NodeProto()
    proto.CopyFrom(n.proto)
    proto.ClearField("input")
    proto.input.extend([g.resolve(i) if i else "" for i in n.inputs])
    model = h.make_model(h.make_graph([proto], "fold", inputs, [h.make_value_info(o, onnx.TypeProto())
                                                                 for o in n.outputs if o]),
                         opset_imports=list(g.model.opset_import))
    try:
        results = ReferenceEvaluator(model).run(None, values)
    except Exception as e:  # onnx's evaluator raises anything; the node is what failed
        raise ConfigError(f"{n.where}: computing it from its constant inputs failed: {e}") from None
    for o, v in zip([o for o in n.outputs if o], results):
        g.constants[o] = np.asarray(v)
    return True


BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Equal", "Where"})
"""Folded operators whose output has the broadcast shape of their inputs (more values than they hold together)."""


def _folded_size(n: Node, values: list[np.ndarray]) -> int:
    """How many values folding ``n`` gives, from its constant inputs, for the folded operators whose output can hold
    more than their inputs (the others give at most as many as they read); 0 where the inputs do not fit the
    operator (the evaluator then says why)."""
    try:
        if n.op == "ConstantOfShape":
            return math.prod(max(0, int(d)) for d in values[0].reshape(-1))
        if n.op == "Expand":
            return math.prod(np.broadcast_shapes(values[0].shape, tuple(int(d) for d in values[1].reshape(-1))))
        if n.op == "Range":
            start, limit, delta = (float(v.reshape(())) for v in values)
            return max(0, math.ceil((limit - start) / delta))
        if n.op == "Gather":
            data, indices = values[0].shape, values[1].shape
            axis = int(n.attr("axis", 0)) % len(data)
            return math.prod(data[:axis] + indices + data[axis + 1:])
        if n.op in BROADCAST:
            return math.prod(np.broadcast_shapes(*(v.shape for v in values)))
    except (ValueError, TypeError, ZeroDivisionError, OverflowError):
        pass
    return 0


def _check_fold_memory(n: Node, values: list[np.ndarray]) -> None:
    """Refuse, before it is computed, a folded node whose output needs more memory than this process has available
    (8 bytes a value: the widest type these operators compute in): a few bytes of a model can declare gigabytes
    (ConstantOfShape of [3 * 2**28])."""
    count = _folded_size(n, values)
    available = available_memory() if count else None
    if available is not None and 8 * count > available:
        raise ConfigError(f"{n.where}: computing it from its constant inputs gives {count:,} values (about "
                          f"{_checks._bytes(8 * count)}), more than the {_checks._bytes(available)} of memory this "
                          "process has available; load the model where more memory is available, or export it with "
                          "this value computed from the network's input")


def _finish_outputs(g: Graph) -> None:
    """The Sequential's outputs are its last layer's: make them the graph's outputs, adding an identity layer
    (Dropout with ratio 0) where the graph's one output is another blob, and where it has several that the last
    layer does not give, a layer giving them all: their values side by side (each flattened; the batch kept where
    they share it), cut apart again by a Slice (the ONNX backend reshapes each to its declared shape). Outputs that
    are one value (an Identity of another output, or one name twice) are each given."""
    for k, o in enumerate(g.model.graph.output):
        name = g.resolve(o.name)
        if name in g.shapes or name in g.input_shapes or name in g.time_major or name in g.stacked:
            continue
        if not o.name:
            raise SerializationError(f"ONNX graph output {k} has no name: {MALFORMED}")
        if name in g.constants:
            raise ConfigError(f"ONNX graph output {o.name!r} is a constant (an initializer, or computed from constants "
                              "at import); leafpy's network outputs are computed from its inputs: leave it out of the "
                              "graph's outputs")
        raise SerializationError(f"ONNX graph output {o.name!r}: no node and no graph input gives it: {MALFORMED}")
    wanted = [g.resolve(o.name) for o in g.model.graph.output]
    last = list(g.layers[-1].outputs) if g.layers else []
    if wanted == last:
        return
    onnx = require_onnx()
    taken: set[str] = set()
    fake = Node(onnx.helper.make_node("Identity", wanted, [unique_name(w + ":out", taken) for w in wanted],
                                      name=f"{g.model.graph.output[0].name}_output"), 0, g.opset)
    blobs = [g.blob(fake, k) for k in range(len(wanted))]
    if len(wanted) == 1:
        g.add(fake, DropoutConfig(ratio=0.0), blobs, fake.outputs)
        return
    batch = {g.shape(b)[0] for b in blobs}
    rows = []
    for k, b in enumerate(blobs):
        rows.append(unique_name(f"{b}:row", taken))
        flat = ReshapeConfig(shape=(g.shape(b)[0], -1)) if len(batch) == 1 else \
            ReshapeConfig(shape=(1, -1), whole_shape=True)
        g.add(fake, flat, [b], [rows[-1]], suffix=f"_flat{k}")
    g.add(fake, ConcatConfig(axis=1), rows, [f"{fake.name}:all"], suffix="_all")
    points = np.cumsum([g.shape(r)[1] for r in rows]).tolist()[:-1]
    g.add(fake, SliceConfig(axis=1, slice_points=tuple(points)), [f"{fake.name}:all"], fake.outputs)
