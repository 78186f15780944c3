"""Two threads on one network or solver: the second caller is refused with a LeafpyError (never a silent mix of
their batches), and every call that went through is one of a serial order."""

import sys
import threading

import numpy as np
import pytest

import leafpy as lp

BATCH, FEATURES, HIDDEN, CLASSES = 32, 64, 128, 3


def _solver(be):
    net = lp.SequentialConfig(inputs=[("data", [BATCH, FEATURES])])
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=HIDDEN)))
    net.add_layer(lp.LayerConfig("relu", "ReLU"))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=CLASSES)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("out", [BATCH, CLASSES]), ("label", [BATCH, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=CLASSES)))
    cfg = lp.SolverConfig(network=lp.LayerConfig("mlp", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=0.01, momentum=0.9, seed=0)
    return lp.Solver.from_config(be, be, cfg)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, (BATCH, 1)).astype(np.float32))


@pytest.fixture
def switch_often():
    """Threads switch every 10 µs (CPython's default is 5 ms), so that they meet inside the calls."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


class _Blocking:
    """An input whose conversion to an array (inside the call that was given it) waits until ``release``."""

    def __init__(self, x):
        self.x, self.inside, self.release = x, threading.Event(), threading.Event()

    def __array__(self, dtype=None, copy=None):
        self.inside.set()
        assert self.release.wait(30), "the test's other thread never released the input"
        return self.x if dtype is None else self.x.astype(dtype)


def _while_inside(call, blocking, *others):
    """Run ``call`` in a thread; while it is inside (converting ``blocking``), run each of ``others`` here and
    return what each raised (None: it went through)."""
    done = []
    t = threading.Thread(target=lambda: done.append(call()), name="first")
    t.start()
    assert blocking.inside.wait(30)
    raised = []
    for other in others:
        try:
            other()
            raised.append(None)
        except lp.LeafpyError as e:
            raised.append(e)
    blocking.release.set()
    t.join(30)
    assert done, "the first call did not finish"
    return raised


def test_a_second_thread_is_refused_while_a_step_runs(native):
    solver = _solver(native)
    x, y = _batch(0)
    blocking = _Blocking(x)
    net = solver.network
    raised = _while_inside(lambda: solver.train_minibatch(blocking, y), blocking,
                           lambda: solver.train_minibatch(x, y), lambda: net.forward([x]),
                           lambda: net.set_training(False), lambda: net.load_weights(net.named_weights()))
    assert all(isinstance(e, lp.LeafpyError) for e in raised), raised
    msg = str(raised[1])
    assert "'mlp'" in msg and "'first'" in msg and "train_minibatch" in msg and "its own network" in msg
    assert "the solver of network 'mlp'" in str(raised[0])
    assert solver.iteration == 1  # the refused calls did nothing
    solver.train_minibatch(x, y)  # and the solver serves the next caller
    assert solver.iteration == 2


def test_a_second_thread_is_refused_while_forward_runs(native):
    net = _solver(native).network
    x, _ = _batch(0)
    blocking = _Blocking(x)
    raised = _while_inside(lambda: net.forward([blocking]), blocking, lambda: net.forward([x]),
                           lambda: net.backward([np.zeros((BATCH, CLASSES), np.float32)]))
    assert all(isinstance(e, lp.LeafpyError) and "layer 'mlp'" in str(e) for e in raised), raised


def test_calls_from_the_thread_already_inside_go_on(native):
    """A call from inside a call (here: converting an input calls forward) is the same thread's: not refused."""
    net = _solver(native).network
    x, _ = _batch(0)
    inner = []

    class Nested:
        def __array__(self, dtype=None, copy=None):
            inner.append(net.forward([x])[0].to_numpy().copy())
            return x

    net.forward([Nested()])
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), inner[0], rtol=1e-6)


def test_two_threads_training_one_solver_end_in_a_serial_order(native, switch_often):
    x, y = _batch(0)
    for _ in range(5):
        solver = _solver(native)
        start = threading.Barrier(2)
        went, other = [0, 0], []

        def work(i):
            xi, yi = x.copy(), y.copy()
            start.wait()
            for _ in range(200):
                try:
                    solver.train_minibatch(xi, yi)
                    went[i] += 1
                except lp.LeafpyError:
                    pass
                except Exception as e:  # noqa: BLE001  (anything else is the failure this test looks for)
                    other.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not other
        assert solver.iteration == sum(went)
        serial = _solver(native)
        for _ in range(sum(went)):
            serial.train_minibatch(x, y)
        for a, b in zip(solver.network.learnable_weights_data(), serial.network.learnable_weights_data()):
            np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-5, atol=1e-6)


def test_two_threads_running_forward_get_their_own_outputs_or_a_refusal(native, switch_often):
    net = _solver(native).network
    inputs = [_batch(1)[0], _batch(2)[0]]
    expected = [net.forward([x])[0].to_numpy().copy() for x in inputs]
    start = threading.Barrier(2)
    outcomes: list[list[str]] = [[], []]

    def work(i):
        start.wait()
        for _ in range(300):
            try:
                out = net.forward([inputs[i]])[0].to_numpy()
            except lp.LeafpyError:
                outcomes[i].append("refused")
                continue
            # the output is the network's buffer until its next call: the other thread's call may follow at once
            mine, theirs = (np.allclose(out, expected[k], rtol=1e-5, atol=1e-6) for k in (i, 1 - i))
            outcomes[i].append("own" if mine else "next call's" if theirs else "mixed")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(o) == 300 and "mixed" not in o for o in outcomes)
    assert any("own" in o for o in outcomes)


def test_a_layer_inside_a_training_network_is_refused_to_another_thread(native, tmp_path):
    """A layer inside the network (solver.network.layer.layers[i]) is the network's: saving it, loading weights
    into it or switching its mode from another thread while a step runs is refused as the network's own calls are
    (its own guard let a save write weights a step apart, a file whose checksum then failed), and so are
    lp.onnx.export and named_weights of the network."""
    solver = _solver(native)
    x, y = _batch(0)
    blocking = _Blocking(x)
    inner = solver.network.layer.layers[0]
    before = {k: v.copy() for k, v in inner.named_weights().items()}
    raised = _while_inside(lambda: solver.train_minibatch(blocking, y), blocking,
                           lambda: inner.save(str(tmp_path / "fc1.leaf")),
                           lambda: inner.load_weights({k: v + 1 for k, v in before.items()}),
                           lambda: inner.set_training(False),
                           lambda: lp.onnx.export(solver.network, str(tmp_path / "m.onnx")),
                           lambda: solver.network.named_weights())
    assert all(isinstance(e, lp.LeafpyError) and "layer 'mlp'" in str(e) and "thread 'first'" in str(e)
               for e in raised), raised
    assert not (tmp_path / "fc1.leaf").exists() and not (tmp_path / "m.onnx").exists()
    assert inner.training
    inner.save(str(tmp_path / "fc1.leaf"))  # the thread that trains is done: the layer serves this one
    assert lp.Layer.load(native, str(tmp_path / "fc1.leaf")).config.type == "Linear"  # (its checksum holds)
