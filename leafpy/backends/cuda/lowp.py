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


def typed_kernel(cp: Any, in_params: str, out_params: str, operation: str, name: str, formats: dict[str, str],
                 read_outputs: bool = False, preamble: str = "") -> Any:
    """An ElementwiseKernel computing ``operation`` (written over ``T``, as the backend's float kernels are) in
    float, with each array operand named in ``formats`` loaded from and stored to its own format.

    A ``T`` operand named in ``formats`` is an array (pass it through :func:`as_stored`); one not named is a scalar
    (pass np.float32). A ``raw T`` operand named in ``formats`` is read as ``LD_<name>(<name>[k])``; one not named
    is a float32 array (BatchNorm's statistics). ``read_outputs``: the operation reads its outputs' old values."""
    decls: list[list[str]] = [[], []]
    loads: list[str] = []
    stores: list[str] = []
    macros: list[str] = []
    for side, params in enumerate((in_params, out_params)):
        for text in params.split(","):
            raw, typ, pname = _param(text)
            if typ != "T":
                decls[side].append(text.strip())
                continue
            fmt = formats.get(pname)
            if fmt is None:
                decls[side].append(f"{'raw ' if raw else ''}float32 {pname}")
                continue
            ctype = "float32" if fmt == "f32" else "uint16"
            if raw:
                decls[side].append(f"raw {ctype} {pname}")
                macros.append(f"#define LD_{pname}(v) ld_{fmt}(v)\n#define ST_{pname}(v) st_{fmt}(v)")
                continue
            decls[side].append(f"{ctype} {pname}_s")
            if side == 0 or read_outputs:
                loads.append(f"float {pname} = ld_{fmt}({pname}_s);")
            else:
                loads.append(f"float {pname};")
            if side == 1:
                stores.append(f"{pname}_s = st_{fmt}({pname});")
    tag = "_".join(formats[k] for k in sorted(formats))
    body = " ".join([*loads, "{", operation + ";", "}", *stores])
    return cp.ElementwiseKernel(", ".join(decls[0]), ", ".join(decls[1]), body, f"{name}_{tag}",
                                preamble=CONVERT + "\n".join(macros) + "\n" + preamble)
