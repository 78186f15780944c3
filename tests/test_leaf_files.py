"""Files Leaf 0.2.1 wrote, built here from Leaf's own schema (declared below from its published structs: same
file ID, names and ordinals, in a child process so it does not meet leafpy's schema of the same ID), load and
compute what Leaf computed; leafpy writes files Leaf reads; leafpy's own files are checked and bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from scipy.signal import convolve2d

import leafpy as lp
from leafpy import serialization
from leafpy.serialization import fileformat

LEAF_STRUCTS = """
struct Weight { name @0 :Text; tensor @1 :Tensor; }
struct Tensor { shape @0 :List(UInt64); data @1 :List(Float32); }
struct Layer { name @0 :Text; config @1 :LayerConfig; weightsData @2 :List(Weight); }
struct LayerConfig {
  name @0 :Text;
  layerType :union {
    convolution @1 :ConvolutionConfig; linear @2 :LinearConfig; logSoftmax @3 :Void; pooling @4 :PoolingConfig;
    sequential @5 :SequentialConfig; softmax @6 :Void; relu @7 :Void; sigmoid @8 :Void;
    negativeLogLikelihood @9 :NegativeLogLikelihoodConfig; reshape @10 :ReshapeConfig;
  }
  outputs @11 :List(Text); inputs @12 :List(Text); params @13 :List(WeightConfig); propagateDown @14 :List(Bool);
}
struct WeightConfig { name @0 :Text; }
struct ConvolutionConfig { numOutput @0 :UInt64; filterShape @1 :List(UInt64); stride @2 :List(UInt64);
                           padding @3 :List(UInt64); }
struct LinearConfig { outputSize @0 :UInt64; }
struct PoolingConfig { mode @0 :PoolingMode; filterShape @1 :List(UInt64); stride @2 :List(UInt64);
                       padding @3 :List(UInt64); }
enum PoolingMode { max @0; average @1; }
struct SequentialConfig { layers @0 :List(LayerConfig); inputs @1 :List(ShapedInput); forceBackward @2 :Bool; }
struct ShapedInput { name @0 :Text; shape @1 :List(UInt64); }
struct NegativeLogLikelihoodConfig { numClasses @0 :UInt64; }
struct ReshapeConfig { shape @0 :List(UInt64); }
"""
LEAF_SCHEMA = "@0x8316e0f30c445924;\n" + LEAF_STRUCTS  # Leaf's file id, which leafpy's schema shares

# A Leaf program: a LeNet-like network as Leaf's benchmark networks name their layers (conv1/relu: in place on
# conv1's blob), weights "{layer}-0", no biases.
WRITE_LEAF = textwrap.dedent('''
    import json, sys, capnp
    schema = capnp.load(sys.argv[1])
    spec = json.load(open(sys.argv[2]))
    msg = schema.Layer.new_message(name="lenet")
    cfg = msg.init("config")
    cfg.name = "lenet"
    seq = cfg.layerType.init("sequential")
    inp = seq.init("inputs", 1)[0]
    inp.name, inp.shape = "data", [3, 1, 8, 8]
    layers = seq.init("layers", 5)
    layers[0].name = "conv1"
    c = layers[0].layerType.init("convolution")
    c.numOutput, c.filterShape, c.stride, c.padding = 4, [3], [1], [0]
    layers[1].name = "conv1/relu"
    layers[1].layerType.relu = None
    layers[1].inputs, layers[1].outputs = ["SEQUENTIAL_0"], ["SEQUENTIAL_0"]
    layers[0].outputs = ["SEQUENTIAL_0"]
    layers[2].name = "pool1"
    p = layers[2].layerType.init("pooling")
    p.mode, p.filterShape, p.stride, p.padding = "max", [2], [2], [0]
    layers[3].name = "ip1"
    layers[3].layerType.init("linear").outputSize = 5
    layers[3].inputs = ["SEQUENTIAL_2"]
    layers[2].outputs = ["SEQUENTIAL_2"]
    layers[4].name = "prob"
    layers[4].layerType.logSoftmax = None
    weights = msg.init("weightsData", 2)
    for w, (name, shape, values) in zip(weights, spec):
        w.name = name
        t = w.init("tensor")
        t.shape, t.data = shape, values
    open(sys.argv[3], "wb").write(msg.to_bytes_packed())
''')

READ_LEAF = textwrap.dedent('''
    import json, sys, capnp
    schema = capnp.load(sys.argv[1])
    msg = schema.Layer.from_bytes_packed(open(sys.argv[2], "rb").read())
    out = {"name": msg.name, "types": [str(l.layerType.which) for l in msg.config.layerType.sequential.layers],
           "weights": [[w.name, list(w.tensor.shape), list(w.tensor.data)] for w in msg.weightsData]}
    print(json.dumps(out))
''')


def _run(tmp_path, script, *args):
    (tmp_path / "leaf.capnp").write_text(LEAF_SCHEMA)
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "leaf.capnp"), *map(str, args)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def leaf_lenet_reference(x, conv_w, ip_w):
    """What Leaf computed, in float64: a true convolution (scipy's convolve2d), ReLU, 2x2 max pooling, a Linear
    layer without bias, LogSoftmax."""
    n = len(x)
    c = np.stack([[convolve2d(x[i, 0].astype(np.float64), conv_w[o, 0].astype(np.float64), mode="valid")
                   for o in range(len(conv_w))] for i in range(n)])
    r = np.maximum(c, 0)
    p = r.reshape(n, r.shape[1], 3, 2, 3, 2).max(axis=(3, 5))
    z = p.reshape(n, -1) @ ip_w.astype(np.float64).T
    return z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)


def test_a_file_leaf_wrote_computes_what_leaf_computed(tmp_path):
    rng = np.random.default_rng(0)
    conv_w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    conv_w[:, :, 0, :] += 2.0  # an asymmetric filter: a flip makes a difference
    ip_w = rng.standard_normal((5, 36)).astype(np.float32) * 0.3
    spec = [["conv1-0", list(conv_w.shape), conv_w.ravel().tolist()], ["ip1-0", list(ip_w.shape),
                                                                     ip_w.ravel().tolist()]]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    _run(tmp_path, WRITE_LEAF, tmp_path / "spec.json", tmp_path / "lenet.leaf")
    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "lenet.leaf"))
    assert net.learnable_weights_names() == ["conv1/weight", "ip1/weight"]
    assert [layer.name for layer in net.layers] == ["conv1", "conv1/relu", "pool1", "ip1", "prob"]
    assert net.layers[1].in_place  # Leaf's in-place request by a shared blob name
    x = rng.standard_normal((3, 1, 8, 8)).astype(np.float32)
    expected = leaf_lenet_reference(x, conv_w, ip_w)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), expected, rtol=1e-5, atol=1e-5)
    # leafpy holds the filter turned (its convolutions cross-correlate)
    assert not np.allclose(net.learnable_weights_data()[0].to_numpy(), conv_w)

    # written back for Leaf: Leaf's names, the filter as Leaf stored it, data Leaf's schema reads
    net.save(str(tmp_path / "again.leaf"), format="leaf")
    back = json.loads(_run(tmp_path, READ_LEAF, tmp_path / "again.leaf"))
    assert back["types"] == ["convolution", "relu", "pooling", "linear", "logSoftmax"]
    assert [w[0] for w in back["weights"]] == ["conv1-0", "ip1-0"]
    np.testing.assert_array_equal(np.array(back["weights"][0][2], np.float32).reshape(conv_w.shape), conv_w)
    again = lp.Layer.load(lp.backend("native"), str(tmp_path / "again.leaf"))
    np.testing.assert_allclose(again.forward([x])[0].to_numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("conv", ["conv", "inception/3x3"])
def test_leafpy_to_leaf_and_back_computes_the_same(tmp_path, conv):
    """A layer's name may hold "/" (Caffe's "inception/3x3"): its weight "inception/3x3-0" is still Leaf's name,
    and the filter is turned back on loading."""
    cfg = lp.SequentialConfig(inputs=[("data", [2, 2, 7, 7])])
    cfg.add_layer(lp.LayerConfig(conv, lp.ConvolutionConfig(num_output=3, filter_shape=[3, 2], stride=[1],
                                                               padding=[1], bias=False)))
    cfg.add_layer(lp.LayerConfig("act", "Sigmoid"))
    cfg.add_layer(lp.LayerConfig("pool", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])))
    cfg.add_layer(lp.LayerConfig("shape", lp.ReshapeConfig(shape=[2, 36])))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=4, bias=False)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=1)
    x = np.random.default_rng(1).standard_normal((2, 2, 7, 7)).astype(np.float32)
    want = net.forward([x])[0].to_numpy()
    net.save(str(tmp_path / "for_leaf.leaf"), format="leaf")
    assert not (tmp_path / "for_leaf.leaf").read_bytes().startswith(serialization.MAGIC)
    loaded = lp.Layer.load(lp.backend("native"), str(tmp_path / "for_leaf.leaf"))
    np.testing.assert_allclose(loaded.forward([x])[0].to_numpy(), want, rtol=1e-6)
    leaf = json.loads(_run(tmp_path, READ_LEAF, tmp_path / "for_leaf.leaf"))
    assert leaf["weights"][0][0] == f"{conv}-0"
    filt = np.array(leaf["weights"][0][2], np.float32).reshape(leaf["weights"][0][1])
    np.testing.assert_array_equal(filt, net.learnable_weights_data()[0].to_numpy()[..., ::-1, ::-1])


@pytest.mark.parametrize("change,what", [
    (lambda c: c.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2))), "a bias"),
    (lambda c: c.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig())), "BatchNorm did not exist"),
    (lambda c: c.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5))), "Dropout did not exist"),
    (lambda c: c.add_layer(lp.LayerConfig("pool", lp.PoolingConfig(mode="average", filter_shape=[2]))),
     "average pooling"),
    (lambda c: c.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=3, filter_shape=[1], group=3,
                                                                       bias=False))), "group 3"),
    (lambda c: c.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[2],
                                                                       dilation=[2], bias=False))), "dilation"),
    # (Linear's axis and Reshape's whole_shape were written, and read by Leaf as a Linear over the last axis folded
    # with the batch and a Reshape of each sample: another function)
    (lambda c: c.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2, bias=False, axis=-1))), "axis -1"),
    (lambda c: c.add_layer(lp.LayerConfig("r", lp.ReshapeConfig(shape=[4, 24], whole_shape=True))),
     "whole_shape True"),
])
def test_what_leaf_cannot_represent_is_refused(tmp_path, change, what):
    cfg = lp.SequentialConfig(inputs=[("data", [2, 3, 4, 4])])
    change(cfg)
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)
    with pytest.raises(lp.ConfigError, match=what):
        net.save(str(tmp_path / "x.leaf"), format="leaf")
    assert not (tmp_path / "x.leaf").exists()


# --- leafpy's own files: checked, bounded, everything that saves loads ----------------------------------------------
def _small_net(seed=0):
    cfg = lp.SequentialConfig(inputs=[("data", [2, 6])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=8)))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3)))
    return lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=seed)


def test_every_flipped_byte_of_a_model_or_checkpoint_is_detected(tmp_path):
    net = _small_net()
    net.save(str(tmp_path / "model.leaf"))
    obj = lp.SequentialConfig(inputs=[("out", [2, 3]), ("label", [2, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    be = lp.backend("native")
    solver = lp.Solver.from_config(be, be, lp.SolverConfig(network=net.config, objective=lp.LayerConfig("o", obj),
                                                           solver="adam"))
    solver.train_minibatch(np.ones((2, 6), np.float32), np.array([0, 2]))
    solver.save_checkpoint(str(tmp_path / "ckpt.leaf"))
    rng = np.random.default_rng(0)
    for name, load in (("model.leaf", lambda p: lp.Layer.load(be, p)),
                       ("ckpt.leaf", lambda p: lp.Solver.load_checkpoint(be, be, p))):
        good = (tmp_path / name).read_bytes()
        load(str(tmp_path / name))
        for pos in rng.choice(len(good), 60, replace=False):
            bad = bytearray(good)
            bad[pos] ^= 1 << int(rng.integers(8))
            (tmp_path / "bad.leaf").write_bytes(bytes(bad))
            with pytest.raises(lp.SerializationError):
                load(str(tmp_path / "bad.leaf"))
        for cut in (5, 20, len(good) // 2, len(good) - 1):
            (tmp_path / "bad.leaf").write_bytes(good[:cut])
            with pytest.raises(lp.SerializationError):
                load(str(tmp_path / "bad.leaf"))


def test_zero_weights_and_deep_nesting_save_and_load(tmp_path):
    cfg = lp.SequentialConfig(inputs=[("data", [1, 1000])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=1000), params=[
        lp.WeightConfig(filler=lp.FillerConfig(type="constant", value=0.0)),
        lp.WeightConfig(filler=lp.FillerConfig(type="constant", value=0.0))]))
    zeros = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("zeros", cfg))
    zeros.save(str(tmp_path / "zeros.leaf"))
    assert (tmp_path / "zeros.leaf").stat().st_size < 4_004_000 + 8192  # the raw values, and a small message
    assert np.all(lp.Layer.load(lp.backend("native"), str(tmp_path / "zeros.leaf")).learnable_weights_data()[0]
                  .to_numpy() == 0)
    inner = lp.LayerConfig("fc", lp.LinearConfig(output_size=2))
    for depth in range(40):
        seq = lp.SequentialConfig(inputs=[("x", [1, 2])])
        seq.add_layer(inner)
        inner = lp.LayerConfig(f"level{depth}", seq)
    deep = lp.Layer.from_config(lp.backend("native"), inner, seed=0)
    deep.save(str(tmp_path / "deep.leaf"))
    back = lp.Layer.load(lp.backend("native"), str(tmp_path / "deep.leaf"))
    np.testing.assert_array_equal(back.learnable_weights_data()[0].to_numpy(),
                                  deep.learnable_weights_data()[0].to_numpy())


def test_a_bare_file_of_an_earlier_leafpy_is_not_flipped(tmp_path):
    cfg = lp.SequentialConfig(inputs=[("data", [1, 1, 5, 5])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[3])))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)
    msg = serialization.model_message(net.config, net.named_weights())  # leafpy's names ("conv/weight"), written
    # bare as before the header
    (tmp_path / "old.leaf").write_bytes(msg.to_bytes_packed())
    old = lp.Layer.load(lp.backend("native"), str(tmp_path / "old.leaf"))
    np.testing.assert_array_equal(old.learnable_weights_data()[0].to_numpy(),
                                  net.learnable_weights_data()[0].to_numpy())


def test_a_header_that_lies_about_sizes_is_refused_quickly(tmp_path):
    net = _small_net()
    net.save(str(tmp_path / "m.leaf"))
    data = bytearray((tmp_path / "m.leaf").read_bytes())
    import struct
    import zlib

    magic, version, kind, words, length, _ = serialization._HEADER.unpack_from(data)
    fields = serialization._HEADER.pack(magic, version, kind, 2**40, length, 0)[:-4]
    payload = bytes(data[serialization._HEADER.size:])
    forged = fields + struct.pack("<I", zlib.crc32(payload, zlib.crc32(fields)) & 0xFFFFFFFF) + payload
    (tmp_path / "forged.leaf").write_bytes(forged)
    loaded = lp.Layer.load(lp.backend("native"), str(tmp_path / "forged.leaf"))  # sizes bounded by the payload
    assert loaded.learnable_weights_names() == net.learnable_weights_names()
    (tmp_path / "future.leaf").write_bytes(serialization._HEADER.pack(magic, 99, kind, words, length, 0) + payload)
    with pytest.raises(lp.SerializationError, match="newer leafpy"):
        lp.Layer.load(lp.backend("native"), str(tmp_path / "future.leaf"))


def _leaf_zeros(path, n: int) -> None:
    """A Leaf file (a bare packed message, its weights as List(Float32)) of a Linear layer's [n, n] zero weight
    ("fc-0"): packing makes its zeros a few bytes of the file."""
    cfg = lp.SequentialConfig(inputs=[("data", [1, n])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=n, bias=False)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg))
    net.learnable_weights_data()[0].set(np.zeros((n, n), np.float32))
    net.save(str(path), format="leaf")


def test_a_leaf_file_unpacking_past_the_memory_available_is_refused_before_it_is_unpacked(tmp_path, monkeypatch):
    """Packing turns 2 KB of zero words into 2 bytes: a small file can declare gigabytes, refused from its segment
    table before Cap'n Proto unpacks it."""
    _leaf_zeros(tmp_path / "zeros.leaf", 1024)
    assert (tmp_path / "zeros.leaf").stat().st_size < 2**14
    monkeypatch.setattr(fileformat, "available_memory", lambda: 2**20)
    with pytest.raises(lp.SerializationError, match=r"zeros\.leaf: its message unpacks to 4,\d{3},\d{3} bytes "
                                                    r"\(4\.0 MB\), more than the 1\.0 MB of memory"):
        lp.Layer.load(lp.backend("native"), str(tmp_path / "zeros.leaf"))


def test_a_leaf_weight_past_the_memory_left_is_refused_naming_it(tmp_path, monkeypatch):
    """A List(Float32) weight is converted without a Python float per value (12 times its size), once the memory
    left after unpacking the message (here: less than it needs) is known to hold it."""
    _leaf_zeros(tmp_path / "zeros.leaf", 1024)
    left = iter([2**40])  # the message unpacks; then 1 MB is left
    monkeypatch.setattr(fileformat, "available_memory", lambda: next(left, 2**20))
    with pytest.raises(lp.SerializationError, match=r"zeros\.leaf: weight 'fc-0' declares shape \(1024, 1024\) "
                                                    r"\(1,048,576 values, 4\.0 MB\), more than the 1\.0 MB"):
        lp.Layer.load(lp.backend("native"), str(tmp_path / "zeros.leaf"))
