"""Kernel parameters as named WGSL uniform structs, mirrored in Python.

Each kernel family declares its parameters once, as a ``struct NameParams { count: u32, alpha: f32, ... }`` in its
.wgsl file; :func:`param_struct` reads that declaration and gives a callable that packs keyword arguments into the
struct's bytes under WGSL's uniform layout (u32, i32 and f32 take 4 bytes each, in declaration order; the struct's
size is rounded up to 16 bytes). Fields not given are 0, a field the struct lacks is an error, so a call site reads
``GemmParams(m=m, n=n, k=k)`` and cannot drift from the shader.
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path

from ...errors import BackendError

_HERE = Path(__file__).parent
_CODES = {"u32": "I", "i32": "i", "f32": "f"}
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{([^}]*)\}")
_FIELD = re.compile(r"(\w+)\s*:\s*(\w+)")


class ParamStruct(functools.partial):
    """The Python mirror of one WGSL parameter struct: ``ParamStruct(...)(field=value, ...)`` -> bytes. A partial
    over a memoised packer, so that a call (one per dispatch; a training step packs the same values each time) stays
    in C where the values were seen before."""

    name: str
    module: str  # the .wgsl file (without suffix) that declares it: the shader module it feeds
    fields: tuple[str, ...]
    kinds: tuple[str, ...]
    size: int
    per_thread: int  # elements a thread of the struct's module handles (the dispatch grid is count / per_thread)

    def __new__(cls, name: str, module: str, fields: list[tuple[str, str]]) -> ParamStruct:
        names = tuple(f for f, _ in fields)
        kinds = tuple(k for _, k in fields)
        slot = {f: i for i, f in enumerate(names)}
        used = 4 * len(fields)
        size = max(16, -(-used // 16) * 16)
        layout = struct.Struct("<" + "".join(_CODES[k] for k in kinds) + "x" * (size - used))

        def pack(**values: float) -> bytes:
            unknown = [k for k in values if k not in slot]
            if unknown:
                raise BackendError(f"webgpu: {name} ({module}.wgsl) has no field {', '.join(unknown)}; "
                                   f"its fields: {', '.join(names)}")
            slots: list[float] = [0] * len(names)
            for k, v in values.items():
                slots[slot[k]] = v
            return layout.pack(*(float(v) if kind == "f32" else (int(v) & 0xFFFFFFFF if kind == "u32" else int(v))
                                 for v, kind in zip(slots, kinds)))

        self = super().__new__(cls, functools.lru_cache(maxsize=4096)(pack))
        self.name, self.module, self.fields, self.kinds, self.size = name, module, names, kinds, size
        self.per_thread = 1
        return self

    def feeding(self, module: str, per_thread: int = 1) -> ParamStruct:
        """The same struct feeding another build of the kernels (a float16 module, or entry points whose threads
        handle ``per_thread`` elements each: a dispatch's grid is its count over that)."""
        twin = ParamStruct(self.name, module, list(zip(self.fields, self.kinds)))
        twin.per_thread = per_thread
        return twin

    def __repr__(self) -> str:
        return f"ParamStruct({self.name}: {', '.join(self.fields)})"


PER_THREAD = 4
"""Elements a thread of a four-a-thread kernel handles (params.wgsl's quad_first): the float16 elementwise module,
the update rules' entry points. One load a thread (two bytes, in float16) left a large pass at a third of the
memory bandwidth."""


def parse_structs(source: str, module: str) -> dict[str, ParamStruct]:
    """Every struct of u32, i32 and f32 fields declared in WGSL ``source`` (comments ignored)."""
    text = re.sub(r"//[^\n]*", "", source)
    found = {}
    for name, body in _STRUCT.findall(text):
        fields = _FIELD.findall(body)
        bad = [f"{f}: {k}" for f, k in fields if k not in _CODES]
        if bad:
            raise BackendError(f"webgpu: struct {name} in {module}.wgsl: parameter fields must be u32, i32 or f32, "
                               f"got {', '.join(bad)}")
        found[name] = ParamStruct(name, module, fields)
    return found


def param_struct(module: str, name: str) -> ParamStruct:
    """The struct ``name`` declared in ``module``.wgsl beside this file."""
    structs = parse_structs((_HERE / f"{module}.wgsl").read_text(), module)
    if name not in structs:
        raise BackendError(f"webgpu: {module}.wgsl declares no struct {name}; it declares "
                           f"{', '.join(structs) or 'none'}")
    return structs[name]


ElementwiseParams = param_struct("elementwise", "ElementwiseParams")
UpdateParams = param_struct("update", "UpdateParams")
LrnParams = param_struct("lrn", "LrnParams")
BatchNormParams = param_struct("batchnorm", "BatchNormParams")
ReduceParams = param_struct("reduce", "ReduceParams")
ClassesParams = param_struct("classes", "ClassesParams")
GemmParams = param_struct("gemm", "GemmParams")
ConvParams = param_struct("conv", "ConvParams")
PoolParams = param_struct("pool", "PoolParams")
WinogradParams = param_struct("winograd", "WinogradParams")
DirectParams = param_struct("direct", "DirectParams")
SequenceParams = param_struct("sequence", "SequenceParams")
ScatterParams = param_struct("scatter", "ScatterParams")
HalfParams = param_struct("half", "HalfParams")
