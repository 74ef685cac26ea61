"""ConvKernel: a loaded direct sparse convolution (plan/conv.py), called like F.conv2d on NCHW or, compiled
with layout "nhwc", channels_last tensors.

It goes through the one compile path, loader and launch of runtime/kernel.py (compile_plan; LoadedPlanKernel
loads it, uploads W's arrays where the kernel reads W as data, and launches it). Either mapping: the
csr-columns kernel reads x itself; the generated kernel (ConvTilePlan) reads a zero-bordered copy, which
the call writes into a buffer the kernel keeps (one copy launch; the border is never written, so it stays
zero; a channels_last x is transposed by the same copy).
"""
from __future__ import annotations

from .kernel import Built, LoadedPlanKernel, check_tensor, compile_sketch
from .streams import current_stream_handle


class ConvKernel(LoadedPlanKernel):
    """k(x) -> y, k(x, out=y), k(x, residual=r) (compiled with residual=True: y = conv(x) + bias + r, then
    ReLU). x: [batch,] Cin x H x W, contiguous, of the kernel's dtype and device; any batch up to 65535
    (input_shape's batch only sized the plan). out / residual: [batch,] Cout x OH x OW alike; out may be
    residual itself (an in-place add: each element is read before it is written, by the same thread), but
    must not overlap x. Attributes: plan, source, compile_seconds, load_seconds, cache_hit, tune_seconds,
    choice (the chooser's record when timed), mapping, layout.

    layout "nhwc" (plan.geometry.layout): x, out and residual are 4-D (batch, C, H, W) tensors contiguous
    in torch.channels_last (x.is_contiguous(memory_format=torch.channels_last)), and the output is
    allocated so. A 3-D x is refused there (torch has no channels_last for 3-D tensors): pass a batch of
    one. A tensor with C == 1 or H == W == 1 is NCHW- and channels_last-contiguous at once (one memory
    order): either layout takes it.

    NaN and inf in x: only W's stored nonzeros multiply x, and a tap outside the image multiplies nothing
    but zeros (the csr-columns kernel reads nothing there, the generated one the zero border), so a NaN
    pixel poisons exactly the outputs whose receptive field holds it at a nonzero weight.

    The generated mapping (k.mapping "conv-...") copies x into a zero-bordered buffer the kernel owns, sized
    for input_shape's batch when compiled: a larger batch reallocates it (outside CUDA-graph capture), and
    two streams or threads calling one kernel at once would share it: call a kernel from one thread (or give
    each thread its own kernel) and on one stream at a time."""

    def __init__(self, plan, built: Built, device_index: int, full_plan=None):
        super().__init__(plan, built, device_index, full_plan)
        self._init_call_state()

    def _init_call_state(self) -> None:
        """What a call keeps beside the loaded kernel: the shapes, the bordered buffer with its views and the
        buffers it outgrew, the lean call's signature (CPU tests stand a kernel up with this, no GPU)."""
        plan = self.launch_plan
        g = plan.geometry
        self.in_shape = (g.channels, g.height, g.width)
        self.out_shape = (g.out_channels, g.out_height, g.out_width)
        self._bordered = None
        self._border_views: dict = {}  # batch -> views of the bordered buffer a call copies into (_views_for)
        self._retired: list = []  # bordered buffers outgrown by a larger batch, kept for graphs that use them
        self._lean = None  # the fast call's signature (_lean_signature)
        # without padding, in NCHW and with one copy, the bordered image is x itself, byte for byte (Hp = H,
        # Wp = W; plane = Cin*H*W, x's batch stride): the kernel reads x where it lies, and the copy launch
        # (~1.5-2 us under graph replay, a fifth of a small layer) goes
        self.reads_x_in_place = (plan.bordered and g.layout == "nchw" and plan.shifts == 1
                                 and tuple(g.padding) == (0, 0))
        if plan.bordered:  # made now, not at the first call, which may be a graph capture
            self._bordered = self._bordered_buffer(g.batch)  # also the fallback for an x read in place

    @property
    def layout(self) -> str:
        """How x, the output and the residual lie in memory: "nchw" or "nhwc" (plan.geometry.layout)."""
        return self.launch_plan.geometry.layout

    def _bordered_buffer(self, batch: int):
        import torch

        # a normal tensor even when the first call runs under inference_mode: an inference tensor could not be
        # written by a later call outside it
        with torch.inference_mode(False):
            return torch.zeros((batch, self.launch_plan.shifts, self.launch_plan.plane), dtype=self._dtype, device=self._device)

    def bordered(self, x, batch: int):
        """x ([batch,] Cin x H x W, NCHW- or channels_last-contiguous) copied into the interior of the
        kernel's zero-bordered NCHW buffer (one launch, which transposes a channels_last x), and, where the
        plan reads shifted copies (plan.shifts > 1), copy j holding copy 0 shifted by j elements (written in
        the same launch where the padding leaves room, _views_for; else one more launch from copy 0); the
        [batch, shifts, plane] buffer the generated kernel reads. Where that buffer would
        equal x (reads_x_in_place: no padding, NCHW, one copy) and x is 16-byte aligned, x itself."""
        import torch

        if self.reads_x_in_place and x.is_contiguous() and x.data_ptr() % 16 == 0:
            return x  # the kernel's vector loads want 16-byte alignment, which the buffer has and a view may not
        if self._bordered.shape[0] < batch:
            if torch.cuda.is_current_stream_capturing():
                raise ValueError(f"a batch of {batch} is larger than the {self._bordered.shape[0]} the kernel's "
                                 "bordered input holds, and a CUDA graph is being captured (no allocation may "
                                 "outlive it): call the kernel once with this batch before capturing, or compile "
                                 "with input_shape's batch at least this large")
            # the old buffer stays allocated: a CUDA graph captured at the smaller batch still copies into it
            self._retired.append(self._bordered)
            self._bordered = self._bordered_buffer(batch)
            self._border_views = {}
        buffer, interior, shifted = self._views_for(batch)
        x = x if x.dim() == 4 else x.view(batch, *self.in_shape)
        if interior.dim() == 5:  # every copy's interior in one launch (_views_for)
            interior.copy_(x.unsqueeze(1).expand(interior.shape))
            return buffer
        interior.copy_(x)
        if shifted is not None:
            shifted[0].copy_(shifted[1])
        return buffer

    def _views_for(self, batch: int):
        """(the buffer's first `batch` images, the interior of copy 0 as [batch, Cin, H, W], and the shifted
        copies' (target, source) or None), made once per batch: views cost host time on every call. Where
        the first interior element lies at least shifts - 1 elements into the image (any padding, in practice),
        the interior is every copy's at once, [batch, shifts, Cin, H, W] (copy j's starts j elements earlier:
        stride plane - 1 along the copies, no element written twice), so one copy_ launch fills them all
        (shifted None); the border, never written, stays zero in each copy."""
        import torch

        views = self._border_views.get(batch)
        if views is None:
            g = self.launch_plan.geometry
            (ph, pw), buffer = g.padding, self._bordered[:batch]
            shifts, plane = buffer.shape[1], buffer.shape[2]
            xp = buffer[:, 0].view(batch, g.channels, g.bordered_height, g.bordered_width)
            first = ph * g.bordered_width + pw  # the first interior element's place in a copy
            if shifts > 1 and first >= shifts - 1:
                hw = g.bordered_height * g.bordered_width
                every = torch.as_strided(buffer, (batch, shifts, g.channels, g.height, g.width),
                                         (shifts * plane, plane - 1, hw, g.bordered_width, 1),
                                         buffer.storage_offset() + first)
                views = self._border_views[batch] = (buffer, every, None)
                return views
            shifted = None
            if shifts > 1:  # copy j (1 <= j < shifts) at i: copy 0 at i + j; its last j elements are never read
                length = plane - shifts + 1
                source = torch.as_strided(buffer, (batch, shifts - 1, length), (shifts * plane, 1, 1),
                                          buffer.storage_offset() + 1)
                shifted = (buffer[:, 1:, :length], source)
            views = self._border_views[batch] = (buffer, xp[:, :, ph:ph + g.height, pw:pw + g.width], shifted)
        return views

    def _check(self, t, what: str, shape: tuple[int, int, int]) -> None:
        """Raise, naming the problem and the fix, unless t is a tensor of the kernel's device, dtype and
        [batch,] `shape`, contiguous in the kernel's layout."""
        import torch

        check_tensor(t, what, self._device, self._dtype)
        nhwc = self.layout == "nhwc"
        if t.dim() not in ((4,) if nhwc else (3, 4)) or tuple(t.shape[-3:]) != shape:
            g = self.launch_plan.geometry
            if nhwc and t.dim() == 3 and tuple(t.shape) == shape:
                raise ValueError(f"{what} is 3-D {tuple(t.shape)}; this kernel was compiled with layout='nhwc', "
                                 "which takes 4-D channels_last tensors (torch has no channels_last for 3-D ones): "
                                 f"pass {what}.unsqueeze(0).contiguous(memory_format=torch.channels_last), a "
                                 "batch of one, or compile with layout='nchw'")
            expected = (f"(batch, {shape[0]}, {shape[1]}, {shape[2]}) (channels_last)" if nhwc else
                        f"[batch,] {shape[0]} x {shape[1]} x {shape[2]} (NCHW)")
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {expected}; the kernel is a Conv2d "
                             f"{g.channels} -> {g.out_channels} on {g.height} x {g.width} images, kernel {g.kernel}, "
                             f"stride {g.stride}, padding {g.padding}: compile one for this shape")
        # out must be written where it is: a contiguous copy of it would take the result instead
        if nhwc and not t.is_contiguous(memory_format=torch.channels_last):
            fix = ("allocate it with memory_format=torch.channels_last (torch.empty_like of a channels_last "
                   "tensor) or omit out" if what == "out" else f"pass {what}.contiguous(memory_format="
                   "torch.channels_last)")
            if t.is_contiguous():
                raise ValueError(f"{what} is NCHW-contiguous; this kernel was compiled with layout='nhwc': {fix} "
                                 "or compile with layout='nchw'")
            raise ValueError(f"{what} is not channels_last-contiguous (strides {t.stride()}): {fix}")
        if not nhwc and not t.is_contiguous():
            fix = "allocate it NCHW-contiguous (torch.empty(shape)) or omit out" if what == "out" else \
                f"pass {what}.contiguous()"
            if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
                raise ValueError(f"{what} is channels_last; this kernel was compiled with layout='nchw': {fix} "
                                 "or compile with layout='nhwc'")
            raise ValueError(f"{what} is not contiguous (strides {t.stride()}): {fix} (NCHW)")

    def _lean_signature(self) -> tuple:
        import torch

        nhwc = self.layout == "nhwc"
        return (torch.Tensor, self._dtype, self._device, torch.Size(self.in_shape), self.out_shape,
                torch.channels_last if nhwc else torch.contiguous_format, bool(self.launch_plan.residual),
                self.launch_plan.output_alignment)

    def __call__(self, x, out=None, residual=None):
        # The common call (a 4-D x as compiled, a fresh output, the residual where compiled with one) costs
        # attribute reads, the bordered copy where the mapping reads one, one allocation and one launch; any
        # comparison failing sends it through the checks below, which name the problem.
        lean = self._lean
        if lean is None:
            lean = self._lean = self._lean_signature()
        if out is None and isinstance(x, lean[0]) and x.dtype == lean[1] and x.device == lean[2] and \
                x.dim() == 4 and x.shape[1:] == lean[3] and x.is_contiguous(memory_format=lean[5]) and \
                0 < x.shape[0] <= 65535 and (self._bordered is None or x.shape[0] <= self._bordered.shape[0]):
            batch = x.shape[0]
            if not lean[6]:
                extra = () if residual is None else None
            elif isinstance(residual, lean[0]) and residual.dtype == lean[1] and residual.device == lean[2] and \
                    residual.dim() == 4 and residual.shape[0] == batch and residual.shape[1:] == lean[4] and \
                    residual.is_contiguous(memory_format=lean[5]) and residual.data_ptr() % lean[7] == 0:
                extra = (residual.data_ptr(),)
            else:
                extra = None
            if extra is not None:
                import torch

                out = torch.empty((batch, *lean[4]), dtype=lean[1], device=lean[2], memory_format=lean[5])
                if self._bordered is not None:
                    x = self.bordered(x, batch)
                    self._zero_partial(out, 1)
                self.launch(x.data_ptr(), out.data_ptr(), batch, current_stream_handle(self.device_index), *extra)
                return out
        return self._checked_call(x, out, residual)

    def _checked_call(self, x, out, residual):
        import torch

        self._check(x, "x", self.in_shape)
        batch = x.shape[0] if x.dim() == 4 else 1
        if batch > 65535:
            raise ValueError(f"x has a batch of {batch}; one launch takes at most 65535: split the batch")
        shape = (*x.shape[:-3], *self.out_shape)
        if self.launch_plan.residual:
            if residual is None:
                raise ValueError("the kernel was compiled with residual=True: pass residual= (a tensor shaped like "
                                 "the output), or compile without it")
            self._check(residual, "residual", self.out_shape)
            if tuple(residual.shape) != shape:
                raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {shape} (the output's)")
        elif residual is not None:
            raise ValueError("the kernel was compiled without a residual: compile with residual=True to add one")
        if out is None:
            out = torch.empty(shape, dtype=self._dtype, device=self._device,
                              memory_format=torch.channels_last if self.layout == "nhwc" else torch.contiguous_format)
        else:
            self._check(out, "out", self.out_shape)
            if tuple(out.shape) != shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape} for x of shape {tuple(x.shape)}")
            if _overlap(out, x):
                raise ValueError("out shares memory with x: the kernel would read pixels it has already "
                                 "overwritten. Pass an out of its own, or omit out")
            if residual is not None and _overlap(out, residual) and \
                    (out.data_ptr() != residual.data_ptr() or out.shape != residual.shape):
                raise ValueError("out partly overlaps residual: pass residual itself as out (an in-place add) or "
                                 "a separate tensor")
        if batch == 0:
            return out
        target = out
        if self._bordered is not None:
            x = self.bordered(x, batch)
            # vector stores and residual loads: vec pixels (nchw), runs of channels (nhwc); the copies keep the
            # memory format (empty_like / clone preserve it)
            align = self.launch_plan.output_alignment
            if out.data_ptr() % align:
                target = torch.empty_like(out)
            if residual is not None and residual.data_ptr() % align:
                residual = residual.clone()
            self._zero_partial(target, target.dim() - 3)  # the channel dimension, a logical index in either layout
        extra = (residual.data_ptr(),) if self.launch_plan.residual else ()
        self.launch(x.data_ptr(), target.data_ptr(), batch, current_stream_handle(self.device_index),
                    *extra)
        if target is not out:
            out.copy_(target)
        return out

    def launch(self, x_ptr: int, y_ptr: int, batch: int, stream: int, *residual_ptr: int) -> None:
        """The raw launch (no checks): device pointers, the batch and a stream handle. For the generated
        mapping x_ptr is the zero-bordered input (k.bordered(x, batch)) and the split output channels
        (plan.partial_rows) are zeroed by the caller first."""
        tiles, blocks = self.launch_plan.grid
        self._launch_plan((tiles, blocks, batch), self.launch_plan.threads, stream, x_ptr, y_ptr, *residual_ptr)

    def __repr__(self) -> str:
        return (f"ConvKernel({self.launch_plan.name}, compile {self.compile_seconds:.3f}s, "
                f"{'cache hit' if self.cache_hit else 'built'})")


def _overlap(a, b) -> bool:
    start, first = a.data_ptr(), b.data_ptr()
    return start < first + b.numel() * b.element_size() and first < start + a.numel() * a.element_size()


def build_conv_kernel(plan, device_index: int, cache=None, compiler=None, built: Built | None = None,
                      full_plan=None) -> ConvKernel:
    """Compile (or fetch from the disk cache) and load a direct convolution plan; plan may be a sketch where
    full_plan makes the whole plan (runtime.kernel.compile_sketch: made only on a miss or when asked for)."""
    if built is None:
        built, full_plan = compile_sketch(plan, full_plan, cache, compiler)
    return ConvKernel(plan, built, device_index, full_plan)
