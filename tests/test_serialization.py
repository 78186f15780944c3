"""Cap'n Proto models and checkpoints: round trips, Leaf 0.2.1 files, resume, bad files, atomic saves."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_gradients import CASES, nested_config
from test_leaf_files import LEAF_STRUCTS

import leafpy as lp
from leafpy import serialization


def _roundtrip(layer, path, backend, inputs):
    layer.save(path)
    loaded = lp.Layer.load(backend, path)
    loaded.set_training(layer.training)
    assert loaded.config == layer.config
    a = [o.to_numpy() for o in layer.forward(inputs)]
    b = [o.to_numpy() for o in loaded.forward(inputs)]  # a standalone layer's weights arrive with its shapes
    assert loaded.learnable_weights_names() == layer.learnable_weights_names()
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for w1, w2 in zip(layer.learnable_weights_data(), loaded.learnable_weights_data()):
        np.testing.assert_array_equal(w1.to_numpy(), w2.to_numpy())
    return loaded


@pytest.mark.parametrize("type_name", sorted(CASES))
def test_every_layer_type_round_trips(tmp_path, native, type_name):
    for k, (config, make_inputs) in enumerate(CASES[type_name]):
        layer = lp.Layer.from_config(native, lp.LayerConfig("l", config, params=[]), seed=1)
        layer.set_training(False)
        inputs = [x.astype(np.float32) for x in make_inputs(np.random.default_rng(0))]
        layer.forward(inputs)  # creates weights
        loaded = _roundtrip(layer, tmp_path / f"{type_name}{k}.leaf", native, inputs)
        assert loaded.config.type == type_name


def test_nested_network_round_trips_with_params(tmp_path, native):
    cfg = nested_config()
    cfg.layers[0] = lp.LayerConfig("conv", cfg.layers[0].config, params=[
        lp.WeightConfig(lr_mult=2.0, decay_mult=0.0, filler=lp.FillerConfig(type="gaussian", std=0.5)),
        lp.WeightConfig(name="shared_bias", filler=lp.FillerConfig(type="constant", value=0.1))])
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=4)
    x = np.random.default_rng(1).random((2, 1, 4, 4)).astype(np.float32)
    loaded = _roundtrip(net, tmp_path / "net.leaf", native, [x])
    assert loaded.learnable_weights_configs()[0].lr_mult == 2.0
    assert "block/fc_a/weight" in loaded.learnable_weights_names()


def test_standalone_layer_weights_apply_on_first_forward(tmp_path, native):
    layer = lp.Layer.from_config(native, lp.LayerConfig("fc", lp.LinearConfig(output_size=3)), seed=0)
    x = np.ones((2, 4), np.float32)
    y = layer.forward([x])[0].to_numpy()
    layer.save(tmp_path / "fc.leaf")
    loaded = lp.Layer.load(native, tmp_path / "fc.leaf")
    np.testing.assert_array_equal(loaded.forward([x])[0].to_numpy(), y)


# Leaf 0.2.1's structs and ordinals under another file id, so that it can be loaded beside leafpy's schema in this
# process (message bytes do not depend on the id)
LEAF_SCHEMA = "@0xc3a4e1f2b5d60718;\n" + LEAF_STRUCTS


def write_leaf_file(tmp_path, rng):
    """A network as Leaf 0.2.1 would save it: Reshape, Convolution (no bias), Pooling, ReLU, Linear (no bias),
    Sigmoid, with weights named "{layer}-{i}"."""
    import capnp

    schema_path = tmp_path / "leaf_021.capnp"
    schema_path.write_text(LEAF_SCHEMA)
    leaf = capnp.load(str(schema_path))
    msg = leaf.Layer.new_message()
    msg.name = "leafnet"
    cfg = msg.init("config")
    cfg.name = "leafnet"
    seq = cfg.layerType.init("sequential")
    ins = seq.init("inputs", 1)
    ins[0].name = "data"
    ins[0].shape = [2, 16]
    layers = seq.init("layers", 6)
    layers[0].name = "reshape"
    layers[0].layerType.init("reshape").shape = [2, 1, 4, 4]
    layers[1].name = "conv"
    conv = layers[1].layerType.init("convolution")
    conv.numOutput, conv.filterShape, conv.stride, conv.padding = 2, [3], [1], [0]
    layers[2].name = "pool"
    pool = layers[2].layerType.init("pooling")
    pool.mode, pool.filterShape, pool.stride, pool.padding = "max", [2], [2], [0]
    layers[3].name = "relu"
    layers[3].layerType.relu = None
    layers[4].name = "fc"
    layers[4].layerType.init("linear").outputSize = 3
    layers[5].name = "sig"
    layers[5].layerType.sigmoid = None
    conv_w = rng.standard_normal((2, 1, 3, 3)).astype(np.float32)
    fc_w = rng.standard_normal((3, 2)).astype(np.float32)
    weights = msg.init("weightsData", 2)
    for w, (name, arr) in zip(weights, (("conv-0", conv_w), ("fc-0", fc_w))):
        w.name = name
        t = w.init("tensor")
        t.shape = list(arr.shape)
        t.data = arr.reshape(-1).tolist()
    path = tmp_path / "leaf.model"
    path.write_bytes(msg.to_bytes_packed())
    return path, conv_w, fc_w


def test_leaf_021_file_loads_and_computes_what_leaf_computed(tmp_path, native):
    import reference as ref

    rng = np.random.default_rng(3)
    path, conv_w, fc_w = write_leaf_file(tmp_path, rng)
    net = lp.Layer.load(native, path)
    assert net.learnable_weights_names() == ["conv/weight", "fc/weight"]  # Leaf's layers had no bias
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = net.forward([x])[0].to_numpy()
    # Leaf ran cuDNN in CUDNN_CONVOLUTION mode: a true convolution, i.e. a cross-correlation with the filter
    # turned in both spatial axes
    c = ref.conv2d(x.reshape(2, 1, 4, 4).astype(np.float64), conv_w[..., ::-1, ::-1].astype(np.float64), None)
    p, _ = ref.maxpool(c, 2, 2)
    h = np.maximum(p, 0).reshape(2, -1)
    expected = 1 / (1 + np.exp(-(h @ fc_w.T)))
    np.testing.assert_allclose(y, expected, rtol=1e-5)


def test_weights_are_matched_by_name_not_position(tmp_path, native):
    """Leaf's Layer.load matched weights by position."""
    cfg = lp.SequentialConfig(inputs=[("data", [1, 3])])
    cfg.add_layer(lp.LayerConfig("a", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("b", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=0)
    path = tmp_path / "net.leaf"
    net.save(path)
    msg = serialization.editable_message(path, "Layer")
    saved = serialization._read_weights(msg.weightsData, "test")
    names = list(saved)
    order = [2, 3, 0, 1]  # store b's weights first
    serialization._write_weights(msg.init("weightsData", 4), [(names[i], saved[names[i]]) for i in order])
    path.write_bytes(serialization.encode(msg, "Layer"))
    loaded = lp.Layer.load(native, path)
    for w1, w2 in zip(net.learnable_weights_data(), loaded.learnable_weights_data()):
        np.testing.assert_array_equal(w1.to_numpy(), w2.to_numpy())


def test_missing_and_misshapen_weights_are_named(tmp_path, native):
    cfg = lp.SequentialConfig(inputs=[("data", [1, 3])])
    cfg.add_layer(lp.LayerConfig("a", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=0)
    path = tmp_path / "net.leaf"
    net.save(path)
    msg = serialization.editable_message(path, "Layer")
    serialization._write_weights(msg.init("weightsData", 1), [("a/weight", np.zeros((3, 3), np.float32))])
    path.write_bytes(serialization.encode(msg, "Layer"))
    with pytest.raises(lp.SerializationError, match="'a/bias' is missing"):
        lp.Layer.load(native, path)
    msg.clear_write_flag()
    serialization._write_weights(msg.init("weightsData", 2), [("a/weight", np.zeros((3, 4), np.float32)),
                                                              ("a/bias", np.zeros(3, np.float32))])
    path.write_bytes(msg.to_bytes_packed())
    with pytest.raises(lp.SerializationError, match=r"'a/weight' has shape \(3, 4\).*needs \(3, 3\)"):
        lp.Layer.load(native, path)


# --- checkpoints ------------------------------------------------------------------------------------------------
def _solver(backend, rule="momentum", minibatch_size=1):
    run = lp.config.load(os.path.join(os.path.dirname(__file__), "..", "configs", "digits_lenet.yaml"))
    import dataclasses
    cfg = dataclasses.replace(run.solver, solver=rule, minibatch_size=minibatch_size, clip_gradients=5.0)
    return lp.Solver.from_config(backend, backend, cfg)


@pytest.mark.parametrize("rule,k", [("momentum", 1), ("adam", 1), ("nesterov", 2), ("rmsprop", 1), ("adagrad", 1),
                                    ("adadelta", 1), ("adamw", 2)])
def test_resume_equals_uninterrupted_training_bit_for_bit(tmp_path, native, rule, k):
    ds = lp.data.digits()
    batches = list(lp.data.batches(ds.x_train[:320], ds.y_train[:320], 32, seed=0))
    straight = _solver(native, rule, k)
    for xb, yb in batches:
        straight.train_minibatch(xb, yb)
    first = _solver(native, rule, k)
    for xb, yb in batches[:5]:  # stops in the middle of an accumulation when k == 2
        first.train_minibatch(xb, yb)
    first.save_checkpoint(tmp_path / "ckpt.leaf")
    resumed = lp.Solver.load_checkpoint(native, native, tmp_path / "ckpt.leaf")
    assert resumed.iteration == first.iteration and resumed.config == first.config
    for xb, yb in batches[5:]:
        resumed.train_minibatch(xb, yb)
    assert resumed.iteration == straight.iteration
    for a, b in zip(straight.network.learnable_weights_data(), resumed.network.learnable_weights_data()):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())


# --- bad files ------------------------------------------------------------------------------------------------------
@pytest.fixture
def good_file(tmp_path, native):
    net = lp.Layer.from_config(native, lp.LayerConfig("net", nested_config()), seed=0)
    path = tmp_path / "good.leaf"
    net.save(path)
    return path


def test_bad_files_raise_serialization_error(tmp_path, native, good_file, monkeypatch):
    data = good_file.read_bytes()
    cases = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "corrupted": bytes(b ^ 0x5A if i % 7 == 3 else b for i, b in enumerate(data)),
        "garbage": os.urandom(4096),
        "text": b"name: not a capnp file\n" * 20,
    }
    for name, content in cases.items():
        p = tmp_path / f"{name}.leaf"
        p.write_bytes(content)
        with pytest.raises(lp.SerializationError) as e:
            lp.Layer.load(native, p)
        assert str(p) in str(e.value), name
    with pytest.raises(lp.SerializationError, match="cannot read"):
        lp.Layer.load(native, tmp_path / "missing.leaf")
    with pytest.raises(lp.SerializationError, match=f"{tmp_path}: a directory, not a regular file"):
        lp.Layer.load(native, tmp_path)
    # a checkpoint is not a model, and the other way round
    with pytest.raises(lp.SerializationError, match="if it is a model file: Layer.load reads it"):
        lp.Solver.load_checkpoint(native, native, good_file)
    run = lp.config.load(os.path.join(os.path.dirname(__file__), "..", "configs", "digits_mlp.yaml"))
    lp.Solver.from_config(native, native, run.solver).save_checkpoint(tmp_path / "ckpt.leaf")
    with pytest.raises(lp.SerializationError) as e:
        lp.Layer.load(native, tmp_path / "ckpt.leaf")
    assert str(tmp_path / "ckpt.leaf") in str(e.value) and "stack:" not in str(e.value)
    assert "if it is a solver checkpoint: Solver.load_checkpoint reads it" in str(e.value)
    monkeypatch.setattr(serialization, "MAX_FILE_BYTES", 100)
    with pytest.raises(lp.SerializationError, match="over the limit"):
        lp.Layer.load(native, good_file)


def test_hostile_file_is_stopped_by_the_traversal_limit(tmp_path, native):
    """A tiny packed file whose pointers claim a huge list must not be walked."""
    import capnp  # noqa: F401

    msg = serialization.schema().Layer.new_message()
    msg.name = "x"
    w = msg.init("weightsData", 1)
    w[0].name = "huge"
    t = w[0].init("tensor")
    t.shape = [50_000_000]
    t.init("data", 50_000_000)  # all zeros: packs to almost nothing
    path = tmp_path / "bomb.leaf"
    path.write_bytes(msg.to_bytes_packed())
    assert path.stat().st_size < 200_000
    with pytest.raises(lp.SerializationError):
        lp.Layer.load(native, path)


def test_deeply_nested_file_is_stopped_by_the_nesting_limit(tmp_path, native):
    msg = serialization.schema().Layer.new_message()
    msg.name = "deep"
    cfg = msg.init("config")
    for depth in range(serialization.NESTING_LIMIT + 10):
        cfg.name = f"level{depth}"
        seq = cfg.layerType.init("sequential")
        cfg = seq.init("layers", 1)[0]
    cfg.name = "leaf"
    cfg.layerType.relu = None
    path = tmp_path / "deep.leaf"
    path.write_bytes(msg.to_bytes_packed())
    with pytest.raises(lp.SerializationError, match="deep.leaf.*too deeply-nested"):
        lp.Layer.load(native, path)


def test_a_failed_save_leaves_the_old_file(tmp_path, native, good_file, monkeypatch):
    before = good_file.read_bytes()
    net = lp.Layer.from_config(native, lp.LayerConfig("other", nested_config()), seed=9)

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(lp.SerializationError, match="No space left"):
        net.save(good_file)
    monkeypatch.undo()
    assert good_file.read_bytes() == before
    assert lp.Layer.load(native, good_file).name == "net"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_save_interrupted_by_an_exception_in_serialising(tmp_path, native, good_file, monkeypatch):
    before = good_file.read_bytes()
    net = lp.Layer.from_config(native, lp.LayerConfig("other", nested_config()), seed=9)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        net.save(good_file)
    monkeypatch.undo()
    assert good_file.read_bytes() == before


def test_save_to_a_directory_or_a_missing_one_says_so(tmp_path, native):
    net = lp.Layer.from_config(native, lp.LayerConfig("net", nested_config()), seed=9)
    with pytest.raises(lp.SerializationError, match="it is a directory; give a file name such as .*model.leaf"):
        net.save(tmp_path)
    with pytest.raises(lp.SerializationError, match=r"the directory .*missing does not exist"):
        net.save(tmp_path / "missing" / "net.leaf")
    assert list(tmp_path.iterdir()) == [] and not list(tmp_path.parent.glob(f".{tmp_path.name}.*.tmp"))


def test_a_layer_types_field_table_maps_config_fields_to_schema_fields(monkeypatch):
    """serialization.FIELD_NAMES stores a config field under another schema name, both ways."""
    cfg = lp.LayerConfig("pool", lp.PoolingConfig(mode="max", filter_shape=[3], stride=[2], padding=[1]))
    monkeypatch.setitem(serialization.FIELD_NAMES, "Pooling", {"filter_shape": "stride", "stride": "filterShape"})
    msg = serialization.schema().LayerConfig.new_message()
    serialization.write_layer_config(msg, cfg)
    pooling = msg.layerType.pooling
    assert list(pooling.stride) == list(cfg.config.filter_shape)
    assert list(pooling.filterShape) == list(cfg.config.stride)
    assert serialization.read_layer_config(msg.as_reader()) == cfg


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the umask is read from /proc where it can be")
def test_a_new_file_gets_the_umask_s_mode_without_the_umask_being_set(tmp_path, monkeypatch):
    """Setting the umask to read it is process-wide: a file another thread created meanwhile would get mode 0o666.
    Where the system tells it, it is read, never set."""
    from leafpy.serialization.atomic import atomic_write

    old = os.umask(0o027)
    try:
        def refuse(mask):
            raise AssertionError("os.umask called")

        monkeypatch.setattr(os, "umask", refuse)
        atomic_write(tmp_path / "new.bin", b"data")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert (tmp_path / "new.bin").stat().st_mode & 0o777 == 0o640
