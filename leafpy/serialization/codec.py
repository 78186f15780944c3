"""The Cap'n Proto codec: configs (LayerConfig, SolverConfig) to and from the structs of ``leaf.capnp``.

Config dataclasses map onto schema structs field by field (snake_case to camelCase), so a new layer type needs
only its schema entry; ``UNION_MEMBERS`` and ``FIELD_NAMES`` name the exceptions. Files, weights and Leaf's names
are the business of the package's other modules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import SerializationError
from ..layer_config import FillerConfig, LayerConfig, WeightConfig, layer_types, lookup

_SCHEMA: Any = None


def schema() -> Any:
    """The parsed leaf.capnp schema (loaded once)."""
    global _SCHEMA
    if _SCHEMA is None:
        import capnp

        here = Path(__file__).resolve().parent.parent  # the leafpy package
        for candidate in (here / "leaf.capnp", here.parent / "capnp" / "leaf.capnp"):
            if candidate.exists():
                _SCHEMA = capnp.load(str(candidate))  # type: ignore[attr-defined]  # pycapnp has no stubs
                break
        else:
            raise SerializationError(f"leaf.capnp schema not found next to {here}")
    return _SCHEMA


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


UNION_MEMBERS: dict[str, str] = {}
"""Layer type -> its member of LayerConfig's union, for a type whose member is not its name matched without case
(``LeakyReLU`` is stored as ``leakyRelu`` with no entry here)."""
FIELD_NAMES: dict[str, dict[str, str]] = {}
"""Layer type -> {config field: schema field}, for fields not stored under their lowerCamelCase name."""


def _union_member(type_name: str) -> str:
    if type_name in UNION_MEMBERS:
        return UNION_MEMBERS[type_name]
    members = schema().LayerConfig.LayerType.schema.union_fields
    for m in members:
        if m.lower() == type_name.lower():
            return m
    raise SerializationError(f"layer type {type_name!r} has no entry in leaf.capnp's LayerConfig union")


def _void_default(member: str, config: LayerConfig) -> bool:
    """Whether ``config`` is stored as the Void member ``member``: a type stored so (as Leaf had it) whose settings,
    kept in its member ``{member}Config``, are all their defaults (old readers and Leaf then read it as before)."""
    union = schema().LayerConfig.LayerType.schema.union_fields
    return member + "Config" in union and config.config == type(config.config)()


def _layer_type_of(member: str) -> str | None:
    """The layer type stored as union member ``member`` (the inverse of _union_member)."""
    if member.endswith("Config") and member[:-len("Config")] in schema().LayerConfig.LayerType.schema.union_fields:
        member = member[:-len("Config")]  # the settings of a type otherwise stored as Void
    for type_name, m in UNION_MEMBERS.items():
        if m == member:
            return type_name
    return next((t for t in layer_types() if t.lower() == member.lower()), None)


def _schema_field(type_name: str, field: str) -> str:
    return FIELD_NAMES.get(type_name, {}).get(field) or _camel(field)


# --------------------------------------------------------------------------------------------------------------
# config -> capnp
# --------------------------------------------------------------------------------------------------------------
def _write_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [max(int(v), 0) if isinstance(v, int) else v for v in value]
    return value


def _fill_struct(builder: Any, type_name: str, config: Any) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        field = _schema_field(type_name, f.name)
        if isinstance(value, int) and builder.schema.fields[field].proto.slot.type.which() == "list":
            setattr(builder, field, [value])  # an optional integer (any sign), stored as a list of at most one
            continue
        setattr(builder, field, _write_value(value))


def write_layer_config(builder: Any, config: LayerConfig) -> None:
    """Fill a capnp LayerConfig builder from ``config`` (containers recursively)."""
    builder.name = config.name
    member = _union_member(config.type)
    ltype = builder.layerType
    if config.type == "Sequential":
        seq = config.config
        sb = ltype.init("sequential")
        layers = sb.init("layers", len(seq.layers))
        for i, lc in enumerate(seq.layers):
            write_layer_config(layers[i], lc)
        ins = sb.init("inputs", len(seq.inputs))
        for i, (n, shape) in enumerate(seq.inputs):
            ins[i].name = n
            ins[i].shape = list(shape)
        sb.forceBackward = seq.force_backward
    elif config.config is None or _void_default(member, config):
        setattr(ltype, member, None)
    elif member + "Config" in schema().LayerConfig.LayerType.schema.union_fields:
        _fill_struct(ltype.init(member + "Config"), config.type, config.config)
    else:
        _fill_struct(ltype.init(member), config.type, config.config)
    builder.outputs = list(config.outputs)
    builder.inputs = list(config.inputs)
    params = builder.init("params", len(config.params))
    for i, p in enumerate(config.params):
        params[i].name = p.name or ""
        params[i].lrMult = p.lr_mult
        params[i].decayMult = p.decay_mult
        if p.filler is not None:
            fb = params[i].init("filler")
            fb.type = _camel(p.filler.type)
            fb.value = p.filler.value
            fb.std = p.filler.std
    builder.propagateDown = list(config.propagate_down)


# --------------------------------------------------------------------------------------------------------------
# capnp -> config
# --------------------------------------------------------------------------------------------------------------
def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def _read_value(value: Any) -> Any:
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        return tuple(_read_value(v) for v in value)
    if hasattr(value, "raw") or type(value).__name__ == "_DynamicEnum":
        return str(value)
    return value


NEWER = "the file was written by a newer leafpy, or is damaged: upgrade leafpy to read it"


def _get(reader: Any, field: str, where: str) -> Any:
    """``reader.field`` as a plain value (:func:`_read_value`), where an enum value this schema does not know (a
    newer leafpy's) is a SerializationError naming it rather than capnp's own words."""
    try:
        return _read_value(getattr(reader, field))
    except Exception:  # noqa: BLE001 - capnp reports an unknown enumerant as a bare KjException
        raise SerializationError(f"{where}.{_snake(field)}: a value this leafpy does not know ({NEWER})") from None


def read_layer_config(reader: Any, where: str = "config") -> LayerConfig:
    """The LayerConfig a capnp LayerConfig reader holds (``where`` names it in errors)."""
    name = reader.name
    try:
        which = reader.layerType.which()
    except Exception:  # noqa: BLE001 - a union member this schema does not have
        raise SerializationError(f"{where} (layer '{name}'): a layer type this leafpy does not know ({NEWER})") \
            from None
    type_name = _layer_type_of(which)
    if type_name is None:
        raise SerializationError(f"{where}: unknown layer type {which!r}")
    entry = lookup(type_name)
    if type_name == "Sequential":
        sr = reader.layerType.sequential
        config: Any = entry.config_class(  # type: ignore[misc]
            layers=[read_layer_config(lc, f"{where}.layers[{i}]") for i, lc in enumerate(sr.layers)],
            inputs=[(i.name, tuple(i.shape)) for i in sr.inputs],
            force_backward=bool(sr.forceBackward))
    elif entry.config_class is None or getattr(reader.layerType, which) is None:
        config = type_name  # a type without settings, or stored as Void: its defaults
    else:
        sub = getattr(reader.layerType, which)
        kwargs = {}
        for f in dataclasses.fields(entry.config_class):
            stored = _schema_field(type_name, f.name)
            if stored in sub.schema.fieldnames:
                value = _get(sub, stored, f"{where} (layer '{name}')")
                if value == () and f.default is not dataclasses.MISSING:
                    continue  # an empty list (or one a file written before the field existed lacks): the default
                if (type_name, f.name) == ("Reshape", "shape") and isinstance(value, tuple):
                    value = tuple(-1 if d == 0 else d for d in value)  # files store an inferred entry as 0
                kwargs[f.name] = value
        config = entry.config_class(**kwargs)
    params = []
    for p in reader.params:
        filler = None
        if p._has("filler"):
            kind = _get(p.filler, "type", f"{where} (layer '{name}').filler")
            filler = FillerConfig(type=_snake(str(kind)), value=p.filler.value, std=p.filler.std)
        params.append(WeightConfig(name=p.name or None, lr_mult=p.lrMult, decay_mult=p.decayMult, filler=filler))
    return LayerConfig(name, config, inputs=list(reader.inputs), outputs=list(reader.outputs), params=params,
                       propagate_down=[bool(b) for b in reader.propagateDown])



_SOLVER_OPTIONAL_ZERO = {"max_iter", "clip_gradients", "weight_decay"}


def write_solver_config(builder: Any, cfg: Any) -> None:
    """Fill a capnp SolverConfig builder from a SolverConfig (any dataclass with its fields)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        camel = _camel(f.name)
        if f.name in ("network", "objective"):
            if value is not None:
                write_layer_config(builder.init(camel), value)
        elif f.name == "seed":
            builder.seed = -1 if value is None else int(value)
        elif f.name == "loss_scale":  # text: "" (the precision's default), "dynamic", "none" or a number
            builder.lossScale = "" if value is None else value if isinstance(value, str) else repr(float(value))
        elif value is None:
            continue
        else:
            setattr(builder, camel, list(value) if isinstance(value, tuple) else value)


def read_solver_config(reader: Any, config_class: type) -> Any:
    """A ``config_class`` (SolverConfig) from a capnp SolverConfig reader."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(config_class):
        camel = _camel(f.name)
        if f.name in ("network", "objective"):
            kwargs[f.name] = read_layer_config(getattr(reader, camel), f"solver.{f.name}") \
                if reader._has(camel) else None
        elif f.name == "seed":
            kwargs["seed"] = None if reader.seed < 0 else int(reader.seed)
        elif f.name == "loss_scale":
            text = str(reader.lossScale)  # a number as its repr: read as one (SolverConfig takes numbers only)
            try:
                kwargs["loss_scale"] = float(text) if text and text not in ("dynamic", "none") else text or None
            except ValueError:  # (not a number: SolverConfig refuses it, naming the field)
                kwargs["loss_scale"] = text
        else:
            v = _read_value(getattr(reader, camel))
            if f.name in _SOLVER_OPTIONAL_ZERO and not v:
                v = None
            kwargs[f.name] = v
    return config_class(**kwargs)
