"""bfloat16 and float16 buffers in the cuda backend's own kernels: loads and stores in the buffer's format,
arithmetic in float.

The kernels see a 16-bit buffer as ``unsigned short`` (a ``uint16`` view) and convert with the device functions of
:data:`CONVERT`, so they need neither CUDA's ``cuda_bf16.h``/``cuda_fp16.h`` headers nor CuPy's own bfloat16 type.
:func:`typed_kernel` rewrites one of the backend's ElementwiseKernel formulas (written over a type ``T``) into a
kernel whose every array operand has its own format (float32, bfloat16 or float16), so one formula serves any mix:
a bfloat16 activation times a float32 dropout mask, a bfloat16 weight-gradient product added into a float32
accumulator.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ...errors import BackendError

CONVERT = r"""
typedef float T;
__device__ __forceinline__ float ld_f32(float v) { return v; }
__device__ __forceinline__ float st_f32(float v) { return v; }
__device__ __forceinline__ float ld_bf16(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
// round to nearest even; a NaN stays a (quiet) NaN; values beyond bfloat16's range round to infinity
__device__ __forceinline__ unsigned short st_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float ld_f16(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short st_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
"""
"""Device functions: ``ld_<format>`` reads a stored value as float, ``st_<format>`` rounds a float to the format
(round to nearest even, as NumPy's and ml_dtypes' conversions do)."""

FORMATS = ("f32", "bf16", "f16")


def low_dtypes() -> tuple[np.dtype, ...]:
    """The 16-bit float dtypes: float16, and bfloat16 where ml_dtypes is installed."""
    out = [np.dtype(np.float16)]
    try:
        import ml_dtypes

        out.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return tuple(out)


def storage_format(dtype: Any) -> str | None:
    """The kernels' name of ``dtype``'s format ("f32", "bf16", "f16"), None for any other dtype."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt.itemsize == 2 and dt.kind == "V" and dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return "bf16"
    return None


def is_low(array: Any) -> bool:
    """Whether ``array`` holds bfloat16 or float16 values."""
    dtype = getattr(array, "dtype", None)
    return dtype is not None and storage_format(dtype) in ("bf16", "f16")


def as_stored(array: Any) -> Any:
    """``array`` as its kernels take it: a 16-bit float array viewed as uint16, any other unchanged."""
    return array.view(np.uint16) if is_low(array) else array


def formats_of(op: str, **arrays: Any) -> dict[str, str]:
    """Each named array's format; a BackendError naming ``op`` for an array of an unsupported dtype."""
    out = {}
    for name, a in arrays.items():
        fmt = storage_format(a.dtype)
        if fmt is None:
            raise BackendError(f"cuda {op}: operand '{name}' has dtype {a.dtype}; its low-precision kernel takes "
                               "float32, bfloat16 or float16 operands (run a float64 backend in float64 throughout)")
        out[name] = fmt
    return out


def _param(text: str) -> tuple[bool, str, str]:
    words = text.split()
    raw = words[0] == "raw"
    return raw, words[-2], words[-1]


_C_TYPES = {"int32": "int", "uint32": "unsigned int", "float32": "float", "int64": "long long"}

VECTOR_WIDTH = 8
"""Values per thread in the vectorised 16-bit kernels: one 16-byte load (uint4) per 16-bit array, two (float4) per
float32 array."""


def _parse(in_params: str, out_params: str, formats: dict[str, str]) -> list[tuple[int, bool, str, str]]:
    """Each parameter as (side: 0 input, 1 output; raw; its type after rewriting; name)."""
    out = []
    for side, params in enumerate((in_params, out_params)):
        for text in params.split(","):
            raw, typ, pname = _param(text)
            if typ == "T":
                fmt = formats.get(pname)
                typ = "float32" if fmt is None else ("float32" if fmt == "f32" else "uint16")
            out.append((side, raw, typ, pname))
    return out


def _vector_source(params: list, operation: str, name: str, formats: dict[str, str], read_outputs: bool,
                   macros: str) -> str:
    """A kernel applying ``operation`` to :data:`VECTOR_WIDTH` consecutive elements per thread, its arguments
    those of the ElementwiseKernel (same order) and then the number of vectors."""
    args, loads, lanes_in, lanes_out, stores = [], [], [], [], []
    w = VECTOR_WIDTH
    for side, raw, typ, pname in params:
        fmt = formats.get(pname)
        if raw:
            ctype = "unsigned short" if typ == "uint16" else _C_TYPES[typ]
            args.append(f"{'' if side else 'const '}{ctype}* {pname}")
            continue
        if fmt is None:  # a scalar
            args.append(f"{_C_TYPES[typ]} {pname}")
            continue
        ctype = "float" if fmt == "f32" else "unsigned short"
        args.append(f"{'' if side else 'const '}{ctype}* {pname}_s")
        const = "" if side else "const "
        if side == 0 or read_outputs:
            if fmt == "f32":
                loads.append(f"const float4* {pname}_p = reinterpret_cast<const float4*>({pname}_s) + 2 * v;"
                             f" const float4 {pname}_a = {pname}_p[0], {pname}_b = {pname}_p[1];"
                             f" float {pname}_8[{w}] = {{{pname}_a.x, {pname}_a.y, {pname}_a.z, {pname}_a.w,"
                             f" {pname}_b.x, {pname}_b.y, {pname}_b.z, {pname}_b.w}};")
            else:
                loads.append(f"const uint4 {pname}_v = reinterpret_cast<const uint4*>({pname}_s)[v];"
                             f" const unsigned short* {pname}_h = reinterpret_cast<const unsigned short*>"
                             f"(&{pname}_v); float {pname}_8[{w}];"
                             f" for (int k = 0; k < {w}; ++k) {pname}_8[k] = ld_{fmt}({pname}_h[k]);")
        else:
            loads.append(f"float {pname}_8[{w}];")
        if side == 0:
            lanes_in.append(f"{const}float {pname} = {pname}_8[k];")
        else:
            lanes_in.append(f"float {pname} = {pname}_8[k];" if read_outputs else f"float {pname};")
            lanes_out.append(f"{pname}_8[k] = {pname};")
            if fmt == "f32":
                stores.append(f"float4* {pname}_p = reinterpret_cast<float4*>({pname}_s) + 2 * v;"
                              f" {pname}_p[0] = make_float4({pname}_8[0], {pname}_8[1], {pname}_8[2], {pname}_8[3]);"
                              f" {pname}_p[1] = make_float4({pname}_8[4], {pname}_8[5], {pname}_8[6], {pname}_8[7]);")
            else:
                stores.append(f"uint4 {pname}_v; unsigned short* {pname}_h = reinterpret_cast<unsigned short*>"
                              f"(&{pname}_v); for (int k = 0; k < {w}; ++k) {pname}_h[k] = st_{fmt}({pname}_8[k]);"
                              f" reinterpret_cast<uint4*>({pname}_s)[v] = {pname}_v;")
    lines = [CONVERT, macros,
             f'extern "C" __global__ void {name}({", ".join(args + ["long long n_vectors"])}) {{',
             "    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
             "    if (v >= n_vectors) return;",
             *("    " + line for line in loads),
             f"    #pragma unroll\n    for (int k = 0; k < {w}; ++k) {{",
             f"        const long long i = v * {w} + k; (void)i;",
             *("        " + line for line in lanes_in),
             f"        {{ {operation}; }}",
             *("        " + line for line in lanes_out),
             "    }",
             *("    { " + line + " }" for line in stores),
             "}"]
    return "\n".join(lines)


def one_memory_order(arrays: Any) -> bool:
    """Whether the arrays share one shape and one order (equal strides in elements) and each fills one block of
    memory: row-major, or a channels-last [N, C, H, W] view of NHWC memory. Work on each element that does not
    depend on where the element sits may then run over their memory in order, as over flat arrays."""
    first = arrays[0]
    if not (first.flags.c_contiguous or (first.ndim == 4 and first.transpose(0, 2, 3, 1).flags.c_contiguous)):
        return False
    order = tuple(s // first.itemsize for s in first.strides)
    return all(a.shape == first.shape and tuple(s // a.itemsize for s in a.strides) == order for a in arrays)


class TypedKernel:
    """An operation over arrays of any of the three formats: an ElementwiseKernel for any layout, and a kernel of
    :data:`VECTOR_WIDTH` values per thread where every (non-raw) array is contiguous, 16-byte aligned and of one
    size, a multiple of the width (one value per thread moved 16-bit arrays at a third of the bandwidth of the
    float32 kernels' float4 loads on an H200)."""

    BLOCK = 256

    def __init__(self, cp: Any, in_params: str, out_params: str, operation: str, name: str,
                 formats: dict[str, str], read_outputs: bool = False) -> None:
        params = _parse(in_params, out_params, formats)
        macros = "\n".join(f"#define LD_{p}(v) ld_{formats[p]}(v)\n#define ST_{p}(v) st_{formats[p]}(v)"
                            for _, raw, _, p in params if raw and p in formats)
        decls: list[list[str]] = [[], []]
        loads: list[str] = []
        stores: list[str] = []
        for side, raw, typ, pname in params:
            fmt = formats.get(pname)
            if raw or fmt is None:
                decls[side].append(f"{'raw ' if raw else ''}{typ} {pname}")
                continue
            decls[side].append(f"{typ} {pname}_s")
            if side == 0 or read_outputs:
                loads.append(f"float {pname} = ld_{fmt}({pname}_s);")
            else:
                loads.append(f"float {pname};")
            if side == 1:
                stores.append(f"{pname}_s = st_{fmt}({pname});")
        tag = "_".join(formats[k] for k in sorted(formats))
        self.name = f"{name}_{tag}"
        body = " ".join([*loads, "{", operation + ";", "}", *stores])
        self.elementwise = cp.ElementwiseKernel(", ".join(decls[0]), ", ".join(decls[1]), body, self.name,
                                                preamble=CONVERT + macros + "\n")
        self.arrays = [k for k, (_, raw, _, p) in enumerate(params) if not raw and p in formats]
        self.source = _vector_source(params, operation, self.name + "_v", formats, read_outputs, macros)
        self._cp = cp
        self._vector: Any = None
        self.reads_index = re.search(r"\bi\b", operation) is not None
        """Whether the operation reads the element's (row-major) index: its vector kernel then needs row-major
        arrays, where other operations run over any arrays of :func:`one_memory_order`."""

    def __call__(self, *args: Any) -> None:
        arrays = [args[k] for k in self.arrays]
        size = arrays[0].size
        if size % VECTOR_WIDTH == 0 and 0 < size < 2**40 and all(
                a.size == size and a.data.ptr % 16 == 0 for a in arrays) and (
                all(a.flags.c_contiguous for a in arrays) or (not self.reads_index and one_memory_order(arrays))):
            if self._vector is None:
                self._vector = self._cp.RawModule(code=self.source).get_function(self.name + "_v")
            n = size // VECTOR_WIDTH
            self._vector(((n + self.BLOCK - 1) // self.BLOCK,), (self.BLOCK,), (*args, np.int64(n)))
        else:
            self.elementwise(*args)


def typed_kernel(cp: Any, in_params: str, out_params: str, operation: str, name: str, formats: dict[str, str],
                 read_outputs: bool = False) -> TypedKernel:
    """A kernel computing ``operation`` (written over ``T``, as the backend's float kernels are) in float, with
    each array operand named in ``formats`` loaded from and stored to its own format.

    A ``T`` operand named in ``formats`` is an array (pass it through :func:`as_stored`); one not named is a scalar
    (pass np.float32). A ``raw T`` operand named in ``formats`` is read as ``LD_<name>(<name>[k])``; one not named
    is a float32 array (BatchNorm's statistics). ``read_outputs``: the operation reads its outputs' old values.
    Other parameters pass through (``int32 c``: pass np.int32). The operation may read ``i``, the element's index."""
    return TypedKernel(cp, in_params, out_params, operation, name, formats, read_outputs)
