"""Run under ``mpiexec -n N``: data-parallel training of a small network, for tests/test_distributed.py.

    python tests/distributed_worker.py equivalence OUT.npz RULE BATCH STEPS [--accumulate K] [--clip C]
        [--batch-norm] [--sync-batch-norm]
        [--precision bf16|fp16]
    python tests/distributed_worker.py fail OUT_DIR [raise|kill]
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import leafpy as lp
from leafpy import distributed as dist


def problem(n: int = 97, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(np.float32) + (x[:, 3] > 1)
    return x, y


def solver_config(rule: str, batch: int, accumulate: int = 1, clip: float | None = None,
                  batch_norm: bool = False, frozen: bool = False) -> lp.SolverConfig:
    """A small classifier; ``frozen``: its first layer's weights with lr_mult 0 (fine-tuning the rest)."""
    net = lp.SequentialConfig(inputs=[("data", [batch, 6])])
    # before a BatchNorm a bias has no gradient but rounding noise (which Adam would scale up): none there
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=16, bias=not batch_norm),
                                 params=[lp.WeightConfig(lr_mult=0.0)] * (2 if frozen else 0)))
    if batch_norm:
        net.add_layer(lp.LayerConfig("bn1", lp.BatchNormConfig(momentum=0.2)))
    net.add_layer(lp.LayerConfig("act", "TanH"))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("out", [batch, 3]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    base_lr = {"adadelta": 1.0, "adam": 0.01, "rmsprop": 0.01, "adagrad": 0.05}.get(rule, 0.1)
    return lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                           solver=rule, base_lr=base_lr, momentum=0.9, lr_policy="step", gamma=0.5, stepsize=4,
                           weight_decay=1e-3, clip_gradients=clip, minibatch_size=accumulate, seed=3)


def equivalence(out: str, rule: str, batch: int, steps: int, accumulate: int, clip: float | None,
                backend: str = "native", batch_norm: bool = False, sync_batch_norm: bool = False,
                precision: str = "fp32", frozen: bool = False) -> None:
    group = dist.init()
    with dist.failing_rank_ends_the_job(group):
        be = lp.backend(backend, **({"precision": precision} if precision != "fp32" else {}))
        solver = lp.Solver.from_config(be, be, solver_config(rule, batch, accumulate, clip, batch_norm, frozen))
        if group.rank != 0:  # other ranks start elsewhere: DataParallel must give them rank 0's weights
            for w in solver.network.learnable_weights_data():
                w.set(np.full(w.shape, 0.5, np.float32))
        # a bucket per weight: several start early
        dp = dist.DataParallel(solver, group, bucket_bytes=64, sync_batch_norm=sync_batch_norm)
        x, y = problem()
        done, epoch = 0, 0
        while done < steps * accumulate:
            for xb, yb in dist.shard_batches(x, y, batch, group, seed=7, epoch=epoch):
                dp.train_minibatch(xb, yb)
                done += 1
                if done == steps * accumulate:
                    break
            epoch += 1
        weights = {f"w{i}": w.to_numpy() for i, w in enumerate(solver.network.learnable_weights_data())}
        np.savez(f"{out}.rank{group.rank}.npz", iteration=solver.iteration, transport=dp.transport.name,
                 overlapped=dp.overlapped, skipped=solver.skipped_steps, **weights)


def stop_mid_accumulation(run_path: str, out: str) -> None:
    """A stop on rank 0 after the second call of the first epoch, as a stop signal sets it: the ranks agree on it
    with the third call's loss and stop there (minibatch_size 2: one call pending); rank 0 writes the checkpoint."""
    group = dist.init()
    with dist.failing_rank_ends_the_job(group):
        class Stop(lp.Callback):
            def on_batch_end(self, trainer, epoch, batch, loss):
                if group.rank == 0 and (epoch, batch) == (0, 1):
                    trainer.interrupted = True

        trainer = lp.Trainer(lp.config.load(run_path), out_dir=out, callbacks=[Stop()], group=group,
                             log=lambda m: None)
        try:
            trainer.fit()
        except lp.train.TrainingInterrupted:
            pass


def dropout_masks(out: str) -> None:
    """Each rank's dropout mask after two steps of a network with dropout."""
    group = dist.init()
    with dist.failing_rank_ends_the_job(group):
        be = lp.backend("native")
        cfg = solver_config("momentum", 8)
        cfg.network.config.layers.insert(2, lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5)))
        solver = lp.Solver.from_config(be, be, cfg)
        dp = dist.DataParallel(solver, group)
        x, y = problem()
        for xb, yb in list(dist.shard_batches(x, y, 8, group, seed=1))[:2]:
            dp.train_minibatch(xb, yb)
        drop = next(w for w in solver.network.workers() if hasattr(w, "draws_random"))
        np.save(f"{out}.rank{group.rank}.npy", np.asarray(drop.mask))


def fail(out_dir: str, how: str = "raise") -> None:
    """Rank 1 fails at its third step: ``how`` "raise" (an exception) or "kill" (SIGKILL, no Python left to
    report it); the other rank is then waiting in the gradients' all-reduce."""
    group = dist.init()
    with dist.failing_rank_ends_the_job(group):
        be = lp.backend("native")
        solver = lp.Solver.from_config(be, be, solver_config("momentum", 8))
        dp = dist.DataParallel(solver, group)
        x, y = problem()
        for i, (xb, yb) in enumerate(dist.shard_batches(x, y, 8, group, seed=1)):
            if i == 2 and group.rank == 1:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise lp.ConfigError("a deliberate failure on rank 1")
            dp.train_minibatch(xb, yb)
        open(f"{out_dir}/finished.rank{group.rank}", "w").close()


if __name__ == "__main__":
    if sys.argv[1] == "equivalence":
        args = sys.argv[2:]
        acc = int(args[args.index("--accumulate") + 1]) if "--accumulate" in args else 1
        clip = float(args[args.index("--clip") + 1]) if "--clip" in args else None
        backend = args[args.index("--backend") + 1] if "--backend" in args else "native"
        precision = args[args.index("--precision") + 1] if "--precision" in args else "fp32"
        equivalence(args[0], args[1], int(args[2]), int(args[3]), acc, clip, backend, "--batch-norm" in args,
                    "--sync-batch-norm" in args, precision, "--frozen" in args)
    elif sys.argv[1] == "stop":
        stop_mid_accumulation(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "dropout":
        dropout_masks(sys.argv[2])
    elif sys.argv[1] == "fail":
        fail(sys.argv[2], *sys.argv[3:4])
