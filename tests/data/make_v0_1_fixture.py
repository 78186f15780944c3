"""Run as ``python make_v0_1_fixture.py LEAFPY_TREE OUT_DIR`` with LEAFPY_TREE a checkout of commit 9305875.

Writes tests/data/v0_1_checkpoint.leaf with the leafpy of commit 9305875 (the code before recorded steps read
their rate from a device buffer): an MLP with dropout trained 4 steps with Nesterov under Caffe's inv schedule,
and the weights that code reached after 4 more steps (tests/data/v0_1_continued.npz)."""

import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import leafpy as lp  # noqa: E402

be = lp.backend("native")
cfg = lp.SequentialConfig(inputs=[("data", [16, 64])])
cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=24)))
cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
cfg.add_layer(lp.LayerConfig("drop1", lp.DropoutConfig(ratio=0.3)))
cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
obj = lp.SequentialConfig(inputs=[("out", [16, 10]), ("label", [16, 1])])
obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
sol = lp.SolverConfig(network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj), solver="nesterov",
                      base_lr=0.1, momentum=0.9, lr_policy="inv", gamma=0.1, power=0.75, weight_decay=1e-3, seed=4)
rng = np.random.default_rng(0)
x = rng.standard_normal((8, 16, 64)).astype(np.float32)
y = rng.integers(0, 10, (8, 16)).astype(np.float32)
s = lp.Solver.from_config(be, be, sol)
for i in range(4):
    s.train_minibatch(x[i], y[i])
s.save_checkpoint(sys.argv[2] + "/v0_1_checkpoint.leaf")
for i in range(4, 8):
    s.train_minibatch(x[i], y[i])
np.savez(sys.argv[2] + "/v0_1_continued.npz", x=x, y=y,
         **{f"w{i}": w.to_numpy() for i, w in enumerate(s.network.learnable_weights_data())})
