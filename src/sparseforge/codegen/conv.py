"""Lowering target: the direct sparse convolution (plan/conv.py). Pure: render_conv(plan) -> PTX.

The csr-columns kernel (codegen/csr.py render_columns) over an implicit im2col: lanes across output
pixels, a warp per output channel (or several splitting its nonzeros). Per pixel a lane keeps the base
(oh*sh - ph)*W + (ow*sw - pw) and a 64-bit mask of the taps inside the image; per nonzero it unpacks the
slot (offset | tap << 26) and loads x[base + offset] if the tap's bit is set. Parameters: x ([batch,]
Cin x H x W), y ([batch,] Cout x OH x OW), values, packed slots (int32), rows (int32 pairs), bias (fp32 or
null), then residual (as y) when the plan adds one.
"""
from __future__ import annotations

from ..plan.conv import MAX_OFFSET, TAP_SHIFT, ConvPlan
from ..plan.config import WARP
from .csr import render_columns
from .emitter import Emitter
from .ptx import KernelSource


class ImplicitConv:
    """The operand of the direct convolution: the input image, read through per-pixel bases and tap masks."""
    params = ("p_x", "p_c", "p_values", "p_cols", "p_rows", "p_bias")
    title = "direct sparse Conv2d (implicit im2col, NCHW) over padded CSR, a warp per output channel"

    def registers(self, plan: ConvPlan) -> list[str]:
        c = plan.config.columns
        return [".reg .b64 %rdb, " + ", ".join(f"%tm{i}" for i in range(c)) + ", "
                + ", ".join(f"%rdx{j}_{i}" for j in range(WARP) for i in range(c)) + ";",
                ".reg .b32 %oh, %ow, %ih, %iw, " + ", ".join(f"%cb{i}" for i in range(c)) + ", "
                + ", ".join(f"%tp{j}, %of{j}" for j in range(WARP)) + ";",
                ".reg .pred %pr, %ps, %pv;"]

    def setup(self, e: Emitter, plan: ConvPlan) -> None:
        g, es = plan.geometry, plan.element_bytes
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
                     f"mad.lo.u32 %cb{i}, %oh, {g.width}, %ow;", f"mov.b64 %tm{i}, 0;"])
            for r in range(kh):
                # unsigned compare: a row above the image wraps to a large number and fails it too
                e.lines([f"add.u32 %ih, %oh, {r * dh};", f"setp.lt.u32 %pr, %ih, {g.height};"])
                for s in range(kw):
                    e.lines([f"add.u32 %iw, %ow, {s * dw};", f"setp.lt.u32 %ps, %iw, {g.width};",
                             "and.pred %pv, %pr, %ps;", f"@%pv or.b64 %tm{i}, %tm{i}, {1 << (r * kw + s)};"])

    def nonzero(self, e: Emitter, plan: ConvPlan, j: int) -> None:
        e.lines([f"shr.u32 %tp{j}, %cj{j}, {TAP_SHIFT};", f"and.b32 %of{j}, %cj{j}, {MAX_OFFSET - 1};"])

    def load(self, e: Emitter, plan: ConvPlan, j: int, v: int, offset: int) -> str:
        """Pixel v of the lane (loads are single elements): x[base_v + offset_j] if tap_j is inside."""
        e.lines([f"shr.b64 %rdt, %tm{v}, %tp{j};", "and.b64 %rdt, %rdt, 1;", "setp.ne.u64 %pv, %rdt, 0;",
                 f"and.pred %pq{j}_{v}, %pj{j}, %pn{v};", f"and.pred %pq{j}_{v}, %pq{j}_{v}, %pv;",
                 f"add.u32 %t, %cb{v}, %of{j};", f"mad.wide.s32 %rdx{j}_{v}, %t, {plan.element_bytes}, %rdb;"])
        return f"[%rdx{j}_{v}]"


def render_conv(plan: ConvPlan) -> KernelSource:
    return render_columns(plan, ImplicitConv())
