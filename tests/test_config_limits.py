"""Run files made carelessly or with intent to harm: alias bombs, deep nesting, bytes that are not UTF-8, values
their tags cannot hold, non-finite and absurd numbers, special files. Each is a ConfigError naming the place, raised
quickly and before anything large is allocated; NumPy scalars are numbers like Python's."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import leafpy as lp

MLP = (Path(__file__).resolve().parent.parent / "configs" / "digits_mlp.yaml").read_text()


def with_solver(extra: str) -> str:
    """The shipped MLP run file with ``extra`` appended to its one-line solver mapping."""
    return re.sub(r"seed: 0}\s*$", f"seed: 0, {extra}}}\n", MLP)


def quick(fn, limit=5.0):
    """fn raises a ConfigError quickly: the bound is loose for a busy machine (the inputs it guards took 45 s and
    gigabytes before they were bounded)."""
    start = time.perf_counter()
    with pytest.raises(lp.ConfigError) as info:
        fn()
    assert time.perf_counter() - start < limit
    return str(info.value)


def test_billion_laughs_is_refused_within_a_second():
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    bomb = "\n".join(lines) + "\nname: *a9\n" + MLP.replace("name: digits-mlp\n", "")
    msg = quick(lambda: lp.config.loads(bomb, "bomb.yaml"))
    assert msg.startswith("bomb.yaml") and "alias" in msg


def test_a_few_aliases_still_work():
    text = "solver_defaults: &s {base_lr: 0.02}\n"  # not a run-file key: the alias itself must be accepted
    doc = lp.config._yaml(text + "x: *s\ny: *s\n")
    assert doc["x"] == doc["y"] == {"base_lr": 0.02}


@pytest.mark.parametrize("opener,closer", [("[", "]"), ("{a: ", "}")])
def test_yaml_nested_thousands_deep_is_a_config_error(opener, closer):
    deep = "name: " + opener * 5000 + "1" + closer * 5000 + "\n"
    msg = quick(lambda: lp.config.loads(deep, "deep.yaml"))
    assert "deep.yaml" in msg and "nested" in msg


def test_a_run_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(MLP.replace("digits-mlp", "d\xefgits").encode("latin-1"))
    msg = quick(lambda: lp.config.load(path))
    assert str(path) in msg and "UTF-8" in msg
    assert "UTF-8" in quick(lambda: lp.config.loads(b"name: \xff\xfe\n"))


@pytest.mark.parametrize("value", ["!!float abc", "!!int 1.5x", "!!bool maybe"])
def test_a_value_its_tag_cannot_hold_is_a_config_error(value):
    msg = quick(lambda: lp.config.loads(with_solver(f"clip_gradients: {value}"), "tag.yaml"))
    assert "tag.yaml" in msg


@pytest.mark.parametrize("field,value", [
    ("solver.base_lr", ".inf"), ("solver.base_lr", ".nan"), ("solver.weight_decay", ".inf"),
    ("solver.clip_gradients", ".inf"), ("solver.gamma", "-.inf"), ("solver.stepsize", ".inf"),
    ("solver.max_iter", "1e400"),
])
def test_non_finite_solver_values_are_refused_naming_the_field(field, value):
    sets = [f"{field}={value}"] + (["solver.lr_policy=poly"] if field == "solver.max_iter" else [])
    msg = quick(lambda: lp.config.loads(MLP, overrides=sets))
    assert field in msg


@pytest.mark.parametrize("layer,field", [
    ("{name: fc1, type: Linear, output_size: .inf}", "output_size"),
    ("{name: fc1, type: Linear, output_size: 128, params: [{lr_mult: .inf}]}", "lr_mult"),
    ("{name: fc1, type: Linear, output_size: 128, params: [{filler: {type: constant, value: .nan}}]}", "value"),
    ("{name: fc1, type: Linear, output_size: 128, params: [{filler: {type: gaussian, std: .inf}}]}", "std"),
    ("{name: fc1, type: Linear, output_size: 100000000000000000000000}", "output_size"),
])
def test_non_finite_and_out_of_range_layer_values_are_refused_naming_the_field(layer, field):
    text = MLP.replace("{name: fc1, type: Linear, output_size: 128}", layer)
    msg = quick(lambda: lp.config.loads(text))
    assert f"network.layers[1].{field}" in msg or ("layers[1]" in msg and field in msg), msg


def test_an_absurd_size_is_refused_before_anything_is_allocated():
    run = lp.config.loads(MLP.replace("output_size: 128", "output_size: 1000000000000"))
    msg = quick(lambda: lp.Solver.from_config(lp.backend("native"), lp.backend("native"), run.solver))
    assert "fc1" in msg and "1000000000000" in msg and "memory" in msg


def test_an_absurd_input_shape_is_refused_before_anything_is_allocated():
    run = lp.config.loads(MLP.replace("shape: [null, 1, 8, 8]", "shape: [null, 1, 800000, 800000]"))
    msg = quick(lambda: lp.Layer.from_config(lp.backend("native"), run.network))
    assert "flat" in msg and "memory" in msg


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_as_run_file_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    result: list = []
    t = threading.Thread(target=lambda: result.append(_error(lambda: lp.config.load(fifo))), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader so the test process can end
        with open(fifo, "w"):
            pass
        t.join(5)
        pytest.fail("config.load blocked on a FIFO")
    assert isinstance(result[0], lp.ConfigError) and "FIFO" in str(result[0]) and str(fifo) in str(result[0])


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return e
    return None


def test_a_directory_as_run_file_is_refused(tmp_path):
    with pytest.raises(lp.LeafpyError, match="directory"):
        lp.config.load(tmp_path)


def test_loads_of_something_else_than_text_is_a_config_error():
    assert "str" in quick(lambda: lp.config.loads(None))
    assert "str" in quick(lambda: lp.config.loads(12))
    assert "path" in quick(lambda: lp.config.load(None))
    assert "RunConfig" in quick(lambda: lp.config.dumps(None))
    run = lp.config.loads(MLP)
    assert "config.save: path" in quick(lambda: lp.config.save(run, None))


def test_numpy_scalars_are_numbers():
    cfg = lp.SolverConfig(base_lr=np.float32(0.01), momentum=np.float64(0.9), stepsize=np.int64(5),
                          minibatch_size=np.int32(2), weight_decay=np.float16(0.001), stepvalues=(np.int64(3),),
                          lr_policy="multistep")
    assert cfg.base_lr == pytest.approx(0.01) and cfg.stepsize == 5 and cfg.minibatch_size == 2
    assert type(cfg.base_lr) is float and type(cfg.stepsize) is int
    lin = lp.LinearConfig(output_size=np.int64(7))
    assert lin.output_size == 7 and type(lin.output_size) is int
    conv = lp.ConvolutionConfig(num_output=np.uint8(4), filter_shape=[np.int64(3)])
    assert conv.filter_shape == (3, 3)
    with pytest.raises(lp.ConfigError, match="expected a number"):
        lp.SolverConfig(base_lr=np.bool_(True))


def nested(depth: int) -> dict:
    inner = {"name": "core", "type": "Sequential", "inputs": [{"name": "x", "shape": [2, 3]}],
             "layers": [{"name": "r", "type": "ReLU"}]}
    for i in range(depth):
        inner = {"name": f"s{i}", "type": "Sequential", "inputs": [{"name": "x", "shape": [2, 3]}], "layers": [inner]}
    return inner


def test_sequentials_nested_sixty_deep_load_and_three_thousand_deep_are_a_config_error():
    import yaml

    text = yaml.safe_dump({"network": nested(60)}, default_flow_style=True, width=10**9)
    cfg = lp.config.layer_from_dict(lp.config._yaml(text)["network"])
    out = lp.Layer.from_config(lp.backend("native"), cfg).forward([-np.ones((2, 3), np.float32)])[0]
    np.testing.assert_allclose(out.to_numpy(), np.zeros((2, 3)))
    assert "nested more than" in quick(lambda: lp.config.layer_from_dict(nested(3000)))


def test_a_network_whose_layers_together_exceed_the_memory_is_refused_before_allocating():
    limit = lp._checks.machine_memory()
    if limit is None:
        pytest.skip("the system does not report its memory size")
    width = 1000
    batch = limit // (3 * 2 * 4 * width)  # each Linear's outputs (and their gradients): a third of the memory
    cfg = lp.SequentialConfig(inputs=[("data", [batch, width])])
    for i in range(4):
        cfg.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=width)))
        cfg.add_layer(lp.LayerConfig(f"relu{i}", "ReLU"))  # in place: nothing more to hold
    msg = quick(lambda: lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("big", cfg)), limit=2.0)
    assert "layer 'fc2' (Linear): with this layer" in msg and "smaller batch" in msg
    cfg.layers[:] = cfg.layers[:4]  # two of them fit
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fits", cfg))
    assert net.learnable_weights_names()[-1] == "fc1/bias"


def test_a_run_file_of_more_plain_values_than_the_limit_is_refused_while_read(tmp_path, monkeypatch):
    """A run file of plain values past MAX_NODES (2 MB of `1,` took PyYAML 24 s and 815 MB before any check) is
    refused naming the file and the line, before the rest is read; the limit is shown lowered, for speed. The
    run.yaml of a table of 120,000 columns (its data.features) still loads under the real limit."""
    monkeypatch.setattr(lp.config, "MAX_NODES", 20_000)
    path = tmp_path / "many.yaml"
    path.write_text("class_names: [" + "1," * 100_000 + "1]\n" + MLP)
    msg = quick(lambda: lp.config.load(str(path)))
    assert msg.startswith(str(path)) and "more than 20000 values" in msg and "line 1" in msg, msg
    monkeypatch.undo()
    wide = MLP.replace("data: {dataset: digits, ", "data: {dataset: csv, path: t.csv, target: y, features: [" +
                       ", ".join(f"c{i}" for i in range(120_000)) + "], ")
    assert len(lp.config.loads(wide, "wide.yaml").data["features"]) == 120_000
    layers = "".join(f"    - {{name: hidden{i}, type: Linear, output_size: 4}}\n" for i in range(1000))
    big = MLP.replace("    - {name: flat, type: Flatten}\n", "    - {name: flat, type: Flatten}\n" + layers)
    assert len(lp.config.loads(big, "big.yaml").network.config.layers) == 1005


@pytest.mark.parametrize("text,value", [("10", 10), ("07", 7), ("0x10", 16), ("+5", 5), ("1e3", 1000.0),
                                        ("5e-4", 0.0005), ("1.5", 1.5), (".inf", float("inf")), ("08", "08"),
                                        ("'010'", "010"),
                                        # class names as an earlier leafpy wrote them into run.yaml
                                        ("['07', 08, 09, +.5, 0o17]", ["07", "08", "09", "+.5", "0o17"])])
def test_numbers_read_alike_in_yaml_1_1_and_1_2_are_taken(text, value):
    """Numbers mean what YAML 1.1 (PyYAML, and the run.yaml files leafpy wrote) and YAML 1.2 agree on; `08` is
    text in both, as zero-padded class names were written."""
    got = lp.config._yaml(f"x: {text}\n")["x"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["010", "1_6", "1:30", "0b101", "1_000.5"])
def test_numbers_yaml_1_1_and_1_2_read_differently_are_refused_naming_the_line(text):
    """`batch_size: 010` was eight (YAML 1.1's octal) where YAML 1.2, and a reader, says ten; `1:30` was ninety,
    `1_6` sixteen: refused naming the line and the fix, not taken silently."""
    with pytest.raises(lp.ConfigError, match=rf"run.yaml: line 4: {re.escape(text)} is read as another .* by YAML "
                                             r"1.1 than by YAML 1.2.*quote it for text"):
        lp.config.loads(MLP.replace("batch_size: 32", f"batch_size: {text}").replace(
            "name: digits-mlp", "name: digits-mlp\n# a comment"), "run.yaml")
