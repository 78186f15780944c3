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


class ParamStruct:
    """The Python mirror of one WGSL parameter struct: ``ParamStruct(...)(field=value, ...)`` -> bytes."""

    def __init__(self, name: str, module: str, fields: list[tuple[str, str]]) -> None:
        self.name = name
        self.module = module  # the .wgsl file (without suffix) that declares it: the shader module it feeds
        self.fields = tuple(f for f, _ in fields)
        self.kinds = tuple(k for _, k in fields)
        self._slot = {f: i for i, f in enumerate(self.fields)}
        size = 4 * len(fields)
        self.size = max(16, -(-size // 16) * 16)
        self._format = "<" + "".join(_CODES[k] for k in self.kinds) + "x" * (self.size - size)
        self._cached = functools.lru_cache(maxsize=4096)(self._pack)

    def __call__(self, **values: float) -> bytes:
        return self._cached(**values)  # memoised: a training step packs the same values each time

    def _pack(self, **values: float) -> bytes:
        unknown = [k for k in values if k not in self._slot]
        if unknown:
            raise BackendError(f"webgpu: {self.name} ({self.module}.wgsl) has no field {', '.join(unknown)}; "
                               f"its fields: {', '.join(self.fields)}")
        slots: list[float] = [0] * len(self.fields)
        for k, v in values.items():
            slots[self._slot[k]] = v
        return struct.pack(self._format, *(float(v) if kind == "f32" else
                                           (int(v) & 0xFFFFFFFF if kind == "u32" else int(v))
                                           for v, kind in zip(slots, self.kinds)))

    def __repr__(self) -> str:
        return f"ParamStruct({self.name}: {', '.join(self.fields)})"


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
SequenceParams = param_struct("sequence", "SequenceParams")
ScatterParams = param_struct("scatter", "ScatterParams")
