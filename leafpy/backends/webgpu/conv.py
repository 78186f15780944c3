"""The webgpu backend's convolutions and pooling: implicit GEMM (gemm.wgsl reads x and dy and writes y in NCHW),
im2col columns in batch chunks past the binding limit (conv.wgsl), Winograd F(2x2, 3x3) and F(2x2, 5x5)
(winograd.wgsl), max and average pooling (pool.wgsl); float16 builds of those modules where operands are float16.
Uses the gemm family (implicit GEMMs, Winograd's tile products), the elementwise family (bias adds) and the binding
family."""

from __future__ import annotations

import numpy as np

from ..base import plain_conv
from .binding import Family
from .elementwise import Elementwise
from .encoder import Dispatch
from .gemm import Gemms
from .params import ConvParams, DirectParams, PoolParams, WinogradParams
from .view import WView


class Convolution(Family):
    """Convolution and pooling."""

    def __init__(self, gemms: Gemms, ew: Elementwise) -> None:
        super().__init__(gemms.binding)
        self.gemms = gemms
        self.ew = ew

    # --- convolution: implicit GEMM (the GEMM kernel reads x and dy and writes y in NCHW itself); the data gradient
    # and tensors past the binding limit go through im2col columns in batch chunks ----------------------------------
    CONV_SCRATCH = 256 << 20
    """Bytes of im2col columns per batch chunk: larger chunks give each GEMM enough tiles to fill a large GPU."""

    def conv_geometry(self, x_shape, w_shape, y_shape, stride, padding):
        n, c, h, w = x_shape
        o, _, kh, kw = w_shape
        oh, ow = y_shape[2], y_shape[3]
        k = c * kh * kw
        per_sample = k * oh * ow * 4
        limit = min(self.gpu.max_binding, self.CONV_SCRATCH)
        chunk = max(1, min(n, limit // max(per_sample, 1)))
        # a chunk's samples of x and y are bound as one range each
        chunk = max(1, min(chunk, (self.gpu.max_binding - self.gpu.offset_align) // (4 * max(c * h * w, o * oh * ow))))
        geometry = self.conv_constants(x_shape, w_shape, y_shape, stride, padding)
        return n, c, o, k, oh * ow, chunk, tuple(g for g in geometry if g[0] != "CONV_O")

    @staticmethod
    def conv_constants(x_shape, w_shape, y_shape, stride, padding, **modes) -> tuple:
        _, c, h, w = x_shape
        o, _, kh, kw = w_shape
        geometry = dict(CONV_C=c, IN_H=h, IN_W=w, CONV_O=o, KH=kh, KW=kw, SH=stride[0], SW=stride[1],
                        PH=padding[0], PW=padding[1], OH=y_shape[2], OW=y_shape[3])
        return tuple(modes.items()) + tuple(geometry.items())

    implicit_conv = True
    """Convolutions read x and dy in place (implicit GEMM); False: always through im2col columns."""
    implicit_data_grad = False
    """The data gradient as one implicit GEMM too (stride 1, where it does no more work): it needs no columns (on
    AlexNet-128 600 MB less scratch) but its gathers made it 1.3x slower than GEMM + col2im on an H200."""

    def _fits(self, *buffers: WView) -> bool:
        return self.implicit_conv and max(b.raw.size for b in buffers) <= self.gpu.max_binding

    def _conv_scratch(self, k: int, p: int, chunk: int, o: int) -> tuple[WView, WView]:
        return self._scratch_buffer(k * p * chunk, "cols"), self._scratch_buffer(o * p * chunk, "ymat")

    def _conv_launch(self, entry: str, geometry: tuple, count: int, n0: int, nc: int, o: int, src: WView,
                     dst: WView, to_gemm: bool = False):
        """A layout pass over samples [n0, n0 + nc); the NCHW tensor (x or dy read, y or dx written) is bound
        whole where it fits, else just those samples."""
        nchw = 0 if entry == "im2col" or to_gemm else 1
        tensor = (src, dst)[nchw]
        per_sample = tensor.size // tensor.shape[0]
        ranges: list = [None, None]
        offset = n0 * per_sample
        if tensor.raw.size > self.gpu.max_binding:
            base, size, offset = self._span(offset * 4, (n0 + nc) * per_sample * 4)
            ranges[nchw] = (base, size)
        params = ConvParams(count=count, offset=offset, samples=nc, out_channels=o, to_gemm=int(to_gemm))
        self._dispatch("conv", entry, params, [src, dst], self._grid(count), ranges, constants=geometry)

    winograd = True
    """Stride-1 convolutions with 3x3 or 5x5 windows and at least WINOGRAD_MIN_CHANNELS channels in and out run
    forward, data gradient and filter gradient as Winograd F(4x4, 3x3) and F(3x3, 5x5), or F(2x2, 3x3) and
    F(2x2, 5x5) with ``winograd_f4x4`` and ``winograd_f3x3`` off (winograd.wgsl): a batched GEMM over the tile's
    36, 49, 16 or 36 points between transforms, so 2.25, 5.4, 4 or 9 multiplications per output instead of 9 or 25
    (F(2x2, 3x3) and F(2x2, 5x5): 1.94x and 2.58x fewer on AlexNet's 13x13 and 27x27 maps, whose last blocks
    overhang; F(4x4, 3x3): 2.64x on 13x13; F(3x3, 5x5): 4.6x on 27x27)."""
    winograd_f4x4 = True
    """3x3 windows run F(4x4, 3x3) (36-point tiles over 4x4 output blocks: 2.25 multiplications per output, 0.73x
    F(2x2, 3x3)'s GEMM work on a 13x13 map) instead of F(2x2, 3x3)."""
    winograd_f3x3 = True
    """5x5 windows run F(3x3, 5x5) (49-point tiles over 3x3 output blocks: 5.4 multiplications per output, 0.56x
    F(2x2, 5x5)'s GEMM work on a 27x27 map) instead of F(2x2, 5x5)."""
    WINOGRAD_MIN_CHANNELS = 64
    WINOGRAD_SCRATCH = 1 << 30
    """Bytes of transformed tiles per batch chunk (and at most the device's storage-binding limit)."""
    winograd_filter_grad = True
    """Whether the filter gradient takes Winograd too (where ``winograd`` applies)."""
    winograd_f16_tiles = False
    """float16 3x3 convolutions keep their transformed tiles (U, V, M; the filter gradient's transformed x and dy)
    in float16 too, halving the transforms' and the tile products' memory traffic; the filter gradient's sums stay
    float32. Measured on 64 -> 64 channels at 13x13 against float64 (max error / max value): 5.8e-4, 6.9e-4, 5.3e-4
    for the forward pass, data and filter gradients, against 2.6e-4, 2.6e-4, 4.8e-7 with float32 tiles (float16's
    unit roundoff: 4.9e-4). F(2x2, 5x5) keeps float32 tiles whatever this says: its larger transform coefficients
    made float16 tiles 7.6e-3 to 1.1e-2 off (64 -> 96 channels at 27x27). Off by default until a GPU shows the
    traffic saved is worth a second rounding (and a loss-scaled gradient's transform, up to 4x its largest value,
    overflows float16 sooner: the loss scale backs off further)."""

    def winograd_chunk(self, x_shape, w_shape, y_shape, stride, padding) -> int:
        """Samples per batch chunk where ``y = conv(x, w)`` (and the data and filter gradients of that geometry) can
        run as Winograd on this device; 0 where it cannot."""
        n, c, h, wd = x_shape
        o, oh, ow = y_shape[1], y_shape[2], y_shape[3]
        r = w_shape[2]
        if not (self.winograd and r in (3, 5) and w_shape[3] == r and tuple(stride) == (1, 1)
                and all(0 <= q < r for q in padding) and min(c, o) >= self.WINOGRAD_MIN_CHANNELS):
            return 0
        if 4 * max(n * c * h * wd, n * o * oh * ow) > self.gpu.max_binding:
            return 0
        m = self.winograd_block(r)
        per_sample = -(-max(h, oh) // m) * -(-max(wd, ow) // m)  # blocks: the data gradient's tile x
        tile_bytes = 4 * (m + r - 1) ** 2 * max(c, o) * per_sample
        chunk = min(n, min(self.gpu.max_binding, self.WINOGRAD_SCRATCH) // tile_bytes)
        if chunk < 1 or -(-chunk * per_sample // 32) > self.gpu.max_groups:
            return 0
        return chunk

    def winograd_block(self, r: int) -> int:
        """The side of the output blocks of RxR windows' Winograd passes: F(4x4, 3x3), F(3x3, 5x5) or F(2x2, RxR)."""
        if r == 3 and self.winograd_f4x4:
            return 4
        return 3 if r == 5 and self.winograd_f3x3 else 2

    def _block_constant(self, r: int) -> tuple:
        """winograd.wgsl's BLOCK where it is not its default 2."""
        m = self.winograd_block(r)
        return (("BLOCK", m),) if m != 2 else ()

    def _winograd_setup(self, x_shape, y_shape, r: int, padding, chunk: int, dtypes: tuple = (np.float32,) * 3):
        """(geometry constants, blocks per sample, points per tile, scratch for U, V and M in ``dtypes``) of one
        Winograd pass, x the transform's input and y its output."""
        _, cin, h, wd = x_shape
        cout, oh, ow = y_shape[1], y_shape[2], y_shape[3]
        m = self.winograd_block(r)
        per_sample = -(-oh // m) * -(-ow // m)
        points = (m + r - 1) ** 2
        geometry = (("CONV_C", cin), ("CONV_O", cout), ("IN_H", h), ("IN_W", wd), ("PH", padding[0]),
                    ("PW", padding[1]), ("OH", oh), ("OW", ow), ("R", r)) + self._block_constant(r)
        blocks = chunk * per_sample
        scratch = (self._scratch_buffer(points * cout * cin, "winograd_u", dtypes[0]),
                   self._scratch_buffer(points * cin * blocks, "winograd_v", dtypes[1]),
                   self._scratch_buffer(points * cout * blocks, "winograd_m", dtypes[2]))
        return geometry, per_sample, points, scratch

    def _tile_dtype(self, r: int, *operands: WView) -> np.dtype:
        """The transformed tiles' dtype for RxR windows: float16 where ``winograd_f16_tiles``, R is 3 and every
        operand is float16."""
        half = self.winograd_f16_tiles and self.winograd_block(r) == 2 and r == 3 and \
            all(v.dtype == np.float16 for v in operands)
        return np.dtype(np.float16 if half else np.float32)

    def _winograd_module(self, src: WView, dst: WView) -> str:
        """winograd.wgsl with src, or dst and its bias, declared float16 where the buffers bound there are (built on
        first use): winograd16src reads a float16 x, w or dy into float32 tiles, winograd16dst stores float32 tiles'
        results into a float16 y, dx or dw; "winograd" for float32 ones. The transforms' arithmetic and the tiles U,
        V and M stay float32 (unless ``winograd_f16_tiles``), so a float16 result is rounded once, when stored."""
        halves = [name for name, v in (("src", src), ("dst", dst)) if v.dtype.itemsize == 2]
        return self.gpu.epilogue_module("winograd", halves)

    def _winograd_blocks(self, entry: str, src: WView, dst: WView, channels: int, blocks: int, n0: int,
                         geometry: tuple) -> None:
        """A transform with a thread per (channel, 2x2 block) of the chunk from sample n0."""
        params = WinogradParams(count=channels * blocks, blocks=blocks, first_sample=n0)
        self._dispatch(self._winograd_module(src, dst), entry, params, [src, dst], self._grid(channels * blocks),
                       constants=geometry)

    def _winograd(self, x: WView, w: WView, y: WView, padding, flip: bool, chunk: int,
                  bias: WView | None = None) -> None:
        """y = the RxR stride-1 correlation of x with w [O][C][R][R] padded by ``padding``, as Winograd F(MxM, RxR)
        (M: :meth:`winograd_block`) in batch chunks; with ``flip`` the data gradient's: x has w's O channels, y its
        C, through w rotated 180 degrees."""
        n, cin = x.shape[:2]
        cout, r = y.shape[1], w.shape[2]
        geometry, per_sample, points, (u, v, m) = self._winograd_setup(x.shape, y.shape, r, padding, chunk,
                                                                       (self._tile_dtype(r, x, w, y),) * 3)
        params = WinogradParams(count=cout * cin, w_out=w.shape[0], w_in=w.shape[1])
        self._dispatch(self._winograd_module(w, u), "winograd_filter", params, [w, u], self._grid(cout * cin),
                       constants=(("FLIP", int(flip)), ("R", r)) + self._block_constant(r))
        out_consts = geometry + ((("HAS_BIAS", 1),) if bias is not None else ())
        bias_or_none = bias if bias is not None else self._scratch_buffer(1, "nobias")
        for n0 in range(0, n, chunk):
            blocks = min(chunk, n - n0) * per_sample
            self._winograd_blocks("winograd_input", x, v, cin, blocks, n0, geometry)
            self.gemms.product(u, False, v, False, m, cout, blocks, cin, 1.0, 0.0, batch=points)
            params = WinogradParams(count=cout * blocks, blocks=blocks, first_sample=n0)
            out = Dispatch(self._winograd_module(m, y), "winograd_output", params, [m, y, bias_or_none],
                           self._grid(cout * blocks), None, out_consts)
            self.enc.defer(out, tuple(y.shape), y)  # an in-place ReLU may join its store
        if chunk < n:
            self.enc.emit_pending()  # a ReLU over all of y cannot join the last chunk's store

    def _winograd_filter_grad(self, x: WView, dy: WView, dw: WView, padding, beta: float, chunk: int) -> None:
        """dw = the filter gradient of an RxR stride-1 convolution (+ beta dw) through Winograd F(MxM, RxR): the
        transformed x and dy blocks multiplied per point of the tile (K = the blocks: split-K), chunk by chunk."""
        n, c = x.shape[:2]
        o, r = dy.shape[1], dw.shape[2]
        tiles = self._tile_dtype(r, x, dy)  # the transformed x and dy; du keeps float32 sums over the blocks
        geometry, per_sample, points, (du, v, z) = self._winograd_setup(x.shape, dy.shape, r, padding, chunk,
                                                                        (np.float32, tiles, tiles))
        for n0 in range(0, n, chunk):
            blocks = min(chunk, n - n0) * per_sample
            self._winograd_blocks("winograd_input", x, v, c, blocks, n0, geometry)
            self._winograd_blocks("winograd_dy", dy, z, o, blocks, n0, geometry)
            self.gemms.product(z, False, v, True, du, o, c, blocks, 1.0, 0.0 if n0 == 0 else 1.0, batch=points)
        self._dispatch(self._winograd_module(du, dw), "winograd_filter_grad", WinogradParams(count=o * c, beta=beta),
                       [du, dw], self._grid(o * c), constants=(("R", r),) + self._block_constant(r))

    def winograd_conv(self, x: WView, w: WView, y: WView, stride, padding, bias: WView | None = None) -> bool:
        """The forward pass as Winograd where ``_winograd_chunk`` says it applies; False where it does not."""
        chunk = self.winograd_chunk(x.shape, w.shape, y.shape, stride, padding)
        if chunk:
            self._winograd(x, w, y, padding, False, chunk, bias)
        return bool(chunk)

    def winograd_conv_grad_data(self, dy: WView, w: WView, dx: WView, stride, padding) -> bool:
        """The data gradient as Winograd where it applies: dx = dy correlated with w rotated 180 degrees (channels
        swapped), padded by R - 1 - padding; False where it does not apply."""
        chunk = self.winograd_chunk(dx.shape, w.shape, dy.shape, stride, padding)
        if chunk:
            r = w.shape[2]
            self._winograd(dy, w, dx, (r - 1 - padding[0], r - 1 - padding[1]), True, chunk)
        return bool(chunk)

    def winograd_conv_grad_filter(self, x: WView, dy: WView, dw: WView, stride, padding, beta: float) -> bool:
        """The filter gradient as Winograd where it applies (and ``winograd_filter_grad``); False elsewhere."""
        chunk = self.winograd_filter_grad and self.winograd_chunk(x.shape, dw.shape, dy.shape, stride, padding)
        if chunk:
            self._winograd_filter_grad(x, dy, dw, padding, beta, chunk)
        return bool(chunk)

    # --- grouped, dilated or asymmetrically padded: direct.wgsl, a thread per element written -------------------
    @staticmethod
    def _direct_constants(x_shape, w_shape, y_shape, stride, padding, dilation, groups) -> tuple:
        n, c, h, w = x_shape
        return (("BATCH", n), ("C_IN", c), ("C_OUT", w_shape[0]), ("GROUPS", groups), ("IN_H", h), ("IN_W", w),
                ("KH", w_shape[2]), ("KW", w_shape[3]), ("SH", stride[0]), ("SW", stride[1]), ("PH", padding[0]),
                ("PW", padding[1]), ("DH", dilation[0]), ("DW", dilation[1]), ("OH", y_shape[2]), ("OW", y_shape[3]))

    def _direct(self, entry: str, a: WView, b: WView, dst: WView, consts: tuple, beta: float = 0.0) -> None:
        self._dispatch("direct", entry, DirectParams(count=dst.size, beta=beta), [a, b, dst], self._grid(dst.size),
                       constants=consts)

    def conv2d(self, x, w, out, stride, padding, ws, bias=None, dilation=(1, 1), groups=1):
        if not plain_conv(x.shape, w.shape, out.shape, stride, padding, dilation, groups):
            consts = self._direct_constants(x.shape, w.shape, out.shape, stride, padding, dilation, groups)
            self._direct("direct_fwd", x, w, out, consts)
            if bias is not None:
                self.ew.bias_add(out, bias)
            return
        if self.winograd_conv(x, w, out, stride, padding, bias):
            return
        n, c, o, k, p, chunk, u = self.conv_geometry(x.shape, w.shape, out.shape, stride, padding)
        if self._fits(x, w, out):
            conv = self.conv_constants(x.shape, w.shape, out.shape, stride, padding, B_MODE=1, C_MODE=1)
            self.gemms.product(w, False, x, False, out, o, n * p, k, 1.0, 0.0, conv, bias=bias)  # bias in the store
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            self._conv_launch("im2col", u, k * nc * p, n0, nc, o, x, cols)
            self.gemms.product(w, False, cols, False, ymat, o, nc * p, k, 1.0, 0.0)
            self._conv_launch("relayout", u, nc * o * p, n0, nc, o, ymat, out)
        if bias is not None:
            self.ew.bias_add(out, bias)

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws, dilation=(1, 1), groups=1):
        if not plain_conv(dx.shape, w.shape, dy.shape, stride, padding, dilation, groups):
            consts = self._direct_constants(dx.shape, w.shape, dy.shape, stride, padding, dilation, groups)
            return self._direct("direct_data", dy, w, dx, consts)
        if self.winograd_conv_grad_data(dy, w, dx, stride, padding):
            return
        n, c, o, k, p, chunk, u = self.conv_geometry(dx.shape, w.shape, dy.shape, stride, padding)
        h, wd = dx.shape[2], dx.shape[3]
        # implicit: dx [C x N*H*W] = w as [C x O*KH*KW] times dy gathered per (o, i, j) and x position, with no
        # columns or col2im; it multiplies every x position by every window offset, so it does more work than the
        # columns where the stride or a smaller output leaves many of those terms zero, or C is far below a tile
        implicit = -(-c // 64) * 64 * n * h * wd * o * w.shape[2] * w.shape[3]
        columns = -(-k // 64) * 64 * n * p * o
        if self.implicit_data_grad and tuple(stride) == (1, 1) and implicit <= 1.1 * columns and self._fits(dy, w, dx):
            conv = self.conv_constants(dx.shape, w.shape, dy.shape, stride, padding, A_MODE=2, B_MODE=4, C_MODE=2)
            self.gemms.product(w, False, dy, False, dx, c, n * h * wd, o * w.shape[2] * w.shape[3], 1.0, 0.0, conv)
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        direct = self._fits(dy)
        conv = self.conv_constants(dx.shape, w.shape, dy.shape, stride, padding, B_MODE=3)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            if direct:  # dy read in NCHW by the GEMM
                self.gemms.product(w, True, dy, False, cols, k, nc * p, o, 1.0, 0.0, conv, n0)
            else:
                self._conv_launch("relayout", u, nc * o * p, n0, nc, o, dy, ymat, to_gemm=True)
                self.gemms.product(w, True, ymat, False, cols, k, nc * p, o, 1.0, 0.0)
            self._conv_launch("col2im", u, nc * c * h * wd, n0, nc, o, cols, dx)

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0, dilation=(1, 1), groups=1):
        if not plain_conv(x.shape, dw.shape, dy.shape, stride, padding, dilation, groups):
            consts = self._direct_constants(x.shape, dw.shape, dy.shape, stride, padding, dilation, groups)
            return self._direct("direct_filter", x, dy, dw, consts, beta)
        if self.winograd_conv_grad_filter(x, dy, dw, stride, padding, beta):
            return
        n, c, o, k, p, chunk, u = self.conv_geometry(x.shape, dw.shape, dy.shape, stride, padding)
        if self._fits(x, dy):
            # dw [O x CKK] = dy [O x N*P] times the im2col columns transposed [N*P x CKK], both read in place
            conv = self.conv_constants(x.shape, dw.shape, dy.shape, stride, padding, A_MODE=1, B_MODE=2)
            self.gemms.product(dy, False, x, True, dw, o, k, n * p, 1.0, beta, conv)
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            self._conv_launch("im2col", u, k * nc * p, n0, nc, o, x, cols)
            self._conv_launch("relayout", u, nc * o * p, n0, nc, o, dy, ymat, to_gemm=True)
            self.gemms.product(ymat, False, cols, True, dw, o, k, nc * p, 1.0, beta if n0 == 0 else 1.0)

    # --- pooling ------------------------------------------------------------------------------------------------
    @staticmethod
    def _pool_constants(x_shape, y_shape, kernel, stride, padding, is_max, pad_end=None, count_pad=True) -> tuple:
        h, w = x_shape[2], x_shape[3]
        end = pad_end or padding
        bounds = (-padding[0], -padding[1], h + end[0], w + end[1]) if count_pad else (0, 0, h, w)
        return (("IS_MAX", int(is_max)), ("IN_H", h), ("IN_W", w), ("KH", kernel[0]),
                ("KW", kernel[1]), ("SH", stride[0]), ("SW", stride[1]), ("PH", padding[0]), ("PW", padding[1]),
                ("OH", y_shape[2]), ("OW", y_shape[3])) + tuple(zip(("LH", "LW", "HH", "HW"), bounds))

    def pool2d(self, x, out, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        m = mask if mask is not None else self._scratch_buffer(out.size, "nomask")
        consts = self._pool_constants(x.shape, out.shape, kernel, stride, padding, mode == "max", pad_end, count_pad)
        self._pool("pool_fwd", [x, out, m], x.shape, out.shape, out.shape, consts)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        m = mask if mask is not None else self._scratch_buffer(dy.size, "nomask")
        consts = self._pool_constants(dx.shape, dy.shape, kernel, stride, padding, mode == "max", pad_end, count_pad)
        tiled = (tuple(kernel) == tuple(stride) and tuple(padding) == (0, 0)
                 and (dx.shape[2], dx.shape[3]) == (dy.shape[2] * stride[0], dy.shape[3] * stride[1]))
        if tiled:  # each input in exactly one window: a thread per output writes its window
            self._pool("pool_bwd_tiled", [dy, dx, m], dy.shape, dx.shape, dy.shape, consts, per_thread=0)
        else:  # a thread per input sums over the windows that hold it
            self._pool("pool_bwd", [dy, dx, m], dy.shape, dx.shape, dy.shape, consts)

    def _pool(self, entry: str, buffers: list, src_shape, dst_shape, mask_shape, consts: tuple,
              per_thread: int = 1) -> None:
        """One thread per dst element (per src element with ``per_thread=0``), over runs of (n, c) planes whose
        bindings fit the device's limit."""
        module = "pool16" if buffers[0].dtype.itemsize == 2 else "pool"  # float16 src and dst: pool16
        planes = dst_shape[0] * dst_shape[1]
        sizes = [s[2] * s[3] for s in (src_shape, dst_shape, mask_shape)]
        for p0, p1, binds, offsets in self._item_chunks(planes, sizes):
            count = (p1 - p0) * sizes[per_thread]
            params = PoolParams(count=count, **dict(zip(("src_offset", "dst_offset", "mask_offset"), offsets)))
            self._dispatch(module, entry, params, buffers, self._grid(count), binds, constants=consts)
