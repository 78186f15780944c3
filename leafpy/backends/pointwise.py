"""Pointwise formulas written once: the activations as one table, and the code every backend runs generated from it.

A line of :data:`TABLE` gives an activation's forward formula ``y = f(x)``, its gradient ``dx = dy * f'`` written
from the output ``y`` where the output determines it (so the layer may run in place over its input) or else from
the input ``x``, and the names of its parameters (their values come from the layer's config, in this order). The
formulas are small expression trees built with Python's operators and the functions below (:func:`exp`,
:func:`where`, ...). From them this module generates:

- the NumPy evaluation the array backends run (:func:`evaluate`: a ufunc per node, writing into ``out``, with
  temporaries reused along the way);
- the CuPy ``ElementwiseKernel`` sources of the cuda backend (:func:`cuda_kernel_sources`);
- the WGSL of the webgpu backend (:func:`wgsl_functions`, :func:`wgsl_entry_points` with their in-place twins, and
  :func:`wgsl_epilogue`, the activation a GEMM or a Winograd output transform applies in its store).

WGSL has no ``erf``, ``expm1`` or ``log1p``: :data:`WGSL_HELPERS` defines them. ``erf`` there is the Chebyshev fit of
``erfc`` from Press et al., Numerical Recipes (2nd ed., section 6.2, ``erfcc``: fractional error below 1.2e-7),
so ``erf`` is within 2e-7 of the true value in float32 arithmetic (tests/test_activations.py checks it against
``math.erf`` on the GPU backend).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendError

_LEAVES = ("var", "param", "const")


class Expr:
    """A node of a pointwise formula: ``op`` and its arguments (nodes, or a leaf's name or value)."""

    __slots__ = ("op", "args")

    def __init__(self, op: str, *args: Any) -> None:
        self.op = op
        self.args = args

    def __add__(self, o: Any) -> Expr:
        return Expr("add", self, _node(o))

    def __radd__(self, o: Any) -> Expr:
        return Expr("add", _node(o), self)

    def __sub__(self, o: Any) -> Expr:
        return Expr("sub", self, _node(o))

    def __rsub__(self, o: Any) -> Expr:
        return Expr("sub", _node(o), self)

    def __mul__(self, o: Any) -> Expr:
        return Expr("mul", self, _node(o))

    def __rmul__(self, o: Any) -> Expr:
        return Expr("mul", _node(o), self)

    def __truediv__(self, o: Any) -> Expr:
        return Expr("div", self, _node(o))

    def __rtruediv__(self, o: Any) -> Expr:
        return Expr("div", _node(o), self)

    def __neg__(self) -> Expr:
        return Expr("neg", self)

    def __gt__(self, o: Any) -> Expr:
        return Expr("gt", self, _node(o))

    def __lt__(self, o: Any) -> Expr:
        return Expr("gt", _node(o), self)

    def children(self) -> tuple[Expr, ...]:
        return () if self.op in _LEAVES else self.args


def _node(v: Any) -> Expr:
    return v if isinstance(v, Expr) else Expr("const", float(v))


def var(name: str) -> Expr:
    return Expr("var", name)


def param(name: str) -> Expr:
    return Expr("param", name)


def exp(a: Any) -> Expr:
    return Expr("exp", _node(a))


def expm1(a: Any) -> Expr:
    return Expr("expm1", _node(a))


def log1p(a: Any) -> Expr:
    return Expr("log1p", _node(a))


def tanh(a: Any) -> Expr:
    return Expr("tanh", _node(a))


def erf(a: Any) -> Expr:
    return Expr("erf", _node(a))


def sqrt(a: Any) -> Expr:
    return Expr("sqrt", _node(a))


def sign(a: Any) -> Expr:
    """-1, 0 or 1 as ``a`` is negative, zero or positive."""
    return Expr("sign", _node(a))


def maximum(a: Any, b: Any) -> Expr:
    return Expr("max", _node(a), _node(b))


def minimum(a: Any, b: Any) -> Expr:
    return Expr("min", _node(a), _node(b))


def where(cond: Expr, a: Any, b: Any) -> Expr:
    """``a`` where ``cond`` holds, else ``b`` (both are computed)."""
    return Expr("where", cond, _node(a), _node(b))


@dataclass(frozen=True)
class Pointwise:
    """One activation: ``forward`` in terms of ``x``; ``gradient`` (dx) in terms of ``dy`` and either ``y`` or
    ``x``; ``params`` the names its :func:`param` nodes use, in the order backends receive their values."""

    name: str
    forward: Expr
    gradient: Expr
    params: tuple[str, ...] = ()
    entry: str = ""
    """The webgpu entry point's name, where the name itself is a WGSL built-in (tanh)."""
    reads: str = field(init=False)
    """What the gradient reads besides dy: "y" (the layer may run in place) or "x"."""

    def __post_init__(self) -> None:
        grad_vars = _leaves(self.gradient, "var") - {"dy"}
        if _leaves(self.forward, "var") != {"x"} or len(grad_vars) != 1 or not grad_vars <= {"x", "y"}:
            raise BackendError(f"pointwise line {self.name!r}: the forward formula must read x only and the "
                               f"gradient dy and one of x or y; got {sorted(grad_vars)}")
        unknown = (_leaves(self.forward, "param") | _leaves(self.gradient, "param")) - set(self.params)
        if unknown:
            raise BackendError(f"pointwise line {self.name!r}: parameters {sorted(unknown)} not declared")
        if not self.entry:
            object.__setattr__(self, "entry", self.name)
        object.__setattr__(self, "reads", next(iter(grad_vars)))


def _leaves(e: Expr, kind: str) -> set:
    found: set = set()
    stack = [e]
    while stack:
        n = stack.pop()
        if n.op == kind:
            found.add(n.args[0])
        stack.extend(n.children())
    return found


# --- the table ------------------------------------------------------------------------------------------------------
X, Y, DY = var("x"), var("y"), var("dy")


def _sigmoid(z: Expr) -> Expr:
    # from e = exp(-|z|), which never overflows: 1 / (1 + e) for z > 0, e / (1 + e) below, so the small values of
    # the negative side keep their relative precision (0.5 (1 + tanh(z / 2)) loses it all by z = -17 in float32)
    e = exp(minimum(z, -z))
    return where(z > 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus() -> Pointwise:
    beta, threshold = param("beta"), param("threshold")
    z = beta * X  # linear above the threshold, as PyTorch
    return Pointwise("softplus", where(z > threshold, X, log1p(exp(minimum(z, threshold))) / beta),
                     where(z > threshold, DY, DY * _sigmoid(z)), ("beta", "threshold"))


def _gelu() -> Pointwise:
    cdf = 0.5 * (1.0 + erf(X * math.sqrt(0.5)))
    return Pointwise("gelu", X * cdf, DY * (cdf + X * exp(-0.5 * X * X) * (1.0 / math.sqrt(2.0 * math.pi))))


def _gelu_tanh() -> Pointwise:
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    t = tanh(k * (X + c * X * X * X))
    return Pointwise("gelu_tanh", 0.5 * X * (1.0 + t),
                     DY * (0.5 * (1.0 + t) + 0.5 * X * (1.0 - t * t) * (k * (1.0 + 3.0 * c * X * X))))


def _silu() -> Pointwise:
    s = _sigmoid(X)
    return Pointwise("silu", X * s, DY * (s * (1.0 + X * (1.0 - s))))


_SLOPE, _ALPHA = param("negative_slope"), param("alpha")
_LOWER, _UPPER = param("lower"), param("upper")

TABLE: dict[str, Pointwise] = {line.name: line for line in (
    Pointwise("relu", maximum(X, 0.0), where(Y > 0.0, DY, 0.0)),
    Pointwise("sigmoid", _sigmoid(X), DY * Y * (1.0 - Y)),
    Pointwise("tanh", tanh(X), DY * (1.0 - Y * Y), entry="tanh_fwd"),
    # from y: y > 0 exactly where x > 0 (negative_slope >= 0, alpha >= 0: their configs check)
    Pointwise("leaky_relu", where(X > 0.0, X, _SLOPE * X), where(Y > 0.0, DY, _SLOPE * DY), ("negative_slope",)),
    Pointwise("elu", where(X > 0.0, X, _ALPHA * expm1(minimum(X, 0.0))), where(Y > 0.0, DY, DY * (Y + _ALPHA)),
              ("alpha",)),
    _softplus(),
    _gelu(),
    _gelu_tanh(),
    _silu(),
    # from y: lower < y < upper exactly where lower < x < upper (lower < upper: the config checks)
    Pointwise("clip", minimum(maximum(X, _LOWER), _UPPER), where(Y > _LOWER, where(_UPPER > Y, DY, 0.0), 0.0),
              ("lower", "upper")),
)}
"""Every activation, by the name backends know it by (``Backend.activation(name, ...)``)."""


def line(kind: str) -> Pointwise:
    try:
        return TABLE[kind]
    except KeyError:
        raise BackendError(f"unknown pointwise formula {kind!r}; known: {', '.join(TABLE)}") from None


# --- shared structure -----------------------------------------------------------------------------------------------
@functools.cache  # the table's formulas live as long as the module
def _uses(root: Expr) -> tuple[dict[int, int], list[Expr]]:
    """How many parents each node has, and the inner nodes in an order that computes arguments first."""
    counts: dict[int, int] = {}
    order: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        counts[id(n)] = counts.get(id(n), 0) + 1
        if counts[id(n)] > 1 or n.op in _LEAVES:
            continue
        stack.append((n, True))
        stack.extend((c, False) for c in reversed(n.children()))
    return counts, order


# --- NumPy / CuPy arrays ------------------------------------------------------------------------------------------
_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "gt": "greater",
           "exp": "exp", "expm1": "expm1", "log1p": "log1p", "tanh": "tanh", "max": "maximum", "min": "minimum",
           "sqrt": "sqrt", "sign": "sign"}

def _erf_ufunc(xp: Any) -> Callable:
    if xp.__name__.startswith("numpy"):  # NumPy, or the native backend's NumPy with MKL products (numpy_mkl)
        try:
            from scipy.special import erf as scipy_erf
            return scipy_erf
        except ImportError:
            vectorised = xp.frompyfunc(math.erf, 1, 1)

            def erf_any(a: Any, out: Any) -> Any:
                out[...] = vectorised(a)
                return out
            return erf_any
    from cupyx.scipy.special import erf as cupy_erf
    return cupy_erf


def numpy_source(expr: Expr, var_names: tuple[str, ...], param_names: tuple[str, ...], out_is_free: bool) -> str:
    """Python source of ``run(*values, *params, out)``: the formula as a ufunc call per node into ``out`` or scratch
    (``xp`` the array module, ``erf`` its erf). A node's result goes into the scratch of an argument that nothing
    else reads, so little scratch is allocated; with ``out_is_free`` (out shares no input's memory) ``out`` itself
    serves as the first scratch: it then holds one value at a time until the last operation reads it and writes
    out. Otherwise (an in-place layer) only the last operation writes ``out``, and a ``where`` writes the input it
    may alias last, under its own mask."""
    counts, order = _uses(expr)
    name: dict[int, str] = {}
    kind: dict[str, str] = {}  # name -> "input" | "scalar" | "float" | "bool" | "out"
    free: dict[str, bool] = {}  # a scratch whose value no later node reads
    lines: list[str] = []
    spare = [out_is_free]

    def leaf(n: Expr) -> str:
        if n.op == "const":
            kind[repr(n.args[0])] = "scalar"
            return repr(n.args[0])
        kind[n.args[0]] = "input" if n.op == "var" else "scalar"
        return n.args[0]

    def scratch(dtype: str) -> str:
        if dtype == "float" and spare[0]:
            spare[0] = False
            kind["out"] = "out"
            return "out"
        t = f"t{len(lines)}"
        lines.append(f"{t} = xp.empty(out.shape, {'bool' if dtype == 'bool' else 'out.dtype'})")
        kind[t] = dtype
        return t

    def reuse(args: list[str], nodes: tuple) -> str | None:
        for a, c in zip(args, nodes):
            if kind.get(a) in ("float", "out") and free.get(a) and counts[id(c)] == 1:
                free[a] = False
                return a
        return None

    for n in order:
        nodes = n.children()
        args = [name[id(c)] if id(c) in name else leaf(c) for c in nodes]
        if all(kind[a] == "scalar" for a in args):  # parameters and constants only: Python arithmetic
            dst = name[id(n)] = f"c{len(lines)}"
            kind[dst] = "scalar"
            py = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}", "neg": "-{}"}
            fn = {"max": "max", "min": "min"}.get(n.op, f"math.{n.op}")
            lines.append(f"{dst} = " + (py[n.op].format(*args) if n.op in py else f"{fn}({', '.join(args)})"))
            continue
        if n is expr:
            dst = "out"
        elif n.op == "gt":
            dst = scratch("bool")
        else:
            branches = (args[1:], nodes[1:]) if n.op == "where" else (args, nodes)
            dst = reuse(*branches) or scratch("float")
        name[id(n)] = dst
        free[dst] = counts[id(n)] == 1
        if n.op == "where":
            cond, a, b = args
            if nodes[2].op == "const" and nodes[2].args[0] == 0.0 and kind[a] != "scalar":
                lines.append(f"xp.multiply({a}, {cond}, out={dst})")
                continue
            steps = [(a, cond), (b, f"xp.logical_not({cond})")]
            for src, mask in (steps if kind[a] != "input" else steps[::-1]):
                if src != dst:
                    lines.append(f"xp.copyto({dst}, {src}, where={mask})")
        else:
            fn = "erf" if n.op == "erf" else f"xp.{_UFUNCS[n.op]}"
            lines.append(f"{fn}({', '.join(args)}, out={dst})")
    if expr.op in _LEAVES:  # a formula that is one of its inputs
        lines.append(f"xp.copyto(out, {leaf(expr)})")
    body = "".join(f"    {ln}\n" for ln in lines)
    return f"def run({', '.join((*var_names, *param_names, 'out'))}):\n{body}"


@functools.cache
def numpy_function(xp: Any, expr: Expr, var_names: tuple[str, ...], param_names: tuple[str, ...],
                   out_is_free: bool) -> Callable[..., None]:
    """:func:`numpy_source` compiled over the array module ``xp`` (once per formula and case)."""
    namespace = {"xp": xp, "math": math, "erf": _erf_ufunc(xp) if "erf" in _ops(expr) else None}
    exec(compile(numpy_source(expr, var_names, param_names, out_is_free), "<pointwise>", "exec"), namespace)
    return namespace["run"]


def _ops(e: Expr) -> set[str]:
    return {e.op}.union(*(_ops(c) for c in e.children()))


def evaluate(xp: Any, expr: Expr, var_names: tuple[str, ...], values: tuple, param_names: tuple[str, ...],
             params: tuple[float, ...], out: Any) -> None:
    """Write ``expr`` over the arrays ``values`` (named ``var_names``) into ``out``, with ``params`` (named
    ``param_names``), through the generated :func:`numpy_function`; ``out`` may be one of the values."""
    free = not any(xp.may_share_memory(out, v) for v in values)
    numpy_function(xp, expr, var_names, param_names, free)(*values, *params, out)


# --- C (CuPy ElementwiseKernel) and WGSL text -------------------------------------------------------------------------
def _text(root: Expr, names: dict[str, str], dialect: str, prefix: str = "t") -> tuple[list[str], str]:
    """(statements binding the nodes used more than once, named ``prefix`` and a number, the expression of the
    root) in C or WGSL."""
    counts, order = _uses(root)
    bound: dict[int, str] = {}
    lines: list[str] = []

    def lit(v: float) -> str:
        s = repr(float(v))
        return f"(T){s}" if dialect == "c" else s

    def text(n: Expr) -> str:
        if id(n) in bound:
            return bound[id(n)]
        if n.op == "const":
            return lit(n.args[0])
        if n.op in ("var", "param"):
            return names[n.args[0]]
        a = [text(c) for c in n.children()]
        infix = {"add": "+", "sub": "-", "mul": "*", "div": "/", "gt": ">"}
        if n.op in infix:
            return f"({a[0]} {infix[n.op]} {a[1]})"
        if n.op == "neg":
            return f"(-{a[0]})"
        if n.op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})" if dialect == "c" else f"select({a[2]}, {a[1]}, {a[0]})"
        if n.op == "sign" and dialect == "c":
            return f"(T)(((T)0 < {a[0]}) - ({a[0]} < (T)0))"
        fn = {"max": "max", "min": "min"}.get(n.op, n.op)
        if dialect == "wgsl" and n.op in ("erf", "expm1", "log1p"):
            fn = "lp_" + n.op
        return f"{fn}({', '.join(a)})"

    for n in order:
        if counts[id(n)] > 1 and n is not root:
            name = f"{prefix}{len(bound)}"
            lines.append(f"T {name} = {text(n)};" if dialect == "c" else f"let {name} = {text(n)};")
            bound[id(n)] = name
    return lines, text(root)


def cuda_kernel_sources() -> dict[str, tuple[str, str, str, str]]:
    """Per kernel (the activation's name, and name + "_grad"): ElementwiseKernel's (in_params, out_params,
    operation, name), over a type T (float or double)."""
    kernels = {}
    for ln in TABLE.values():
        names = {p: p for p in ln.params} | {"x": "x", "y": "y", "dy": "dy"}
        extra = "".join(f", T {p}" for p in ln.params)
        body, value = _text(ln.forward, names, "c")
        kernels[ln.name] = ("T x" + extra, "T y", " ".join([*body, f"y = {value};"]), f"leafpy_{ln.name}")
        body, value = _text(ln.gradient, names, "c")
        kernels[ln.name + "_grad"] = (f"T {ln.reads}, T dy" + extra, "T dx", " ".join([*body, f"dx = {value};"]),
                                      f"leafpy_{ln.name}_grad")
    return kernels


WGSL_HELPERS = """
// erf from the Chebyshev fit of erfc in Numerical Recipes (erfcc, fractional error < 1.2e-7)
fn lp_erf(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))));
    return sign(x) * (1.0 - r);
}

// exp(x) - 1 and log(1 + x) without cancellation near 0 (Kahan's and Goldberg's corrections)
fn lp_expm1(x: f32) -> f32 {
    let u = exp(x);
    if (abs(x) > 0.5) { return u - 1.0; }
    if (u == 1.0) { return x; }
    return (u - 1.0) * x / log(u);
}

fn lp_log1p(x: f32) -> f32 {
    let u = 1.0 + x;
    if (abs(x) > 0.5) { return log(u); }
    if (u == 1.0) { return x; }
    return log(u) * x / (u - 1.0);
}
"""


def _wgsl_params(ln: Pointwise) -> str:
    return "".join(f", p{i}: f32" for i in range(len(ln.params)))


def wgsl_functions() -> str:
    """The helpers and, per line, ``pw_NAME_f(x, p0, ...)`` and ``pw_NAME_g(y or x, dy, p0, ...)``."""
    parts = [WGSL_HELPERS]
    for ln in TABLE.values():
        names = {p: f"p{i}" for i, p in enumerate(ln.params)} | {"x": "x", "y": "y", "dy": "dy"}
        for suffix, expr, args in (("f", ln.forward, "x: f32"), ("g", ln.gradient, f"{ln.reads}: f32, dy: f32")):
            body, value = _text(expr, names, "wgsl")
            stmts = "".join(f"    {s}\n" for s in body)
            signature = f"fn pw_{ln.name}_{suffix}({args}{_wgsl_params(ln)}) -> f32"
            parts.append(f"{signature} {{\n{stmts}    return {value};\n}}\n")
    return "\n".join(parts)


_ENTRY = """@compute @workgroup_size(256)
fn {entry}(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let i = flat_index(gid, nw);
    if (i < p.count) {{ {store}; }}
}}
"""


def wgsl_entry_points() -> str:
    """Elementwise entry points over the bindings a, b, c of elementwise.wgsl, parameters in p.act0, p.act1: NAME
    (b = f(a)) and NAME_grad (c = g(a, b)), and their in-place twins NAME_inplace (a = f(a)) and NAME_grad_inplace
    (b = g(a, b)) for an output bound once with the input it overwrites."""
    out = []
    for ln in TABLE.values():
        ps = "".join(f", p.act{i}" for i in range(len(ln.params)))
        f, g = f"pw_{ln.name}_f", f"pw_{ln.name}_g"
        for entry, store in ((ln.entry, f"b[i] = {f}(a[i]{ps})"), (ln.entry + "_inplace", f"a[i] = {f}(a[i]{ps})"),
                             (ln.name + "_grad", f"c[i] = {g}(a[i], b[i]{ps})"),
                             (ln.name + "_grad_inplace", f"b[i] = {g}(a[i], b[i]{ps})")):
            out.append(_ENTRY.format(entry=entry, store=store))
    return "\n".join(out)


def wgsl_inplace() -> dict[str, tuple[int, int]]:
    """Entry points with an in-place twin: (output position, the input position it may overwrite)."""
    found = {}
    for ln in TABLE.values():
        found[ln.entry] = (1, 0)
        found[ln.name + "_grad"] = (2, 1)
    return found


def _codes() -> dict[str, int]:
    return {name: i + 1 for i, name in enumerate(TABLE)}


def wgsl_epilogue() -> str:
    """``act_epilogue(s)``: the activation chosen by the pipeline constant ACT (0: none; see
    :func:`epilogue_constants`) with its parameters in ACT_P0, ACT_P1, ..."""
    lines = ["override ACT: u32 = 0u;"]
    lines += [f"override ACT_P{i}: f32 = 0.0;" for i in range(max(len(ln.params) for ln in TABLE.values()))]
    lines.append("fn act_epilogue(s: f32) -> f32 {")
    for name, code in _codes().items():
        ps = "".join(f", ACT_P{i}" for i in range(len(TABLE[name].params)))
        lines.append(f"    if (ACT == {code}u) {{ return pw_{name}_f(s{ps}); }}")
    lines += ["    return s;", "}", ""]
    return "\n".join(lines)


def epilogue_constants(kind: str, params: tuple[float, ...] = ()) -> tuple[tuple[str, Any], ...]:
    """The pipeline constants that make :func:`wgsl_epilogue` apply ``kind`` with ``params``."""
    line(kind)
    return (("ACT", _codes()[kind]), *((f"ACT_P{i}", float(v)) for i, v in enumerate(params)))
