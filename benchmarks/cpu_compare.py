"""CPU training step, leafpy native against PyTorch, measured so that a shared machine cannot fake the result.

Each engine runs in a worker process of its own (same initial weights, same batches, same rule; losses after 10
identical steps are printed side by side). Timed rounds alternate between the two, in pairs whose order flips
each time; before a round starts, the parent waits until the other worker's threads are idle (its CPU time in
/proc/<pid>/stat stops advancing: OpenBLAS and OpenMP threads spin for a while after their work). During each
round the parent reads /proc/stat and subtracts the two workers' own CPU time: what is left is other processes'
use. A pair is kept only when in both of its rounds others used at most ``--quiet`` cores (0.15); if no pair is
quiet, all are reported with a warning. The table gives medians of the kept rounds, their spread (quartiles),
and the paired ratio: the median over kept pairs of torch ms / leafpy ms (above 1: leafpy is faster).
``--products`` adds, for networks of Linear layers, rounds timing each engine's products alone at the step's shapes
(leafpy's BLAS against PyTorch's): the rest of each step, and the ceiling of the ratio (torch's step over leafpy's
products: what leafpy would reach with everything but its products free).

    python benchmarks/cpu_compare.py [--nets mlp128,lenet64] [--rules momentum,inv,adam] [--pairs 15]
        [--threads 2] [--products] [--json FILE]
    python benchmarks/cpu_compare.py --show FILE    # the table of an earlier run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ENGINES = ("leafpy", "torch")


# --- statistics (no timing here: unit tested) --------------------------------------------------------------------
def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); a single value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(pairs: list[dict], quiet: float) -> dict:
    """The row of one network and rule from its pairs of rounds ({"leafpy": ms, "torch": ms, "others": cores of
    each round, the larger of the two}): the pairs where others used at most ``quiet`` cores are kept (all of them,
    flagged, when none is quiet); medians, quartiles and the paired ratio over the kept ones."""
    kept = [p for p in pairs if p["others"] <= quiet]
    row: dict[str, Any] = {"pairs": len(pairs), "kept": len(kept), "all_noisy": not kept}
    use = kept or pairs
    for engine in ENGINES:
        q1, med, q3 = quartiles([p[engine] for p in use])
        row[f"{engine}_ms"], row[f"{engine}_q1"], row[f"{engine}_q3"] = med, q1, q3
    row["ratio"] = statistics.median(p["torch"] / p["leafpy"] for p in use)
    if all("leafpy_products" in p and "torch_products" in p for p in use):
        for engine in ENGINES:  # the step's products alone, and the rest of the step
            row[f"{engine}_products_ms"] = statistics.median(p[f"{engine}_products"] for p in use)
            row[f"{engine}_rest_ms"] = statistics.median(p[engine] - p[f"{engine}_products"] for p in use)
        row["products_ratio"] = statistics.median(p["torch_products"] / p["leafpy_products"] for p in use)
        # the most the step's ratio could be were the rest of leafpy's step free: torch's step over leafpy's products
        row["ceiling"] = statistics.median(p["torch"] / p["leafpy_products"] for p in use)
    row["others_median"] = statistics.median(p["others"] for p in pairs)
    return row


def others_cores(busy_ticks: int, worker_ticks: int, seconds: float) -> float:
    """Cores other processes used during a round: the machine's busy ticks minus the workers' (and never below 0:
    the two counters are sampled a moment apart)."""
    return max(0.0, (busy_ticks - worker_ticks) / TICK / seconds)


# --- /proc ---------------------------------------------------------------------------------------------------------
def cpu_ticks(pid: int) -> int:
    """User + system ticks of a process, all its threads."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def busy_ticks() -> int:
    """The machine's busy ticks (all but idle and iowait) from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values[:8]) - values[3] - values[4]


def wait_idle(pid: int, interval: float = 0.03, timeout: float = 3.0) -> None:
    """Return once the process used no CPU for two intervals running (its spinning threads went to sleep)."""
    end = time.monotonic() + timeout
    last, still = cpu_ticks(pid), 0
    while still < 2 and time.monotonic() < end:
        time.sleep(interval)
        now = cpu_ticks(pid)
        still = still + 1 if now == last else 0
        last = now


def wait_quiet(pids: list[int], quiet: float, timeout: float, window: float = 0.2) -> None:
    """Wait (at most ``timeout`` seconds) for a window in which other processes used at most ``quiet`` cores, so
    that fewer rounds are lost to another user's burst."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        busy0, own0 = busy_ticks(), sum(cpu_ticks(p) for p in pids)
        time.sleep(window)
        if others_cores(busy_ticks() - busy0, sum(cpu_ticks(p) for p in pids) - own0, window) <= quiet:
            return


def machine() -> dict:
    """The CPU as /proc/cpuinfo names it (with its family and model where the name is short, as a VM's "AMD EPYC"),
    whether it has AVX-512, and the CPU count."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    cpu = f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} model " \
          f"{fields.get('model', '?')}{', AVX-512' if 'avx512f' in fields.get('flags', '').split() else ''})"
    return {"cpu": cpu, "cpus": os.cpu_count()}


# --- workers -------------------------------------------------------------------------------------------------------
def _batches(batch: int, shape: tuple, classes: int) -> tuple[list, list]:
    import numpy as np
    rng = np.random.default_rng(0)
    xs = [rng.random((batch, *shape), dtype=np.float32) for _ in range(4)]
    ys = [rng.integers(0, classes, batch) for _ in range(4)]
    return xs, ys


def product_shapes(weight_shapes: list[tuple[int, ...]], batch: int) -> list[tuple[int, int, int, bool, bool]] | None:
    """The products (m, n, k, a transposed, b transposed) a training step of a network of Linear layers makes, in
    order: each layer's forward (x W^T), its weight gradient (dy^T x) and, past the first layer, its data gradient
    (dy W). None for a network with other weights than matrices and vectors (a convolution's products are no
    plain GEMMs in PyTorch)."""
    if any(len(s) > 2 for s in weight_shapes):
        return None
    out: list[tuple[int, int, int, bool, bool]] = []
    for i, (n, k) in enumerate(s for s in weight_shapes if len(s) == 2):
        out.append((batch, n, k, False, True))
        out.append((n, k, batch, True, False))
        if i:
            out.append((batch, k, n, False, False))
    return out


def _products(kind: str, shapes: list[tuple[int, int, int, bool, bool]] | None, be: Any) -> Any:
    """A function running the step's products alone once (leafpy: through the native backend's gemm, its BLAS;
    torch: torch.mm), on operands of the step's shapes and memory layouts; None without ``shapes``."""
    if shapes is None:
        return None
    import numpy as np
    rng = np.random.default_rng(1)

    def operand(rows: int, cols: int, trans: bool) -> Any:  # as stored: the transpose of a transposed operand
        return rng.random((cols, rows) if trans else (rows, cols), dtype=np.float32)

    calls = [(operand(m, k, ta), ta, operand(k, n, tb), tb, np.empty((m, n), np.float32))
             for m, n, k, ta, tb in shapes]
    if kind == "leafpy":
        def run() -> None:
            for a, ta, b, tb, c in calls:
                be.gemm(a, ta, b, tb, c)
        return run
    import torch
    tcalls = [(torch.from_numpy(a).t() if ta else torch.from_numpy(a), torch.from_numpy(b).t() if tb
               else torch.from_numpy(b), torch.from_numpy(c)) for a, ta, b, tb, c in calls]

    def run_torch() -> None:
        for a, b, c in tcalls:
            torch.mm(a, b, out=c)
    return run_torch


def _engine(kind: str, net: str, rule: str, blas: str = "auto") -> tuple[Any, Any, dict, Any]:
    """(step(i), loss(), facts, products() or None) of one engine, built from train_step.py's networks and
    trainers; products (see :func:`product_shapes`) for networks of Linear layers."""
    import numpy as np
    import train_step as ts

    import leafpy as lp
    make, batch, shape, classes = ts.NETWORKS[net]
    xs, ys = _batches(batch, shape, classes)
    be = lp.backend("native", **({} if blas == "auto" else {"blas": blas}))
    solver = ts.leafpy_solver(be, make(), batch, classes, rule)
    initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    products = _products(kind, product_shapes([w.shape for w in initial], batch), be)
    if kind == "leafpy":
        data = [(lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(y.astype(np.float32)))
                for x, y in zip(xs, ys)]
        return (lambda i: solver.train_minibatch(*data[i % 4])), solver.loss, {"numpy": np.__version__,
                                                                              "native_blas": be.blas}, products
    import torch
    trainer = ts.TorchTrainer.of_network(torch, solver.network.layer, initial, "cpu", False, rule)
    data = [trainer.to_device(x, y) for x, y in zip(xs, ys)]
    blas = "MKL" if torch.backends.mkl.is_available() else "?"
    return ((lambda i: trainer.step(*data[i % 4])), trainer.loss, {"torch": torch.__version__, "torch_blas": blas},
            products)


def worker(conn: Any, kind: str, net: str, rule: str, threads: int, blas: str = "auto") -> None:
    """One engine's process: answers ("round", steps) with ms per step, and "stop"."""
    from threadpoolctl import threadpool_info, threadpool_limits
    threadpool_limits(threads)
    if kind == "torch":
        import torch
        torch.set_num_threads(threads)
    step, loss, facts, products = _engine(kind, net, rule, blas)
    threadpool_limits(threads)  # again: a BLAS loaded by the engine (leafpy's MKL) is limited too
    for i in range(10):
        step(i)
    facts["loss10"] = loss()
    facts["blas"] = sorted({f"{p['internal_api']} {p['version']}" for p in threadpool_info()
                            if p["user_api"] == "blas"})
    k = 10
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:  # warm-up, and a first estimate of the step's time
        step(k)
        k += 1
    conn.send({**facts, "warm_ms": (time.perf_counter() - t) / (k - 10) * 1000, "products": products is not None})
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        t = time.perf_counter()
        if msg[0] == "products":  # the step's products alone, as many times as there were steps
            for _ in range(msg[1]):
                products()
        else:
            for _ in range(msg[1]):
                step(k)
                k += 1
        conn.send((time.perf_counter() - t) / msg[1] * 1000)


# --- the parent ----------------------------------------------------------------------------------------------------
def timed_round(conns: dict, procs: dict, engine: str, steps: int, what: str = "round") -> tuple[float, float]:
    """(ms per step, others' cores) of one round of ``engine`` (``what``: "round" for training steps, "products"
    for the step's products alone), started once the other worker is idle."""
    other = ENGINES[1 - ENGINES.index(engine)]
    wait_idle(procs[other].pid)
    pids = [p.pid for p in procs.values()] + [os.getpid()]
    busy0, own0, t0 = busy_ticks(), sum(cpu_ticks(p) for p in pids), time.perf_counter()
    conns[engine].send((what, steps))
    ms = conns[engine].recv()
    seconds = time.perf_counter() - t0
    return ms, others_cores(busy_ticks() - busy0, sum(cpu_ticks(p) for p in pids) - own0, seconds)


def compare(net: str, rule: str, args: Any) -> dict:
    ctx = mp.get_context("spawn")
    conns, procs, facts = {}, {}, {}
    for engine in ENGINES:
        parent, child = ctx.Pipe()
        procs[engine] = ctx.Process(target=worker, args=(child, engine, net, rule, args.threads, args.blas),
                                     daemon=True)
        procs[engine].start()
        conns[engine] = parent
    try:
        for engine in ENGINES:
            facts[engine] = conns[engine].recv()
        steps = {e: max(2, round(args.round_s * 1000 / facts[e]["warm_ms"])) for e in ENGINES}
        pairs = []
        pids = [p.pid for p in procs.values()] + [os.getpid()]
        for i in range(args.pairs):
            wait_quiet(pids, args.quiet, args.wait_quiet)
            pair: dict[str, Any] = {"others": 0.0}
            for engine in (ENGINES if i % 2 == 0 else ENGINES[::-1]):
                pair[engine], others = timed_round(conns, procs, engine, steps[engine])
                pair["others"] = max(pair["others"], others)
                if args.products and facts[engine]["products"]:
                    pair[f"{engine}_products"], others = timed_round(conns, procs, engine, steps[engine],
                                                                     "products")
                    pair["others"] = max(pair["others"], others)
            pairs.append(pair)
    finally:
        for engine in ENGINES:
            conns[engine].send(("stop",))
            procs[engine].join(10)
    row = {"network": net, "rule": rule, **summarize(pairs, args.quiet), "rounds": pairs,
           "leafpy_loss10": facts["leafpy"]["loss10"], "torch_loss10": facts["torch"]["loss10"]}
    row["facts"] = {e: {k: v for k, v in facts[e].items() if k not in ("loss10", "warm_ms")} for e in ENGINES}
    return row


def print_row(r: dict) -> None:
    spread = {e: f"{r[e + '_q1']:.2f}-{r[e + '_q3']:.2f}" for e in ENGINES}
    flag = "  (no quiet pair: all rounds)" if r["all_noisy"] else ""
    print(f"{r['network']:<10}{r['rule']:>9}{r['leafpy_ms']:>10.2f} {spread['leafpy']:>15}{r['torch_ms']:>10.2f} "
          f"{spread['torch']:>15}{r['ratio']:>7.2f}{r['kept']:>5}/{r['pairs']:<3}{r['others_median']:>7.2f}"
          f"{r['leafpy_loss10']:>10.5f}{r['torch_loss10']:>10.5f}{flag}", flush=True)
    if "products_ratio" in r:
        print(f"{'':<10}{'products':>9}{r['leafpy_products_ms']:>10.2f} {'':>15}{r['torch_products_ms']:>10.2f} "
              f"{'':>15}{r['products_ratio']:>7.2f}   rest: leafpy {r['leafpy_rest_ms']:.2f} ms, torch "
              f"{r['torch_rest_ms']:.2f} ms; ceiling (leafpy's rest free) {r['ceiling']:.2f}", flush=True)


def print_head(info: dict, facts: dict, threads: int, quiet: float) -> None:
    print(f"# {info['cpu']}, {info['cpus']} CPUs, {threads} threads per engine; leafpy: numpy "
          f"{facts['leafpy']['numpy']}, {', '.join(facts['leafpy']['blas'])}, products in "
          f"{facts['leafpy'].get('native_blas', 'numpy')}; torch {facts['torch']['torch']} "
          f"({facts['torch']['torch_blas']}); pairs kept where others used <= {quiet} cores")
    print(f"{'network':<10}{'rule':>9}{'leafpy ms':>10} {'(q1-q3)':>15}{'torch ms':>10} {'(q1-q3)':>15}"
          f"{'ratio':>7}{'kept':>9}{'others':>7}{'loss@10 l':>10}{'loss@10 t':>10}")


def show(saved: dict) -> int:
    m = saved["machine"]
    print_head(m, {"leafpy": m, "torch": m}, m["threads"], saved["quiet_cores"])
    for r in saved["rows"]:
        print_row(r)
    return 0


def main() -> int:
    import train_step as ts
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default="mlp128,lenet64,mlp4096,lenet1024")
    p.add_argument("--rules", default="momentum,inv,adam")
    p.add_argument("--pairs", type=int, default=15, help="pairs of timed rounds per network and rule")
    p.add_argument("--round-s", type=float, default=0.6, help="seconds per timed round (about)")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines")
    p.add_argument("--blas", choices=("auto", "numpy", "mkl"), default="auto",
                   help="the native backend's blas option (leafpy's products in NumPy's BLAS or Intel MKL)")
    p.add_argument("--quiet", type=float, default=0.15, help="most cores other processes may use in a kept round")
    p.add_argument("--wait-quiet", type=float, default=10.0,
                   help="seconds to wait at most, before each pair, for other processes to fall quiet")
    p.add_argument("--products", action="store_true",
                   help="also time each engine's products alone at the step's shapes, in rounds of their own "
                        "(networks of Linear layers): the step's floor, and the rest of each step")
    p.add_argument("--json", help="write the rows and the machine here")
    p.add_argument("--show", metavar="JSON", help="print the table of an earlier run's --json file, and stop")
    args = p.parse_args()
    if args.show:
        return show(json.loads(Path(args.show).read_text()))
    nets, rules = args.nets.split(","), args.rules.split(",")
    bad = [n for n in nets if n not in ts.NETWORKS or n in ts.GPU_ONLY] + [r for r in rules if r not in ts.RULES]
    if bad:
        p.error(f"unknown network or rule {bad[0]!r}: networks mlp128, lenet64, mlp4096, lenet1024; "
                f"rules {', '.join(ts.RULES)}")
    info = machine()
    rows = []
    for net in nets:
        for rule in rules:
            rows.append(compare(net, rule, args))
            if len(rows) == 1:
                print_head(info, rows[0]["facts"], args.threads, args.quiet)
            print_row(rows[-1])
    if any(r["all_noisy"] for r in rows):
        print("# WARNING: no quiet pair in some rows: their numbers are from all rounds, with other load")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": {**info, "threads": args.threads,
                                                           **rows[0]["facts"]["leafpy"],
                                                           **rows[0]["facts"]["torch"]},
                                               "quiet_cores": args.quiet, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
