"""The native backend's MKL products (leafpy.backends.mkl): every operand layout checked against float64 NumPy,
through a stand-in for MKL's CBLAS entry points that reads and writes memory by the pointers, leading dimensions
and strides it is given (so the layout logic runs everywhere), and through MKL itself where the ``mkl`` package
is installed; the backend's ``blas`` option and its errors."""

import ctypes
import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import child_env

import leafpy as lp
from leafpy.backends import mkl
from leafpy.backends.native import NativeBackend

CTYPE = {"s": ctypes.c_float, "d": ctypes.c_double}
DTYPE = {"s": np.float32, "d": np.float64}


def _matrix(letter, ptr, rows, cols, ld, trans):
    """The row-major matrix op(X) of rows x cols that CBLAS reads at ``ptr``: X stored with leading dimension ld,
    transposed where ``trans``."""
    stored_rows, stored_cols = (cols, rows) if trans else (rows, cols)
    count = (stored_rows - 1) * ld + stored_cols
    raw = np.frombuffer((CTYPE[letter] * count).from_address(ptr), DTYPE[letter])
    size = raw.itemsize
    x = np.lib.stride_tricks.as_strided(raw, (stored_rows, stored_cols), (ld * size, size))
    return x.T if trans else x


class FakeEntry:
    """A CBLAS entry point of the stand-in, in float64 NumPy: ``letter`` "s" or "d", ``variant`` its form; counts
    its calls (ctypes' argtypes and restype are set on it as on a real one)."""

    def __init__(self, letter, variant):
        self.letter, self.variant, self.calls = letter, variant, 0
        self.argtypes = self.restype = None

    def __call__(self, *args):
        self.calls += 1
        self.run(*args)


class FakeGemm(FakeEntry):
    """cblas_?gemm (variant False) / cblas_?gemm_batch_strided (True), row-major only."""

    def run(self, *args):
        if self.variant:
            (order, ta, tb, m, n, k, alpha, pa, lda, sa, pb, ldb, sb, beta, pc, ldc, sc, count) = args
        else:
            (order, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc), (sa, sb, sc, count) = args, (0, 0, 0, 1)
        assert order == mkl.ROW_MAJOR
        size = np.dtype(DTYPE[self.letter]).itemsize
        for i in range(count):
            a = _matrix(self.letter, pa + i * sa * size, m, k, lda, ta == mkl.TRANS).astype(np.float64)
            b = _matrix(self.letter, pb + i * sb * size, k, n, ldb, tb == mkl.TRANS).astype(np.float64)
            c = _matrix(self.letter, pc + i * sc * size, m, n, ldc, False)
            old = c.astype(np.float64) if beta != 0 else 0.0
            c[...] = alpha * (a @ b) + beta * old


class FakeAxpby(FakeEntry):
    """cblas_?axpby (variant True: y = alpha x + beta y) / cblas_?axpy (False: beta 1), unit strides."""

    def run(self, *args):
        n, alpha, px, incx, *rest = args
        beta, py, incy = rest if self.variant else (1.0, *rest)
        assert incx == incy == 1
        x, y = (_matrix(self.letter, ptr, 1, n, n, False)[0] for ptr in (px, py))
        y[...] = alpha * x.astype(np.float64) + beta * y.astype(np.float64)


class FakeLib:
    def __init__(self):
        self.cblas_sgemm, self.cblas_dgemm = FakeGemm("s", False), FakeGemm("d", False)
        self.cblas_sgemm_batch_strided, self.cblas_dgemm_batch_strided = FakeGemm("s", True), FakeGemm("d", True)
        self.cblas_saxpby, self.cblas_daxpby = FakeAxpby("s", True), FakeAxpby("d", True)
        self.cblas_saxpy, self.cblas_daxpy = FakeAxpby("s", False), FakeAxpby("d", False)
        self.threads = None

    def MKL_Set_Num_Threads(self, n):
        self.threads = n.value

    def calls(self):
        return sum(g.calls for g in (self.cblas_sgemm, self.cblas_dgemm, self.cblas_sgemm_batch_strided,
                                     self.cblas_dgemm_batch_strided))


def _libraries():
    yield "stand-in", mkl.Mkl(FakeLib())
    real = mkl.load()
    if real is not None:
        yield "mkl", real


@pytest.fixture(params=["stand-in", "mkl"])
def blas(request, monkeypatch):
    found = dict(_libraries())
    if request.param not in found:
        pytest.skip("Intel MKL is not installed here (pip install mkl): the stand-in's run checks the layouts")
    monkeypatch.setattr(found[request.param], "min_work", 0)  # these products are small: MKL takes them all
    return found[request.param]


def _stored(x, layout, rng):
    """``x`` stored as asked: "c" rows contiguous, "f" columns contiguous, "rows" every other row of a larger
    array (a leading dimension past the width), "cols" every other column of a column-major one."""
    if layout == "c":
        return np.ascontiguousarray(x)
    if layout == "f":
        return np.asfortranarray(x)
    if layout == "rows":
        big = rng.standard_normal((x.shape[0] * 2, x.shape[1] + 3)).astype(x.dtype)
        view = big[::2, 1:x.shape[1] + 1]
        view[...] = x
        return view
    big = np.asfortranarray(rng.standard_normal((x.shape[0] + 5, x.shape[1] * 2)).astype(x.dtype))
    view = big[2:x.shape[0] + 2, ::2]
    view[...] = x
    return view


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_of_every_layout_match_float64(blas, dtype):
    rng = np.random.default_rng(7)
    layouts = ("c", "f", "rows", "cols")
    for (m, n, k), la, lb, lc in itertools.product([(5, 7, 3), (1, 6, 4), (6, 1, 4), (3, 4, 1), (33, 17, 65)],
                                                     layouts, layouts, ("c", "f", "rows")):
        a64, b64, c64 = (rng.standard_normal(s) for s in ((m, k), (k, n), (m, n)))
        a, b, c = (_stored(x.astype(dtype), lay, rng) for x, lay in ((a64, la), (b64, lb), (c64, lc)))
        before = c.astype(np.float64)
        assert blas.gemm(a, b, c, 0.5, -2.0), (m, n, k, la, lb, lc)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(c, 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) - 2.0 * before,
                                   rtol=tol, atol=tol * 10, err_msg=f"{(m, n, k, la, lb, lc)}")
        c[...] = np.nan
        assert blas.gemm(a, b, c)  # beta 0: out's old values (NaN) are not read
        np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=tol, atol=tol * 10)


def test_batched_products_and_a_matrix_broadcast_over_the_batch(blas):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 6, 5)).astype(np.float32)
    b2 = rng.standard_normal((5, 7)).astype(np.float32)
    b3 = rng.standard_normal((4, 7, 5)).astype(np.float32).transpose(0, 2, 1)  # each matrix column-major
    for b in (b2, b3):
        out = np.full((4, 6, 7), np.nan, np.float32)
        assert blas.gemm(a, b, out)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
        got = blas.matmul(a, b)  # np.matmul's form, out allocated
        np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    filt = rng.standard_normal((3, 6)).astype(np.float32)  # a 2-D filter times a batch of columns (convolutions)
    out = np.empty((4, 3, 5), np.float32)
    blas.matmul(filt, a, out=out)
    np.testing.assert_allclose(out, filt.astype(np.float64) @ a.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_what_blas_cannot_take_is_left_to_numpy():
    lib = FakeLib()
    blas = mkl.Mkl(lib)
    blas.min_work = 0
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 6)).astype(np.float32)
    cases = [
        (a, a.astype(np.float64), np.empty((6, 6), np.float32), False),                 # mixed dtypes
        (a.astype(np.float16), a.astype(np.float16), np.empty((6, 6), np.float16), False),  # no float16 GEMM
        (a[::-1], a, np.empty((6, 6), np.float32), False),                              # a negative stride
        (a, a, a, False),                                                                # out is an operand
        (a[:0], a, np.empty((0, 6), np.float32), False),                                 # empty
        (a, a.T, np.empty((6, 6), np.float32), True),                                    # a transpose: taken
    ]
    assert [blas.gemm(x, y, out) for x, y, out, _ in cases] == [taken for *_, taken in cases]
    assert lib.calls() == 1
    z = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (6, 6), (0, 0))  # zero strides: numpy computes
    out = np.empty((6, 6), np.float32)
    assert not blas.gemm(z, a, out)
    np.testing.assert_array_equal(blas.matmul(a, a[::-1]), a @ a[::-1])  # matmul falls back to NumPy itself


def test_an_empty_batch_writes_nothing(blas):
    """A batch of no matrices (views of larger arrays, so their strides are a matrix's) is no product: nothing
    past the empty output is written, as np.matmul writes nothing."""
    buf = np.full(64, np.nan, np.float32)
    a = np.ones(64, np.float32)[:0].reshape(0, 3, 4)
    b = np.ones(64, np.float32)[:0].reshape(0, 4, 5)
    out = buf[:0].reshape(0, 3, 5)
    blas.gemm(a, b, out)
    assert np.isnan(buf).all()
    assert blas.matmul(a, b, out=out).shape == (0, 3, 5) and np.isnan(buf).all()
    assert blas.matmul(a, np.ones((4, 5), np.float32)).shape == (0, 3, 5)


def test_random_batched_layouts_match_float64_or_are_left_untouched(blas):
    """Random batches (of 1 too), each operand 2-D, a batch of one broadcast, or a batch, its matrices row- or
    column-major or every other row, some a batch's every other matrix; out row- or column-major: where gemm takes
    the product, out is alpha a @ b + beta out in float64; where it does not, out is as it was."""
    rng = np.random.default_rng(21)

    def operand(shape, batch):
        form = rng.integers(3)  # 2-D, a batch of one, a batch
        full = shape if form == 0 else (1 if form == 1 else batch, *shape)
        x = rng.standard_normal(full).astype(np.float32)
        if rng.random() < 0.3 and x.ndim == 3:  # every other matrix of a larger batch
            big = rng.standard_normal((2 * x.shape[0], *shape)).astype(np.float32)
            big[::2] = x
            x = big[::2]
        if rng.random() < 0.4:
            x = np.asfortranarray(x.swapaxes(-1, -2)).swapaxes(-1, -2) if x.ndim == 2 else \
                np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
        elif rng.random() < 0.3:
            big = np.zeros((*x.shape[:-2], 2 * x.shape[-2], x.shape[-1] + 2), np.float32)
            big[..., ::2, 1:-1] = x
            x = big[..., ::2, 1:-1]
        return x

    taken = 0
    for _ in range(300):
        batch = int(rng.integers(1, 4))
        m, n, k = (int(v) for v in rng.integers(1, 7, 3))
        a, b = operand((m, k), batch), operand((k, n), batch)
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        if not lead and rng.random() < 0.5:
            lead = (batch,)
        out = rng.standard_normal((*lead, m, n)).astype(np.float32)
        if rng.random() < 0.5:
            out = np.ascontiguousarray(out.swapaxes(-1, -2)).swapaxes(-1, -2)
        before = out.astype(np.float64)
        if blas.gemm(a, b, out, 0.5, -1.5):
            taken += 1
            expect = 0.5 * np.matmul(a.astype(np.float64), b.astype(np.float64)) - 1.5 * before
            np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5, err_msg=f"{a.strides} {b.strides}")
        else:
            np.testing.assert_array_equal(out, before)
    assert taken > 60  # (a batch of one, or of other sizes, is left to NumPy)


def test_mkl_runs_its_32_bit_interface_whatever_the_environment_asks():
    """MKL_INTERFACE_LAYER=ILP64 would have libmkl_rt read 64-bit sizes where the products pass 32-bit ints:
    MKL is opened with its LP64 layer chosen before any other call."""
    if mkl.load() is None:
        pytest.skip("Intel MKL is not installed here (pip install mkl)")
    code = textwrap.dedent("""
        import numpy as np
        from leafpy.backends import mkl
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
        out = np.zeros((5, 3))
        blas = mkl.load()
        blas.min_work = 0
        assert blas.gemm(a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-12)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], env=child_env(MKL_INTERFACE_LAYER="ILP64"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def _trained(be, cfg, x, y, steps, **fields):
    """Losses of ``steps`` momentum steps of network ``cfg`` (log-probabilities of 10 classes) on one batch, and
    the trained solver; ``fields``: the rest of the SolverConfig."""
    batch = x.shape[0]
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 10]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    sol = lp.SolverConfig(network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", momentum=0.9, **fields)
    solver = lp.Solver.from_config(be, be, sol)
    losses = []
    for _ in range(steps):
        solver.train_minibatch(x, y)
        losses.append(solver.loss())
    return np.array(losses), solver


def _lenet_losses(be, steps=6):
    cfg = lp.SequentialConfig(inputs=[("data", [16, 1, 28, 28])])
    cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=6, filter_shape=[5])))
    cfg.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])))
    cfg.add_layer(lp.LayerConfig("conv2", lp.ConvolutionConfig(num_output=8, filter_shape=[5])))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=32)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    rng = np.random.default_rng(11)
    x, y = rng.random((16, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 16)
    return _trained(be, cfg, x, y, steps, base_lr=0.05, weight_decay=5e-4, seed=5)[0]


def test_a_network_trains_alike_on_either_blas(blas):
    plain = NativeBackend(blas="numpy")
    with_blas = NativeBackend(blas="numpy")
    with_blas._mkl, with_blas.xp = blas, blas.numpy  # as blas="mkl" builds it, on this library
    lib = blas.lib
    before = lib.calls() if isinstance(lib, FakeLib) else None
    expect, got = _lenet_losses(plain), _lenet_losses(with_blas)
    np.testing.assert_allclose(got, expect, rtol=2e-4)
    assert got[-1] < got[0]
    if before is not None:  # every product of the step went through the library
        assert lib.calls() - before >= 6 * 6


def test_the_blas_option(monkeypatch):
    assert lp.backend("native", blas="numpy").blas == "numpy"
    with pytest.raises(lp.ConfigError, match="unknown blas 'openblas'; valid: auto, numpy, mkl"):
        lp.backend("native", blas="openblas")
    monkeypatch.setattr(mkl, "load", lambda path=None: None)
    with pytest.raises(lp.BackendUnavailable, match="pip install mkl"):
        lp.backend("native", blas="mkl")
    assert NativeBackend(blas="auto").blas == "numpy"  # auto: NumPy's where MKL is missing
    monkeypatch.setattr(mkl, "load", lambda path=None: mkl.Mkl(FakeLib()))
    monkeypatch.setattr(mkl, "intel_cpu", lambda: False)
    assert NativeBackend(blas="auto").blas == "numpy"  # and on other vendors' CPUs
    monkeypatch.setattr(mkl, "intel_cpu", lambda: True)
    be = NativeBackend(blas="auto")
    assert be.blas == "mkl" and be.xp.matmul == be._mkl.matmul
    assert be.full_precision() is be and NativeBackend(blas="auto", precision="bf16").full_precision().blas == "mkl"


def test_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert mkl.threads() == 3
    monkeypatch.setenv("MKL_NUM_THREADS", "many")
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")
    assert mkl.threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert mkl.threads() >= 1
    lib = FakeLib()
    mkl.Mkl(lib)
    assert lib.threads == mkl.threads()


def test_small_products_stay_in_numpy():
    """Products under MIN_WORK multiply-adds go to NumPy (the entry point's Python costs more than they take)."""
    lib = FakeLib()
    blas = mkl.Mkl(lib)
    a = np.ones((32, 32), np.float32)
    out = np.empty((32, 32), np.float32)
    assert 32 ** 3 < mkl.MIN_WORK and not blas.gemm(a, a, out) and lib.calls() == 0
    np.testing.assert_array_equal(blas.matmul(a, a), np.full((32, 32), 32.0, np.float32))
    big = np.ones((64, 128), np.float32)
    assert blas.gemm(big, big.T, np.empty((64, 64), np.float32)) and lib.calls() == 1  # 64 * 64 * 128 >= MIN_WORK


def test_the_environment_chooses_when_the_code_does_not(monkeypatch):
    monkeypatch.setenv("LEAFPY_BLAS", "numpy")
    monkeypatch.setattr(mkl, "load", lambda path=None: mkl.Mkl(FakeLib()))
    monkeypatch.setattr(mkl, "intel_cpu", lambda: True)
    assert NativeBackend().blas == "numpy"
    assert NativeBackend(blas="mkl").blas == "mkl"  # an option given wins
    monkeypatch.setenv("LEAFPY_BLAS", "")
    assert NativeBackend().blas == "mkl"  # empty: auto
    monkeypatch.setenv("LEAFPY_BLAS", "openblas")
    with pytest.raises(lp.ConfigError, match="LEAFPY_BLAS='openblas' in the environment: valid values are auto"):
        NativeBackend()


def test_a_leafpy_command_runs_the_blas_the_environment_names(tmp_path):
    """Through the command, as a user on an Intel machine runs it: LEAFPY_BLAS=numpy and =mkl train the shipped
    MLP to the same losses to float32 rounding (MKL's products and OpenBLAS's round differently)."""
    if mkl.load() is None:
        pytest.skip("Intel MKL is not installed here (pip install mkl)")
    losses = {}
    for blas in ("numpy", "mkl"):
        out = tmp_path / blas
        done = subprocess.run([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--epochs", "1", "--out",
                               str(out)], capture_output=True, text=True, cwd=tmp_path,
                              env=child_env(LEAFPY_BLAS=blas), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        history = json.loads((out / "history.json").read_text())
        losses[blas] = (history[-1]["loss"], history[-1]["test_loss"])
    np.testing.assert_allclose(losses["mkl"], losses["numpy"], rtol=2e-3, err_msg=str(losses))


def test_a_batch_of_one_runs_as_its_product(blas):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, 6, 4)).astype(np.float32)
    b = rng.standard_normal((4, 5)).astype(np.float32)
    out = np.full((1, 6, 5), np.nan, np.float32)
    assert blas.gemm(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    b3 = np.asfortranarray(rng.standard_normal((4, 5))).astype(np.float32)[None]  # column-major, a batch of one
    assert blas.gemm(a, b3, out, 2.0, 1.0)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64) + 2.0 * (a.astype(np.float64) @
                               b3.astype(np.float64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_momentum_update_matches_float64_and_leaves_the_gradient(blas, dtype):
    rng = np.random.default_rng(3)
    n = mkl.MIN_UPDATE + 1001
    for offset in (0, 1):  # arrays starting off a vector boundary too
        w, g, h = (rng.standard_normal(n + offset).astype(dtype)[offset:] for _ in range(3))
        w0, g0, h0 = (x.astype(np.float64) for x in (w, g, h))
        assert blas.momentum(w, g, h, 0.05, 0.9)
        h_ref = 0.9 * h0 + 0.05 * g0
        tol = 1e-6 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(h, h_ref, rtol=tol, atol=tol)
        np.testing.assert_allclose(w, w0 - h_ref, rtol=tol, atol=tol)
        np.testing.assert_array_equal(g, g0.astype(dtype))
    small = np.zeros(mkl.MIN_UPDATE - 1, dtype)
    assert not blas.momentum(small, small.copy(), small.copy(), 0.1, 0.9)
    w = np.zeros(n, dtype)
    assert not blas.momentum(w, w, np.zeros(n, dtype), 0.1, 0.9)  # overlapping: NumPy's
    assert not blas.momentum(w, np.zeros(n, np.float16), np.zeros(n, dtype), 0.1, 0.9)
    assert not blas.momentum(np.zeros((n, 2), dtype)[:, 0], np.zeros(n, dtype), np.zeros(n, dtype), 0.1, 0.9)


def test_the_momentum_update_is_the_same_to_the_bit_wherever_the_arrays_lie():
    real = mkl.load()
    if real is None:
        pytest.skip("Intel MKL is not installed here (pip install mkl)")
    rng = np.random.default_rng(4)
    n = 3 * mkl.MIN_UPDATE + 7
    w, g, h = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    results = []
    for offset in range(4):  # a resumed run's buffers lie elsewhere: its updates must not change
        moved = [np.empty(n + offset, np.float32)[offset:] for _ in range(3)]
        for dst, src in zip(moved, (w, g, h)):
            dst[...] = src
        for _ in range(3):
            assert real.momentum(*moved, 0.01, 0.9)
        results.append(moved[0].copy())
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def _mlp_losses(be, steps=5, kept=None):
    """(the losses, fc1's weight) of a few steps; ``kept``: a list the solver is added to (a deleted solver's
    recorded steps let go of their recordings)."""
    cfg = lp.SequentialConfig(inputs=[("data", [32, 64])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=300)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    rng = np.random.default_rng(12)
    x, y = rng.standard_normal((32, 64), dtype=np.float32), rng.integers(0, 10, 32)
    losses, solver = _trained(be, cfg, x, y, steps, base_lr=0.1, weight_decay=1e-3, seed=2)
    if kept is not None:
        kept.append(solver)
    return losses, solver.network.learnable_weights_data()[0].to_numpy()


def test_a_solver_runs_the_momentum_update_on_mkl_and_a_registered_rule_in_its_place(blas):
    from leafpy.backends import updates

    plain = NativeBackend(blas="numpy")
    with_blas = NativeBackend(blas="numpy")
    with_blas._mkl, with_blas.xp = blas, blas.numpy
    lib = blas.lib
    fake = isinstance(lib, FakeLib)
    before = lib.cblas_saxpby.calls if fake else None
    (expect, w_expect), (got, w_got) = _mlp_losses(plain), _mlp_losses(with_blas)
    np.testing.assert_allclose(got, expect, rtol=1e-5)
    np.testing.assert_allclose(w_got, w_expect, rtol=1e-4, atol=1e-6)
    assert got[-1] < got[0]
    if fake:  # fc1's 19,200 weights went through it twice a step: its weight decay, its update
        assert lib.cblas_saxpby.calls - before == 10
    builtin = updates.TABLE["momentum"]
    try:  # a line registered under the name replaces leafpy's momentum everywhere, MKL's update included
        w, g, h = updates.var("w"), updates.var("g"), updates.var("h")
        updates.register(updates.Rule("momentum", ("h",), ("momentum",), (("h", h * 0.0 + g * 0.0), ("w", w))))
        frozen, w_frozen = _mlp_losses(with_blas)
        assert np.all(frozen == frozen[0])
    finally:
        updates.register(builtin)


def test_a_replayed_step_runs_its_products_as_calls_worked_out_once_with_the_eager_values(blas):
    """A recorded step keeps each product MKL takes as MKL's function with the addresses worked out
    (Mkl.gemm_call): replayed, it gives the values of the same steps run as they are, to the bit."""
    def backend(replay):
        be = NativeBackend(blas="numpy")
        be._mkl, be.xp, be.replay = blas, blas.numpy, replay
        return be

    eager, replayed = backend(False), backend(True)
    kept: list = []
    (expect, w_expect), (got, w_got) = _mlp_losses(eager, steps=8), _mlp_losses(replayed, steps=8, kept=kept)
    assert replayed.replays >= 5 and eager.replays == 0
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(w_got, w_expect)
    recording = next(e.recording for e in replayed.recorder.steps.values() if e.recording is not None)
    names = [getattr(fn, "__name__", "") for fn, _, _ in recording]
    # fc1 and fc2 forward, both filter gradients, fc2's data gradient: MKL's calls, no product left to dispatch
    assert "gemm" not in names and names.count("call") == 5, names


@pytest.mark.parametrize("layout", ["c", "f", "rows"])
def test_a_recorded_product_replays_as_the_call_it_was_in_any_layout_and_argument_form(blas, layout):
    """NativeBackend._replay_call against the product run as it is, bit for bit: positional and keyword forms,
    transposed operands, a column-major or padded output (the transposed path), a batch and a batch of one."""
    be = NativeBackend(blas="numpy")
    be._mkl, be.xp = blas, blas.numpy
    gemm = type(be).gemm.__wrapped__
    rng = np.random.default_rng(21)
    cases = [((7, 5), False, (6, 5), True, (7, 6)), ((5, 7), True, (5, 6), False, (7, 6)),
             ((3, 7, 5), False, (5, 6), False, (3, 7, 6)), ((1, 7, 5), False, (1, 5, 6), False, (1, 7, 6)),
             ((4, 7, 5), False, (4, 5, 6), False, (4, 7, 6))]  # (a, trans_a, b, trans_b, out) as gemm takes them
    for a_shape, trans_a, b_shape, trans_b, out_shape in cases:
        a, b = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
        start = rng.standard_normal(out_shape).astype(np.float32)
        for form in ("positional", "keywords", "defaults"):
            outs = []
            for replayed in (False, True):
                out = _stored(start.copy(), layout, rng) if len(out_shape) == 2 else start.copy()
                out[...] = start
                if form == "positional":
                    args, kwargs = (a, trans_a, b, trans_b, out, 0.5, 0.25), {}
                elif form == "keywords":
                    args, kwargs = (a, trans_a), {"b": b, "trans_b": trans_b, "out": out, "beta": 0.25, "alpha": 0.5}
                else:
                    args, kwargs = (a, trans_a, b, trans_b, out), {}
                if replayed:
                    fn, args2, kwargs2 = be._replay_call((gemm.__get__(be), args, kwargs))
                    fn(*args2, **kwargs2)
                else:
                    gemm(be, *args, **kwargs)
                outs.append(np.array(out))
            np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"{a_shape} {b_shape} {layout} {form}")


def test_a_recording_that_cannot_be_worked_out_keeps_its_calls_and_the_step_runs_once(blas, monkeypatch):
    def broken(call):
        raise RuntimeError("cannot work it out")

    eager, replayed = NativeBackend(blas="numpy"), NativeBackend(blas="numpy")
    for be in (eager, replayed):
        be._mkl, be.xp = blas, blas.numpy
    eager.replay = False
    monkeypatch.setattr(replayed, "_replay_call", broken)
    (expect, w_expect), (got, w_got) = _mlp_losses(eager, steps=6), _mlp_losses(replayed, steps=6)
    np.testing.assert_array_equal(got, expect)  # each step ran once: the same losses as the steps run as they are
    np.testing.assert_array_equal(w_got, w_expect)
    assert replayed.replays >= 3


def test_a_product_worked_out_once_keeps_its_operands_and_runs_again(blas):
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((20, 30))
    out = np.full((40, 20), np.nan)
    call = blas.gemm_call(a, b.T, out, 2.0, 0.0)
    expect = 2.0 * a @ b.T
    del a, b
    call()
    np.testing.assert_allclose(out, expect, rtol=1e-12)
    out[...] = 1.0
    call()  # beta 0: what out held is not read
    np.testing.assert_allclose(out, expect, rtol=1e-12)
    assert blas.gemm_call(np.ones((4, 3)), np.ones((3, 5)), np.ones((4, 5), np.float32)) is None  # mixed dtypes


def test_axpby_matches_float64_where_it_runs_and_leaves_the_rest_to_numpy(blas):
    rng = np.random.default_rng(5)
    n = mkl.MIN_UPDATE + 3
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    expect = 5e-4 * x.astype(np.float64) + 1.0 * y
    assert blas.axpby(5e-4, x, 1.0, y)
    np.testing.assert_allclose(y, expect, rtol=1e-6, atol=1e-7)
    y[:] = np.nan
    assert not blas.axpby(2.0, x, 0.0, y)  # beta 0: NumPy's, which ignores y
    assert not blas.axpby(1.0, y, 0.5, y)  # overlapping
    be = NativeBackend(blas="numpy")
    be._mkl, be.xp = blas, blas.numpy
    be.axpby(2.0, x, 0.0, y)
    np.testing.assert_array_equal(y, 2.0 * x)
    small = np.ones(10, np.float32)
    be.axpby(0.5, small, 2.0, small.copy())  # small: NumPy's, no error
