"""Solver update rules written once: the rules as one table, and the code every backend runs generated from it.

A line of :data:`TABLE` gives a rule's state buffers (its history, kept per weight), its hyper-parameters, and its
formula: assignments run in order, per element, each a target (``w``, a state buffer, or a local name that later
assignments read) and an expression built as in :mod:`.pointwise` (``var``, ``param``, Python's operators,
:func:`~.pointwise.sqrt`, :func:`~.pointwise.where`, ...). Besides ``w``, the gradient ``g`` (read only; a backend
may use its memory as scratch) and the state, a formula reads ``lr``, the weight's rate for the step (``rate[0]``
times its ``lr_mult``), and ``policy_lr`` (``rate[2]`` times ``lr_mult``: the policy's rate before a rule's own
correction, for decoupled weight decay). ``rate`` lives on the device (see ``Backend.solver_update``), so a recorded
step replays under any schedule; where ``rate[1]`` is 0 the update writes nothing. From a line this module
generates:

- the NumPy code the array backends run (:func:`numpy_function`): one ufunc call per node, in place over pieces of
  the weight that stay in cache, results written into their target or into the memory of an operand no later node
  reads (a dead gradient, a state buffer being replaced, or a piece of shared scratch);
- the cuda backend's fused CuPy ``ElementwiseKernel`` (:func:`cuda_kernel_source`) and, for float32 arrays, its
  kernel of four elements a thread (:func:`cuda_vector_source`);
- the webgpu backend's fused WGSL entry point ``NAME_update`` (:func:`wgsl_entry_points`), bound as update.wgsl
  declares: rate, w, g, s1, s2, s3, the hyper-parameters in ``UpdateParams.hp0``, ``hp1``, ...

A new rule is a line here (:func:`register` adds one at run time) and a solver rule naming it (leafpy.solvers).
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendError
from .pointwise import Expr, _text, _uses, param, sqrt, var

MAX_STATE = 3
"""State buffers a rule may keep (webgpu binds rate, w, g and these, under the 8 storage buffers a stage may use)."""
MAX_PARAMS = 6
"""Hyper-parameters a rule may take (update.wgsl's hp0 ... hp5)."""
WGSL_PARAMS = tuple(f"hp{i}" for i in range(MAX_PARAMS))
"""The UpdateParams fields of a rule's hyper-parameters, in order."""
RATES = {"lr": 0, "policy_lr": 2}
"""The rates a formula may read: the element of the rate buffer each multiplies by the weight's lr_mult."""
_OPS = {"add", "sub", "mul", "div", "neg", "gt", "max", "min", "exp", "expm1", "log1p", "tanh", "sqrt", "sign",
        "where"}
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True, eq=False)  # one line is one rule: compared and hashed by identity (each update looks it up)
class Rule:
    """One update rule: ``state`` its history buffers and ``params`` its hyper-parameters (both in the order the
    backends receive them), ``steps`` its formula as (target, expression) assignments run in order."""

    name: str
    state: tuple[str, ...]
    params: tuple[str, ...]
    steps: tuple[tuple[str, Expr], ...]
    locals: tuple[str, ...] = field(init=False)
    """Targets that are neither w nor state: values later steps read, never stored."""
    rates: tuple[str, ...] = field(init=False)
    """The rates (:data:`RATES`) the formula reads."""

    def __post_init__(self) -> None:
        where = f"update rule {self.name!r}"
        names = ("w", "g", *self.state, *self.params)
        bad = [n for n in (self.name, *names) if not _NAME.match(n) or keyword.iskeyword(n) or n in RATES]
        if bad or len(set(names)) < len(names):
            raise BackendError(f"{where}: names must be distinct lower-case identifiers other than "
                               f"{', '.join(RATES)}; got {bad or sorted(names)}")
        if len(self.state) > MAX_STATE or len(self.params) > MAX_PARAMS:
            raise BackendError(f"{where}: at most {MAX_STATE} state buffers and {MAX_PARAMS} hyper-parameters; got "
                               f"{len(self.state)} and {len(self.params)}")
        known, rates, local = {"w", "g", *self.state, *RATES}, set(), []
        for target, expr in self.steps:
            problems = self._problems(target, expr, known)
            if problems:
                raise BackendError(f"{where}: the step assigning {target!r} {'; '.join(problems)}")
            rates |= _leaves(expr, "var") & set(RATES)
            if target not in known:
                local.append(target)
                known.add(target)
        if "w" not in (t for t, _ in self.steps):
            raise BackendError(f"{where}: no step assigns w")
        object.__setattr__(self, "locals", tuple(local))
        object.__setattr__(self, "rates", tuple(r for r in RATES if r in rates))

    def _problems(self, target: str, expr: Expr, known: set) -> list[str]:
        """What is wrong with the step ``target = expr``, given the names assigned before it."""
        unread = sorted(_leaves(expr, "var") - known)
        undeclared = sorted(_leaves(expr, "param") - set(self.params))
        unknown_ops = sorted(_ops(expr) - _OPS - {"var", "param", "const"})
        return [text for text, bad in (
            (f"reads {unread} before they are assigned", unread), (f"undeclared parameters {undeclared}", undeclared),
            (f"operations {unknown_ops} no backend generates", unknown_ops),
            (f"assigns {target!r}", target in ("g", *RATES, *self.params) or not _NAME.match(target))) if bad]


def _leaves(e: Expr, kind: str) -> set:
    if e.op == kind:
        return {e.args[0]}
    return set().union(*(_leaves(c, kind) for c in e.children()))


def _ops(e: Expr) -> set:
    return {e.op}.union(*(_ops(c) for c in e.children()))


# --- the table ------------------------------------------------------------------------------------------------------
W, G, LR = var("w"), var("g"), var("lr")


def _toward(s: Expr, target: Expr, decay: Expr) -> Expr:
    """``decay·s + (1 - decay)·target``, as ``s + (1 - decay)(target - s)``."""
    return s + (1.0 - decay) * (target - s)


def _scaled(step: Expr, s: Expr, eps: Expr) -> Expr:
    """``w - lr·step / (sqrt(s) + eps)``."""
    return W - LR * (step / (sqrt(s) + eps))


def _adam(name: str, decay: bool) -> Rule:
    m, v, b1, b2, eps = var("m"), var("v"), param("beta1"), param("beta2"), param("eps")
    shrink = (("w", W * (1.0 - var("policy_lr") * param("decay"))),) if decay else ()  # decoupled, before the step
    return Rule(name, ("m", "v"), ("beta1", "beta2", "eps", *(("decay",) if decay else ())), (
        *shrink, ("m", m + (1.0 - b1) * (G - m)), ("v", _toward(v, G * G, b2)), ("w", _scaled(m, v, eps))))


def _table() -> dict[str, Rule]:
    h, u, prev = var("h"), var("u"), var("prev")
    momentum, decay, eps = param("momentum"), param("decay"), param("eps")
    rules = (
        Rule("momentum", ("h",), ("momentum",), (("h", h * momentum + G * LR), ("w", W - h))),
        # w -= (1 + m) h - m prev, as w = w - h + m (prev - h)
        Rule("nesterov", ("h", "prev"), ("momentum",), (
            ("prev", h), ("h", h * momentum + G * LR), ("w", W - h + (prev - h) * momentum))),
        _adam("adam", decay=False),
        _adam("adamw", decay=True),
        Rule("rmsprop", ("h",), ("decay", "eps"), (("h", _toward(h, G * G, decay)), ("w", _scaled(G, h, eps)))),
        Rule("adagrad", ("h",), ("eps",), (("h", h + G * G), ("w", _scaled(G, h, eps)))),
        Rule("adadelta", ("h", "u"), ("decay", "eps"), (
            ("h", _toward(h, G * G, decay)), ("d", G * sqrt(u + eps) / sqrt(h + eps)),
            ("u", _toward(u, var("d") * var("d"), decay)), ("w", W - var("d") * LR))),
    )
    return {r.name: r for r in rules}


TABLE: dict[str, Rule] = _table()
"""Every update rule, by the name backends know it by (``Backend.solver_update(name, ...)``)."""


def register(rule: Rule) -> Rule:
    """Add ``rule`` to :data:`TABLE` (a rule of that name is replaced); the backends generate its code on first
    use."""
    TABLE[rule.name] = rule
    return rule


def rule(kind: str) -> Rule:
    try:
        return TABLE[kind]
    except KeyError:
        raise BackendError(f"unknown update rule {kind!r}; known: {', '.join(TABLE)}") from None


# --- NumPy / CuPy arrays ------------------------------------------------------------------------------------------
_PY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})", "neg": "(-{})",
       "gt": "({} > {})", "where": "({1} if {0} else {2})", "max": "max({}, {})", "min": "min({}, {})",
       "sign": "((0.0 < {0}) - ({0} < 0.0))"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "max": "maximum",
          "min": "minimum", "exp": "exp", "expm1": "expm1", "log1p": "log1p", "tanh": "tanh", "sqrt": "sqrt",
          "sign": "sign"}


class _NumpyPlan:
    """The Python source of a rule's update over pieces: scalars once, then per piece a ufunc call per node, each
    writing into its step's target or into memory whose value nothing reads any more."""

    def __init__(self, r: Rule) -> None:
        self.rule, self.scratch = r, 0
        self.head: list[str] = []  # once per call: rates, parameters, scalar nodes
        self.body: list[str] = []  # per piece
        self.uses: dict[Any, int] = {}  # value -> reads left
        self.held: dict[str, Any] = {}  # array slot -> the value it holds
        self.where: dict[Any, str] = {}  # value -> its slot, or the name of a scalar
        start: dict[str, tuple] = {n: ("in", n) for n in ("w", "g", *r.state)} | {n: ("rate", n) for n in RATES}
        self.env = dict(start)  # a name -> its current value
        self.scalar: set = {("rate", n) for n in RATES}
        self._count()
        self.env = dict(start)
        for n in ("w", "g", *r.state):
            self.held[self._slot(n)] = ("in", n)
            self.where[("in", n)] = self._slot(n)
        for name, i in RATES.items():
            if name in r.rates:
                self.head.append(f"{name} = float(rate[{i}]) * lr_mult")
                self.where[("rate", name)] = name
        if r.params:
            self.head.append(f"{''.join(f'p_{p}, ' for p in r.params)}= params")
        for k, (target, expr) in enumerate(r.steps):
            self._step(k, target, expr)

    @staticmethod
    def _slot(name: str) -> str:
        return f"v_{name}"

    def _value(self, k: int, n: Expr) -> Any:
        """The value a node of step k stands for: a variable's current value, or the node's result."""
        if n.op == "var":
            return self.env[n.args[0]]
        return ("const", n.args[0]) if n.op == "const" else ("param", n.args[0]) if n.op == "param" else (k, id(n))

    def _count(self) -> None:
        """Reads left of every value, and which values are scalars (parameters, constants and rates only)."""
        for k, (target, expr) in enumerate(self.rule.steps):
            _, order = _uses(expr)
            for n in order:
                kids = [self._value(k, c) for c in n.children()]
                if all(v in self.scalar or v[0] in ("const", "param") for v in kids):
                    self.scalar.add((k, id(n)))
                for v in kids:
                    self.uses[v] = self.uses.get(v, 0) + 1
            root = self._value(k, expr)
            if expr.op in ("var", "const", "param"):
                self.uses[root] = self.uses.get(root, 0) + 1
            new = (k, "=", target)
            if target in self.rule.locals and (root in self.scalar or root[0] in ("const", "param")):
                self.scalar.add(new)  # a local of rates and parameters only: a Python float
            self.env[target] = new

    def _ref(self, v: Any) -> str:
        if v[0] == "const":
            return repr(float(v[1]))
        if v[0] == "param":
            return f"p_{v[1]}"
        return self.where[v]

    def _free(self, target: str) -> str:
        """A slot whose value nothing reads any more: the step's target (written anyway), else scratch (it stays in
        cache), else the gradient (writing it costs its memory traffic); else new scratch."""
        rank = {self._slot(target): 0, "v_g": 2}
        dead = [slot for slot, value in self.held.items() if self.uses.get(value, 0) == 0 and
                (slot in rank or slot.startswith("t"))]
        if dead:
            return min(dead, key=lambda slot: rank.get(slot, 1))
        self.scratch += 1
        return f"t{self.scratch - 1}"

    def _step(self, k: int, target: str, expr: Expr) -> None:
        buffer = target in ("w", *self.rule.state)
        _, order = _uses(expr)
        for n in order:
            v = (k, id(n))
            kids = [self._value(k, c) for c in n.children()]
            args = [self._ref(c) for c in kids]
            if v in self.scalar:
                fn = _PY.get(n.op, f"math.{n.op}({{}})")
                name = self.where[v] = f"c{len(self.head)}"
                self.head.append(f"{name} = {fn.format(*args)}")
                continue
            for c in kids:
                if c in self.uses:
                    self.uses[c] -= 1
            if n.op == "gt":
                name = self.where[v] = f"b{len(self.body)}"
                self.body.append(f"{name} = xp.greater({args[0]}, {args[1]})")
                continue
            dst = self._slot(target) if n is expr and buffer else self._free(target)
            self._emit(n.op, args, dst)
            self.held[dst] = v
            self.where[v] = dst
        root = self._value(k, expr)
        new = (k, "=", target)
        self.env[target] = new
        if new in self.scalar:
            self.where[new] = self._ref(root)
            return
        if expr.op in ("var", "const", "param") or root in self.scalar:  # a copy
            if root in self.uses:
                self.uses[root] -= 1
            dst = self._slot(target) if buffer else self._free(target)
            self.body.append(f"xp.copyto({dst}, {self._ref(root)})")
        else:
            dst = self.where[root]
        self.held[dst] = new
        self.where[new] = dst
        self.uses.setdefault(new, 0)

    def _emit(self, op: str, args: list[str], dst: str) -> None:
        infix = _INFIX.get(op)
        if infix and dst in args and (dst == args[0] or op in ("add", "mul")):  # in place: a ufunc call without
            other = args[1] if dst == args[0] else args[0]                       # keywords (the faster one)
            self.body.append(f"{dst} {infix}= {other}")
            return
        if op != "where":
            self.body.append(f"xp.{_UFUNC[op]}({', '.join(args)}, out={dst})")
            return
        cond, a, b = args
        if dst == a:
            self.body.append(f"xp.copyto({dst}, {b}, where=xp.logical_not({cond}))")
            return
        if dst != b:
            self.body.append(f"xp.copyto({dst}, {b})")
        self.body.append(f"xp.copyto({dst}, {a}, where={cond})")

    def source(self) -> str:
        buffers = ("w", "g", *self.rule.state)
        scratch = [f"t{i}" for i in range(self.scratch)]
        head = [*self.head, *[f"{''.join(f'w{t}, ' for t in scratch)}= scratch"] * bool(scratch), "size = f_w.size"]
        loop = [", ".join(self._slot(n) for n in buffers) + " = " + ", ".join(f"f_{n}[a:a + step]" for n in buffers),
                *(f"{t} = w{t}[:size - a]" for t in scratch), *self.body]
        lines = [f"def run(xp, rate, lr_mult, params, scratch, step, {', '.join(f'f_{n}' for n in buffers)}):",
                 "    if rate[1] == 0:", "        return", *(f"    {ln}" for ln in head),
                 "    for a in range(0, size, step):", *(f"        {ln}" for ln in loop)]
        return "\n".join(lines) + "\n"


def numpy_source(r: Rule) -> tuple[str, int]:
    """Python source of ``run(xp, rate, lr_mult, params, scratch, step, w, g, *state)`` over flat arrays, in pieces of
    ``step`` elements (``scratch`` holds arrays of that many, or of the arrays' size where smaller); and how many of
    those it needs."""
    plan = _NumpyPlan(r)
    return plan.source(), plan.scratch


@functools.cache
def numpy_function(r: Rule) -> tuple[Callable[..., None], int, int]:
    """:func:`numpy_source` of the line ``r`` compiled (once per line), its scratch count and its number of state
    buffers. A backend looks its line up itself (``TABLE.get(kind) or rule(kind)``): one call less per update."""
    source, scratch = numpy_source(r)
    namespace: dict[str, Any] = {"math": math}
    exec(compile(source, f"<update rule {r.name}>", "exec"), namespace)
    return namespace["run"], scratch, len(r.state)


# --- one loop over the elements (the native backend's numba kernels) ------------------------------------------------
LOOP_OPS = frozenset({"add", "sub", "mul", "div", "neg", "sqrt"})
"""What a formula may compute per element for :func:`loop_sources` (the operations IEEE rounds exactly, so a loop
gives the values of NumPy's ufuncs)."""


def loop_sources(r: Rule) -> tuple[str, str, int] | None:
    """The line ``r`` as one pass over the elements, with the values of :func:`numpy_function` (None where a step
    computes per element something outside :data:`LOOP_OPS`): Python source of ``prepare(rate, lr_mult, params,
    dtype)``, which returns None where ``rate[1]`` is 0, else the scalars the elements read, computed as the NumPy
    code computes them (in Python floats, rounded to the arrays' dtype where an element meets them, as NumPy rounds
    a Python float); source of ``kernel(consts, w, g, *state)`` over flat arrays, each element's steps in the
    arrays' dtype; and the number of state arrays."""
    head = ["if rate[1] == 0:", "    return None"]
    head += [f"{name} = float(rate[{i}]) * lr_mult" for name, i in RATES.items() if name in r.rates]
    if r.params:
        head.append(f"{''.join(f'p_{p}, ' for p in r.params)}= params")
    consts: list[str] = []  # scalars that meet elements: consts[k]
    body: list[str] = []
    env: dict[str, tuple[str, str]] = {n: ("elem", f"v_{n}") for n in ("w", "g", *r.state)}
    env |= {n: ("scalar", n) for n in r.rates} | {n: ("scalar", f"p_{n}") for n in r.params}
    for k, (target, expr) in enumerate(r.steps):
        memo: dict[int, tuple[str, str]] = {}

        def gen(n: Expr, k: int = k, memo: dict = memo) -> tuple[str, str] | None:
            if id(n) in memo:
                return memo[id(n)]
            if n.op == "const":
                return "scalar", repr(float(n.args[0]))
            if n.op == "var":
                return env[n.args[0]]
            if n.op == "param":
                return "scalar", f"p_{n.args[0]}"
            kids = [gen(c) for c in n.children()]
            if any(c is None for c in kids):
                return None
            name = f"x{k}_{len(memo)}"
            if all(c[0] == "scalar" for c in kids):  # type: ignore[index]
                fn = _PY.get(n.op, f"math.{n.op}({{}})")
                head.append(f"{name} = {fn.format(*(c[1] for c in kids))}")  # type: ignore[index]
                memo[id(n)] = ("scalar", name)
                return memo[id(n)]
            if n.op not in LOOP_OPS:
                return None
            args = []
            for kind, text in kids:  # type: ignore[misc]
                if kind == "scalar":
                    consts.append(text)
                    text = f"k{len(consts) - 1}"
                args.append(text)
            form = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})", "neg": "(-{})",
                    "sqrt": "np.sqrt({})"}[n.op]
            body.append(f"{name} = {form.format(*args)}")
            memo[id(n)] = ("elem", name)
            return memo[id(n)]

        value = gen(expr)
        if value is None:
            return None
        if value[0] == "scalar" and target in r.locals:
            env[target] = value
            continue
        if value[0] == "scalar":  # a buffer assigned a scalar: each element gets it
            consts.append(value[1])
            value = ("elem", f"k{len(consts) - 1}")
        local = f"v_{target}" if target in ("w", *r.state) else f"l_{target}"
        body.append(f"{local} = {value[1]}")
        env[target] = ("elem", local)
    head.append(f"return np.array([{', '.join(consts)}], dtype)")
    buffers = ("w", "g", *r.state)
    written = [n for n in buffers if n in {t for t, _ in r.steps}]
    prepare = "\n".join(["def prepare(rate, lr_mult, params, dtype):", *(f"    {ln}" for ln in head)])
    kernel = "\n".join([
        f"def kernel(consts, {', '.join(buffers)}):",
        *(f"    k{i} = consts[{i}]" for i in range(len(consts))),
        "    for i in range(w.size):",
        *(f"        v_{n} = {n}[i]" for n in buffers),
        *(f"        {ln}" for ln in body),
        *(f"        {n}[i] = v_{n}" for n in written)])
    return prepare + "\n", kernel + "\n", len(r.state)


# --- C (CuPy ElementwiseKernel) and WGSL text -------------------------------------------------------------------------
def _statements(r: Rule, names: dict[str, str], dialect: str, declare: str) -> list[str]:
    """The steps as assignments (a local's first one declared with ``declare``), in C or WGSL."""
    out, seen = [], set()
    for k, (target, expr) in enumerate(r.steps):
        body, value = _text(expr, names, dialect, prefix=f"t{k}_")
        lhs = names[target]
        if target in r.locals and target not in seen:
            seen.add(target)
            lhs = f"{declare} {lhs}"
        out += [*body, f"{lhs} = {value};"]
    return out


_CUDA_SKIP = "rate[1] == (T)0"
"""Where the cuda kernels of an update write nothing: a loss-scaled step with inf or nan gradients."""


def _cuda_parts(r: Rule) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """Rule ``r`` in C over a type T, for the cuda kernels: the arrays it assigns (``w``, ``s_NAME``), its scalars
    (``lr_mult``, ``p_NAME``) and its statements per element, reading those, ``g`` and the array ``rate``."""
    names = {"w": "w", "g": "g"} | {n: f"s_{n}" for n in r.state} | {n: f"p_{n}" for n in r.params} | \
        {n: f"l_{n}" for n in r.locals} | {n: n for n in RATES}
    rates = [f"const T {n} = rate[{RATES[n]}] * lr_mult;" for n in r.rates]
    return (("w", *(names[n] for n in r.state)), ("lr_mult", *(names[p] for p in r.params)),
            " ".join([*rates, *_statements(r, names, "c", "T")]))


def cuda_kernel_source(kind: str) -> tuple[str, str, str, str]:
    """Rule ``kind`` as ElementwiseKernel's (in_params, out_params, operation, name), over a type T (float or
    double): ``kernel(g, rate, lr_mult, *params, w, *state)``, writing nothing where ``rate[1] == 0``."""
    r = rule(kind)
    outputs, scalars, body = _cuda_parts(r)
    return (", ".join(["T g", "raw T rate", *(f"T {s}" for s in scalars)]), ", ".join(f"T {o}" for o in outputs),
            f"if (!({_CUDA_SKIP})) {{ {body} }}", f"leafpy_{r.name}_update")


def cuda_vector_source(kind: str, copy: str = "") -> tuple[str, str]:
    """Rule ``kind`` over float32 arrays as a CUDA kernel that updates four elements a thread (float4 loads and
    stores: ``leafpy.backends.cuda.kernels.vectorized_source``), and its name: ``kernel(g, w, *state, rate,
    lr_mult, *params, n4)`` over ``n4`` float4s, each element as :func:`cuda_kernel_source`'s; where
    ``rate[1] == 0`` every thread returns before it loads or stores anything. ``copy`` ("bf16" or "f16"): the
    kernel also stores the updated weight rounded to that format (``kernel(g, w, *state, copy, rate, ...)``)."""
    from .cuda.kernels import vectorized_source  # here, not above: the cuda package loads with its backend only

    r = rule(kind)
    outputs, scalars, body = _cuda_parts(r)
    name = f"leafpy_{r.name}_update4" + (f"_{copy}" if copy else "")
    return vectorized_source(name, ("g",), outputs, scalars, body, read_outputs=True, pointers=("rate",),
                             skip=_CUDA_SKIP, copy=copy), name


def cuda_kernel_sources() -> dict[str, tuple[str, str, str, str]]:
    """:func:`cuda_kernel_source` of every rule, by name."""
    return {name: cuda_kernel_source(name) for name in TABLE}


_WGSL_ENTRY = """@compute @workgroup_size(256)
fn {name}(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    if (rate[1] == 0.0) {{ return; }}
    let i0 = quad_first(gid, nw);  // four elements a thread (webgpu.params.PER_THREAD)
    for (var j = 0u; j < 4u; j = j + 1u) {{
        let i = i0 + j * 256u;
        if (i >= p.count) {{ return; }}
{body}
    }}
}}
"""


def wgsl_entry_point(kind: str, copy: bool = False) -> str:
    """Rule ``kind`` as the entry point ``NAME_update`` of update.wgsl's bindings: loads, the steps, stores. With
    ``copy`` (a float16 module): ``NAME_update_h``, which also stores the updated weight rounded to float16 into the
    array bound after the rule's state (``h4`` .. ``h7``: see :func:`wgsl_entry_points`)."""
    r = rule(kind)
    buffers = {"w": "w", "g": "g"} | {n: f"s{i + 1}" for i, n in enumerate(r.state)}
    names = {n: f"v_{n}" for n in buffers} | {n: f"p.{f}" for n, f in zip(r.params, WGSL_PARAMS)} | \
        {n: f"l_{n}" for n in r.locals} | {n: f"rate_{n}" for n in RATES}
    lines = [f"let rate_{n} = rate[{RATES[n]}] * p.lr_mult;" for n in r.rates]
    lines += [f"var v_{n} = {b}[i];" for n, b in buffers.items()]
    lines += _statements(r, names, "wgsl", "var")
    written = {t for t, _ in r.steps}
    lines += [f"{b}[i] = v_{n};" for n, b in buffers.items() if n in written]
    if copy:
        lines.append(f"h{4 + len(r.state)}[i] = to_h(v_w);")
    return _WGSL_ENTRY.format(name=r.name + ("_update_h" if copy else "_update"),
                              body="\n".join(f"        {ln}" for ln in lines))


def wgsl_entry_points(copy: bool = False) -> str:
    """:func:`wgsl_entry_point` of every rule; with ``copy`` their float16-copy twins, after the declarations of the
    arrays they store the copy in: ``h4`` .. ``h7`` at bindings 4 to 7, the one after a rule's last state array
    (each entry point uses one of them, so those sharing a binding with s1 .. s3 never meet in one pipeline)."""
    head = "".join(f"@group(0) @binding({k}) var<storage, read_write> h{k}: array<f16>;\n" for k in range(4, 8)) \
        if copy else ""
    return head + "\n".join(wgsl_entry_point(name, copy) for name in TABLE)
