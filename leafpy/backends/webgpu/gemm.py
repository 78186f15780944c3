"""The webgpu backend's matrix products (gemm.wgsl, and its float16 builds where operands are float16): the tile
choice, split-K with its sum of partials, and products whose operands exceed the storage-binding limit computed in
blocks. Uses the reductions family (split-K's sums) and the binding family below it."""

from __future__ import annotations

from ...errors import BackendError
from .binding import Family, SplitSumHalfParams
from .encoder import Dispatch
from .params import ElementwiseParams, GemmParams
from .reduce import Reductions
from .view import WView


class Gemms(Family):
    """GEMM tiles and split-K."""

    def __init__(self, sums: Reductions) -> None:
        super().__init__(sums.binding)
        self.sums = sums

    # --- BLAS ---------------------------------------------------------------------------------------------------
    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        m, n = out.shape
        k = a.shape[0] if trans_a else a.shape[1]
        self.product(a, trans_a, b, trans_b, out, m, n, k, alpha, beta)

    SPLIT_K_TILES = 1024
    """Split K across the grid when C has fewer tiles than this and K is long (weight gradients): a large GPU
    holds several 256-thread workgroups per multiprocessor, so a grid needs about this many to fill it."""

    SPLIT_K_FROM = 512
    """Products with at least this long a K may be split (2048 -> 512: LeNet-1024's fc1 filter gradient and
    forward fill an H200 in 2.11 instead of 2.18 ms of GPU time per step)."""
    SPLIT_K_MIN = 256
    """The shortest K range of one split (its partial product is written out and summed)."""
    SPLIT_K_FINE_WORK = 1 << 26
    SPLIT_K_FINE_GROUPS = 64
    SPLIT_K_FINE_MIN = 64
    """A plain product of at least SPLIT_K_FINE_WORK multiply-adds that splitting by SPLIT_K_MIN would still run
    as fewer than SPLIT_K_FINE_GROUPS workgroups (under half the multiprocessors of a large GPU) splits K down to
    SPLIT_K_FINE_MIN: long serial K loops on a few multiprocessors (an LSTM's per-step recurrent products, 64 x
    2048 by 512 and 64 x 512 by 2048: 32 workgroups each) otherwise set the step's time, while smaller products
    (MLP-128's) gained less than the partial sums cost (the benchmarks' other networks split as before)."""

    SPLIT_SUM_ROWS = 16384
    """Split-K products with at most this many outputs sum their partials with a workgroup per output (where each
    has at least :data:`SPLIT_SUM_ROWS_PARTIALS`)."""
    SPLIT_SUM_ROWS_PARTIALS = 16
    """Fewer partials per output are summed by a thread per output: a workgroup adding up three numbers leaves
    almost all its threads idle (a batch-8 LeNet forward on SwiftShader spent 90% of its time so, in fc1's sum)."""

    SMALL_TILES = True
    """Products with a side of at most 32 use 32x32 tiles."""
    BIG_TILES_SPLIT_K = True
    """Whether products too small for 128x128 tiles take them anyway when split-K will fill the GPU (the filter
    gradients of AlexNet's conv3-5 ran 1.15-1.2x faster so on an H200)."""

    WIDE_TILE_RATE = 1.1
    BIG_TILE_RATE = 1.2
    """Speeds of 64x128 and 128x128 tiles relative to 64x64 on products large enough for them: the choice weighs a
    tile's rate against the padding it adds to m and n."""

    def tile(self, m: int, n: int, k: int = 0, batch: int = 1) -> tuple[str, int, int, tuple]:
        """The kernel for an m x n product as (entry point, tile rows, tile columns, its pipeline constants): 32x32
        tiles where a side is that short; otherwise, of 64x64, 64x128 and 128x128 tiles, the one with the least
        padded area per unit of speed among those with enough tiles to fill the GPU (256, or fewer where split-K
        will fill it); 64x64 always qualifies."""
        if self.SMALL_TILES and min(m, n) <= 32:
            return "gemm", 32, 32, (("TS", 8), ("TILES", 128))
        best: float | None = None
        choice: tuple[str, int, int, tuple] = ("gemm", 64, 64, ())
        for tm, tn, rate in ((64, 64, 1.0), (64, 128, self.WIDE_TILE_RATE), (128, 128, self.BIG_TILE_RATE)):
            tiles = -(-m // tm) * -(-n // tn) * batch
            if (tm, tn) != (64, 64) and not (tiles >= 256 or (self.BIG_TILES_SPLIT_K and k >= self.SPLIT_K_FROM)):
                continue
            cost = tiles * tm * tn / rate
            if best is None or cost < best:
                best = cost
                choice = ("gemm", 64, 64, ()) if tm == tn == 64 else \
                    ("gemm_big", tm, tn, (("BIG_ROWS", tm),) if tm != 128 else ())
        return choice

    def product(self, a, trans_a, b, trans_b, out, m, n, k, alpha, beta, conv: tuple = (), n0: int = 0,
              bias: WView | None = None, batch: int = 1) -> None:
        """``conv``: convolution geometry and operand modes as pipeline constants (see gemm.wgsl), with ``n0`` the
        first sample; the caller makes sure every operand fits one binding. ``bias``: added per row of C (a
        convolution's output channel; C_MODE 1 only). ``batch``: that many products of this shape, stored one
        after another in a, b and out (plain operands), in one dispatch."""
        module = self.module(a, b, out)
        lds = {"lda": m if trans_a else k, "ldb": k if trans_b else n, "ldc": n}  # row strides as stored
        consts = (("TRANS_A", int(trans_a)), ("TRANS_B", int(trans_b))) + conv
        if bias is not None:
            consts += (("HAS_BIAS", 1),)
        operands = [a, b, out, bias if bias is not None else self._scratch_buffer(1, "nobias"),
                    self._scratch_buffer(1, "noact")]
        if not conv and max(a.raw.size, b.raw.size, out.raw.size) > self.gpu.max_binding:
            return self._blocks(operands, trans_a, trans_b, m, n, k, alpha, beta, consts, lds)
        entry, tm, tn, tile_consts = self.tile(m, n, k, batch)
        consts += tile_consts
        gx, gy = -(-n // tn), -(-m // tm)
        if gy > self.gpu.max_groups:
            raise BackendError(f"webgpu: a GEMM of {m} rows needs {gy} workgroups in a grid dimension; this device "
                               f"allows {self.gpu.max_groups}: use a smaller batch")
        if batch > 1:  # z = split * batch + product
            consts += (("BATCHED", 1),)
        tiles = gx * gy * batch
        outputs = batch * m * n
        splits, chunk = (1, k) if "C_MODE" in dict(conv) else self._k_splits(
            tiles, tm, m, n, k, batch, bool(conv))
        # columns past the device's grid width run as several dispatches, each from its first column (col0)
        spans = [(c0, min(gx - c0, self.gpu.max_groups)) for c0 in range(0, gx, self.gpu.max_groups)]
        shape = dict(m=m, n=n, k=k, first_sample=n0, batch=batch, **lds)
        if splits == 1 and len(spans) == 1 and batch == 1:  # encoded at the next dispatch: a bias or ReLU may join
            self.enc.defer(Dispatch(module, entry, GemmParams(**shape, k_slice=k, alpha=alpha, beta=beta), operands,
                                    (gx, gy, 1), None, consts), (m, n), out)
            return
        if splits == 1:
            for c0, cx in spans:
                self._dispatch(module, entry, GemmParams(**shape, k_slice=k, col0=c0 * tn, alpha=alpha, beta=beta),
                               operands, (cx, gy, batch), constants=consts)
            return
        partial = self._scratch_buffer(splits * outputs, "splitk")  # float32 partials, whatever C's format
        for c0, cx in spans:
            self._dispatch(self.module(a, b, partial), entry, GemmParams(**shape, k_slice=chunk, col0=c0 * tn,
                                                                               alpha=1.0),
                           [a, b, partial, *operands[3:]], (cx, gy, splits * batch), constants=consts)
        if outputs <= self.SPLIT_SUM_ROWS and splits >= self.SPLIT_SUM_ROWS_PARTIALS:  # one workgroup per output
            def emit() -> None:
                self.sums.sum_rows(partial, out, splits, outputs, alpha, beta, columns=True)
        else:
            def emit() -> None:
                self.split_sum(partial, out, splits, outputs, alpha, beta)
        if batch == 1 and out.size == outputs and out.dtype.itemsize == 4:
            self.enc.defer_sum(out, partial, splits, alpha, beta, emit)  # a recurrent cell next may add them itself
        else:
            emit()

    def _k_splits(self, tiles: int, tm: int, m: int, n: int, k: int, batch: int = 1,
                  conv: bool = False) -> tuple[int, int]:
        """(ranges, their length) of K for a product of ``tiles`` workgroups (tiles of ``tm`` rows), each range
        writing a float32 partial product that is then summed: enough ranges to fill the GPU where the tiles alone
        do not and K is long (see SPLIT_K_TILES, SPLIT_K_FROM, SPLIT_K_MIN and SPLIT_K_FINE_*), as long as the
        partials fit one binding; (1, k) for none."""
        fill = self.SPLIT_K_TILES * (4 if tm == 32 else 1)  # 32x32 tiles run 64 threads, the others 256
        if tiles >= fill or k < self.SPLIT_K_FROM:
            return 1, k
        shortest = self.SPLIT_K_MIN
        if (not conv and m * n * k * batch >= self.SPLIT_K_FINE_WORK
                and tiles * min(-(-fill // tiles), k // shortest) < self.SPLIT_K_FINE_GROUPS):
            shortest = self.SPLIT_K_FINE_MIN
        splits = max(1, min(-(-fill // tiles), k // shortest, self.gpu.max_groups // batch))
        while splits > 1 and splits * batch * m * n * 4 > self.gpu.max_binding:
            splits //= 2
        if splits == 1:
            return 1, k
        chunk = -(-k // splits)
        chunk = -(-chunk // 16) * 16  # whole K slices of either kernel
        return -(-k // chunk), chunk

    def split_sum(self, partial: WView, out: WView, splits: int, outputs: int, alpha: float, beta: float) -> None:
        """out = alpha * (the sum of the ``splits`` slices of ``partial``) + beta * out, a thread per output (a
        float16 out rounded once)."""
        if out.dtype.itemsize == 2:
            self._elementwise("split_sum_h", outputs, [partial, out], SplitSumHalfParams, whole=(0,),
                                     slices=splits, alpha=alpha, beta=beta)
            return
        self._elementwise("split_sum", outputs, [partial, out], ElementwiseParams, whole=(0,), slices=splits,
                          part_inner=outputs, whole_inner=outputs, alpha=alpha, beta=beta)

    def module(self, a: WView, b: WView, out: WView) -> str:
        """gemm.wgsl with the operands that are float16 declared so (C's Bias and ActOut with C), built on first
        use: gemm16AB is float16 A and B into a float32 C; the tiles in workgroup memory, the products and the sums
        stay float32, and a float16 C is rounded once, when stored. "gemm" for float32 operands."""
        if a.dtype.itemsize == b.dtype.itemsize == out.dtype.itemsize == 4:
            return "gemm"
        return self.gpu.epilogue_module("gemm", [name for name, v in zip("ABC", (a, b, out)) if v.dtype.itemsize == 2])

    def _blocks(self, operands, trans_a, trans_b, m, n, k, alpha, beta, consts, lds) -> None:
        """A product whose operands exceed the storage-binding limit, in blocks of C whose rows of A, rows of B^T
        and rows of C can each be bound, and, where a transposed A or an untransposed B (stored K-major) is too
        large, in ranges of K whose products add up in C (weight gradients over a long sequence)."""
        a, b, out = operands[:3]
        limit = self.gpu.max_binding - self.gpu.offset_align  # room for aligning each binding's start down

        def a_bytes(mb: int, kb: int) -> int:
            return kb * m * 4 if trans_a else mb * k * 4

        def b_bytes(nb: int, kb: int) -> int:
            return nb * k * 4 if trans_b else kb * n * 4

        mb, nb = min(m, 32 * self.gpu.max_groups), min(n, 32 * self.gpu.max_groups)  # any tile's grid fits the device's
        kb = k
        while kb > 1 and ((trans_a and kb * m * 4 > limit) or (not trans_b and kb * n * 4 > limit)):
            kb = -(-kb // 2)
        while mb > 1 and (a_bytes(mb, kb) > limit or mb * n * 4 > limit):
            mb = -(-mb // 2)
        while nb > 1 and b_bytes(nb, kb) > limit:
            nb = -(-nb // 2)
        if a_bytes(mb, kb) > limit or b_bytes(nb, kb) > limit or mb * n * 4 > limit:
            raise BackendError(f"webgpu: a {m}x{k} by {k}x{n} GEMM cannot be split under the device's storage "
                               f"binding limit ({self.gpu.max_binding} bytes): one row of A, B or C as stored is "
                               "larger than that; use a smaller layer or batch, or the cuda or native backend")

        for k0 in range(0, k, kb):
            kk = min(kb, k - k0)
            for m0 in range(0, m, mb):
                mm = min(mb, m - m0)
                for n0 in range(0, n, nb):
                    nn = min(nb, n - n0)
                    ra = self._span(k0 * m * 4, (k0 + kk) * m * 4) if trans_a else \
                        self._span(m0 * k * 4, (m0 + mm) * k * 4)
                    rb = self._span(n0 * k * 4, (n0 + nn) * k * 4) if trans_b else \
                        self._span(k0 * n * 4, (k0 + kk) * n * 4)
                    rc = self._span((m0 * n + n0) * 4, ((m0 + mm - 1) * n + n0 + nn) * 4)
                    a_off = ra[2] + (m0 if trans_a else k0)
                    b_off = rb[2] + (k0 if trans_b else n0)
                    entry, tm, tn, tile_consts = self.tile(mm, nn, kk)
                    gx, gy = -(-nn // tn), -(-mm // tm)
                    splits, chunk = self._k_splits(gx * gy, tm, mm, nn, kk)
                    if splits == 1:
                        params = GemmParams(m=mm, n=nn, k=kk, batch=1, a_offset=a_off, b_offset=b_off,
                                            c_offset=rc[2], k_slice=kk, **lds, alpha=alpha,
                                            beta=beta if k0 == 0 else 1.0)
                        self._dispatch("gemm", entry, params, operands, (gx, gy, 1),
                                       [ra[:2], rb[:2], rc[:2], None, None], constants=consts + tile_consts)
                        continue
                    # too few tiles for a long K (a large layer's product at a small batch): split K, the
                    # partials [splits, mm, nn] summed into the block of C, which is rows of nn in rows of n
                    partial = self._scratch_buffer(splits * mm * nn, "splitk")
                    params = GemmParams(m=mm, n=nn, k=kk, batch=1, a_offset=a_off, b_offset=b_off, c_offset=0,
                                        k_slice=chunk, **{**lds, "ldc": nn}, alpha=1.0)
                    self._dispatch("gemm", entry, params, [a, b, partial, *operands[3:]], (gx, gy, splits),
                                   [ra[:2], rb[:2], None, None, None], constants=consts + tile_consts)
                    count = mm * nn
                    self._dispatch("elementwise", "split_sum", ElementwiseParams(
                        count=count, slices=splits, part_inner=nn, whole_inner=n, column=rc[2], alpha=alpha,
                        beta=beta if k0 == 0 else 1.0), [partial, out], self._grid(count), [None, rc[:2]])
