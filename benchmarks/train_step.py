"""Training-step benchmark: leafpy against PyTorch, side by side in one process.

For each network both frameworks start from identical weights, train on identical batches with the same update
rule (``--rules``: momentum SGD at a fixed rate; ``inv``, momentum under Caffe's LeNet schedule
``base_lr (1 + gamma it)^-power``; ``adam``), and are timed alternately (whole steps: forward, backward, update;
GPU-synchronised), each with its default thread behaviour and each round started after the other framework's idle
threads have gone to sleep. The table reports milliseconds per step, the ratio torch/leafpy (above 1: leafpy is
faster), peak memory, and both losses after 10 identical steps, so a speed win can never hide a wrong result.

    python benchmarks/train_step.py --backend native --vs torch [--nets mlp128,lenet64] [--rules momentum,inv,adam]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import leafpy as lp  # noqa: E402

LR, MOMENTUM = 0.01, 0.9
INV_GAMMA, INV_POWER = 1e-4, 0.75  # Caffe's LeNet solver
ADAM_LR = 1e-3
RULES = ("momentum", "inv", "adam")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

SETTLE_S = 0.3
"""Seconds to wait before each timed round on the CPU (GPU rounds start at once: an idle GPU lowers its clocks).
Both frameworks keep their default thread behaviour: after its work, a worker thread of OpenBLAS (numpy) or of
PyTorch's OpenMP spins for a while before it sleeps, and a framework whose threads spin while the other is timed
takes that one's cores (PyTorch's MLP-128 step measured 8.9 ms instead of 2.5 with numpy's threads spinning).
Forcing both to sleep at once instead (OMP_WAIT_POLICY=PASSIVE, OPENBLAS_THREAD_TIMEOUT=4) is not neutral: it
slows PyTorch's small steps about 2x (MLP-128 4.7 against 2.5 ms) and leafpy's by ~10%. So each round starts
after the other framework's threads have gone to sleep."""


def conv_tolerance(text: str) -> float | None | str:
    """--conv-tolerance's value: a number, 'any' (None: any fp32 plan) or 'default' (the backend's own)."""
    return None if text == "any" else text if text == "default" else float(text)


TENSOR_CORE_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
"""Dense bf16/fp16 tensor-core FLOP/s by GPU (NVIDIA's data sheets; the SXM parts)."""


def training_flops(net: lp.Layer) -> float:
    """Floating-point operations of one training step's products: 2 per multiply-add, three products per
    convolution, linear or recurrent layer (forward, data gradient, weight gradient; the usual convention, though
    the first layer's data gradient is not computed)."""
    macs = 0
    for layer in _leaves(net):
        kind, weights = layer.config.type, [w.shape for w in layer.learnable_weights_data()]
        if kind == "Convolution":
            o, c, kh, kw = weights[0]
            macs += int(np.prod(layer.outputs[0].shape)) * c * kh * kw
        elif kind == "Linear":
            out = layer.outputs[0].shape
            macs += int(np.prod(out)) * weights[0][1]
        elif kind in ("LSTM", "GRU", "RNN"):
            n, t = layer.inputs[0].shape[:2]
            macs += n * t * sum(int(np.prod(w)) for w in weights if len(w) == 2)
    return 6.0 * macs


def _leaves(layer: lp.Layer):
    children = getattr(layer, "layers", None)
    if not children:
        yield layer
        return
    for child in children:
        yield from _leaves(child)


def tensor_core_peak() -> float | None:
    try:
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - no GPU, no CuPy: no peak to report
        return None
    return next((v for k, v in TENSOR_CORE_PEAK.items() if k in name), None)


def mlp_config(batch: int) -> lp.LayerConfig:
    cfg = lp.SequentialConfig(inputs=[("data", [batch, 784])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=512)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=512)))
    cfg.add_layer(lp.LayerConfig("relu2", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc3", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return lp.LayerConfig("mlp", cfg)


def from_run_file(name: str, batch: int) -> lp.LayerConfig:
    """A shipped network with the batch size changed and Dropout removed (so both frameworks compute the same)."""
    net = lp.config.load(ROOT / "configs" / name).network
    seq = net.config
    cfg = lp.SequentialConfig(inputs=[(n, [batch, *s[1:]]) for n, s in seq.inputs])
    for layer in seq.layers:
        if layer.type != "Dropout":
            cfg.add_layer(layer)
    return lp.LayerConfig(net.name, cfg)


NETWORKS = {
    "mlp128": (lambda: mlp_config(128), 128, (784,), 10),
    "mlp4096": (lambda: mlp_config(4096), 4096, (784,), 10),
    "lenet64": (lambda: from_run_file("mnist_lenet.yaml", 64), 64, (1, 28, 28), 10),
    "lenet1024": (lambda: from_run_file("mnist_lenet.yaml", 1024), 1024, (1, 28, 28), 10),
    "alexnet128": (lambda: from_run_file("alexnet.yaml", 128), 128, (3, 224, 224), 1000),
    "alexnet-lrn128": (lambda: from_run_file("alexnet_lrn.yaml", 128), 128, (3, 227, 227), 1000),
    "resnet18-128": (lambda: from_run_file("resnet18_cifar.yaml", 128), 128, (3, 32, 32), 10),
}
GPU_ONLY = {"alexnet128", "alexnet-lrn128", "resnet18-128"}


# --- leafpy -----------------------------------------------------------------------------------------------------
def set_attributes(backend, items: list[str], error) -> None:
    """The benchmark scripts' ``--set NAME=VALUE``: each a backend tuning attribute, converted to the type it has
    (as written where it is None, off; ``NAME=None`` turns a setting off; ``error``: the parser's, for a name the
    backend lacks or a value that is no number)."""
    for item in items:
        name, _, value = item.partition("=")
        if not hasattr(backend, name):
            error(f"--set {item}: the {backend.name} backend has no attribute {name!r}")
        if value == "None":
            setattr(backend, name, None)
            continue
        try:
            number = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            error(f"--set {item}: {value!r} is not a number")
        current = getattr(backend, name)
        setattr(backend, name, number if current is None else type(current)(number))  # (None: a setting left off)


def solver_and_batch(backend, name: str) -> tuple[lp.Solver, lp.SharedTensor, lp.SharedTensor]:
    """A solver for one of NETWORKS and a random batch for it (used by the other benchmark scripts)."""
    make, batch, shape, classes = NETWORKS[name]
    solver = leafpy_solver(backend, make(), batch, classes)
    rng = np.random.default_rng(0)
    x = lp.SharedTensor.from_numpy(rng.random((batch, *shape), dtype=np.float32))
    y = lp.SharedTensor.from_numpy(rng.integers(0, classes, batch).astype(np.float32))
    return solver, x, y


def leafpy_solver(backend, net_cfg: lp.LayerConfig, batch: int, classes: int, rule: str = "momentum") -> lp.Solver:
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, classes]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=classes)))
    if rule == "adam":
        update = dict(solver="adam", base_lr=ADAM_LR)
    elif rule == "inv":
        update = dict(solver="momentum", base_lr=LR, momentum=MOMENTUM, lr_policy="inv", gamma=INV_GAMMA,
                      power=INV_POWER)
    else:
        update = dict(solver="momentum", base_lr=LR, momentum=MOMENTUM)
    cfg = lp.SolverConfig(network=net_cfg, objective=lp.LayerConfig("loss", obj), seed=0, **update)
    return lp.Solver.from_config(backend, backend, cfg)


# --- torch ------------------------------------------------------------------------------------------------------
def torch_model(torch, net: lp.Layer, initial: list[np.ndarray]):
    """The same network in PyTorch, with leafpy's initial weights copied in: one module per layer, run in the
    order and with the blob wiring of the leafpy network (so branching networks, ResNet's residual adds, work)."""
    nn = torch.nn
    graph, eltwise_sum, concat = _torch_modules(torch)
    mods, wiring = [], []
    weights = iter(initial)
    prev = [name for name, _ in net.config.config.inputs]
    for layer in net.layers:
        lc = layer.config
        c, t = lc.config, lc.type
        if t == "Linear":
            w = layer.weights[0]
            m = nn.Linear(w.shape[1], w.shape[0], bias=c.bias)
        elif t == "Convolution":
            w = layer.weights[0]
            m = nn.Conv2d(w.shape[1], w.shape[0], tuple(c.filter_shape), tuple(c.stride), tuple(c.padding),
                          bias=c.bias)
        elif t == "Pooling":
            cls = nn.MaxPool2d if c.mode == "max" else nn.AvgPool2d
            m = cls(tuple(c.filter_shape), tuple(c.stride), tuple(c.padding))
        elif t == "BatchNorm":
            m = nn.BatchNorm2d(layer.weights[0].shape[0], eps=c.eps, momentum=c.momentum, affine=c.affine)
        elif t == "LRN":
            m = nn.LocalResponseNorm(c.local_size, alpha=c.alpha, beta=c.beta, k=c.k)
        elif t == "Eltwise":
            if c.operation != "sum":
                raise SystemExit(f"torch_model: Eltwise {c.operation} is not mapped")
            m = eltwise_sum(c.coeff)
        elif t == "Concat":
            m = concat(c.axis)
        else:
            m = {"ReLU": nn.ReLU, "Flatten": nn.Flatten, "LogSoftmax": lambda: nn.LogSoftmax(dim=1),
                 "Sigmoid": nn.Sigmoid, "TanH": nn.Tanh}[t]()
        with torch.no_grad():  # leafpy's weight names are PyTorch's (weight, bias, running_mean, running_var)
            for name in (layer.worker.weight_names if layer.weights else ()):
                getattr(m, name).copy_(torch.from_numpy(next(weights)))
        ins = list(lc.inputs) or prev[:1]
        outs = list(lc.outputs) or [lc.name]
        mods.append(m)
        wiring.append((ins, outs[0]))
        prev = outs
    return graph(mods, wiring, net.config.config.inputs[0][0])


@functools.cache
def _torch_modules(torch):
    """PyTorch modules for leafpy's wiring and its multi-input layers (defined once torch is imported)."""
    nn = torch.nn

    class Graph(nn.Module):
        def __init__(self, mods, wiring, input_name):
            super().__init__()
            self.mods = nn.ModuleList(mods)
            self.wiring = wiring
            self.input_name = input_name

        def forward(self, x):
            blobs = {self.input_name: x}
            for m, (ins, out) in zip(self.mods, self.wiring):
                blobs[out] = m(*(blobs[n] for n in ins))
            return blobs[out]

    class EltwiseSum(nn.Module):
        def __init__(self, coeff):
            super().__init__()
            self.coeff = tuple(coeff)

        def forward(self, *xs):
            coeff = self.coeff or (1.0,) * len(xs)
            out = xs[0] * coeff[0] if coeff[0] != 1.0 else xs[0]
            for c, x in zip(coeff[1:], xs[1:]):
                out = out + (x * c if c != 1.0 else x)
            return out

    class Concat(nn.Module):
        def __init__(self, axis):
            super().__init__()
            self.axis = axis

        def forward(self, *xs):
            return torch.cat(xs, dim=self.axis)

    return Graph, EltwiseSum, Concat


class TorchTrainer:
    """PyTorch's side of a benchmark: ``model`` (returning log-probabilities) trained with NLL and ``rule``, in its
    fastest setup for the device (fused optimizers, cudnn.benchmark)."""

    def __init__(self, torch, model: Any, device: str, tf32: bool, rule: str = "momentum",
                 precision: str = "fp32") -> None:
        self.torch = torch
        self.device = device
        self.model = model.to(device)
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision) if device == "cuda" else None
        # mixed precision as PyTorch users run it: autocast, channels-last convolutions, a GradScaler for fp16
        self.channels_last = self.amp is not None and any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device == "cuda" else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        fast = {"fused": True} if device == "cuda" else {}  # PyTorch's fastest optimizer kernels on the GPU
        self.schedule = None
        if rule == "adam":
            self.opt = torch.optim.Adam(params, lr=ADAM_LR, **fast)
        else:
            self.opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, **fast)
            if rule == "inv":
                self.schedule = torch.optim.lr_scheduler.LambdaLR(
                    self.opt, lambda it: (1.0 + INV_GAMMA * it) ** -INV_POWER)
        self.loss_fn = torch.nn.NLLLoss()
        if device == "cuda":
            tf32 = tf32 or precision == "tf32"
            torch.backends.cudnn.allow_tf32 = tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.benchmark = True
        self.last = None

    def to_device(self, x, y):
        t = self.torch
        xt = t.from_numpy(x).to(self.device)
        if self.channels_last and xt.dim() == 4:
            xt = xt.contiguous(memory_format=t.channels_last)
        return xt, t.from_numpy(y.astype(np.int64)).to(self.device)

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.amp is not None:
            with self.torch.autocast(device_type="cuda", dtype=self.amp):
                out = self.model(x)
            self.last = self.loss_fn(out.float(), y)
        else:
            self.last = self.loss_fn(self.model(x), y)
        if self.scaler is not None:
            self.scaler.scale(self.last).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.last.backward()
            self.opt.step()
        if self.schedule is not None:
            self.schedule.step()

    @classmethod
    def of_network(cls, torch, net: lp.Layer, initial: list[np.ndarray], device: str, tf32: bool,
                   rule: str = "momentum", precision: str = "fp32") -> TorchTrainer:
        """The trainer of :func:`torch_model`'s twin of ``net``."""
        return cls(torch, torch_model(torch, net, initial), device, tf32, rule, precision)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def loss(self) -> float:
        return float(self.last.item())


# --- timing -----------------------------------------------------------------------------------------------------
def side_by_side(solver: lp.Solver, data_l: list, trainer: Any, data_t: list, backend: Any, n: int,
                 args: Any) -> tuple[list[float], list[float], list[float]]:
    """Warm both up, then ``args.rounds`` rounds of ``n`` steps each, leafpy's and PyTorch's (``trainer``, or None)
    alternately, cycling through their batches: (leafpy ms per step, torch ms per step, leafpy's issue ms) per
    round."""
    k = [0]

    def l_step() -> None:
        solver.train_minibatch(*data_l[k[0] % len(data_l)])
        k[0] += 1

    def t_step() -> None:
        trainer.step(*data_t[k[0] % len(data_t)])
        k[0] += 1

    for _ in range(args.warmup):
        l_step()
        if trainer:
            t_step()
    lt: list[float] = []
    tt: list[float] = []
    issue: list[float] = []
    for _ in range(args.rounds):
        lt.append(timed(l_step, backend.synchronize, n, issue))
        if trainer:
            tt.append(timed(t_step, trainer.sync, n))
    return lt, tt, issue


def timed(step, sync, n: int, issue: list | None = None) -> float:
    """Milliseconds per step over n steps; ``issue`` collects the CPU time of issuing them (before the final
    synchronisation: a step's launches are asynchronous on GPU backends), so a launch-bound row shows itself."""
    time.sleep(SETTLE_S)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        step()
    if issue is not None:
        issue.append((time.perf_counter() - t) / n * 1000)
    sync()
    return (time.perf_counter() - t) / n * 1000


def bench_network(name: str, backend, torch, device: str, args, rule: str = "momentum") -> dict:
    make, batch, shape, classes = NETWORKS[name]
    rng = np.random.default_rng(0)
    xs = [rng.random((batch, *shape), dtype=np.float32) for _ in range(4)]
    ys = [rng.integers(0, classes, batch) for _ in range(4)]
    gc.collect()  # the previous network's solver (layers refer to each other) is freed before this one's peak
    if backend.name == "native":
        tracemalloc.start()  # numpy reports its buffers to tracemalloc: the peak of everything leafpy holds
    elif backend.name == "cuda":
        backend.track_memory()  # peak bytes in use, as torch.cuda.max_memory_allocated counts
    solver = leafpy_solver(backend, make(), batch, classes, rule)
    row: dict = {"network": name, "batch": batch, "rule": rule}
    initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    data_l = [(lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(y.astype(np.float32)))
              for x, y in zip(xs, ys)]
    # identical steps: both losses after 10 steps
    for i in range(10):
        solver.train_minibatch(*data_l[i % 4])
    row["leafpy_loss10"] = solver.loss()
    if backend.name == "native":
        outside = sum(a.nbytes for a in initial)  # the copy kept for torch
        row["leafpy_peak_mb"] = (tracemalloc.get_traced_memory()[1] - outside) / 2**20
        tracemalloc.stop()
    trainer = None
    if torch is not None:
        trainer = TorchTrainer.of_network(torch, solver.network.layer, initial, device, args.tf32, rule, args.precision)
        data_t = [trainer.to_device(x, y) for x, y in zip(xs, ys)]
        for i in range(10):
            trainer.step(*data_t[i % 4])
        row["torch_loss10"] = trainer.loss()

    n = args.steps if args.steps else max(3, min(50, int(2000 / max(batch, 1))))
    lt, tt, issue = side_by_side(solver, data_l, trainer, data_t if trainer else [], backend, n, args)
    if backend.name == "cuda":
        row["leafpy_peak_mb"] = backend.peak_memory() / 2**20
    row["leafpy_ms"] = statistics.median(lt)
    row["tflops"] = training_flops(solver.network.layer) / row["leafpy_ms"] / 1e9
    if device == "cuda":
        row["leafpy_issue_ms"] = statistics.median(issue)
    if trainer:
        row["torch_ms"] = statistics.median(tt)
        row["ratio"] = row["torch_ms"] / row["leafpy_ms"]
        if device == "cuda":
            row["torch_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
    return row


def bench_gemm(backend, torch, device: str, n: int = 4096, reps: int = 10) -> dict:
    rng = np.random.default_rng(0)
    a_h = rng.random((n, n), dtype=np.float32)
    b_h = rng.random((n, n), dtype=np.float32)
    ta, tb, tc = (lp.SharedTensor.from_numpy(m) for m in (a_h, b_h, np.zeros((n, n), np.float32)))
    a, b = ta.read(backend), tb.read(backend)
    c = tc.write(backend)

    def l_step():
        backend.gemm(a, False, b, False, c)

    flops = 2 * n ** 3
    l_step()
    ms = min(timed(l_step, backend.synchronize, reps) for _ in range(3))
    row = {"gemm": n, "leafpy_tflops": flops / ms / 1e9}
    if backend.name == "native":
        ref = np.empty((n, n), np.float32)
        np_ms = min(timed(lambda: np.matmul(a_h, b_h, out=ref), lambda: None, reps) for _ in range(3))
        row["numpy_tflops"] = flops / np_ms / 1e9
        row["of_numpy"] = row["leafpy_tflops"] / row["numpy_tflops"]
    if torch is not None:
        at, bt = torch.from_numpy(a_h).to(device), torch.from_numpy(b_h).to(device)
        sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
        t_ms = min(timed(lambda: torch.mm(at, bt), sync, reps) for _ in range(3))
        row["torch_tflops"] = flops / t_ms / 1e9
    ct = tc.to_numpy()
    err = float(np.abs(ct[:64, :64] - a_h[:64] @ b_h[:, :64]).max() / np.abs(ct[:64, :64]).max())
    row["max_rel_error"] = err
    return row


def main() -> int:
    global SETTLE_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="native", choices=lp.backends.BACKEND_NAMES)
    p.add_argument("--vs", choices=["torch", "none"], default="torch")
    p.add_argument("--nets", default="", help="comma-separated subset of " + ", ".join(NETWORKS))
    p.add_argument("--rules", default="momentum", help="comma-separated subset of " + ", ".join(RULES))
    p.add_argument("--steps", type=int, default=0, help="steps per timing round (default: by batch size)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for both frameworks")
    p.add_argument("--tf32", action="store_true", help="let both frameworks use TF32 tensor cores (cuda)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="training precision of both frameworks: leafpy's precision setting; PyTorch's autocast to "
                        "bf16/fp16 (GradScaler for fp16) with channels-last convolutions, or TF32 switches")
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--conv-tolerance", type=conv_tolerance, default="default",
                   help="cuda: the backend's conv_tolerance (a number, or 'any' for any fp32 plan, as PyTorch's "
                        "cudnn.benchmark; default: the backend's)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set one of leafpy's backend tuning attributes first (as profile_layers.py's --set)")
    p.add_argument("--channels-last", action="store_true",
                   help="leafpy stores 4-D tensors NHWC (the backend's channels_last option; native and cuda)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds to wait before each timed round, so the other framework's idle threads sleep "
                        "(default: 0.3 on native, 0 on GPU backends, whose clocks drop while idle)")
    args = p.parse_args()
    SETTLE_S = args.settle if args.settle is not None else (0.3 if args.backend == "native" else 0.0)

    options: dict = {"precision": args.precision} if args.precision != "fp32" else {}
    if args.backend == "cuda" and args.tf32:
        options["tf32"] = True
    if args.backend == "cuda" and args.conv_tolerance != "default":
        options["conv_tolerance"] = args.conv_tolerance
    if args.backend != "webgpu":  # stated either way: the cuda backend's default depends on the precision
        options["channels_last"] = args.channels_last
    backend = lp.backend(args.backend, **options)
    set_attributes(backend, args.set, p.error)
    device = "cpu" if args.backend == "native" else "cuda"
    torch = None
    if args.vs == "torch":
        import torch
        torch.set_num_threads(args.threads)
    limiter = None
    try:
        from threadpoolctl import threadpool_limits
        limiter = threadpool_limits(args.threads)
    except ImportError:
        print("# threadpoolctl is not installed: numpy's BLAS keeps its own thread count (pip install threadpoolctl)")
    names = [n for n in (args.nets.split(",") if args.nets else NETWORKS) if n]
    rules = [r for r in args.rules.split(",") if r]
    unknown = [x for x in names if x not in NETWORKS] + [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"unknown network or rule {unknown[0]!r}: networks {', '.join(NETWORKS)}; rules {', '.join(RULES)}")
    if device == "cpu":
        names = [n for n in names if n not in GPU_ONLY]
    rows = []
    if args.precision != "fp32":
        print(f"# precision {args.precision} in both frameworks")
    if args.channels_last:
        print("# leafpy stores 4-D tensors channels-last")
    print(f"# leafpy {args.backend} vs {args.vs} on {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__ if torch else '-'}, numpy {np.__version__}")
    gpu = device == "cuda"
    issue_head = f"{'(issue)':>9}" if gpu else ""
    print(f"{'network':<12}{'rule':>9}{'batch':>6}{'leafpy ms':>11}{issue_head}{'torch ms':>10}{'torch/leafpy':>14}"
          f"{'leafpy MB':>11}{'torch MB':>10}{'loss@10 leafpy':>16}{'loss@10 torch':>15}")
    for name, rule in [(n, r) for n in names for r in rules]:
        r = bench_network(name, backend, torch, device, args, rule)
        rows.append(r)
        f = lambda k, fmt: (format(r[k], fmt) if k in r else "n/a")  # noqa: E731
        issue_cell = f"{f('leafpy_issue_ms', '.2f'):>9}" if gpu else ""
        print(f"{name:<12}{rule:>9}{r['batch']:>6}{f('leafpy_ms', '.2f'):>11}{issue_cell}{f('torch_ms', '.2f'):>10}"
              f"{f('ratio', '.2f'):>14}{f('leafpy_peak_mb', '.0f'):>11}{f('torch_peak_mb', '.0f'):>10}"
              f"{f('leafpy_loss10', '.5f'):>16}{f('torch_loss10', '.5f'):>15}", flush=True)
    peak = tensor_core_peak() if args.backend == "cuda" and args.precision in ("bf16", "fp16") else None
    if peak:
        print(f"# of the GPU's {args.precision} tensor-core peak ({peak / 1e12:.0f} TFLOP/s dense), counting 3 "
              "products per layer: " + ", ".join(
                  f"{r['network']} {r['tflops']:.1f} TFLOP/s = {r['tflops'] * 1e12 / peak:.1%}" for r in rows))
    if not args.no_gemm:
        g = bench_gemm(backend, torch, device)
        rows.append(g)
        for r in rows:
            if r.get("network", "").startswith("mlp") and r.get("rule") == "momentum":
                # forward, weight gradients, and input gradients of every layer but the first
                dims = [784, 512, 512, 10]
                macs = sum(a * b for a, b in zip(dims, dims[1:]))
                flops = 2 * r["batch"] * (3 * macs - dims[0] * dims[1])
                r["leafpy_gflops"] = flops / r["leafpy_ms"] / 1e6
                r["of_sgemm"] = r["leafpy_gflops"] / (g["leafpy_tflops"] * 1000)
                print(f"{r['network']}: {r['leafpy_gflops']:.1f} GFLOP/s in the training step, "
                      f"{r['of_sgemm']:.0%} of the SGEMM rate")
        extra = f", numpy {g['numpy_tflops']:.3f} ({g['of_numpy']:.0%} of numpy)" if "numpy_tflops" in g else ""
        extra += f", torch {g['torch_tflops']:.3f}" if "torch_tflops" in g else ""
        print(f"SGEMM 4096: leafpy {g['leafpy_tflops']:.3f} TFLOP/s{extra}; max rel error {g['max_rel_error']:.1e}")
    if limiter is not None:
        limiter.unregister() if hasattr(limiter, "unregister") else None
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
