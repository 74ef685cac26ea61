"""Direct sparse convolution: a Conv2d as an SpMM over an implicit im2col, in two mappings.

W (Cout x Cin/groups*kh*kw in torch's (ci, r, s) order; DLMC's .smtx files hold TensorFlow's (r, s, ci)
order, which suite/conv.py reorders) is the same padded CSR
as the SpMM kernels read; N is the output pixels of one image (OH x OW), a batch entry per grid.z. No
im2col buffer exists: a nonzero (co, ci, r, s) reads input pixel (oh*sh - ph + r*dh, ow*sw - pw + s*dw) of
channel ci, which sits at a constant offset

    offset(ci, r, s) = (g*Cin/groups + ci)*H*W + r*dh*W + s*dw      (g: co's group)

from the lane's base (oh*sh - ph)*W + (ow*sw - pw). Each slot stores offset | tap << 26 (tap = r*kw + s),
and each lane keeps, per output pixel, a 64-bit mask of the taps that fall inside the image: padding is a
predicate, never a border or a buffer. codegen/conv.py renders it through mappings/csr/render.py's render_columns.

Layouts (ConvGeometry.layout). "nchw": input [batch,] Cin x H x W, output [batch,] Cout x OH x OW, residual as
the output. "nhwc" (torch's channels_last: the same logical shapes, channels innermost in memory): input
element (ci, ih, iw) at (ih*W + iw)*Cin + ci, so a csr-columns slot holds

    offset(ci, r, s) = (r*dh*W + s*dw)*Cin + g*Cin/groups + ci

from the lane's base ((oh*sh - ph)*W + (ow*sw - pw))*Cin, and output element (co, n) at n*Cout + co. The
csr-columns kernel then reads x where it lies: a warp's 32 pixels are Cin elements apart, one sector each
where Cin*es >= 32 (NCHW's read is coalesced), the price of no copy; the chooser times it against the
generated mapping and cuDNN in the same layout.

The second mapping (ConvTilePlan, "conv-row-groups" and the other generated mappings) is the SpMM's
generated kernel (plan/plan.py: every nonzero an FMA immediate) over a zero-bordered copy xp of the input
([batch,] Cin x Hp x Wp, Hp = H + 2*ph, Wp = W + 2*pw, made by the launch). A lane's column is an output
pixel n = oh*OW + ow; its base in xp is the window's corner (oh*sh)*Wp + ow*sw, and a nonzero at input
channel c, tap (r, s) reads xp at base + c*Hp*Wp + r*dh*Wp + s*dw: a constant, so each nonzero is one load
at a constant offset and one FMA, with no masks (the border holds the zeros padding would read) and no
wasted columns (the base is computed per lane, so any strides work and no row tail is computed). W is
expanded to Cout x Cin*kh*kw (row co's columns moved to its group's channels), so a row group may span
convolution groups and a column is always one input channel and tap. In nhwc its operand is the same
bordered NCHW buffer (the launch's copy into it transposes a channels_last x in the same one launch), and
only the stores change: a thread's vec pixels are Cout elements apart (one store each), and runs of a
group's consecutive output channels of one pixel, aligned, are stored as one vector (store_runs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..formats import SparseMatrix
from ..mappings.registry import CONV, find_family
from .config import TileConfig, epilogue_tag
from ..mappings.csr.plan import CsrColumnsConfig, CsrPlan, make_csr_plan
from .plan import Plan, make_plan, sketch_plan

TAP_SHIFT = 26            # offset bits in a slot; the tap index above them
MAX_OFFSET = 1 << TAP_SHIFT
MAX_TAPS = 63             # a lane's tap mask is one 64-bit word, its top bit never set:
EMPTY_TAP = 63            # the tap of the slots past a row's end, in no pixel's mask (nothing loaded)
CONV_COLUMNS = (1, 2)     # pixels a lane the direct convolution takes
CONV_LAYOUTS = ("nchw", "nhwc")  # x, the output and the residual in memory; nhwc is torch's channels_last
MAX_IMAGE = 1 << 31       # nhwc: a csr-columns lane's pixel base + offset is a signed 32-bit element index


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
    dilation (pairs: rows, columns), groups, and the memory layout of input, output and residual (the
    shapes are logical, torch's, in either layout). Validated on construction, with the problem named."""
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
    layout: str = "nchw"   # "nchw", or "nhwc" (channels innermost: torch's channels_last)

    @classmethod
    def of(cls, input_shape, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
           groups: int = 1, layout: str = "nchw") -> "ConvGeometry":
        shape = tuple(input_shape)
        if len(shape) != 4 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in shape):
            raise ValueError(f"input_shape must be (batch, channels, height, width) ints, got {input_shape!r}")
        for value, name in ((out_channels, "out_channels"), (groups, "groups")):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        return cls(*(int(v) for v in shape), int(out_channels), _pair(kernel_size, "kernel_size"),
                   _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), int(groups),
                   layout)

    def __post_init__(self):
        if not isinstance(self.layout, str) or self.layout not in CONV_LAYOUTS:
            raise ValueError(f"layout must be 'nchw' or 'nhwc' (torch's channels_last), got {self.layout!r}")
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
        (kh, kw) = self.kernel
        largest = self.input_offset(self.channels - 1, kh - 1, kw - 1)
        if largest >= MAX_OFFSET:  # a slot holds offset | tap << 26: a larger offset would spill into the tap
            raise ValueError(f"an input image of {self.channels} x {self.height} x {self.width} elements "
                             f"({self.layout}) with a {kh} x {kw} kernel at dilation {self.dilation} reaches offset "
                             f"{largest}, over the {MAX_OFFSET} a slot addresses: split the channels")
        image = self.channels * self.height * self.width
        if self.layout == "nhwc" and image > MAX_IMAGE:  # nchw's lane base is a pixel index, far smaller
            raise ValueError(f"an nhwc input image of {image} elements is over the {MAX_IMAGE} a lane's 32-bit "
                             "pixel base addresses: split the image or the channels")

    def input_offset(self, channel, r, s):
        """Elements in x from a pixel's window corner to input channel `channel` at tap (r, s) (ints or numpy
        arrays): channel*H*W + r*dh*W + s*dw in nchw, (r*dh*W + s*dw)*Cin + channel in nhwc."""
        spatial = r * self.dilation[0] * self.width + s * self.dilation[1]
        if self.layout == "nhwc":
            return spatial * self.channels + channel
        return channel * self.height * self.width + spatial

    @property
    def pixel_stride(self) -> int:
        """Elements in x (and the output) between neighbouring pixels of a row: 1 in nchw, the channels in
        nhwc."""
        return self.channels if self.layout == "nhwc" else 1

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
    def bordered_height(self) -> int:
        """Rows of the zero-bordered input the generated mapping reads (H + 2*ph)."""
        return self.height + 2 * self.padding[0]

    @property
    def bordered_width(self) -> int:
        """Columns of the zero-bordered input, its row pitch (W + 2*pw)."""
        return self.width + 2 * self.padding[1]

    @property
    def bordered_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.channels, self.bordered_height, self.bordered_width

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

    @property
    def input_memory_shape(self) -> tuple[int, int, int, int]:
        """x's dimensions in memory order: (batch, Cin, H, W) in nchw, (batch, H, W, Cin) in nhwc (the shape
        of a numpy array laid out as the kernel reads it: execute_conv's)."""
        return _in_memory_order(self.input_shape, self.layout)

    @property
    def output_memory_shape(self) -> tuple[int, int, int, int]:
        """The output's (and residual's) dimensions in memory order, as input_memory_shape."""
        return _in_memory_order(self.output_shape, self.layout)

    def short(self) -> str:
        """The shapes as a name piece (the layout is not in it: the plans' names carry it beside)."""
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return (f"c{self.channels}h{self.height}w{self.width}o{self.out_channels}k{kh}x{kw}s{sh}x{sw}p{ph}x{pw}"
                f"d{dh}x{dw}g{self.groups}")


def _in_memory_order(shape: tuple[int, int, int, int], layout: str) -> tuple[int, int, int, int]:
    batch, channels, height, width = shape
    return (batch, height, width, channels) if layout == "nhwc" else shape


@dataclass(frozen=True, eq=False)
class ConvPlan(CsrPlan):
    """A CsrPlan whose column indices are packed input offsets and taps (see the module docstring), in the
    geometry's layout (nhwc: offsets into the channels_last x itself, outputs n*Cout + co)."""
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
        return f"conv2d_{self.geometry.layout}_{self.dtype}_{self.geometry.short()}_{self.config.short()}{epi}"

    def describe(self) -> str:
        g = self.geometry
        return (f"Plan {self.name}\n  Conv2d {g.channels} -> {g.out_channels}, kernel {g.kernel}, stride {g.stride}, "
                f"padding {g.padding}, dilation {g.dilation}, groups {g.groups}; input {g.input_shape}; "
                f"output {g.output_shape}; layout {g.layout}\n  W {self.M}x{self.K}, nnz {self.nnz}; implicit im2col, "
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
    offset = g.input_offset(channel, r, s)
    packed[slot] = offset | (tap << TAP_SHIFT)
    return packed.astype(np.uint32).view(np.int32)


def _check_weight(w: SparseMatrix, geometry: ConvGeometry) -> None:
    if tuple(w.shape) != geometry.weight_shape:
        raise ValueError(f"W is {w.shape[0]} x {w.shape[1]}; a Conv2d {geometry.channels} -> "
                         f"{geometry.out_channels} with a {geometry.kernel[0]} x {geometry.kernel[1]} kernel and "
                         f"groups = {geometry.groups} needs {geometry.weight_shape[0]} x {geometry.weight_shape[1]} "
                         "(Cout x Cin/groups*kh*kw, in torch's (ci, r, s) order)")


def make_conv_plan(w: SparseMatrix, geometry: ConvGeometry, dtype: str = "float32",
                   config: CsrColumnsConfig | TileConfig | None = None, bias=None, relu: bool = False,
                   residual: bool = False, arch: int = 90, sketch: bool = False) -> "ConvPlan | ConvTilePlan":
    """The plan of a sparse Conv2d in the mapping the config's family names (mappings/registry.py): a
    CsrColumnsConfig (the default) the csr-columns kernel over the implicit im2col (ConvPlan), a TileConfig the
    generated kernel over the zero-bordered input (ConvTilePlan; sketch=True: its row groups as counts only,
    for ranking)."""
    _check_weight(w, geometry)
    config = config or CsrColumnsConfig()
    family = find_family(config, CONV)
    if family is None:
        raise TypeError(f"the direct convolution takes a CsrColumnsConfig or a TileConfig, got "
                        f"{type(config).__name__}")
    return family.hook("plan")(w, geometry, dtype, config, bias, relu, residual, arch, sketch)


def check_conv_columns(config: CsrColumnsConfig) -> None:
    """ValueError where the direct convolution cannot take the csr-columns config."""
    if config.columns not in CONV_COLUMNS:
        raise ValueError(f"the direct convolution takes columns (pixels a lane) in {CONV_COLUMNS}, got "
                         f"{config.columns}: at 4 a chunk's unpacked taps and offsets spill (ptxas 13.0)")


def make_conv_columns_plan(w: SparseMatrix, geometry: ConvGeometry, dtype: str, config: CsrColumnsConfig, bias,
                           relu: bool, residual: bool, arch: int, sketch: bool = False) -> "ConvPlan":
    """The csr-columns kernel's plan over the implicit im2col (sketch: the same, its plans are cheap)."""
    _check_weight(w, geometry)
    check_conv_columns(config)
    n = geometry.out_height * geometry.out_width
    base = make_csr_plan(w, n, dtype, "kn", config, bias, relu, arch)
    packed = pack_taps(w, geometry, base.cols, base.rows)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CsrPlan)}
    fields["cols"], fields["residual"] = packed, bool(residual)
    return ConvPlan(**fields, geometry=geometry)


@dataclass(frozen=True)
class ConvTilePlan(Plan):
    """A Plan of the generated kernel (row groups, every nonzero an FMA immediate) whose columns are the
    output pixels of one image (N = OH*OW) and whose operand is the zero-bordered input (module docstring).
    Its W is the expanded Cout x Cin*kh*kw matrix (expand_groups), so column k is input channel k // taps.
    The operand is NCHW in either layout; geometry.layout says how the output (and residual) lie."""
    bordered = True  # the operand is the zero-bordered NCHW copy of x (codegen/operands.py BorderedConvInput)
    geometry: ConvGeometry | None = None
    residual: bool = False   # the epilogue adds R (laid out as the output, parameter param_r) before ReLU

    @property
    def mapping(self) -> str:
        return f"conv-{super().mapping}"

    @property
    def name(self) -> str:
        epi = epilogue_tag(self.bias, self.relu, self.residual)
        return (f"conv2d_imm_{self.geometry.layout}_{self.dtype}_{self.geometry.short()}_{self.config.short()}{epi}_"
                f"{self.digest[:12]}")

    @property
    def output_strides(self) -> tuple[int, int]:
        """(elements between output channels, between a thread's consecutive pixels): nchw (N, 1), nhwc
        (1, Cout)."""
        return (1, self.M) if self.geometry.layout == "nhwc" else (self.N, 1)

    @property
    def channel_vector(self) -> int:
        """nhwc: the most consecutive output channels of one pixel one store may take: the widest of 8 / 4 / 2
        within 16 bytes that divides Cout (so every pixel's channels start aligned to it); 1 in nchw (a
        thread's vector runs along its pixels there)."""
        if self.geometry.layout != "nhwc":
            return 1
        return next((w for w in (8, 4, 2) if w * self.element_bytes <= 16 and self.M % w == 0), 1)

    def store_runs(self, group) -> list[tuple[int, int]]:
        """nhwc: the group's slots as (first slot, count) runs of consecutive output channels starting at a
        multiple of count (count a power of two up to channel_vector), each stored (and its residual loaded)
        as one vector per pixel, so a warp writes whole sectors where a group holds aligned channel runs.
        A split group's atomic adds take pairs in 16-bit types (f16x2 / bf16x2), single fp32 values. nchw:
        singles (the vector is along pixels)."""
        widest = self.channel_vector
        if group.partial:
            widest = min(widest, 2) if self.element_bytes == 2 else 1
        rows, runs, slot = tuple(group.rows), [], 0
        while slot < len(rows):
            count, first = widest, rows[slot]
            while count > 1 and (first % count or rows[slot:slot + count] != tuple(range(first, first + count))):
                count //= 2
            runs.append((slot, count))
            slot += count
        return runs

    @cached_property
    def output_alignment(self) -> int:
        """Bytes the output (and residual) pointer must be aligned to: where a thread's pixels are adjacent
        (nchw, or nhwc with one output channel) the vec pixels' vector, else the longest run of channels any
        group stores as one vector (computed once: the launch reads it)."""
        if self.output_strides[1] == 1:
            return self.config.vec * self.element_bytes
        return self.element_bytes * max((count for g in self.groups for _, count in self.store_runs(g)), default=1)

    def input_offset(self, k: int) -> int:
        """Elements from a lane's base in the bordered input to column k (channel, tap) of its window."""
        g = self.geometry
        channel, tap = divmod(k, g.taps)
        r, s = divmod(tap, g.kernel[1])
        return (channel * g.bordered_height + r * g.dilation[0]) * g.bordered_width + s * g.dilation[1]

    @property
    def shifts(self) -> int:
        """Copies of the bordered image the kernel reads (conv_shifts): 1, or vec where a tap's offset is not
        a multiple of the vector width."""
        return conv_shifts(self.geometry, self.config.vec)

    @property
    def plane(self) -> int:
        """Elements of one bordered image (Cin x Hp x Wp), one copy's length in the kernel's buffer."""
        g = self.geometry
        return g.channels * g.bordered_height * g.bordered_width

    def operand_offset(self, k: int) -> int:
        """Elements from a lane's base, in the buffer of shifted copies, to column k's vector: the copy
        shifted by j = input_offset % shifts holds xp[i + j] at i, so the vector starts at a multiple of vec."""
        offset = self.input_offset(k)
        j = offset % self.shifts
        return j * self.plane + offset - j

    def describe(self) -> str:
        g = self.geometry
        return (f"{super().describe()}\n  as Conv2d {g.channels} -> {g.out_channels}, kernel {g.kernel}, stride "
                f"{g.stride}, padding {g.padding}, dilation {g.dilation}, groups {g.groups}; generated code over "
                f"the zero-bordered input {g.bordered_shape}; output {g.output_shape}, layout {g.layout}")


def expand_groups(w: SparseMatrix, geometry: ConvGeometry) -> SparseMatrix:
    """W (Cout x Cin/groups*kh*kw) as Cout x Cin*kh*kw: row co's column k moves to its group's channels,
    (co // (Cout/groups)) * (Cin/groups*kh*kw) + k. The identity for groups = 1."""
    if geometry.groups == 1:
        return w
    per_group_out, width = geometry.out_channels // geometry.groups, w.shape[1]
    shift = np.repeat((np.arange(w.shape[0]) // per_group_out) * width, w.row_nnz)
    return SparseMatrix(w.indptr, w.indices.astype(np.int64) + shift, w.values, (w.shape[0], geometry.groups * width),
                        w.dtype)


def conv_vector_width(geometry: ConvGeometry, wanted: int) -> int:
    """The widest vector (<= wanted) of pixels a lane can load as one aligned piece: its pixels consecutive
    in the bordered input (stride 1 along rows, OW a multiple of it) and its base a multiple of it (Wp too).
    A tap s*dw elements along a row that is not a multiple of vec reads a copy of the bordered image shifted
    by that remainder (conv_shifts), so 3x3 layers take vectors too."""
    g = geometry
    for vec in (4, 2):
        if vec <= wanted and g.stride[1] == 1 and g.out_width % vec == 0 and g.bordered_width % vec == 0:
            return vec
    return 1


def conv_shifts(geometry: ConvGeometry, vec: int) -> int:
    """How many copies of the bordered image, each shifted one element further, the generated kernel at
    vector width vec reads: vec when some tap's column offset s*dw is not a multiple of vec (copy j holds
    xp[i + j] at i, so every tap's vector is aligned in one of them), else 1. The copies cost the input's
    bytes once more each per call, against vec pixels a load and a decoded FMA operand for all of them."""
    if vec == 1 or geometry.kernel[1] == 1 or geometry.dilation[1] % vec == 0:
        return 1
    return vec


def make_conv_tile_plan(w: SparseMatrix, geometry: ConvGeometry, dtype: str, config: TileConfig, bias, relu: bool,
                        residual: bool, arch: int, sketch: bool = False) -> ConvTilePlan:
    """The generated kernel's plan over the zero-bordered input (sketch: its row groups as counts only)."""
    _check_weight(w, geometry)
    if config.transpose_x:
        raise ValueError("transpose_x applies to the SpMM's nk layout; the convolution's columns are output "
                         "pixels read from a bordered NCHW image: use transpose_x=False")
    if residual and config.segment_nnz:
        raise ValueError("split K (segment_nnz > 0) cannot add a residual: the launch zeroes the split output "
                         "channels before their partial sums are added, which would drop the residual (and an "
                         "in-place out = residual). Use segment_nnz=0, or add the residual after the kernel")
    vec = conv_vector_width(geometry, config.vec)
    if vec != config.vec:
        config = dataclasses.replace(config, vec=vec)
    n = geometry.out_height * geometry.out_width
    base = (sketch_plan if sketch else make_plan)(expand_groups(w, geometry), n, dtype, "kn", config, bias, relu, arch)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Plan)}
    return ConvTilePlan(**fields, geometry=geometry, residual=bool(residual))


def execute_conv(plan: "ConvPlan | ConvTilePlan", x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """float64 reference from the plan's own data. x, residual and the result in the geometry's layout, in
    memory order: [batch,] Cin x H x W and [batch,] Cout x OH x OW in nchw, [batch,] H x W x Cin and
    [batch,] OH x OW x Cout in nhwc. A ConvPlan's packed slots are read as the kernel reads them (the
    image as flat memory at each pixel's base + the slot's offset, where the slot's tap is inside), a
    ConvTilePlan's groups through its input offsets from each pixel's base in the bordered NCHW input (what
    the kernels compute, step for step)."""
    g = plan.geometry
    x = np.asarray(x, np.float64)
    single = x.ndim == 3
    x = x.reshape(-1, *g.input_memory_shape[1:])
    out = (_execute_tile if plan.bordered else _execute_columns)(plan, x)  # [batch, M, N]
    if plan.bias is not None:
        out += np.asarray(plan.bias)[None, :, None]
    out = _to_memory_order(out, g)
    if residual is not None:
        out += np.asarray(residual, np.float64).reshape(out.shape)
    if plan.relu:
        out = np.maximum(out, 0)
    return out[0] if single else out


def _to_memory_order(out: np.ndarray, g: ConvGeometry) -> np.ndarray:
    """[batch, Cout, N] sums as the output lies in memory (output_memory_shape with the batch)."""
    if g.layout == "nhwc":
        out = out.transpose(0, 2, 1)
    return np.ascontiguousarray(out).reshape(out.shape[0], *g.output_memory_shape[1:])


def _execute_columns(plan: ConvPlan, x: np.ndarray) -> np.ndarray:
    g = plan.geometry
    kw, (dh, dw) = g.kernel[1], g.dilation
    flat = x.reshape(x.shape[0], -1)
    oh, ow = np.divmod(np.arange(plan.N), g.out_width)
    ih0, iw0 = oh * g.stride[0] - g.padding[0], ow * g.stride[1] - g.padding[1]  # window corners (may be outside)
    base = (ih0 * g.width + iw0) * g.pixel_stride
    out = np.zeros((x.shape[0], plan.M, plan.N))
    packed = plan.cols.view(np.uint32).astype(np.int64)
    for co, (start, end) in enumerate(plan.rows.tolist()):
        for slot in range(start, end):
            tap, offset = packed[slot] >> TAP_SHIFT, packed[slot] & (MAX_OFFSET - 1)
            r, s = divmod(int(tap), kw)
            ih, iw = ih0 + r * dh, iw0 + s * dw
            inside = (ih >= 0) & (ih < g.height) & (iw >= 0) & (iw < g.width)
            taken = flat[:, np.where(inside, base + offset, 0)]
            out[:, co] += float(plan.values[slot]) * np.where(inside, taken, 0.0)
    return out


def _execute_tile(plan: ConvTilePlan, x: np.ndarray) -> np.ndarray:
    g = plan.geometry
    (ph, pw) = g.padding
    if g.layout == "nhwc":  # the launch copies x into the NCHW bordered buffer
        x = x.transpose(0, 3, 1, 2)
    bordered = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))).reshape(x.shape[0], -1)
    oh, ow = np.divmod(np.arange(plan.N), g.out_width)
    base = oh * g.stride[0] * g.bordered_width + ow * g.stride[1]
    out = np.zeros((x.shape[0], plan.M, plan.N))
    for group in plan.groups:
        for column in group.columns:
            taken = bordered[:, base + plan.input_offset(column.k)]
            for slot, value in column.uses:
                out[:, group.rows[slot]] += value * taken
    return out
