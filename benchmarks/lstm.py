"""LSTM training-step benchmark: leafpy against PyTorch's nn.LSTM (cuDNN on the GPU), side by side in one process.

The network: two stacked LSTM layers (the first returning every step, the second its last step) over batch-first
sequences, then Linear and LogSoftmax, trained with NegativeLogLikelihood and momentum SGD. Both frameworks start
from identical weights (PyTorch's b_hh is held at zero and frozen, since leafpy's one bias stands for b_ih + b_hh)
and train on identical batches; steps are timed alternately as in train_step.py (whole steps, GPU-synchronised,
cudnn.benchmark on). The table reports milliseconds per step, torch/leafpy (above 1: leafpy is faster), and both
losses after 10 identical steps, so a speed win cannot hide a wrong result.

    python benchmarks/lstm.py --backend cuda --vs torch            # 2 layers, hidden 512, sequence 64, batch 64
    python benchmarks/lstm.py --backend native --vs torch --small  # a quick CPU run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step  # noqa: E402  (timing, settling and the solver, shared with the other benchmarks)

import leafpy as lp  # noqa: E402

FULL = {"layers": 2, "hidden": 512, "steps": 64, "batch": 64, "input": 128, "classes": 10}
SMALL = {"layers": 2, "hidden": 64, "steps": 16, "batch": 16, "input": 32, "classes": 10}


def lstm_config(s: dict) -> lp.LayerConfig:
    cfg = lp.SequentialConfig(inputs=[("data", [s["batch"], s["steps"], s["input"]])])
    for i in range(s["layers"]):
        last = i == s["layers"] - 1
        cfg.add_layer(lp.LayerConfig(f"lstm{i}", lp.LSTMConfig(hidden_size=s["hidden"], return_sequences=not last)))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=s["classes"])))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return lp.LayerConfig("lstm", cfg)


def torch_lstm(torch, s: dict, initial: list[np.ndarray]) -> Any:
    """The same network in PyTorch with leafpy's initial weights (log-probabilities of the last step)."""
    nn = torch.nn

    class LSTMClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(s["input"], s["hidden"], num_layers=s["layers"], batch_first=True)
            self.fc = nn.Linear(s["hidden"], s["classes"])

        def forward(self, x):
            out, _ = self.lstm(x)
            return torch.log_softmax(self.fc(out[:, -1]), dim=1)

    model = LSTMClassifier()
    w = iter(initial)
    with torch.no_grad():
        for i in range(s["layers"]):
            getattr(model.lstm, f"weight_ih_l{i}").copy_(torch.from_numpy(next(w)))
            getattr(model.lstm, f"weight_hh_l{i}").copy_(torch.from_numpy(next(w)))
            getattr(model.lstm, f"bias_ih_l{i}").copy_(torch.from_numpy(next(w)))
            getattr(model.lstm, f"bias_hh_l{i}").zero_()
            getattr(model.lstm, f"bias_hh_l{i}").requires_grad_(False)
        model.fc.weight.copy_(torch.from_numpy(next(w)))
        model.fc.bias.copy_(torch.from_numpy(next(w)))
    return model


def bench(backend, torch, device: str, s: dict, args) -> dict:
    rng = np.random.default_rng(0)
    shape = (s["batch"], s["steps"], s["input"])
    xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
    ys = [rng.integers(0, s["classes"], s["batch"]) for _ in range(4)]
    solver = train_step.leafpy_solver(backend, lstm_config(s), s["batch"], s["classes"])
    initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    data_l = [(lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(y.astype(np.float32)))
              for x, y in zip(xs, ys)]
    row: dict = {"network": f"lstm{s['layers']}x{s['hidden']}", **s}
    for i in range(10):
        solver.train_minibatch(*data_l[i % 4])
    row["leafpy_loss10"] = solver.loss()
    trainer = None
    if torch is not None:
        trainer = train_step.TorchTrainer(torch, torch_lstm(torch, s, initial), device, args.tf32)
        data_t = [trainer.to_device(x, y) for x, y in zip(xs, ys)]
        for i in range(10):
            trainer.step(*data_t[i % 4])
        row["torch_loss10"] = trainer.loss()
    lt, tt, _ = train_step.side_by_side(solver, data_l, trainer, data_t if trainer else [], backend, args.n, args)
    row["leafpy_ms"] = statistics.median(lt)
    if trainer:
        row["torch_ms"] = statistics.median(tt)
        row["ratio"] = row["torch_ms"] / row["leafpy_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="native", choices=lp.backends.BACKEND_NAMES)
    p.add_argument("--vs", choices=["torch", "none"], default="torch")
    p.add_argument("--small", action="store_true", help="hidden 64, sequence 16, batch 16, input 32 (quick on a CPU)")
    p.add_argument("--n", type=int, default=10, help="steps per timing round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tf32", action="store_true", help="let both frameworks use TF32 tensor cores (cuda)")
    p.add_argument("--settle", type=float, default=None, help="seconds before each timed round (see train_step.py)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    train_step.SETTLE_S = args.settle if args.settle is not None else (0.3 if args.backend == "native" else 0.0)
    options = {"tf32": True} if args.backend == "cuda" and args.tf32 else {}
    backend = lp.backend(args.backend, **options)
    device = "cpu" if args.backend == "native" else "cuda"
    torch = None
    if args.vs == "torch":
        import torch
    s = SMALL if args.small else FULL
    print(f"# leafpy {args.backend} vs {args.vs} on {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__ if torch else '-'}: {s['layers']}-layer LSTM, hidden {s['hidden']}, sequence "
          f"{s['steps']}, batch {s['batch']}, input {s['input']}")
    r = bench(backend, torch, device, s, args)
    f = lambda k, fmt: (format(r[k], fmt) if k in r else "n/a")  # noqa: E731
    print(f"{'network':<12}{'leafpy ms':>11}{'torch ms':>10}{'torch/leafpy':>14}{'loss@10 leafpy':>16}"
          f"{'loss@10 torch':>15}")
    print(f"{r['network']:<12}{f('leafpy_ms', '.2f'):>11}{f('torch_ms', '.2f'):>10}{f('ratio', '.2f'):>14}"
          f"{f('leafpy_loss10', '.5f'):>16}{f('torch_loss10', '.5f'):>15}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "rows": [r]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
