"""SparseLinear and SparseConv2d: nn.Linear / nn.Conv2d whose unstructured sparse weight runs on the generated
kernels (compile_spmm / compile_conv2d, through the one chooser) for the input shapes where that measured
faster than dense, and dense everywhere else.

The weight is held as CSR buffers (indptr, indices, values: state_dict entries), so a 90%-sparse layer keeps
about a fifth of the dense bytes (values plus 4-byte indices); the dense weight is made only where dense was
chosen for some shape, for autograd, on the CPU, or on request (keep_dense=True). On a GPU the buffers move
to host memory once a kernel holds W (its own copy, in its own format), so the device keeps one copy of W.
`memory_bytes()` says what the layer holds, the kernels' own copies of W included.

Each input shape (Linear: the token count n = x.numel() / in_features; Conv2d: the image size H x W) is
decided once, at its first call or ahead by `prepare` (the kernel and choice caches make a later process
load it in milliseconds): the chooser times its candidates and dense cuBLAS / cuDNN side by side under graph
replay and keeps the sparse kernel only with the margin MIN_SPEEDUP (`policy="measure"`; "sparse" and
"dense" force a path). `decisions` lists what was chosen and why.

Two execution modes rank the paths differently (semi/decide.py): replayed in a CUDA graph only GPU time
counts; called eagerly, a call also pays its host time, which for small layers exceeds the GPU time. With
`measure_eager = True` (convert(..., eager=True)), where a width's kernel won under graph replay it is timed
eagerly against dense too, and where dense is faster there by the margin (`eager_decisions`) eager calls of
that width run dense while captured ones keep the kernel. That costs the dense W beside the kernel's copy
for such widths, and eager calls of them then no longer exercise the kernel, so it is off by default: a model
served under CUDA graphs gains nothing from it. (A width dense under graph replay stays dense eagerly: the
kernel's host time is not below dense's.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import SparseFormatError, SparseMatrix
from ..formats.device import DeviceCsr
from ..ops import conv_memory_format, register
from ..runtime.streams import ready_dense_fallback
from ..semi.decide import DENSE, MIN_SPEEDUP, UNSTRUCTURED, Decision, decide, fixed, width_key
from ..tune.choose import TUNE_BUDGET_S, fastest_with_margin, tuning_budget

POLICIES = ("measure", "sparse", "dense")


class SparseShapeError(ValueError):
    """An input a sparse layer cannot take (features, channels, dtype, device), with the fix named."""


class _SparseWeight(nn.Module):
    """What both layers share: W as CSR buffers, the bias, the per-shape kernels and decisions, the dense
    weight made on demand, and a state_dict that loads any number of nonzeros.

    One copy of W on the GPU: once a layer on a CUDA device has built a kernel, its CSR buffers move to host
    memory (the kernels read their own copy of W in their own format; the buffers stay for state_dict, for
    building the next width's kernel and for a dense W if some width keeps dense, which is copied over then).
    `device` (an empty buffer that moves with the module) is the layer's device either way. state_dict and
    pickles hold the buffers where they are (host memory: checkpointing needs no GPU memory; load_state_dict
    copies across devices); a dtype cast keeps them there, a device move takes them along. A layer whose
    values require grad keeps them on its device. nn.DataParallel, which wants every buffer on one device,
    needs them back: call layer._csr_to_device() on each sparse layer first.

    Editing W's values or the bias in place (`layer.bias.mul_(2)` under no_grad) is seen at the next call
    (their version counters), and the kernels are built again; an edit through `.data` bypasses the version
    counter and is not seen: edit the tensors themselves, or call load_state_dict."""

    _kind = "layer"

    def __init__(self, rows: int, cols: int, nnz: int, bias: bool, device, dtype, policy: str,
                 tune_budget: float | None, keep_dense: bool):
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.keep_dense = policy, keep_dense
        self.tune_budget = tuning_budget(tune_budget)  # 0 and None: the cost model's pick
        self.measure_eager = False  # time eager calls too, where a kernel wins in a graph (module docstring)
        self._shape2d = (rows, cols)
        self.register_buffer("weight_indptr", torch.zeros(rows + 1, dtype=torch.int64, device=device))
        self.register_buffer("weight_indices", torch.zeros(nnz, dtype=torch.int32, device=device))
        self.register_buffer("weight_values", torch.zeros(nnz, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(rows, device=device, dtype=dtype), requires_grad=False) if bias else None
        # an empty tensor that says where the layer computes: it moves with the module (.to(), .cuda()) like
        # any buffer, is not in state_dict, and stands in for W as the torch.library ops' tensor argument
        self.register_buffer("_device_anchor", torch.empty(0, device=device, dtype=dtype), persistent=False)
        self.layer_id = register(self)
        self._reset()

    @property
    def device(self) -> torch.device:
        """Where the layer computes (its inputs, outputs, kernels and bias)."""
        anchor = self._buffers.get("_device_anchor")
        return self.weight_values.device if anchor is None else anchor.device

    @property
    def device_anchor(self) -> torch.Tensor:
        """An empty tensor on the layer's device and of its dtype: what a torch.library op is given to stand for
        W, whose CSR buffers may be in host memory."""
        return self._device_anchor

    @property
    def csr_on_host(self) -> bool:
        return self.weight_values.device != self.device

    def _csr_to_host(self) -> None:
        """Move the CSR buffers to host memory where a kernel holds W on the GPU (not while the values train)."""
        if self.csr_on_host or self.device.type != "cuda" or self.weight_values.requires_grad or \
                not any(k is not None for k in self._paths.values()):
            return
        self._move_csr("cpu")

    def _csr_to_device(self) -> None:
        if self.csr_on_host:
            self._move_csr(self.device)

    def _move_csr(self, device) -> None:
        with torch.inference_mode(False):  # a first call under inference_mode must not make them inference tensors
            for name in ("weight_indptr", "weight_indices", "weight_values"):
                self._buffers[name] = _moved(self._buffers[name].detach(), device)
        bias = self._parameters.get("bias")  # the same weight: _refresh must not drop the kernels
        self._key = (_version(self._buffers["weight_values"]), None if bias is None else _version(bias))

    def _reset(self) -> None:
        self._paths: dict = {}        # shape key -> kernel, or None for dense
        self._decided: dict = {}      # shape key -> Decision (graph replay)
        self._eager_decided: dict = {}  # shape key -> Decision called eagerly, where that was measured
        self._eager_dense: set = set()  # shape keys whose kernel won under graph replay but lost eagerly
        self._outpaced: dict = {}     # shape key -> config of the chooser's kernel where dense measured faster
        self._timed: dict = {}        # shape key -> [(config, us)] of every candidate the chooser timed
        self._dense = None
        self._dense_in_layout = None  # (the dense W it was made from, memory format, W in it): convolutions
        self._matrix = None
        self._device_csr = None  # device_csr(), until the kernel (or prepare's kernels) using it are built
        self._key = None
        self._hot = None  # (dtype, device) of the inputs a kernel last ran on: forward's lean path (see there)
        self._out_tails: dict = {}  # image size -> the output's (Cout, OH, OW) (convolutions)

    # -- the weight -----------------------------------------------------------------------------------------
    def _set_weight(self, matrix2d: torch.Tensor) -> None:
        """Fill the CSR buffers from a dense 2-D weight (zeros where pruned), in the layer's dtype."""
        dense = matrix2d.detach()
        finite = torch.isfinite(dense)
        if not bool(finite.all()):  # refused here, not at the first kernel build from inside a forward
            row, col = (int(i) for i in torch.nonzero(~finite)[0])
            raise SparseFormatError(f"weight[{row}, {col}] = {dense[row, col].item()} is not finite; NaN/inf "
                                    "weights would poison every output that uses them: fix the weights first")
        rows, cols = torch.nonzero(dense, as_tuple=True)  # row-major: already CSR order
        counts = torch.bincount(rows, minlength=dense.shape[0])
        with torch.no_grad():
            indptr = torch.zeros(dense.shape[0] + 1, dtype=torch.int64, device=dense.device)
            indptr[1:] = torch.cumsum(counts, 0)
            self.weight_indptr = indptr.to(self.weight_indptr.device)
            self.weight_indices = cols.to(self.weight_indices.device, torch.int32)
            self.weight_values = dense[rows, cols].to(self.weight_values.device, self.weight_values.dtype)
        self._reset()

    @property
    def nnz(self) -> int:
        return int(self.weight_values.numel())

    @property
    def sparsity(self) -> float:
        rows, cols = self._shape2d
        return 1.0 - self.nnz / max(rows * cols, 1)

    def sparse_matrix(self) -> SparseMatrix:
        """W as a host SparseMatrix (rows x cols) in the layer's dtype, made once per weight version."""
        self._refresh()
        if self._matrix is None:
            kernel_dtype = self.weight_values.dtype in (torch.float32, torch.float16, torch.bfloat16)
            if self.weight_values.is_cuda and kernel_dtype:  # checked on the GPU by reductions, not numpy passes
                self._matrix = DeviceCsr(self.weight_indptr.detach(), self.weight_indices.detach(),
                                         self.weight_values.detach(), self._shape2d,
                                         str(self.weight_values.dtype).replace("torch.", "")).to_host()
                return self._matrix
            values = self.weight_values.detach().to("cpu", torch.float32).numpy()
            self._matrix = SparseMatrix(self.weight_indptr.cpu().numpy(), self.weight_indices.cpu().numpy(), values,
                                        self._shape2d, str(self.weight_values.dtype).replace("torch.", ""))
        return self._matrix

    def device_csr(self) -> DeviceCsr:
        """W as a formats.DeviceCsr on the layer's device (its CSR buffers, copied over where they wait in host
        memory), for the families that pack a kernel's arrays there (registry: device_plan)."""
        self._refresh()
        if self._device_csr is None:  # held while prepare() builds its widths: their kernels share its arrays
            device = self.device
            self._device_csr = DeviceCsr(self.weight_indptr.detach().to(device),
                                         self.weight_indices.detach().to(device),
                                         self.weight_values.detach().to(device), self._shape2d,
                                         str(self.weight_values.dtype).replace("torch.", ""))
        return self._device_csr

    def dense_weight_2d(self) -> torch.Tensor:
        """W dense (rows x cols) on the layer's device and dtype. Made only when something asks for it (a shape
        decided dense, the CPU or autograd path, to_dense(), keep_dense) and kept from then on; under
        torch.compile made from the buffers each time (a traced function keeps no Python state); where autograd
        tracks the values (they require grad), made from them at each call and never kept (a training step
        changes them, and their gradient flows through it)."""
        if self._tracks_values():
            return self._build_dense(tracked=True)
        if torch.compiler.is_compiling():
            return self._build_dense()
        self._refresh()
        if self._dense is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"this {self._kind} runs dense for an input shape first seen during CUDA graph "
                                   "capture: run that shape once (or call prepare()) before capturing")
            # outside inference mode: a dense W made at a first call under inference_mode must still serve a
            # later autograd call (an inference tensor cannot be saved for backward)
            with torch.inference_mode(False):
                self._dense = self._build_dense()
        return self._dense

    def _drop_dense(self) -> None:
        self._dense = self._dense_in_layout = None

    def _make_dense_for(self, example: torch.Tensor) -> None:
        """Make the dense W a dense call on inputs like `example` reads, now (a later call may be a capture)."""
        ready_dense_fallback(self.dense_weight_2d(), self.bias)

    def _tracks_values(self) -> bool:
        """Whether autograd records what is made from W's values now (grad enabled, the values requiring it)."""
        return torch.is_grad_enabled() and self._buffers["weight_values"].requires_grad

    def _build_dense(self, tracked: bool = False) -> torch.Tensor:
        """W dense from the CSR buffers; `tracked`: from the values as autograd sees them (their gradient flows
        back through it), else from a detached view."""
        rows, cols = self._shape2d
        device = self.device
        values = self.weight_values if tracked else self.weight_values.detach()
        values = values.to(device)
        dense = torch.zeros(rows, cols, dtype=values.dtype, device=device)
        which = torch.repeat_interleave(torch.arange(rows, device=device), torch.diff(self.weight_indptr.to(device)),
                                        output_size=values.numel())  # output_size: no device-to-host sync
        dense[which, self.weight_indices.to(device, torch.int64)] = values
        return dense

    def _refresh(self) -> None:
        # Runs on every call, so it looks at two version counters only: load_state_dict and .to() / .half()
        # reset the layer themselves (_load_from_state_dict, _apply); what is left is an in-place edit of the
        # values or the bias (a pattern change goes through _set_weight, which resets too). Inference tensors
        # keep no version counter: they cannot be edited in place outside inference mode either.
        bias = self._parameters.get("bias")
        key = (_version(self._buffers["weight_values"]), None if bias is None else _version(bias))
        if key != self._key:
            self._reset()
            self._key = key

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the layer holds on its device: the CSR buffers (unless held in host memory: csr_host), the
        kernels' copies of W (kernels that read W as data), the dense weight where kept, the bias."""
        held = sum(t.numel() * t.element_size() for t in (self.weight_indptr, self.weight_indices, self.weight_values))
        csr, host = (0, held) if self.csr_on_host else (held, 0)
        held_by: dict = {}  # by storage: kernels packed on the device share W's arrays
        for kernel in (k for k in self._paths.values() if k is not None):
            tensors = getattr(kernel, "weight_tensors", None)
            if tensors is None:  # a kernel that keeps its own bytes (split-24's parts)
                held_by[("kernel", id(kernel))] = getattr(kernel, "weight_bytes", 0)
            else:
                held_by.update({t.data_ptr(): t.numel() * t.element_size() for t in tensors if t is not None})
        kernels = sum(held_by.values())
        dense = 0 if self._dense is None else self._dense.numel() * self._dense.element_size()
        kept = getattr(self, "_dense_in_layout", None)
        if kept is not None and kept[0] is self._dense:
            dense += kept[2].numel() * kept[2].element_size()
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return {"csr": csr, "csr_host": host, "kernels": kernels, "dense": dense, "bias": bias,
                "total": csr + kernels + dense + bias}

    # -- decisions ------------------------------------------------------------------------------------------
    @property
    def decisions(self) -> list[Decision]:
        """Per input shape, the decision under CUDA-graph replay (or the one decision, where not measured)."""
        return [self._decided[key] for key in sorted(self._decided)]

    @property
    def eager_decisions(self) -> list[Decision]:
        """Per input shape whose kernel won under graph replay, the decision for eager calls."""
        return [self._eager_decided[key] for key in sorted(self._eager_decided)]

    def _measures_eagerly(self, example: torch.Tensor) -> bool:
        return getattr(self, "measure_eager", False) and example.is_cuda

    def _runs_dense_eagerly(self, key) -> bool:
        return key in self._eager_dense and not torch.cuda.is_current_stream_capturing()

    def _decide_eagerly(self, key, n: int, kernel, example: torch.Tensor) -> None:
        """Time the kernel and dense called eagerly (host time included) on contiguous copies of `example`;
        where dense is faster by the margin (the kernel, which won in a graph, is the baseline here), eager
        calls of this shape run dense. Any failure of the timing (e.g. no memory for the dense W) keeps the
        kernel, the graph decision, with the reason."""
        from ..runtime.timing import eager_time_us

        try:
            layout = conv_memory_format(example) if example.dim() == 4 else torch.contiguous_format
            xs = [example.contiguous(memory_format=layout).clone(memory_format=layout) for _ in range(4)]
            extra = self._eager_extra(example)
            with torch.no_grad():
                sparse_us = eager_time_us(lambda x: self._kernel_call(kernel, x, *extra), xs)
                self._make_dense_for(example)  # made before timing dense, as a dense call of this shape finds it
                dense_us = eager_time_us(lambda x: self._dense_call(x, *extra), xs)
        except (RuntimeError, ValueError) as exc:
            self._eager_decided[key] = fixed(n, UNSTRUCTURED, f"eager timing failed ({type(exc).__name__}: "
                                                              f"{str(exc)[:120]}): the kernel, as in a graph")
            if not self.keep_dense and all(k is not None for k in self._paths.values()):
                self._drop_dense()
            return
        picked, ratio = fastest_with_margin({UNSTRUCTURED: sparse_us, DENSE: dense_us}, UNSTRUCTURED, MIN_SPEEDUP)
        reason = (f"dense measured {ratio:.2f}x faster than the kernel called eagerly: eager calls run dense"
                  if picked == DENSE else f"called eagerly the kernel holds ({1 / ratio:.2f}x of dense)")
        decision = Decision(n, picked, reason, sparse_us, dense_us, mode="eager")
        self._eager_decided[key] = decision
        if decision.path == DENSE:
            self._eager_dense.add(key)
        elif not (self.keep_dense or self._eager_dense or any(k is None for k in self._paths.values())):
            self._drop_dense()  # no shape needs it (yet): made again if one does

    def _eager_extra(self, example: torch.Tensor) -> tuple:
        return ()

    def _path(self, key, example):
        """The kernel for shape `key` (None: dense), deciding it at first sight."""
        self._refresh()
        if key in self._paths:
            return self._paths[key]
        n = key if isinstance(key, int) else key[0] * key[1]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if self._dense is None:
                raise RuntimeError(f"this {self._kind} sees an input shape ({key}) for the first time during CUDA "
                                   "graph capture, where nothing can be compiled or timed: run that shape once "
                                   "(or call prepare()) before capturing")
            self._decided[key] = fixed(n, DENSE, "first seen during CUDA graph capture, before the layer was "
                                                 "prepared: dense (call prepare first)")
            self._paths[key] = None
            return None
        if self.policy == "dense":
            kernel, decision = None, fixed(n, DENSE, "policy='dense'")
        else:
            try:
                kernel = self._compile(example)
            except ValueError as exc:  # a shape or layer the kernels refuse (taps, offsets, batch): dense
                kernel, decision = None, fixed(n, DENSE, f"the sparse kernels refuse it ({exc}): dense")
            else:
                choice = kernel.choice
                if choice is not None:
                    self._timed[key] = _timed_configs(choice)
                if n in self.__dict__.get("_pinned", ()) and key == n:
                    decision = fixed(n, UNSTRUCTURED, f"the pinned {kernel.mapping} config, compiled and not timed")
                elif self.policy == "sparse" or choice is None or choice.dense_us is None or choice.sparse_us is None:
                    decision = fixed(n, UNSTRUCTURED, f"policy={self.policy!r}: {kernel.mapping} kernel")
                else:
                    decision = decide(n, choice.sparse_us, choice.dense_us, MIN_SPEEDUP, path=UNSTRUCTURED,
                                      mode="graph")
                    if decision.path == DENSE:
                        self._outpaced[key] = kernel.config
                        kernel = None
                    elif self._measures_eagerly(example):
                        self._decide_eagerly(key, n, kernel, example)
        self._paths[key], self._decided[key] = kernel, decision
        if kernel is None:
            with torch.no_grad():  # made now and kept, not at the call, which may be a graph capture
                self._make_dense_for(example)
        self._csr_to_host()  # a kernel holds W on the device now
        return kernel

    def _drop_packings(self) -> None:
        """W's device CSR (a copy of the buffers, and the arrays packed from it): kept only while prepare()
        builds its widths, whose kernels share one packing."""
        self._device_csr = None

    def _input_problem(self, x: torch.Tensor) -> str | None:
        if x.device != self.device:
            return f"input on {x.device}, {self._kind} on {self.device}: move one of them"
        if x.dtype != self.weight_values.dtype:
            return (f"input dtype {x.dtype}, {self._kind} dtype {self.weight_values.dtype}: cast the input "
                    f"(x.to({self.weight_values.dtype})) or the layer (.to(dtype))")
        return None

    def _dense_path(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        return not x.is_cuda or self.policy == "dense" or (torch.is_grad_enabled() and self._needs_grad(x, residual))

    def _needs_grad(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether autograd must see this call: the kernels record no graph, so then the dense path runs
        (the input, W's values, the bias or the residual requiring grad: bias-only fine-tuning too)."""
        bias = self._parameters.get("bias")
        return (x.requires_grad or self._buffers["weight_values"].requires_grad
                or (bias is not None and bias.requires_grad)
                or (isinstance(residual, torch.Tensor) and residual.requires_grad))

    # -- module plumbing ------------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # another weight may have another number of nonzeros: take the incoming buffers' sizes, once they are
        # checked to be a CSR matrix of this layer's shape
        incoming = {name: state_dict.get(prefix + name) for name in ("weight_indptr", "weight_indices",
                                                                      "weight_values")}
        problem = _csr_problem(incoming, self._shape2d) if all(isinstance(t, torch.Tensor)
                                                                for t in incoming.values()) else None
        if problem:
            error_msgs.append(f"{prefix or 'the layer'}: {problem}")
            return
        self._csr_to_device()  # the incoming W lands on the layer's device; the kernels are rebuilt from it
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        for name, tensor in incoming.items():
            current = getattr(self, name)
            if isinstance(tensor, torch.Tensor) and tensor.shape != current.shape:
                setattr(self, name, torch.empty(tensor.shape, dtype=current.dtype, device=current.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if assign:  # the layer now is where the assigned tensors are (a meta-built layer, say): so is its anchor
            bias, values = self._parameters.get("bias"), self._buffers["weight_values"]
            self._buffers["_device_anchor"] = torch.empty(0, device=(bias if bias is not None else values).device,
                                                          dtype=values.dtype)
        self._reset()

    def __getstate__(self):
        # kernels are process- and device-bound: copies and pickles rebuild them (from the caches)
        state = self.__dict__.copy()
        state.update(_paths={}, _decided={}, _eager_decided={}, _eager_dense=set(), _outpaced={}, _timed={},
                     _dense=None,
                     _dense_in_layout=None, _matrix=None,
                     _key=None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_device_anchor" not in self._buffers:  # pickled before the anchor existed
            values = self._buffers["weight_values"]
            self.register_buffer("_device_anchor", torch.empty(0, device=values.device, dtype=values.dtype),
                                 persistent=False)
        self.layer_id = register(self)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half(): kernels and the dense copy belong to the old tensors. fn meets the CSR
        # buffers where they are: a device move takes host-held ones to the new device too (.cpu() leaves
        # them), a dtype cast keeps them in host memory; the anchor says where the layer is afterwards. One that
        # changes nothing (model.to("cuda") on a model there, as pipelines do) keeps the kernels and decisions,
        # and the host-held buffers where they are.
        host = [self._buffers[name] for name in ("weight_indptr", "weight_indices", "weight_values")] \
            if self.csr_on_host else []
        if changes_nothing(self, fn, host):  # the host-held buffers stay where they are, not copied over and back
            return super()._apply(lambda t: t if any(t is h for h in host) else fn(t), recurse)
        if fn(self._buffers["weight_indptr"]).dtype != torch.int64:  # rows + 1 elements: a cheap probe
            raise TypeError(f"this casts every tensor of the {self._kind}, its CSR indices too (Module.type() does): "
                            "cast with .to(dtype), .half(), .bfloat16() or .float(), which leave the indices alone")
        self._reset()
        out = super()._apply(fn, recurse)
        if self.csr_on_host and self.device.type != "cuda":
            self._csr_to_device()
        return out


def changes_nothing(module: nn.Module, fn, host=()) -> bool:
    """Whether Module._apply's `fn` (.to(), .cuda(), .half(), .type()) leaves `module`'s own parameters and buffers
    as they are, each coming back as the same tensor (model.to("cuda") on a model already there). `host`: tensors
    the module holds in host memory, which a device move would carry over: left out. The device anchor is asked
    first: a real move or cast changes it, so nothing else is converted twice."""
    anchor = module._buffers.get("_device_anchor")
    with torch.no_grad():
        if anchor is None or fn(anchor) is not anchor:
            return False
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        return all(fn(t) is t for t in own if not any(t is h for h in host))


def _shape_key(height: int, width: int, layout: torch.memory_format):
    """A convolution's shape key: (H, W) for NCHW inputs, (H, W, "nhwc") for channels_last ones (NHWC
    kernels), so each layout has its own decision and kernel."""
    return (height, width) if layout != torch.channels_last else (height, width, "nhwc")


def _moved(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`. To the host, into pages written first: a copy from the GPU into fresh pages faults each
    one in on the copy's path (2 GB/s measured on an H200 host, 8 GB/s with the pages touched first: a converted
    8B model's CSR, 12 GB at 70%, in 1.5 s instead of 8)."""
    if torch.device(device).type != "cpu" or t.device.type == "cpu":
        return t.to(device)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")  # not torch's default device, which a caller may set
    out.zero_()
    return out.copy_(t)


def _version(t: torch.Tensor) -> int:
    return 0 if t.is_inference() else t._version


def _csr_problem(buffers: dict, shape: tuple[int, int]) -> str | None:
    """Why these CSR buffers are not a matrix of `shape`, or None."""
    rows, cols = shape
    indptr, indices, values = buffers["weight_indptr"], buffers["weight_indices"], buffers["weight_values"]
    if indptr.dim() != 1 or indptr.numel() != rows + 1:
        return f"weight_indptr has {indptr.numel()} entries; this layer's {rows} rows need {rows + 1}"
    if indices.numel() != values.numel() or int(indptr[-1]) != values.numel() or int(indptr[0]) != 0:
        return (f"weight_indptr ends at {int(indptr[-1])} but there are {indices.numel()} indices and "
                f"{values.numel()} values: not one CSR matrix")
    if bool((torch.diff(indptr) < 0).any()):
        return "weight_indptr decreases: not a CSR matrix"
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= cols):
        return f"weight_indices reach {int(indices.max())}; this layer has {cols} columns"
    return None


class SparseLinear(_SparseWeight):
    """y = x W^T + b with W unstructured sparse (any pattern). Input x: (..., in_features) of the layer's dtype
    and device, any leading dimensions and strides; every token count n is a shape of its own (a kernel per n,
    chosen by measurement; `prepare(model, widths)` decides ahead). On the CPU, and whenever autograd needs a
    gradient, the same result is computed densely.

    NaN and inf in x: the sparse kernels multiply only W's stored nonzeros, so a NaN at x[t, k] makes NaN
    exactly the y[t, i] with W[i, k] != 0; dense (cuBLAS) makes every y[t, :] NaN. Rely on neither."""

    _kind = "layer"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, nnz: int = 0, device=None,
                 dtype=torch.float32, policy: str = "measure", tune_budget: float | None = TUNE_BUDGET_S,
                 keep_dense: bool = False):
        self.in_features, self.out_features = in_features, out_features
        super().__init__(out_features, in_features, nnz, bias, device, dtype, policy, tune_budget, keep_dense)
        self._pinned: dict = {}  # token count -> kernel config taken as given (pin)

    @classmethod
    def from_dense(cls, linear: nn.Linear, policy: str = "measure", tune_budget: float | None = TUNE_BUDGET_S,
                   keep_dense: bool = False) -> "SparseLinear":
        """A copy of `linear` (plain or mask-parametrized: its weight's zeros are the pattern)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SparseLinear.from_dense takes an nn.Linear, got {type(linear).__name__}"
                            + ("; use SparseConv2d.from_dense" if isinstance(linear, nn.Conv2d) else ""))
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, 0, weight.device, weight.dtype,
                    policy, tune_budget, keep_dense)
        layer._set_weight(weight)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.detach().to(weight.dtype))
        return layer

    def to_dense(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                           device=self.device, dtype=self.weight_values.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.dense_weight_2d())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparsity={self.sparsity:.1%}, dtype={self.weight_values.dtype}, policy={self.policy!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The lean path (eager host time near dense F.linear's): an input like the last one a
        # kernel ran on, outside compilation and autograd, goes to its kernel after a handful of attribute
        # reads; everything else takes the checked path below, which names any problem.
        hot = self.__dict__.get("_hot")  # a layer pickled by an older version has none
        if hot is not None and type(x) is torch.Tensor and x.dtype == hot[0] and x.device == hot[1] and \
                x.dim() > 0 and x.shape[-1] == self.in_features and self.policy != "dense" and \
                not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and self._needs_grad(x)):
            self._refresh()
            n = x.numel() // self.in_features
            kernel = self._paths.get(n)
            if kernel is not None and self._hot is not None and not (self._eager_dense and self._runs_dense_eagerly(n)):
                if x.is_contiguous() and x.data_ptr() % 16 == 0 and kernel.takes_rows_unchecked:
                    # x's rows are the kernel's N x K operand as they lie: no reshape, no view (each a few us)
                    out = torch.empty((*x.shape[:-1], self.out_features), dtype=hot[0], device=hot[1])
                    kernel.launch_rows(x, out)
                    return out
                if x.dim() == 2:
                    return kernel(x if x.is_contiguous() else x.contiguous())
                y = kernel(x.reshape(-1, self.in_features).contiguous())
                return y.view(*x.shape[:-1], self.out_features)
        return self._checked_forward(x)

    def _checked_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SparseShapeError(f"input has shape {shape}; this layer takes (..., {self.in_features})")
        problem = self._input_problem(x)
        if problem and not (self._dense_path(x) and torch.is_autocast_enabled(x.device.type)):
            raise SparseShapeError(problem)
        if self._dense_path(x):
            return F.linear(x, self.dense_weight_2d(), self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.sparseforge.sparse_linear(x, self._device_anchor, self.bias, self.layer_id,
                                                       self.out_features)
        return self.sparse_forward(x)

    def sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path (also the body of the torch.library op)."""
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if n == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        kernel = self._path(n, rows)
        if kernel is None or self._eager_dense and self._runs_dense_eagerly(n):
            return F.linear(x, self.dense_weight_2d(), self.bias)
        y = kernel(rows if rows.is_contiguous() else rows.contiguous())
        self._hot = (x.dtype, x.device)
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel_call(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel(rows)

    def _dense_call(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.dense_weight_2d(), self.bias)

    def prepare(self, widths) -> list[Decision]:
        """Decide now for each token count in `widths` (seeded random inputs), e.g. before graph capture."""
        generator = torch.Generator(device="cpu").manual_seed(0)
        self._preparing = True  # the widths' kernels share one device packing of W (device_csr)
        try:
            for n in sorted({int(n) for n in widths}):
                if n < 1:
                    raise ValueError(f"widths must be positive token counts, got {n}")
                x = torch.randn(n, self.in_features, generator=generator).to(self.device, self.weight_values.dtype)
                self._path(n, x)
        finally:
            self._preparing = False
            self._drop_packings()
        return self.decisions

    def pin(self, configs: dict) -> None:
        """Run these kernel configs, one per token count ({n: config}, e.g. what a layer of the same shape and
        sparsity measured: kernel_configs()), compiled for this layer's W without choosing or timing; the
        token counts not given are decided as the policy says."""
        from ..mappings.registry import family_of

        checked = {}
        for n, config in configs.items():
            count = width_key(n, "pin takes {token count: config}")
            family_of(config)  # TypeError naming the config classes
            checked[count] = config
        self.__dict__.setdefault("_pinned", {}).update(checked)
        for n in checked:  # decided again, from the pinned config, at the next call or prepare
            self._paths.pop(n, None)
            self._decided.pop(n, None)
            self._eager_decided.pop(n, None)
            self._eager_dense.discard(n)
            self.__dict__.setdefault("_outpaced", {}).pop(n, None)  # a layer pickled before it had none
            self.__dict__.setdefault("_timed", {}).pop(n, None)

    @property
    def pinned(self) -> dict:
        """{token count: config} given to pin."""
        return dict(self.__dict__.get("_pinned", {}))

    def densify_into(self, out: torch.Tensor) -> bool:
        """Write W dense into `out` (out_features x in_features, on the layer's device) from a kernel's own
        device copy of W, where one can (runtime.kernel densify: no copy of W from the host); False where
        none can (no kernel yet, W compiled into the code, a family without the hook)."""
        self._refresh()
        for kernel in self._paths.values():
            densify = getattr(kernel, "densify", None)
            if densify is not None and densify(out) is not None:
                return True
        return False

    def kernel_at(self, n: int):
        """The kernel the layer runs on `n` tokens, or None (dense, or not decided yet)."""
        self._refresh()
        return self._paths.get(n)

    def kernel_configs(self) -> dict:
        """{token count: the config of the kernel it runs} for the token counts that run a kernel."""
        return {n: kernel.config for n, kernel in sorted(self._paths.items()) if kernel is not None}

    def timed_configs(self, key) -> list[TimedConfig]:
        """(config, microseconds, bytes of W as data) of every candidate the chooser timed for shape `key` (token
        count), the losing families' included; empty where nothing was timed (a pinned config, a cached choice's
        lost records)."""
        return list(self.__dict__.get("_timed", {}).get(key, ()))

    def fastest_kernel_configs(self) -> dict:
        """{token count: the config of the chooser's kernel (the fastest measured, or a tie in time won by fewer
        bytes of W)}, the token counts where dense measured faster included (a caller that keeps no dense W, e.g. a decoder layer, runs the kernel there)."""
        return dict(sorted({**self.__dict__.get("_outpaced", {}), **self.kernel_configs()}.items()))

    def kernel_args(self, n: int, on_device: bool = True) -> dict:
        """What compile_spmm and prebuild_spmm take for `n` tokens, alike. With on_device, a pinned config whose
        family packs on the device (registry: device_plan) gets W as the layer's CSR on its GPU: nothing is
        chosen, so no host copy of W is made."""
        from ..mappings.registry import family_of

        bias = None if self.bias is None else self.bias.detach().float().cpu().numpy()
        config = self.pinned.get(n)
        on_device = on_device and config is not None and self.device.type == "cuda" and \
            family_of(config).device_plan is not None
        return {"W": self.device_csr() if on_device else self.sparse_matrix(), "n": n, "dtype": self.weight_values.dtype, "layout": "nk", "bias": bias,
                "tune_budget": self.tune_budget, "config": self.pinned.get(n)}

    def _compile(self, rows: torch.Tensor):
        from ..spmm import compile_spmm

        try:
            return compile_spmm(**self.kernel_args(rows.shape[0]), device=self.device,
                                time_dense=self.policy == "measure")
        finally:  # built or failed: the device CSR is not kept past it (prepare keeps it for its widths)
            if not self.__dict__.get("_preparing"):
                self._drop_packings()

    def prebuild(self, widths, arch: int) -> int:
        """Compile into the disk cache, without a GPU, the kernels deciding each token count in `widths` would
        compile on an sm_`arch` GPU (spmm.prebuild_spmm); how many. W from the host: nothing is packed on the
        device for a compile."""
        from ..spmm import prebuild_spmm

        return sum(prebuild_spmm(**self.kernel_args(n, on_device=False), arch=arch)
                   for n in sorted({int(n) for n in widths}))


class SparseConv2d(_SparseWeight):
    """A Conv2d whose unstructured sparse weight runs on the direct sparse convolution (compile_conv2d:
    implicit im2col, the generated and csr-columns mappings), per image size H x W (any batch) and layout,
    where that measured faster than cuDNN; fused bias (a folded BatchNorm's shift), optionally a residual added
    before the ReLU (residual=True: forward(x, residual=r), r shaped like the output: ResNet's shortcut) and
    ReLU (relu=True); nn.fuse_epilogues sets both from the model's graph. Input x: (batch, Cin, H, W) of the
    layer's dtype and device, NCHW or channels_last: a channels_last x runs on an NHWC kernel (decided on its
    own, against cuDNN in channels_last) and gets a channels_last output, so a channels_last model stays so;
    any other layout is made NCHW-contiguous first."""

    _kind = "convolution"

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, nnz: int = 0, device=None, dtype=torch.float32,
                 policy: str = "measure", tune_budget: float | None = TUNE_BUDGET_S, keep_dense: bool = False,
                 relu: bool = False, residual: bool = False):
        if isinstance(padding, str):
            raise ValueError(f"padding={padding!r}: give the padding as numbers (SparseConv2d.from_dense resolves "
                             "'same' and 'valid' of an nn.Conv2d)")
        pair = lambda v: (int(v), int(v)) if isinstance(v, int) else tuple(int(i) for i in v)  # noqa: E731
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.padding, self.dilation = map(pair, (kernel_size, stride, padding, dilation))
        self.relu, self.residual = bool(relu), bool(residual)
        cols = in_channels // groups * self.kernel_size[0] * self.kernel_size[1]
        super().__init__(out_channels, cols, nnz, bias, device, dtype, policy, tune_budget, keep_dense)

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, policy: str = "measure", tune_budget: float | None = TUNE_BUDGET_S,
                   keep_dense: bool = False, relu: bool = False, residual: bool = False) -> "SparseConv2d":
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"SparseConv2d.from_dense takes an nn.Conv2d, got {type(conv).__name__}"
                            + ("; use SparseLinear.from_dense" if isinstance(conv, nn.Linear) else ""))
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode={conv.padding_mode!r}: the sparse convolution pads with zeros only")
        padding = conv.padding
        if isinstance(padding, str):  # 'valid' or 'same' (stride 1): resolve to numbers
            padding = (0, 0) if padding == "valid" else tuple(d * (k - 1) // 2 for d, k in zip(conv.dilation,
                                                                                                conv.kernel_size))
            if any(d * (k - 1) % 2 for d, k in zip(conv.dilation, conv.kernel_size)):
                raise ValueError("padding='same' with an even kernel extent pads unevenly: not supported")
        weight = conv.weight.detach()
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, padding, conv.dilation,
                    conv.groups, conv.bias is not None, 0, weight.device, weight.dtype, policy, tune_budget,
                    keep_dense, relu, residual)
        layer._set_weight(weight.reshape(weight.shape[0], -1))
        if conv.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(conv.bias.detach().to(weight.dtype))
        return layer

    def to_dense(self) -> nn.Module:
        conv = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                         self.dilation, self.groups, self.bias is not None, device=self.device,
                         dtype=self.weight_values.dtype)
        with torch.no_grad():
            conv.weight.copy_(self.dense_weight())
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        if self.residual:
            return ConvEpilogue(conv, relu=self.relu)
        return nn.Sequential(conv, nn.ReLU()) if self.relu else conv

    def set_epilogue(self, relu: bool, residual: bool) -> None:
        """Change what follows the convolution (fuse_epilogues): the kernels are rebuilt for each input shape
        already decided, in the mapping and config that won there, without timing again (ValueError if one of
        them cannot take the epilogue, the layer then unchanged); shapes kept dense stay dense."""
        old = self.epilogue_state()
        self.relu, self.residual = bool(relu), bool(residual)
        rebuilt = {}
        try:
            for key, kernel in old[2].items():
                rebuilt[key] = None if kernel is None else self._rebuild(kernel)
        except BaseException:  # a refusal (ValueError) or a compile / driver error: the layer as it was
            self.restore_epilogue(old)
            raise
        self._paths, self._decided, self._key = rebuilt, old[3], old[4]
        # eager decisions were measured without this epilogue: eager calls use the (rebuilt) kernels again
        self._eager_decided, self._eager_dense = {}, set()

    def epilogue_state(self) -> tuple:
        """What set_epilogue changes, for restore_epilogue."""
        return (self.relu, self.residual, dict(self._paths), dict(self._decided), self._key,
                dict(self._eager_decided), set(self._eager_dense))

    def restore_epilogue(self, state: tuple) -> None:
        self.relu, self.residual = state[0], state[1]
        self._paths, self._decided, self._key = dict(state[2]), dict(state[3]), state[4]
        self._eager_decided, self._eager_dense = dict(state[5]), set(state[6])

    def _rebuild(self, kernel):
        from ..conv import compile_conv2d

        bias = None if self.bias is None else self.bias.detach().float().cpu().numpy()
        return compile_conv2d(self.sparse_matrix(), kernel.launch_plan.geometry.input_shape, self.stride, self.padding,
                              self.dilation, self.groups, self.weight_values.dtype, bias=bias, relu=self.relu,
                              residual=self.residual, layout=kernel.layout, device=self.device,
                              kernel_size=self.kernel_size, config=kernel.config)

    def dense_weight(self, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        """W as the Conv2d weight (Cout, Cin/groups, kh, kw) in `memory_format`. cuDNN turns a weight that is
        not in its input's layout into one on every call (a copy kernel each call, inside a CUDA graph too, and
        the chooser timed cuDNN with W in the input's layout), so a channels_last W is made once and kept."""
        weight = self.dense_weight_2d().view(self.out_channels, self.in_channels // self.groups, *self.kernel_size)
        if weight.is_contiguous(memory_format=memory_format):
            return weight
        if torch.compiler.is_compiling() or self._tracks_values():  # nothing kept: W is made at each call there
            return weight.contiguous(memory_format=memory_format)
        kept = getattr(self, "_dense_in_layout", None)
        if kept is None or kept[0] is not self._dense or kept[1] != memory_format:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return weight  # nothing is allocated to keep during a capture: cuDNN converts it in the graph
            with torch.inference_mode(False):  # as dense_weight_2d: it may serve a later autograd call
                kept = self._dense_in_layout = (self._dense, memory_format,
                                                weight.contiguous(memory_format=memory_format))
        return kept[2]

    def _make_dense_for(self, example: torch.Tensor) -> None:
        self.dense_weight(conv_memory_format(example))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, residual={self.residual}, relu={self.relu}, sparsity={self.sparsity:.1%}, "
                f"dtype={self.weight_values.dtype}, policy={self.policy!r}")

    def _dense_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.conv2d(x, self.dense_weight(conv_memory_format(x)), self.bias, self.stride, self.padding, self.dilation,
                     self.groups)
        if residual is not None:
            y = y + residual
        return F.relu(y) if self.relu else y

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # The lean path, as SparseLinear.forward's: an input like the last one a kernel ran on (and a residual
        # of the output's shape where the layer adds one) goes to its kernel after a handful of attribute reads
        hot = self.__dict__.get("_hot")  # a layer pickled by an older version has none
        if hot is not None and type(x) is torch.Tensor and x.dtype == hot[0] and x.device == hot[1] and \
                x.dim() == 4 and x.shape[1] == self.in_channels and self.policy != "dense" and \
                not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and self._needs_grad(x, residual)):
            self._refresh()
            if x.is_contiguous():
                key, layout = x.shape[2:], torch.contiguous_format
            else:
                layout = conv_memory_format(x)
                key = _shape_key(x.shape[2], x.shape[3], layout)
            kernel, out_tail = self._paths.get(key), self._out_tails.get(key)
            if kernel is not None and self._hot is not None and not (self._eager_dense and
                                                                     self._runs_dense_eagerly(key)):
                x = x.contiguous(memory_format=layout)  # a no-op for an input already in its layout
                if residual is None and not self.residual:
                    return kernel(x)
                if self.residual and type(residual) is torch.Tensor and residual.dtype == x.dtype and \
                        residual.device == x.device and residual.shape[0] == x.shape[0] and \
                        residual.shape[1:] == out_tail:
                    return kernel(x, residual=residual.contiguous(memory_format=layout))
        return self._checked_forward(x, residual)

    def _checked_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != self.in_channels:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SparseShapeError(f"input has shape {shape}; this convolution takes (batch, {self.in_channels}, "
                                   "H, W)")
        problem = self._input_problem(x) or self._residual_problem(x, residual)
        if problem and not (self._dense_path(x, residual) and torch.is_autocast_enabled(x.device.type)):
            raise SparseShapeError(problem)
        if self._dense_path(x, residual):
            return self._dense_forward(x, residual)
        if torch.compiler.is_compiling():
            oh, ow = self._out_size(x.shape[2], x.shape[3])
            return torch.ops.sparseforge.sparse_conv2d(x, self._device_anchor, self.bias, self.layer_id,
                                                       self.out_channels, oh, ow, residual)
        return self.sparse_forward(x, residual)

    def _residual_problem(self, x: torch.Tensor, residual) -> str | None:
        if not self.residual:
            return None if residual is None else ("this convolution adds no residual: build it with "
                                                  "residual=True (or add the tensor after the call)")
        expected = (x.shape[0], self.out_channels, *self._out_size(x.shape[2], x.shape[3]))
        if not isinstance(residual, torch.Tensor):
            return f"this convolution adds a residual: call it as layer(x, residual=r), r of shape {expected}"
        if tuple(residual.shape) != expected:
            return f"residual has shape {tuple(residual.shape)}; the output's is {expected}"
        if residual.device != x.device or residual.dtype != x.dtype:
            return (f"residual is {residual.dtype} on {residual.device}; the input is {x.dtype} on {x.device}: "
                    "give both alike")
        return None

    def _out_size(self, h: int, w: int) -> tuple[int, int]:
        return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                     zip((h, w), self.padding, self.dilation, self.kernel_size, self.stride))

    def sparse_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_channels, *self._out_size(x.shape[2], x.shape[3]))
        # a channels_last input runs on an NHWC kernel (its own shape key), anything else on an NCHW one
        layout = conv_memory_format(x)
        key = _shape_key(int(x.shape[2]), int(x.shape[3]), layout)
        x = x.contiguous(memory_format=layout)
        kernel = self._path(key, x)
        if kernel is None or self._eager_dense and self._runs_dense_eagerly(key):
            return self._dense_forward(x, residual)
        y = kernel(x) if residual is None else kernel(x, residual=residual.contiguous(memory_format=layout))
        self._out_tails[key] = tuple(y.shape[1:])  # geometry only: never stale
        self._hot = (x.dtype, x.device)
        return y

    def _eager_extra(self, example: torch.Tensor) -> tuple:
        if not self.residual:
            return ()
        shape = (example.shape[0], self.out_channels, *self._out_size(example.shape[2], example.shape[3]))
        generator = torch.Generator(device="cpu").manual_seed(0)  # not the caller's random stream
        residual = torch.randn(shape, generator=generator).to(example.device, example.dtype)
        return (residual.contiguous(memory_format=conv_memory_format(example)),)

    def _kernel_call(self, kernel, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernel(x) if residual is None else kernel(x, residual=residual)

    def _dense_call(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._dense_forward(x, residual)

    def prepare(self, input_shapes, channels_last: bool = False) -> list[Decision]:
        """Decide now for each (batch, Cin, H, W) in `input_shapes` (seeded random inputs), for NCHW inputs or,
        with channels_last=True, for channels_last ones (which run on NHWC kernels)."""
        generator = torch.Generator(device="cpu").manual_seed(0)
        for shape in input_shapes:
            x = torch.randn(tuple(shape), generator=generator).to(self.device, self.weight_values.dtype)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            layout = conv_memory_format(x)
            self._path(_shape_key(int(shape[2]), int(shape[3]), layout), x)
        return self.decisions

    def kernel_args(self, shape: tuple, channels_last: bool) -> dict:
        """What compile_conv2d and prebuild_conv2d take for inputs of `shape` in that layout, alike."""
        bias = None if self.bias is None else self.bias.detach().float().cpu().numpy()
        return {"W": self.sparse_matrix(), "input_shape": tuple(shape), "stride": self.stride, "padding": self.padding,
                "dilation": self.dilation, "groups": self.groups, "dtype": self.weight_values.dtype, "bias": bias,
                "relu": self.relu, "residual": self.residual, "layout": "nhwc" if channels_last else "nchw",
                "kernel_size": self.kernel_size, "tune_budget": self.tune_budget}

    def _compile(self, x: torch.Tensor):
        from ..conv import compile_conv2d

        return compile_conv2d(**self.kernel_args(x.shape, conv_memory_format(x) == torch.channels_last),
                              device=self.device, time_dense=self.policy == "measure")

    def prebuild(self, input_shapes, arch: int, channels_last: bool = False) -> int:
        """Compile into the disk cache, without a GPU, the kernels deciding each (batch, Cin, H, W) in
        `input_shapes` (NCHW, or channels_last inputs) would compile on an sm_`arch` GPU; how many."""
        from ..conv import prebuild_conv2d

        # one per image size (the layer keys its kernels so, whatever the batch: the first shape decides, as in
        # prepare); a tensor both NCHW- and channels_last-contiguous (C = 1, or H = W = 1) runs NCHW
        first = {(int(s[2]), int(s[3])): tuple(s) for s in reversed(list(input_shapes))}
        return sum(prebuild_conv2d(**self.kernel_args(shape, channels_last and shape[1] > 1 and
                                                       shape[2] * shape[3] > 1), arch=arch)
                   for shape in first.values())


class ConvEpilogue(nn.Module):
    """A dense Conv2d with the epilogue a fused SparseConv2d carries: y = relu?(conv(x) + residual)
    (SparseConv2d.to_dense of a layer that adds a residual)."""

    def __init__(self, conv: nn.Conv2d, relu: bool):
        super().__init__()
        self.conv, self.relu = conv, relu

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y = self.conv(x) + residual
        return F.relu(y) if self.relu else y


class TimedConfig(NamedTuple):
    """A candidate the chooser timed: its config, its time, and the bytes of W its kernel reads as data (None
    where W is its code or the record does not say)."""
    config: object
    us: float
    weight_bytes: int | None = None


def _timed_configs(choice) -> list[TimedConfig]:
    from ..tune.pipeline import config_from_record

    timed = []
    for record in choice.records:
        config = config_from_record(record) if record.get("us") else None
        if config is not None:
            timed.append(TimedConfig(config, float(record["us"]), record.get("weight_bytes")))
    return timed
