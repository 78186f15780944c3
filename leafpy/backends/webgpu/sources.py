"""The WGSL of every shader module the webgpu backend builds, by module name, without a device.

A module's text is put together here and nowhere else: params.wgsl first, window.wgsl (a window's geometry) and
lanes.wgsl or lanes_subgroup.wgsl (a workgroup's reduction) where the module uses them, then its own .wgsl file and
the code generated from pointwise.TABLE (for update.wgsl, the solver rules' entry points generated from
updates.TABLE); float16 modules (precision "fp16", named ``<base>16<arrays>``: gemm16AB is gemm.wgsl with A and B
float16) start with :data:`PRELUDE` and have their float16 arrays rewritten by :func:`_halve`. The backend builds
its modules from :func:`module_source`; :func:`module_names` lists every module it may build, so that tests can
compile each one elsewhere: in a browser, whose WGSL compiler (Chrome's Tint) follows the specification more
strictly than wgpu's (naga). The one difference between the two: subgroup operations need
the directive ``enable subgroups;`` under the specification, which naga (wgpu-py 0.32) refuses (``browser=True``
adds it).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from fractions import Fraction
from pathlib import Path

from ...errors import BackendError
from .. import pointwise, updates

_HERE = Path(__file__).parent

BASE = ("elementwise", "update", "reduce", "classes", "gemm", "conv", "pool", "winograd", "batchnorm", "lrn",
        "direct")
"""The float32 modules built when the backend opens."""
ON_USE = ("sequence", "scatter")
"""The float32 modules built on first use (embeddings and recurrent cells)."""
_WINDOWED = ("gemm", "conv", "pool", "winograd", "direct")  # modules that include window.wgsl
_LANED = ("reduce", "classes")  # modules whose reductions combine a workgroup's lanes (lanes*.wgsl)
_EPILOGUE = ("elementwise", "gemm", "winograd")  # modules followed by code generated from pointwise.TABLE
_TYPED = ("batchnorm", "lrn", "sequence", "scatter")  # modules whose float16 arrays are named per call (Device.typed)
_HALF_FIXED = {"pool16": ("pool", ("src", "dst")), "reduce16": ("reduce", ("a",)), "reduce16b": ("reduce", ("b",)),
               "classes16a": ("classes", ("a",)), "classes16c": ("classes", ("c",))}
"""float16 modules built when precision "fp16" opens (with "half" and "elementwise16"): base module, float16 arrays."""
_ARRAY_NAMES = {"gemm": r"[ABC]", "winograd": r"src|dst"}  # how a float16 module's name lists its arrays
F16_OPEN = ("half", "elementwise16", "update16", *_HALF_FIXED)
"""The float16 modules built when precision "fp16" opens (the others on first use)."""
SUBGROUPS_DIRECTIVE = "enable subgroups;\n"


@functools.cache
def _read(name: str) -> str:
    return (_HERE / f"{name}.wgsl").read_text()


def lanes(subgroups: bool) -> str:
    """reduce_workgroup's WGSL: with subgroup operations (lanes_subgroup.wgsl), or the workgroup-memory tree."""
    return _read("lanes_subgroup" if subgroups else "lanes")


def module_source(name: str, subgroups: bool = False, browser: bool = False) -> str:
    """The WGSL of shader module ``name`` (one of :func:`module_names`), its reductions built with subgroup
    operations where ``subgroups``; ``browser``: for a compiler that follows the specification (see the module
    docstring)."""
    base, halves = _split_name(name)
    laned = base in _LANED
    head = SUBGROUPS_DIRECTIVE if laned and subgroups and browser else ""
    if halves is not None:
        head += PRELUDE
    head += _read("params") + (_read("window") if base in _WINDOWED else "") + (lanes(subgroups) if laned else "")
    if name == "half":
        return head + _read("half")
    if name == "elementwise16":
        return head + elementwise_source()
    if name == "update16":  # the rules' twins that also store the float16 copy of the weight
        return head + _read("update") + "\n" + updates.wgsl_entry_points(copy=True)
    text = _read(base) + (winograd_f3x3_5x5() if base == "winograd" else "")
    body = text if halves is None else _halve(text, halves)
    if base == "elementwise":
        return head + body + pointwise.wgsl_functions() + pointwise.wgsl_entry_points()
    if base in _EPILOGUE:
        return head + body + pointwise.wgsl_functions() + pointwise.wgsl_epilogue()
    if base == "update":
        return head + body + "\n" + updates.wgsl_entry_points()
    return head + body


def _split_name(name: str) -> tuple[str, tuple[str, ...] | None]:
    """A module name's base module and float16 arrays (None for a float32 module)."""
    if name in BASE or name in ON_USE:
        return name, None
    if name in ("half", "elementwise16", "update16"):
        return name, ()
    if name in _HALF_FIXED:
        return _HALF_FIXED[name]
    base, _, suffix = name.partition("16")
    arrays = tuple(re.findall(_ARRAY_NAMES.get(base, r"s\d+|[a-f]"), suffix))
    if base not in _EPILOGUE[1:] + _TYPED or not arrays or "".join(arrays) != suffix:
        raise BackendError(f"webgpu: no shader module {name!r}; modules: {', '.join(module_names(True))}, and "
                           "float16 builds of gemm, winograd, batchnorm, lrn, sequence and scatter")
    if base == "gemm" and "C" in arrays:
        arrays += ("Bias", "ActOut")  # the store's bias and activation output have C's dtype
    if base == "winograd" and "dst" in arrays:
        arrays += ("bias",)
    return base, arrays


def module_names(f16: bool = False) -> list[str]:
    """Every shader module the backend may build: the float32 ones, and with ``f16`` the float16 ones, where the
    arrays a call declares float16 vary with its operands: every combination for GEMMs and Winograd transforms, and
    for the others each array alone and all of them together."""
    names = [*BASE, *ON_USE]
    if not f16:
        return names
    names += ["half", "elementwise16", "update16", *_HALF_FIXED]
    names += ["gemm16" + "".join(c) for k in (1, 2, 3) for c in itertools.combinations("ABC", k)]
    names += ["winograd16src", "winograd16dst", "winograd16srcdst"]
    for base in _TYPED:
        arrays = re.findall(r"var<storage, read(?:_write)?> (\w+): array<f32>", _read(base))
        names += [f"{base}16{a}" for a in arrays] + [f"{base}16{''.join(arrays)}"]
    return names


def entry_points(source: str) -> list[str]:
    """The compute entry points of a module's WGSL."""
    return re.findall(r"@compute\s+@workgroup_size\([^)]*\)\s*fn\s+(\w+)", re.sub(r"//[^\n]*", "", source))


PRELUDE = """enable f16;

// f32 -> f16 rounded to nearest (even on ties); past float16's largest finite value (65504, and what rounds to it
// from below 65520) an infinity of the same sign, as loss scaling expects from an overflow (WGSL leaves a plain
// conversion's result there to the device): the largest finite value doubled overflows at run time
var<private> lp_two: f32 = 2.0;
fn to_h(x: f32) -> f16 {
    if (abs(x) >= 65520.0) { return f16(clamp(x, -65504.0, 65504.0)) * f16(lp_two); }
    return f16(x);
}
"""
"""What every float16 shader module starts with (then params.wgsl and the module's own source)."""

_ENTRY = """@compute @workgroup_size(256)
fn {entry}(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let i0 = quad_first(gid, nw);  // four elements a thread (params.PER_THREAD)
    for (var j = 0u; j < 4u; j = j + 1u) {{
        let i = i0 + j * 256u;
        if (i < p.count) {{ {store}; }}
    }}
}}
"""


def elementwise_source() -> str:
    """The float16 elementwise module (after PRELUDE and params.wgsl): elementwise.wgsl's ElementwiseParams, the
    arrays a, b and c bound as float16 (a16, ...) or float32 (a32, ...), each entry point using one of each, and
    the activations' entry points generated from pointwise.TABLE like the float32 ones, with float16 loads and
    stores around float32 arithmetic: NAME_h (b = f(a)), NAME_grad_h (c = g(a, b)) and their in-place twins
    NAME_h_inplace, NAME_grad_h_inplace; copy_h, fill_h, scal_h, axpby_h, block_into_h and block_from_h as
    elementwise.wgsl's; mul_h (c = a * b) and mul_hf (b float32) with in-place twins (a = a * b);
    bias_add_h (bias float16) and bias_add_hf (bias float32); split_sum_h (split-K's float32 partials a summed
    into a float16 product b, one output a thread; the others take params.PER_THREAD elements a thread)."""
    declared = re.search(r"struct ElementwiseParams \{[^}]*\}", _read("elementwise"))
    if declared is None:
        raise BackendError("webgpu: elementwise.wgsl declares no struct ElementwiseParams")
    parts = [declared.group(0), "@group(0) @binding(0) var<uniform> p: ElementwiseParams;"]
    for i, name in enumerate("abc"):
        for kind in ("16", "32"):
            parts.append(f"@group(0) @binding({i + 1}) var<storage, read_write> {name}{kind}: array<f{kind}>;")
    parts.append(pointwise.wgsl_functions())
    for ln in pointwise.TABLE.values():
        ps = "".join(f", p.act{i}" for i in range(len(ln.params)))
        f, g = f"pw_{ln.name}_f", f"pw_{ln.name}_g"
        for entry, store in ((ln.entry + "_h", f"b16[i] = to_h({f}(f32(a16[i]){ps}))"),
                             (ln.entry + "_h_inplace", f"a16[i] = to_h({f}(f32(a16[i]){ps}))"),
                             (ln.name + "_grad_h", f"c16[i] = to_h({g}(f32(a16[i]), f32(b16[i]){ps}))"),
                             (ln.name + "_grad_h_inplace", f"b16[i] = to_h({g}(f32(a16[i]), f32(b16[i]){ps}))")):
            parts.append(_ENTRY.format(entry=entry, store=store))
    blas = (("copy_h", "b16[i] = a16[i]"), ("fill_h", "a16[i] = to_h(p.value)"),
            ("scal_h", "a16[i] = to_h(p.alpha * f32(a16[i]))"),
            ("axpby_h", "b16[i] = to_h(p.alpha * f32(a16[i]) + p.beta * f32(b16[i]))"),
            ("block_into_h", "b16[block_index(i)] = a16[i]"), ("block_from_h", "a16[i] = b16[block_index(i)]"))
    parts.append("fn block_index(i: u32) -> u32 {\n    let g = i + p.base;\n"
                 "    return (g / p.part_inner) * p.whole_inner + p.column + g % p.part_inner;\n}")
    parts += [_ENTRY.format(entry=entry, store=store) for entry, store in blas]
    parts.append("""fn split_sum_one(i: u32) {
    var s = vec4<f32>(0.0);  // four slices a pass, as elementwise.wgsl's slice_sum
    var z = 0u;
    for (; z + 3u < p.slices; z = z + 4u) {
        let at = z * p.count + i;
        s = s + vec4<f32>(a32[at], a32[at + p.count], a32[at + 2u * p.count], a32[at + 3u * p.count]);
    }
    for (; z < p.slices; z = z + 1u) { s.x = s.x + a32[z * p.count + i]; }
    var v = p.alpha * ((s.x + s.y) + (s.z + s.w));
    if (p.beta != 0.0) { v = v + p.beta * f32(b16[i]); }
    b16[i] = to_h(v);
}
""")
    parts.append("""@compute @workgroup_size(256)
fn split_sum_h(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);  // one output a thread (binding.SplitSumHalfParams): its loop over the slices
    if (i < p.count) { split_sum_one(i); }  // has loads enough in flight
}
""")
    for entry, other in (("mul_h", "b16"), ("mul_hf", "b32")):
        parts.append(_ENTRY.format(entry=entry, store=f"c16[i] = to_h(f32(a16[i]) * f32({other}[i]))"))
        parts.append(_ENTRY.format(entry=entry + "_inplace", store=f"a16[i] = to_h(f32(a16[i]) * f32({other}[i]))"))
    channel = "((i + p.base) / p.inner) % p.channels"
    for entry, bias in (("bias_add_h", "b16"), ("bias_add_hf", "b32")):
        parts.append(_ENTRY.format(entry=entry, store=f"a16[i] = to_h(f32(a16[i]) + f32({bias}[{channel}]))"))
    return "\n".join(parts) + "\n"


def _halve(source: str, names: tuple[str, ...]) -> str:
    """``source`` with the storage arrays ``names`` declared float16: each read ``X[i]`` becomes ``f32(X[i])`` and
    each store ``X[i] = v;`` becomes ``X[i] = to_h(v);`` (brackets matched, so indices may nest)."""
    for name in names:
        source, found = re.subn(rf"(var<storage, read(?:_write)?> {name}): array<f32>", r"\1: array<f16>", source)
        if found != 1:
            raise BackendError(f"webgpu: expected one declaration of the storage array {name}, found {found}")
    source = re.sub(r"//[^\n]*", "", source)  # comments would read as code below
    pattern = re.compile(rf"\b({'|'.join(names)})\[")
    out, at = [], 0
    for match in pattern.finditer(source):
        if match.start() < at:
            continue
        depth, end = 1, match.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(source[end], 0)
            end += 1
        access = source[match.start():end]
        store = re.match(r"\s*=(?!=)", source[end:])
        out.append(source[at:match.start()])
        if store:
            stop = source.index(";", end)
            value = source[end + store.end():stop].strip()
            out.append(f"{_halve_reads(access[:-1], pattern, inner=True)}] = to_h({_halve_reads(value, pattern)});")
            at = stop + 1
        else:
            out.append(f"f32({_halve_reads(access[:-1], pattern, inner=True)}])")
            at = end
    out.append(source[at:])
    return "".join(out)


def _halve_reads(text: str, pattern: re.Pattern, inner: bool = False) -> str:
    """Reads of float16 arrays inside an index or a stored value wrapped in f32() (``inner``: text opens with the
    array's own access, which stays as it is)."""
    head = ""
    if inner:
        bracket = text.index("[") + 1
        head, text = text[:bracket], text[bracket:]
    parts, at = [], 0
    for match in pattern.finditer(text):
        if match.start() < at:
            continue
        depth, end = 1, match.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(text[end], 0)
            end += 1
        parts += [text[at:match.start()], f"f32({_halve_reads(text[match.start():end - 1], pattern, True)}])"]
        at = end
    return head + "".join(parts) + text[at:]


# --- Winograd F(3x3, 5x5): matrices from the Toom-Cook construction, its transforms written out ----------------------
F35_POINTS = (0, 1, 2, Fraction(1, 2), Fraction(-3, 2), Fraction(-2, 3))
"""The finite points of F(3x3, 5x5) (with infinity: 7, a 7x7 tile): among sets of small fractions, the one whose
float32 roundings add up least (the largest sum of squared terms an output collects, 84 in one dimension, against
99 for F(2x2, 5x5)'s 0, +-1, +-2)."""


def toom_cook(m: int, r: int, points) -> tuple[list, list, list]:
    """Winograd's minimal filtering F(m, r) over ``points`` (m + r - 2 finite points, and infinity) as exact
    fractions: (B^T [n][n], G [n][r], A^T [m][n]), n = m + r - 1, with y = A^T [(G g) .* (B^T d)] the correlation of
    d (n values) with g (r values). It is the transpose of Toom-Cook's linear convolution (evaluate both factors at
    the points, multiply, interpolate): A^T and G evaluate, B^T is the interpolation's transpose, each of its rows
    scaled to coprime integers with the factor moved into G's row."""
    n = m + r - 1

    def evaluation(k: int) -> list:  # n x k: powers of each point; infinity: the leading coefficient
        return [[Fraction(p) ** i for i in range(k)] for p in points] + [[Fraction(0)] * (k - 1) + [Fraction(1)]]

    v = evaluation(n)
    inv = [[Fraction(int(i == j)) for j in range(n)] for i in range(n)]
    for col in range(n):  # Gauss-Jordan on exact fractions
        piv = next(i for i in range(col, n) if v[i][col] != 0)
        v[col], v[piv], inv[col], inv[piv] = v[piv], v[col], inv[piv], inv[col]
        f = v[col][col]
        v[col], inv[col] = [x / f for x in v[col]], [x / f for x in inv[col]]
        for i in range(n):
            if i != col and v[i][col] != 0:
                f = v[i][col]
                v[i] = [a - f * b for a, b in zip(v[i], v[col])]
                inv[i] = [a - f * b for a, b in zip(inv[i], inv[col])]
    bt = [[inv[j][i] for j in range(n)] for i in range(n)]
    g = evaluation(r)
    at = [list(col) for col in zip(*evaluation(m))]
    for j in range(n):
        den = math.lcm(*(x.denominator for x in bt[j]))
        scale = Fraction(den, math.gcd(*((x * den).numerator for x in bt[j])))
        bt[j] = [x * scale for x in bt[j]]
        g[j] = [x / scale for x in g[j]]
    return bt, g, at


def _wgsl_sum(coefficients, names) -> str:
    """sum of coefficient * name as WGSL, zero terms left out."""
    terms = []
    for c, name in zip(coefficients, names):
        if c == 0:
            continue
        literal = f"{float(c):.9g}"
        literal += "" if any(ch in literal for ch in ".e") else ".0"
        terms.append(name if c == 1 else f"-{name}" if c == -1 else f"{literal} * {name}")
    return " + ".join(terms).replace("+ -", "- ") or "0.0"


def winograd_f3x3_5x5() -> str:
    """winograd.wgsl's F(3x3, 5x5) (BLOCK = 3, R = 5: 7x7 tiles over 3x3 output blocks, 49 points per 9 outputs
    against F(2x2, 5x5)'s 36 per 4; no block overhangs a 27x27 map): its five matrix products and its transforms,
    written out (arrays indexed by a loop counter may be placed in slow local memory), from :func:`toom_cook`."""
    bt, g, at = toom_cook(3, 5, F35_POINTS)
    seven, five = range(7), range(5)

    def fn(name: str, arg: str, out: str, rows: list, size: int) -> str:
        names = [f"a[{i}]" if arg.startswith("Seven") or arg.startswith("Five") else f"a.{'xyz'[i]}"
                 for i in range(size)]
        body = ", ".join(_wgsl_sum(row, names) for row in rows)
        return f"fn {name}(a: {arg}) -> {out} {{\n    return {out}({body});\n}}\n"

    out = ["alias Seven = array<f32, 7>;",
           f"// F(3x3, 5x5) at the points {', '.join(str(p) for p in F35_POINTS)} and infinity",
           fn("times_bt7", "Seven", "Seven", bt, 7),
           fn("times_g7", "Five", "Seven", g, 5),
           fn("times_at7", "Seven", "vec3<f32>", at, 7),
           fn("times_a7", "vec3<f32>", "Seven", [list(c) for c in zip(*at)], 3),
           fn("times_gt7", "Seven", "Five", [list(c) for c in zip(*g)], 7)]
    out.append("fn put_seven(at: u32, r: u32, v: Seven) {\n    let base = 7u * r * p.count + at;\n" + "".join(
        f"    dst[base + {j}u * p.count] = v[{j}];\n" for j in seven) + "}\n")
    out.append("fn tile_col7(at: u32, b: u32) -> Seven {\n    let base = b * p.count + at;\n    return Seven("
               + ", ".join(f"src[base + {7 * a}u * p.count]" for a in seven) + ");\n}\n")
    out.append("fn patch_col7(plane: u32, y0: i32, x: i32) -> Seven {\n"
               "    if (x < 0 || x >= i32(IN_W)) { return Seven(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0); }\n"
               "    let at = i32(plane) + y0 * i32(IN_W) + x;\n    let w = i32(IN_W);\n    return Seven(" + ", ".join(
                   f"x_row(at + {a} * w, y0 + {a})" for a in seven) + ");\n}\n")

    def rows_of(cols: str, k: int, n: int) -> str:
        return ", ".join(f"c{j}[{k}]" if cols == "a" else f"c{j}.{'xyz'[k]}" for j in range(n))

    out.append("fn filter35(i: u32, at: u32) {\n" + "".join(
        f"    let c{j} = times_g7(filter_col(i * 25u, {j}u));\n" for j in five) + "".join(
        f"    put_seven(at, {k}u, times_g7(Five({rows_of('a', k, 5)})));\n" for k in seven) + "}\n")
    out.append("fn input35(i: u32, plane: u32, y0: i32, x0: i32) {\n" + "".join(
        f"    let c{j} = times_bt7(patch_col7(plane, y0, x0 + {j}));\n" for j in seven) + "".join(
        f"    put_seven(i, {k}u, times_bt7(Seven({rows_of('a', k, 7)})));\n" for k in seven) + "}\n")
    out.append("fn output35(i: u32, at: u32, y: u32, x: u32, bias_o: f32) {\n" + "".join(
        f"    let c{j} = times_at7(tile_col7(i, {j}u));\n" for j in seven) + "".join(
        f"    let y{k} = times_at7(Seven({rows_of('v', k, 7)})) + bias_o;\n" for k in range(3)) + "".join(
        f"    put_y(at, y + {k}u, x + {q}u, y{k}.{'xyz'[q]});\n" for k in range(3) for q in range(3)) + "}\n")
    out.append("fn dy35(i: u32, plane: u32, y: u32, x: u32) {\n" + "".join(
        f"    let c{j} = times_a7(vec3<f32>(dy_at(plane, y, x + {j}u), dy_at(plane, y + 1u, x + {j}u), "
        f"dy_at(plane, y + 2u, x + {j}u)));\n" for j in range(3)) + "".join(
        f"    put_seven(i, {k}u, times_a7(vec3<f32>({rows_of('a', k, 3)})));\n" for k in seven) + "}\n")
    out.append("fn filter_grad35(i: u32) {\n" + "".join(
        f"    let c{j} = times_gt7(tile_col7(i, {j}u));\n" for j in seven) + "".join(
        f"    put_dw_row(i * 25u + {5 * k}u, times_gt7(Seven({rows_of('a', k, 7)})));\n" for k in five) + "}\n")
    return "\n" + "\n".join(out)
