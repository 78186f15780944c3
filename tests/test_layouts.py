"""Arrays of the declared size in another layout (channels-last images, transposed gradients) are ShapeErrors
that say which transpose fits, in the API and in the leafpy command; layouts that only differ by axes of length
1 at the end, or images into a flat input, still run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cli import accuracy, run

import leafpy as lp


def _conv_net(channels=3):
    cfg = lp.SequentialConfig(inputs=[("data", [4, channels, 6, 6])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[3])))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    return lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)


def test_channels_last_images_are_refused_with_the_transpose_that_fits():
    net = _conv_net()
    x = np.random.default_rng(0).standard_normal((4, 3, 6, 6)).astype(np.float32)
    with pytest.raises(lp.ShapeError, match=r"got \(4, 6, 6, 3\).*x\.transpose\(0, 3, 1, 2\)"):
        net.forward([x.transpose(0, 2, 3, 1)])
    with pytest.raises(lp.ShapeError, match=r"declared \[4, 3, 6, 6\]\), got \(4, 108\).*x\.reshape"):
        net.forward([x.reshape(4, -1)])
    # the suggested transpose gives what the channels-first array gives
    a = net.forward([x])[0].to_numpy()
    b = net.forward([np.ascontiguousarray(x.transpose(0, 2, 3, 1).transpose(0, 3, 1, 2))])[0].to_numpy()
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_transposed_gradient_is_refused():
    net = _conv_net()
    net.forward([np.zeros((4, 3, 6, 6), np.float32)])
    with pytest.raises(lp.ShapeError, match=r"must have shape \(4, 3\), got \(3, 4\).*g\.T"):
        net.backward([np.ones((3, 4), np.float32)])
    net.backward([np.ones((4, 3, 1), np.float32)])  # a trailing axis of length 1 is the same layout


def test_labels_and_flat_inputs_keep_working():
    cfg = lp.SequentialConfig(inputs=[("data", [5, 16])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("mlp", cfg), seed=0)
    x = np.random.default_rng(1).standard_normal((5, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), net.forward([x.reshape(5, 16)])[0].to_numpy())
    obj = lp.SequentialConfig(inputs=[("out", [5, 3]), ("label", [5, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    loss = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("loss", obj))
    logp = np.log(np.full((5, 3), 1 / 3, np.float32))
    out = loss.forward([logp, np.array([0, 1, 2, 0, 1])])[0].to_numpy()  # labels [N] for [N, 1]
    np.testing.assert_allclose(out.reshape(-1)[0], np.log(3), rtol=1e-6)


def test_the_command_refuses_channels_last_images_before_training(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "images.npz", x=rng.random((40, 6, 6, 3)).astype(np.float32), y=rng.integers(0, 3, 40))
    (tmp_path / "run.yaml").write_text(f"""
name: layout
data: {{dataset: npz, path: {tmp_path / 'images.npz'}, batch_size: 8, test_fraction: 0.25}}
train: {{epochs: 1}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [8, 3, 6, 6]}}]
  layers:
    - {{name: conv, type: Convolution, num_output: 2, filter_shape: [3]}}
    - {{name: flat, type: Flatten}}
    - {{name: fc, type: Linear, output_size: 3}}
    - {{name: logsm, type: LogSoftmax}}
objective:
  type: Sequential
  inputs: [{{name: out, shape: [8, 3]}}, {{name: label, shape: [8, 1]}}]
  layers: [{{name: nll, type: NegativeLogLikelihood, num_classes: 3}}]
solver: {{solver: momentum, base_lr: 0.01, momentum: 0.9}}
""")
    p = run("train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out"))
    assert p.returncode != 0
    assert "x.transpose(0, 3, 1, 2)" in p.stderr and "[6, 6, 3]" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out" / "model.leaf").exists()


CHANNELS_LAST_RUN = """\
# written by hand: every layer kind that sees 4-D tensors, a concatenation over channels, a schedule and Adam
# (no bias before BatchNorm: its gradient is zero but for rounding, which Adam would turn into steps)
name: layouts
data: {dataset: digits, batch_size: 24, test_fraction: 0.25, seed: 3}
train: {epochs: 1}
network:
  type: Sequential
  inputs: [{name: data, shape: [24, 1, 8, 8]}]
  layers:
    - {name: conv1, type: Convolution, num_output: 6, filter_shape: [3], padding: [1], bias: false}
    - {name: bn1, type: BatchNorm}
    - {name: relu1, type: ReLU, outputs: [r1]}
    - {name: side, type: Convolution, num_output: 3, filter_shape: [1], inputs: [r1], outputs: [side]}
    - {name: cat, type: Concat, inputs: [r1, side], outputs: [cat]}
    - {name: lrn, type: LRN, local_size: 3}
    - {name: pool1, type: Pooling, mode: max, filter_shape: [2], stride: [2]}
    - {name: conv2, type: Convolution, num_output: 8, filter_shape: [3], stride: [1], padding: [1]}
    - {name: relu2, type: ReLU}
    - {name: pool2, type: Pooling, mode: average, filter_shape: [2], stride: [2]}
    - {name: flat, type: Flatten}
    - {name: fc, type: Linear, output_size: 10}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [24, 10]}, {name: label, shape: [24, 1]}]
  layers:
    - {name: nll, type: NegativeLogLikelihood, num_classes: 10}
solver: {solver: adam, base_lr: 0.01, lr_policy: step, stepsize: 20, gamma: 0.5, weight_decay: 0.0001, seed: 1}
"""


def _history(out):
    import json

    return json.loads((out / "history.json").read_text())


def test_leafpy_train_channels_last_matches_row_major_and_its_files_mean_the_same(tmp_path):
    """``train.channels_last`` through the leafpy command: the same losses as the row-major run, a model file that
    evaluates to the same accuracy on the row-major backend, and a row-major checkpoint resumed channels-last."""
    run_file = tmp_path / "layouts.yaml"
    run_file.write_text(CHANNELS_LAST_RUN)
    outs = {}
    for name, extra in (("rows", []), ("nhwc", ["--set", "train.channels_last=true"])):
        outs[name] = tmp_path / name
        p = run("train", str(run_file), "--out", str(outs[name]), "--epochs", "2", *extra)
        assert p.returncode == 0, p.stderr
        assert ("on native (channels-last)" in p.stdout) == (name == "nhwc"), p.stdout.splitlines()[0]
        outs[name + "_acc"] = accuracy(p.stdout)
    a, b = _history(outs["rows"]), _history(outs["nhwc"])
    assert len(a) == len(b) == 2
    for ea, eb in zip(a, b):
        assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-4)
        assert eb["test_loss"] == pytest.approx(ea["test_loss"], rel=1e-4)
    # the channels-last run's model, evaluated row-major (the saved weights are in the file's own order)
    e = run("evaluate", str(run_file), "--weights", str(outs["nhwc"] / "model.leaf"))
    assert e.returncode == 0, e.stderr
    assert accuracy(e.stdout) == pytest.approx(outs["nhwc_acc"], abs=1e-9)
    # one epoch row-major, the second channels-last: where two row-major epochs end
    resumed = tmp_path / "resumed"
    p = run("train", str(run_file), "--out", str(resumed), "--epochs", "1")
    assert p.returncode == 0, p.stderr
    p = run("train", str(run_file), "--out", str(resumed), "--epochs", "2", "--resume",
            str(resumed / "checkpoint.leaf"), "--set", "train.channels_last=true")
    assert p.returncode == 0, p.stderr
    native = lp.backend("native")
    ends = [lp.Solver.load_checkpoint(native, native, d / "checkpoint.leaf") for d in (outs["rows"], resumed)]
    assert ends[0].iteration == ends[1].iteration
    for name, w0, w1 in zip(ends[0].network.learnable_weights_names(), ends[0].network.learnable_weights_data(),
                            ends[1].network.learnable_weights_data()):
        np.testing.assert_allclose(w1.to_numpy(), w0.to_numpy(), rtol=1e-3, atol=1e-5, err_msg=name)


def test_channels_last_option_is_checked():
    with pytest.raises(lp.ConfigError, match="channels_last must be true or false"):
        lp.backend("native", channels_last="yes")
    with pytest.raises(lp.ConfigError, match=r"webgpu.*'channels_last' \(this backend stores tensors row-major only"):
        lp.backend("webgpu", channels_last=True)
    with pytest.raises(lp.ConfigError, match=r"train\.channels_last: expected true or false"):
        lp.config.loads(CHANNELS_LAST_RUN.replace("train: {epochs: 1}", "train: {epochs: 1, channels_last: 1}"))


def test_the_default_layout_follows_the_precision_and_row_major_is_every_backends():
    """channels_last None is the backend's default for the precision (native: row-major in every precision);
    channels_last=False is accepted by every backend, the ones that only store row-major included."""
    from leafpy.backends import precision_option

    for precision in ("fp32", "bf16", "fp16"):
        assert lp.backend("native", precision=precision, channels_last=None).channels_last is False
    assert lp.backend("native", channels_last=False) is lp.backend("native")  # the shared default instance
    assert precision_option("fp32") == {}
    assert precision_option("bf16", None) == {"precision": "bf16"}
    assert precision_option("fp32", False) == {"channels_last": False}
    try:
        webgpu = lp.backend("webgpu", channels_last=False)
    except lp.BackendUnavailable as e:
        pytest.skip(f"no webgpu adapter here: {e}")
    assert webgpu is lp.backend("webgpu") and not webgpu.channels_last
    with pytest.raises(lp.ConfigError, match="unknown option 'channels_last'"):
        lp.backend("webgpu", channels_last=0)  # only true or false state a layout


def test_leafpy_train_records_a_stated_row_major_layout(tmp_path):
    """A run file that states ``train.channels_last: false`` keeps saying so in run.yaml (a resume then stores
    tensors as the interrupted run did, whatever the backend's default for its precision)."""
    import yaml

    run_file = tmp_path / "rows.yaml"
    run_file.write_text(CHANNELS_LAST_RUN.replace("train: {epochs: 1}", "train: {epochs: 1, channels_last: false}"))
    out = tmp_path / "out"
    p = run("train", str(run_file), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load((out / "run.yaml").read_text())["train"]["channels_last"] is False
    plain = tmp_path / "plain.yaml"
    plain.write_text(CHANNELS_LAST_RUN)
    p = run("train", str(plain), "--out", str(tmp_path / "plain"))
    assert p.returncode == 0, p.stderr
    assert "channels_last" not in yaml.safe_load((tmp_path / "plain" / "run.yaml").read_text())["train"]


@pytest.mark.cuda
def test_cuda_stores_16_bit_tensors_channels_last_by_default():
    from conftest import backend_or_skip

    backend_or_skip("cuda")
    assert lp.backend("cuda", precision="bf16").channels_last
    assert lp.backend("cuda", precision="fp16").channels_last
    assert not lp.backend("cuda").channels_last and not lp.backend("cuda", precision="tf32").channels_last
    assert not lp.backend("cuda", precision="bf16", channels_last=False).channels_last


def test_channels_last_storage_keeps_its_values_through_aliases_and_reshapes():
    """A tensor's values, whatever shape it is seen with on a channels-last backend: written as [N, C, H, W], read
    through an alias [N, C*H*W], written through it, read back 4-D, reshaped to another 4-D shape, and downloaded:
    always the row-major values NumPy gives for the same reshapes."""
    be = lp.backend("native", channels_last=True)
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    t = lp.SharedTensor((2, 3, 4, 5))
    be.copy(be.view(np.ascontiguousarray(ref.transpose(0, 2, 3, 1)).reshape(-1), (2, 3, 4, 5)), t.write(be))
    assert t.read(be).strides != np.empty((2, 3, 4, 5), np.float32).strides  # stored NHWC
    flat = t.alias((2, 60))
    np.testing.assert_array_equal(np.asarray(flat.read(be)), ref.reshape(2, 60))
    flat.read_write(be)[:, :7] *= -1.0  # written through the alias: the storage is row-major for [2, 60] now
    ref.reshape(2, 60)[:, :7] *= -1.0
    np.testing.assert_array_equal(t.read(be), ref)  # and NHWC again, converted on the device
    other = t.alias((2, 6, 2, 5))  # another 4-D shape of the same storage
    np.testing.assert_array_equal(other.read(be), ref.reshape(2, 6, 2, 5))
    np.testing.assert_array_equal(other.to_numpy(), ref.reshape(2, 6, 2, 5))
    np.testing.assert_array_equal(t.to_numpy(), ref)
    # a host change reaches the device copy in the device's order
    t.set(ref * 2)
    np.testing.assert_array_equal(t.read(be), ref * 2)
    np.testing.assert_array_equal(flat.read(be), (ref * 2).reshape(2, 60))


def test_channels_last_relayout_stays_on_the_device():
    """Seeing a 4-D tensor with another shape converts it on the backend, not through the host."""
    be = lp.backend("native", channels_last=True)
    t = lp.SharedTensor((2, 3, 2, 2))
    be.fill(1.5, t.write(be))
    lp.SharedTensor.reset_transfer_count()
    alias = t.alias((2, 12))
    assert float(alias.read(be).sum()) == pytest.approx(1.5 * 24)
    t.read(be)
    assert lp.SharedTensor.transfers_total == 0


def test_channels_last_prefix_views_of_other_sizes_keep_their_values():
    """Views of a storage's first elements, of other sizes: a storage set whole and synced through a smaller
    view reads back whole; a view written on the device keeps its values through a read of a larger one; the
    elements past a smaller view's survive a write through it."""
    cl = lp.backend("native", channels_last=True)
    whole = lp.SharedTensor((4, 3, 2, 5))
    x = np.arange(whole.size, dtype=np.float32).reshape(whole.shape)
    whole.set(x)
    whole.prefix_view((2, 3, 2, 5)).read(cl)
    np.testing.assert_array_equal(np.asarray(whole.read(cl)), x)
    part = whole.prefix_view((1, 6, 2, 5))
    y = -np.arange(part.size, dtype=np.float32).reshape(part.shape)
    be_view = part.write(cl)
    be_view[...] = y
    whole.read(cl)
    np.testing.assert_array_equal(part.to_numpy(), y)
    small = whole.prefix_view((1, 2, 3, 5))
    z = np.full(small.shape, 7.0, np.float32)
    cl.copy(cl.view(np.ascontiguousarray(z.transpose(0, 2, 3, 1)).reshape(-1), small.shape), small.write(cl))
    want = np.concatenate([y.reshape(-1), x.reshape(-1)[part.size:]])
    want[:small.size] = 7.0
    np.testing.assert_array_equal(whole.to_numpy().reshape(-1), want)


def test_a_write_through_a_smaller_view_of_scratch_storage_rearranges_nothing(monkeypatch):
    """A container's shared gradient buffer is scratch: a smaller layer's gradient written through it on a
    channels-last backend moves no values of the earlier, larger one (they are dead), and its own values are
    what was written."""
    cl = lp.backend("native", channels_last=True)
    storage = lp.SharedTensor((1,))
    big = storage.prefix_view((4, 3, 4, 5), grow=True, scratch=True)
    big.set(np.ones(big.shape, np.float32))
    big.read(cl)
    calls = []
    relayout = cl.relayout
    monkeypatch.setattr(cl, "relayout", lambda *a: (calls.append(a), relayout(*a)))  # undone after the test
    small = storage.prefix_view((2, 3, 2, 5), grow=True, scratch=True)
    z = np.arange(small.size, dtype=np.float32).reshape(small.shape)
    cl.copy(cl.view(np.ascontiguousarray(z.transpose(0, 2, 3, 1)).reshape(-1), small.shape), small.write(cl))
    assert calls == []
    np.testing.assert_array_equal(small.to_numpy(), z)


def test_a_channels_last_training_step_rearranges_only_at_the_flatten(monkeypatch):
    """LeNet on a channels-last backend: the shared gradient buffers are not rearranged between layers of
    other sizes (only the Flatten's two views are), and the weights after three steps are the row-major
    backend's."""
    def train(be):
        cfg = lp.SequentialConfig(inputs=[("data", [8, 1, 14, 14])])
        for layer in (lp.LayerConfig("c1", lp.ConvolutionConfig(num_output=4, filter_shape=[3])),
                      lp.LayerConfig("r1", "ReLU"),
                      lp.LayerConfig("p1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])),
                      lp.LayerConfig("c2", lp.ConvolutionConfig(num_output=6, filter_shape=[3])),
                      lp.LayerConfig("p2", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])),
                      lp.LayerConfig("flat", "Flatten"), lp.LayerConfig("fc", lp.LinearConfig(output_size=3)),
                      lp.LayerConfig("sm", "LogSoftmax")):
            cfg.add_layer(layer)
        obj = lp.SequentialConfig(inputs=[("out", [8, 3]), ("label", [8, 1])])
        obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
        solver = lp.Solver.from_config(be, be, lp.SolverConfig(
            network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj), solver="momentum",
            base_lr=0.1, momentum=0.9, seed=1))
        net = solver.network
        rng = np.random.default_rng(2)
        x = rng.standard_normal((8, 1, 14, 14)).astype(np.float32)
        y = rng.integers(0, 3, (8, 1)).astype(np.float32)
        calls = []
        relayout = be.relayout
        monkeypatch.setattr(be, "relayout", lambda buf, old, new: (calls.append((old, new)), relayout(buf, old, new)))
        for _ in range(3):
            del calls[:]
            solver.train_minibatch(x, y)
        return [w.to_numpy() for w in net.learnable_weights_data()], calls

    row_major, _ = train(lp.backend("native"))
    weights, calls = train(lp.backend("native", channels_last=True))
    assert sorted(calls) == [((8, 6, 2, 2), (8, 24)), ((8, 24), (8, 6, 2, 2))]
    for a, b in zip(weights, row_major):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_backends_of_two_memory_orders_keep_separate_copies():
    """A copy's memory order follows from its backend key: a row-major and a channels-last backend of one
    device never share a copy."""
    rm, cl = lp.backend("native"), lp.backend("native", channels_last=True)
    assert rm.key != cl.key
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    t = lp.SharedTensor.from_numpy(x)
    t.read(cl)
    np.testing.assert_array_equal(np.asarray(t.read(rm)), x)
    t.read_write(cl)[...] *= 2  # written on the channels-last copy: the host copy is synced from it
    np.testing.assert_array_equal(np.asarray(t.read(rm)), 2 * x)


def test_run_yaml_leaves_a_default_layout_to_the_backend_that_runs_it(monkeypatch):
    """A run in its backend's default layout for the precision (cuda: channels-last for bf16, imitated here on
    native) records no layout in run.yaml: ``leafpy evaluate --backend webgpu`` (row-major only) or a resume in
    another precision then runs in that backend's default, instead of meeting a channels_last nobody stated. A
    layout other than the default, or one the run file states, is recorded."""
    from leafpy.backends.native import NativeBackend

    monkeypatch.setattr(NativeBackend, "CHANNELS_LAST_PRECISIONS", ("bf16",))
    run = lp.config.loads(CHANNELS_LAST_RUN.replace("train: {epochs: 1}", "train: {epochs: 1, precision: bf16}"))

    def recorded(train: dict, backend: lp.Backend) -> object:
        stated = dataclasses.replace(run, train={**run.train, **train})
        trainer = lp.Trainer(stated, backend=backend, log=lambda line: None)
        return trainer.resolved_run().train.get("channels_last", "absent")

    default = lp.backend("native", precision="bf16", channels_last=None)
    assert default.channels_last  # the imitated 16-bit default
    assert recorded({}, default) == "absent"
    assert recorded({"channels_last": True}, default) is True
    rows = lp.backend("native", precision="bf16", channels_last=False)
    assert recorded({}, rows) is False and recorded({"channels_last": False}, rows) is False
    assert recorded({}, lp.backend("native", channels_last=True)) is True  # fp32's default is row-major
    assert recorded({"channels_last": False}, lp.backend("native")) is False
