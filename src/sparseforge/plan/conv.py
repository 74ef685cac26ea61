"""Direct sparse convolution (issue 12): a Conv2d as the csr-columns SpMM over an implicit im2col.

W (Cout x Cin/groups*kh*kw in torch's (ci, r, s) order; DLMC's .smtx files hold TensorFlow's (r, s, ci)
order, which suite/conv.py reorders) is the same padded CSR
as the SpMM kernels read; N is the output pixels of one image (OH x OW), a batch entry per grid.z. No
im2col buffer exists: a nonzero (co, ci, r, s) reads input pixel (oh*sh - ph + r*dh, ow*sw - pw + s*dw) of
channel ci, which sits at a constant offset

    offset(ci, r, s) = (g*Cin/groups + ci)*H*W + r*dh*W + s*dw      (g: co's group)

from the lane's base (oh*sh - ph)*W + (ow*sw - pw). Each slot stores offset | tap << 26 (tap = r*kw + s),
and each lane keeps, per output pixel, a 64-bit mask of the taps that fall inside the image: padding is a
predicate, never a border or a buffer. codegen/conv.py renders it through codegen/csr.py's render_columns.
Layout NCHW (input [batch,] Cin x H x W, output [batch,] Cout x OH x OW, residual as the output).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..formats import SparseMatrix
from .config import epilogue_tag
from .csr import CsrColumnsConfig, CsrPlan, make_csr_plan

TAP_SHIFT = 26            # offset bits in a slot; the tap index above them
MAX_OFFSET = 1 << TAP_SHIFT
MAX_TAPS = 63             # a lane's tap mask is one 64-bit word, its top bit never set:
EMPTY_TAP = 63            # the tap of the slots past a row's end, in no pixel's mask (nothing loaded)
CONV_COLUMNS = (1, 2)     # pixels a lane the direct convolution takes


def _pair(value, name: str) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value), int(value)
    try:
        a, b = value
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (a, b)):
            return int(a), int(b)
    except (TypeError, ValueError):
        pass
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


@dataclass(frozen=True)
class ConvGeometry:
    """A Conv2d's shapes: input (batch, channels, height, width), out_channels, kernel, stride, padding,
    dilation (pairs: rows, columns) and groups. Validated on construction, with the problem named."""
    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    @classmethod
    def of(cls, input_shape, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
           groups: int = 1) -> "ConvGeometry":
        shape = tuple(input_shape)
        if len(shape) != 4 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in shape):
            raise ValueError(f"input_shape must be (batch, channels, height, width) ints, got {input_shape!r}")
        for value, name in ((out_channels, "out_channels"), (groups, "groups")):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        return cls(*(int(v) for v in shape), int(out_channels), _pair(kernel_size, "kernel_size"),
                   _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), int(groups))

    def __post_init__(self):
        for name in ("batch", "channels", "height", "width", "out_channels", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch > 65535:
            raise ValueError(f"batch {self.batch} is over the launch grid's 65535: split the batch")
        for name, low in (("kernel", 1), ("stride", 1), ("padding", 0), ("dilation", 1)):
            if min(getattr(self, name)) < low:
                raise ValueError(f"{name} must be >= {low} in both dimensions, got {getattr(self, name)}")
        if self.channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"groups = {self.groups} must divide channels ({self.channels}) and out_channels "
                             f"({self.out_channels})")
        if self.taps > MAX_TAPS:
            raise ValueError(f"a {self.kernel[0]} x {self.kernel[1]} kernel has {self.taps} taps; the direct "
                             f"convolution takes at most {MAX_TAPS} (one 64-bit mask of in-image taps a pixel, "
                             "its top bit marking empty slots)")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(f"the output would be {self.out_height} x {self.out_width}: the kernel "
                             f"{self.kernel} (dilation {self.dilation}) does not fit the padded input "
                             f"{self.height} x {self.width} (padding {self.padding})")
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        largest = (self.channels - 1) * self.height * self.width + (kh - 1) * dh * self.width + (kw - 1) * dw
        if largest >= MAX_OFFSET:  # a slot holds offset | tap << 26: a larger offset would spill into the tap
            raise ValueError(f"an input image of {self.channels} x {self.height} x {self.width} elements with a "
                             f"{kh} x {kw} kernel at dilation {self.dilation} reaches offset {largest}, over the "
                             f"{MAX_OFFSET} a slot addresses: split the channels")

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    @property
    def out_height(self) -> int:
        return (self.height + 2 * self.padding[0] - self.dilation[0] * (self.kernel[0] - 1) - 1) // self.stride[0] + 1

    @property
    def out_width(self) -> int:
        return (self.width + 2 * self.padding[1] - self.dilation[1] * (self.kernel[1] - 1) - 1) // self.stride[1] + 1

    @property
    def weight_shape(self) -> tuple[int, int]:
        """W as the SpMM sees it: Cout x Cin/groups*kh*kw."""
        return self.out_channels, self.channels // self.groups * self.taps

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.channels, self.height, self.width

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.out_channels, self.out_height, self.out_width

    def short(self) -> str:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return (f"c{self.channels}h{self.height}w{self.width}o{self.out_channels}k{kh}x{kw}s{sh}x{sw}p{ph}x{pw}"
                f"d{dh}x{dw}g{self.groups}")


@dataclass(frozen=True, eq=False)
class ConvPlan(CsrPlan):
    """A CsrPlan whose column indices are packed input offsets and taps (see the module docstring)."""
    geometry: ConvGeometry | None = field(default=None)

    @property
    def mapping(self) -> str:
        return "conv-csr-columns"

    @property
    def load_width(self) -> int:
        return 1  # a lane's pixels are 32 apart in its tile; their inputs are not one vector

    @property
    def name(self) -> str:
        epi = epilogue_tag(self.bias, self.relu, self.residual)
        return f"conv2d_nchw_{self.dtype}_{self.geometry.short()}_{self.config.short()}{epi}"

    def describe(self) -> str:
        g = self.geometry
        return (f"Plan {self.name}\n  Conv2d {g.channels} -> {g.out_channels}, kernel {g.kernel}, stride {g.stride}, "
                f"padding {g.padding}, dilation {g.dilation}, groups {g.groups}; input {g.input_shape}; "
                f"output {g.output_shape}\n  W {self.M}x{self.K}, nnz {self.nnz}; implicit im2col, "
                f"{self.config.warps_per_row} warp(s) per output channel, lanes across {self.N} output pixels, "
                f"{self.config.columns} pixels a lane; dtype {self.dtype}")


def pack_taps(w: SparseMatrix, geometry: ConvGeometry, cols: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The slots' column indices k = (ci, r, s) of W as offset | tap << TAP_SHIFT (padding slots: the empty
    tap, which no pixel's mask holds)."""
    g = geometry
    kh, kw = g.kernel
    per_group_in, per_group_out = g.channels // g.groups, g.out_channels // g.groups
    packed = np.full(cols.size, EMPTY_TAP << TAP_SHIFT, np.int64)
    counts = (rows[:, 1] - rows[:, 0]).astype(np.int64)
    slot = np.repeat(rows[:, 0].astype(np.int64), counts) + (np.arange(counts.sum()) -
                                                           np.repeat(np.cumsum(counts) - counts, counts))
    row_of = np.repeat(np.arange(len(counts)), counts)
    k = cols[slot].astype(np.int64)
    ci, tap = k // g.taps, k % g.taps
    r, s = tap // kw, tap % kw
    channel = (row_of // per_group_out) * per_group_in + ci
    offset = channel * g.height * g.width + r * g.dilation[0] * g.width + s * g.dilation[1]
    packed[slot] = offset | (tap << TAP_SHIFT)
    return packed.astype(np.uint32).view(np.int32)


def make_conv_plan(w: SparseMatrix, geometry: ConvGeometry, dtype: str = "float32",
                   config: CsrColumnsConfig | None = None, bias=None, relu: bool = False, residual: bool = False,
                   arch: int = 90) -> ConvPlan:
    if tuple(w.shape) != geometry.weight_shape:
        raise ValueError(f"W is {w.shape[0]} x {w.shape[1]}; a Conv2d {geometry.channels} -> "
                         f"{geometry.out_channels} with a {geometry.kernel[0]} x {geometry.kernel[1]} kernel and "
                         f"groups = {geometry.groups} needs {geometry.weight_shape[0]} x {geometry.weight_shape[1]} "
                         "(Cout x Cin/groups*kh*kw, in torch's (ci, r, s) order)")
    config = config or CsrColumnsConfig()
    if not isinstance(config, CsrColumnsConfig):
        raise TypeError(f"the direct convolution takes a CsrColumnsConfig, got {type(config).__name__}")
    if config.columns not in CONV_COLUMNS:
        raise ValueError(f"the direct convolution takes columns (pixels a lane) in {CONV_COLUMNS}, got "
                         f"{config.columns}: at 4 a chunk's unpacked taps and offsets spill (ptxas 13.0)")
    n = geometry.out_height * geometry.out_width
    base = make_csr_plan(w, n, dtype, "kn", config, bias, relu, arch)
    packed = pack_taps(w, geometry, base.cols, base.rows)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CsrPlan)}
    fields["cols"], fields["residual"] = packed, bool(residual)
    return ConvPlan(**fields, geometry=geometry)


def execute_conv(plan: ConvPlan, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """float64 reference from the plan's own arrays (offsets and taps decoded back), input [batch,] Cin x H x W."""
    g = plan.geometry
    x = np.asarray(x, np.float64)
    single = x.ndim == 3
    x = x.reshape(-1, g.channels, g.height, g.width)
    kh, kw = g.kernel
    out = np.zeros((x.shape[0], g.out_channels, g.out_height, g.out_width))
    oh = np.arange(g.out_height)[:, None] * g.stride[0] - g.padding[0]
    ow = np.arange(g.out_width)[None, :] * g.stride[1] - g.padding[1]
    packed = plan.cols.view(np.uint32).astype(np.int64)
    for co, (start, end) in enumerate(plan.rows.tolist()):
        for slot in range(start, end):
            tap, offset = packed[slot] >> TAP_SHIFT, packed[slot] & (MAX_OFFSET - 1)
            r, s = divmod(int(tap), kw)
            channel = (offset - r * g.dilation[0] * g.width - s * g.dilation[1]) // (g.height * g.width)
            ih, iw = oh + r * g.dilation[0], ow + s * g.dilation[1]
            inside = (ih >= 0) & (ih < g.height) & (iw >= 0) & (iw < g.width)
            taken = x[:, channel, np.clip(ih, 0, g.height - 1), np.clip(iw, 0, g.width - 1)]
            out[:, co] += float(plan.values[slot]) * np.where(inside, taken, 0.0)
    if plan.bias is not None:
        out += np.asarray(plan.bias)[None, :, None, None]
    if residual is not None:
        out += np.asarray(residual, np.float64).reshape(out.shape)
    if plan.relu:
        out = np.maximum(out, 0)
    return out[0] if single else out
