"""Lowering target: the direct sparse convolution (plan/conv.py). Pure: render_conv(plan) -> PTX.

The csr-columns kernel (mappings/csr/render.py render_columns) over an implicit im2col: lanes across output
pixels, a warp per output channel (or several splitting its nonzeros). Per pixel a lane keeps the base
(oh*sh - ph)*W + (ow*sw - pw) (times Cin in nhwc) and a mask of the taps inside the image (32 bits up to 32
taps, else 64; zero for a pixel past N); per nonzero it unpacks the slot (offset | tap << 26) into the
offset and the tap's bit, and per pixel loads x[base + offset] if mask & bit. So a pixel's test is one AND
(the nonzero's presence and the N tail are folded in: slots past a row's end carry EMPTY_TAP, whose bit no
mask holds).
Parameters: x ([batch,] Cin x H x W; nhwc: [batch,] H x W x Cin in memory), y ([batch,] Cout x OH x OW;
nhwc: OH x OW x Cout), values, packed slots (int32), rows (int32 pairs), bias (fp32 or null), then residual
(as y) when the plan adds one.
"""
from __future__ import annotations

from ..plan.conv import EMPTY_TAP, MAX_OFFSET, TAP_SHIFT, ConvPlan
from ..plan.config import WARP
from ..mappings.csr.render import render_columns
from .emitter import Emitter
from .ptx import KernelSource


class ImplicitConv:
    """The operand of the direct convolution: the input image, read through per-pixel bases and tap masks."""
    params = ("p_x", "p_c", "p_values", "p_cols", "p_rows", "p_bias")
    empty_slot = EMPTY_TAP << TAP_SHIFT

    def __init__(self, layout: str):
        self.title = (f"direct sparse Conv2d (implicit im2col, {layout.upper()}) over padded CSR, a warp per "
                      "output channel")

    @staticmethod
    def output_strides(plan: ConvPlan) -> tuple[int, int]:
        """(elements between output channels, between pixels): nchw (N, 1), nhwc (1, Cout)."""
        return (1, plan.M) if plan.geometry.layout == "nhwc" else (plan.N, 1)

    @staticmethod
    def _bits(plan: ConvPlan) -> int:
        return 32 if plan.geometry.taps <= 32 else 64

    def registers(self, plan: ConvPlan) -> list[str]:
        c, b = plan.config.columns, self._bits(plan)
        return [".reg .b64 %rdb, " + ", ".join(f"%rdx{j}_{i}" for j in range(WARP) for i in range(c)) + ";",
                f".reg .b{b} %mt, " + ", ".join(f"%tm{i}" for i in range(c)) + ", "
                + ", ".join(f"%bt{j}" for j in range(WARP)) + ";",
                ".reg .b32 %oh, %ow, %ih, %iw, " + ", ".join(f"%cb{i}" for i in range(c)) + ", "
                + ", ".join(f"%tp{j}, %of{j}" for j in range(WARP)) + ";",
                ".reg .pred %pr, %ps, %pv;"]

    def setup(self, e: Emitter, plan: ConvPlan) -> None:
        g, es, b = plan.geometry, plan.element_bytes, self._bits(plan)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.stride, g.padding, g.dilation
        e.comment("x base of this batch entry")
        e.lines(["ld.param.u64 %rdb, [p_x];", "cvta.to.global.u64 %rdb, %rdb;",
                 f"mul.lo.u64 %rdt, %rdz, {g.channels * g.height * g.width * es};", "add.s64 %rdb, %rdb, %rdt;"])
        for i in range(plan.config.columns):
            e.comment(f"pixel {i} of the lane (tile start + lane + {i * WARP}): its base and in-image taps")
            e.lines([f"add.u32 %t, %rn0, {i * WARP};", f"div.u32 %oh, %t, {g.out_width};",
                     f"rem.u32 %ow, %t, {g.out_width};",
                     f"mul.lo.u32 %oh, %oh, {sh};", f"sub.u32 %oh, %oh, {ph};",  # first input row (may be < 0)
                     f"mul.lo.u32 %ow, %ow, {sw};", f"sub.u32 %ow, %ow, {pw};",
                     f"mad.lo.u32 %cb{i}, %oh, {g.width}, %ow;", f"mov.b{b} %tm{i}, 0;"])
            if g.pixel_stride > 1:  # nhwc: a pixel's channels lie together, pixels Cin elements apart
                e.line(f"mul.lo.u32 %cb{i}, %cb{i}, {g.pixel_stride};")
            for r in range(kh):
                # unsigned compare: a row above the image wraps to a large number and fails it too
                e.lines([f"add.u32 %ih, %oh, {r * dh};", f"setp.lt.u32 %pr, %ih, {g.height};"])
                for s in range(kw):
                    e.lines([f"add.u32 %iw, %ow, {s * dw};", f"setp.lt.u32 %ps, %iw, {g.width};",
                             "and.pred %pv, %pr, %ps;", f"@%pv or.b{b} %tm{i}, %tm{i}, {1 << (r * kw + s)};"])
            e.line(f"selp.b{b} %tm{i}, %tm{i}, 0, %pn{i};  // a pixel past N loads nothing")

    def nonzero(self, e: Emitter, plan: ConvPlan, j: int) -> None:
        b = self._bits(plan)
        # shl.b32 by EMPTY_TAP (63) is 0, and a 64-bit mask never holds bit 63: an empty slot is in no mask
        e.lines([f"shr.u32 %tp{j}, %cj{j}, {TAP_SHIFT};", f"and.b32 %of{j}, %cj{j}, {MAX_OFFSET - 1};",
                 f"shl.b{b} %bt{j}, 1, %tp{j};"])

    def load(self, e: Emitter, plan: ConvPlan, j: int, v: int, offset: int) -> str:
        """Pixel v of the lane (loads are single elements): x[base_v + offset_j] if tap_j is inside."""
        b = self._bits(plan)
        e.lines([f"and.b{b} %mt, %tm{v}, %bt{j};", f"setp.ne.u{b} %pq{j}_{v}, %mt, 0;",
                 f"add.u32 %t, %cb{v}, %of{j};", f"mad.wide.s32 %rdx{j}_{v}, %t, {plan.element_bytes}, %rdb;"])
        return f"[%rdx{j}_{v}]"


def render_conv(plan: ConvPlan) -> KernelSource:
    return render_columns(plan, ImplicitConv(plan.geometry.layout))
