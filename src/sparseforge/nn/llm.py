"""Hugging Face causal LMs converted for decoding: every Linear of the decoder layers (q/k/v/o/gate/up/down
projections) and lm_head of a transformers `LlamaForCausalLM` (and the models that share its layout: Mistral,
Qwen2) replaced by a DecodeLinear where the sparse kernels measured faster than dense at the decode widths.

Decoding calls each Linear on batch x 1 tokens, so the decode widths are given at conversion (`tokens=(1, 8)`:
batch 1 and 8) and decided then; `generate` never compiles or times anything. A width between them runs on the
next larger width's kernel (its input padded with zero rows); a wider one (the prefill: batch x prompt tokens)
runs dense, W written into one workspace per (dtype, device) that every layer shares (the layers run one after
another on a stream: each reads W before the next writes its own; host threads take turns through a lock;
prefills on several CUDA streams at once would need a workspace each, and are not supported), sized to the
largest shape, so no layer keeps a dense W of its own.

Conversion decides once per distinct (weight shape, bias, dtype, sparsity bucket, 2:4 or not): the first layer of a
group is timed at every decode width (nn.convert.measure_layer: the unstructured kernels, 2:4 where the weight
is 2:4, dense); the other layers of the group take its decision and compile its kernel configs (pinned:
SparseLinear.pin) for their own weights at the widths where it won, side by side, nothing ranked or timed
(a Llama has 4 shapes over its 32 layers, so 4 measurements). Each group's decision is kept in the disk cache
under its shape, bias, dtype, sparsity bucket, 2:4-ness, decode widths, tune budget, GPU and the chooser's code
(not the weight), so converting the same architecture again on that GPU measures nothing.
Each layer's dense weight is dropped as it is replaced (peak GPU memory in the report).
On a CPU nothing can be timed: policy="sparse" puts in the modules (which compute densely there, every width
from the shared workspace), for tests and for saving.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..mappings.registry import family_of
from ..ops import register
from ..prune.targets import LayerFilter, Skipped, select_layers
from ..runtime.compiler import CompileError
from ..semi.cusparselt import Sparse24Error, check_weight
from ..semi.runtime import check_pinned
from ..semi.decide import DENSE, SPARSE, UNSTRUCTURED
from ..tune.choose import TUNE_BUDGET_S, tuning_budget
from .convert import SPARSITY_BUCKET, LayerReport, ModelReport, measure_layer, model_bytes, prebuild_layers, \
    unpruned_reason
from .linear24 import SparseLinear24
from .sparse import SparseLinear, SparseShapeError

EXTRA = "pip install 'sparseforge[llm]'"
TRANSFORMERS_RANGE = ((5, 17), (6, 0))  # what the llm extra pins: >= 5.17, < 6
_CANDIDATE = re.compile(r"model\.layers\.\d+\..+|lm_head")


def require_transformers():
    """The transformers module, or ImportError naming the extra that installs it (this part of sparseforge is
    optional: the core needs no transformers)."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"Hugging Face models need the transformers package (>= 5.17, < 6), which is not "
                          f"installed: {EXTRA}") from err
    version = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    low, high = TRANSFORMERS_RANGE
    if not low <= version < high:
        raise ImportError(f"transformers {transformers.__version__} is installed; sparseforge supports >= 5.17, < 6: "
                          f"{EXTRA}")
    return transformers


def is_transformers_model(model) -> bool:
    """Whether `model` is a transformers model (without importing transformers)."""
    return isinstance(model, nn.Module) and any(c.__module__.split(".")[0] == "transformers"
                                                for c in type(model).__mro__)


def is_causal_lm(model) -> bool:
    """Whether `model` is a transformers causal LM of the Llama layout (check_causal_lm passes)."""
    try:
        check_causal_lm(model)
    except TypeError:
        return False
    return True


def check_causal_lm(model) -> None:
    """Refuse, naming the fix, what is not a decoder-only causal LM of the Llama layout (model.model.layers, a
    list of decoder layers, and lm_head)."""
    if not is_transformers_model(model):
        raise TypeError(f"expected a transformers causal LM such as LlamaForCausalLM, got {type(model).__name__}; "
                        "for other models call sparseforge.convert(model, example_inputs)")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise TypeError(f"{type(model).__name__} has no model.layers and lm_head: sparseforge converts causal LMs of "
                        "the Llama layout (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM); load the model "
                        "with AutoModelForCausalLM")


def check_tokens(tokens) -> tuple[int, ...]:
    """The decode widths as a sorted tuple of distinct positive ints: (1, 8), or one int."""
    import numbers

    given = [tokens] if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool) else tokens
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(f"tokens must be the decode batch sizes, e.g. tokens=(1, 8), got {tokens!r}")
    given = list(given)
    bad = [n for n in given if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1]
    if bad or not given:
        raise ValueError(f"tokens must be positive integers (the batch sizes decoding runs), e.g. (1, 8); got "
                         f"{tokens!r}")
    return tuple(sorted({int(n) for n in given}))


# -- the module ----------------------------------------------------------------------------------------------

# (dtype, device) -> [the flat dense-W scratch every prefill call shares, whether a CUDA graph captured a use]
_WORKSPACES: dict = {}
_RETIRED: list = []  # outgrown workspaces a captured graph may still write: kept while the process lives
# held from writing W into the workspace until its matmul is enqueued: host threads that share a stream (a
# server's) take turns, and the stream runs each matmul before the next write
_WORKSPACE_LOCK = threading.RLock()


def reserve_workspace(numel: int, dtype: torch.dtype, device: torch.device) -> list:
    """The shared workspace of (dtype, device), grown to `numel` elements if smaller (DecodeLinear.prepare
    reserves its shape's size, so a capture finds it grown). An outgrown one is freed unless a captured graph
    used it."""
    key = (dtype, torch.device(device))
    found = _WORKSPACES.get(key)
    if found is None or found[0].numel() < numel:
        if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph captures a prefill wider than the shared workspace holds: prepare the "
                               "model (DecodeLinear.prepare, or sparseforge.load onto the GPU) before capturing")
        if found is not None and found[1]:
            _RETIRED.append(found[0])
        # outside inference mode: a workspace made by a first call under inference_mode (an inference tensor)
        # could not be written by a later call outside it
        with torch.inference_mode(False):
            found = _WORKSPACES[key] = [torch.empty(numel, dtype=dtype, device=device), False]
    return found


def _workspace(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A rows x cols view of the shared workspace (contiguous, at its start: 16-byte aligned)."""
    found = reserve_workspace(rows * cols, dtype, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        found[1] = True  # the graph writes this buffer at every replay: never freed
    return found[0][: rows * cols].view(rows, cols)


def _next_width(widths: Iterable[int], n: int) -> int | None:
    """The smallest of `widths` above n, or None. A loop, which torch.compile traces (min(..., default=) it
    cannot: a graph break at every layer)."""
    for width in sorted(widths):
        if width > n:
            return width
    return None


class DecodeLinear(nn.Module):
    """A decoder Linear converted for decoding: on a CUDA device the inputs of `kernel_widths` tokens
    (x.numel() / in_features, decided at conversion) run on `inner` (a SparseLinear: the generated kernels; or a
    SparseLinear24: 2:4 on Sparse Tensor Cores); a width below the largest of them runs on the next larger one's
    kernel, its input padded with zero rows (rows are independent, and a decode kernel's time is W's bytes, not
    the tokens: batch 4 on a model converted for (1, 8) takes the 8-token kernel, nothing compiled or timed);
    wider inputs (the prefill), and every input off a CUDA device, run dense, W written into a workspace shared
    by every DecodeLinear of that shape (prefill is compute-bound: writing W is small beside the matmul, and no
    layer keeps a dense W): a SparseLinear's W scattered from its CSR buffers, a SparseLinear24's from its
    packed 2:4 copy (one kernel; prepare moved its dense weight to host memory: SparseLinear24.release_dense).
    Input x: (..., in_features) in the layer's dtype and device.

    Once a kernel holds W, SparseLinear keeps its CSR buffers in host memory (one copy of W on the device), so
    the workspace is filled from the kernel's own device arrays where its family can (runtime.kernel densify:
    csr, tc-scatter, bitmap-tc and delta-runs); otherwise each prefill copies the CSR buffers over, 6 bytes per nonzero in fp16 (21 GB
    for the decoder of a Llama-3-8B at 50%, on the order of a second per prefill over PCIe)."""

    def __init__(self, inner: SparseLinear | SparseLinear24, kernel_widths: Iterable[int]):
        super().__init__()
        if not isinstance(inner, (SparseLinear, SparseLinear24)):
            raise TypeError(f"inner must be a SparseLinear or SparseLinear24, got {type(inner).__name__}")
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.kernel_widths = frozenset(int(n) for n in kernel_widths)

    @property
    def bias(self):
        return self.inner.bias

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.weight.dtype if isinstance(self.inner, SparseLinear24) else self.inner.weight_values.dtype

    @property
    def decisions(self):
        return self.inner.decisions

    @property
    def uses_workspace(self) -> bool:
        """Whether its prefill reads the workspace its shape shares (not a dense W of the inner layer's own)."""
        inner = self.inner
        return isinstance(inner, SparseLinear) or inner.dense_on_host

    def extra_repr(self) -> str:
        return f"kernel_widths={sorted(self.kernel_widths)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SparseShapeError(f"input has shape {shape}; this layer takes (..., {self.in_features})")
        if self._runs_kernels(x):
            n = x.numel() // self.in_features
            if n in self.kernel_widths:
                return self.inner(x)
            bucket = _next_width(self.kernel_widths, n)
            if bucket is not None and n:  # within a decode width: its kernel on zero rows beyond the tokens
                rows = F.pad(x.reshape(n, self.in_features), (0, 0, 0, bucket - n))
                return self.inner(rows)[:n].view(*x.shape[:-1], self.out_features)
        if self._own_dense(x):
            return F.linear(x, self.dense_weight(x), self.bias)
        with _WORKSPACE_LOCK:
            return F.linear(x, self.dense_weight(x), self.bias)

    @staticmethod
    def _runs_kernels(x: torch.Tensor) -> bool:
        """Whether a call on x may run the inner layer's kernels: on a CUDA device. Elsewhere the inner layer
        would compute densely from a W it keeps, one per layer; the shared workspace serves every width there."""
        return x.is_cuda

    def _own_dense(self, x: torch.Tensor | None) -> bool:
        """Whether a dense call on x gets a W of its own, not the shared workspace: under torch.compile (traced
        code keeps no state), and where autograd saves W for backward (x or W's values require grad)."""
        if torch.compiler.is_compiling():
            return True
        if not torch.is_grad_enabled():
            return False
        inner = self.inner
        values = inner.weight if isinstance(inner, SparseLinear24) else inner.weight_values
        return (x is not None and x.requires_grad) or values.requires_grad

    def prepare(self) -> None:
        """Build the kernels of the decode widths now, on a CUDA device (from the kernel cache; the inner layer
        of a converted or loaded model times nothing), so that the first decode step, which may be a CUDA graph
        capture, finds them; the shared prefill workspace is grown to its shape now, for the same reason. Does
        nothing on a CPU."""
        inner, widths = self.inner, sorted(self.kernel_widths)
        if inner.device.type != "cuda":
            return
        inner.prepare(widths)  # widths decided at conversion are kept
        if isinstance(inner, SparseLinear24):
            inner.runtime().release_unused(widths)  # the copies of W no path of its widths reads go
            inner.release_dense()  # and the dense W to host memory: prefill writes W into the shared workspace
        if self.uses_workspace:
            reserve_workspace(self.out_features * self.in_features, self.dtype, inner.device)

    def dense_weight(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """W dense (out_features x in_features) for a dense call on `x`: the shared workspace (valid until the
        next layer's dense call) filled from the inner layer's own copy of W (a tensor of its own where autograd
        would save it, or under torch.compile); a SparseLinear24 that still holds its dense weight on the device
        gives that."""
        inner = self.inner
        device, dtype = inner.device, self.dtype
        if x is not None and (x.device != device or (x.dtype != dtype and not torch.is_autocast_enabled(device.type))):
            raise SparseShapeError(f"input is {x.dtype} on {x.device}; this layer is {dtype} on {device}: cast or move "
                                   "one of them")
        own = self._own_dense(x)
        if isinstance(inner, SparseLinear24):  # its W or one launch from its packed copy: a capture may take either
            if not inner.dense_on_host or own:
                return inner.dense_weight()
            return inner.densify_into(_workspace(self.out_features, self.in_features, dtype, device))
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            n = None if x is None else x.numel() // self.in_features
            raise RuntimeError(f"a CUDA graph captures this layer on {n} tokens, a width not given at conversion "
                               f"(kernel widths {sorted(self.kernel_widths)}): convert with tokens including {n}")
        if not own and device.type == "cuda":  # from the kernel's own copy on the GPU, where it can (it zeroes)
            out = _workspace(self.out_features, self.in_features, dtype, device)
            if inner.densify_into(out):
                return out
        out = torch.zeros(self.out_features, self.in_features, dtype=dtype, device=device) if own else \
            _workspace(self.out_features, self.in_features, dtype, device).zero_()
        indptr = inner.weight_indptr.to(device, non_blocking=True)
        values = inner.weight_values if own else inner.weight_values.detach()  # a W of its own: autograd sees it
        values = values.to(device, non_blocking=True)
        rows = torch.repeat_interleave(torch.arange(self.out_features, device=device), torch.diff(indptr),
                                       output_size=values.numel())  # output_size: no device-to-host sync
        out.index_put_((rows, inner.weight_indices.to(device, torch.int64, non_blocking=True)), values)
        return out

    def device_bytes(self) -> int:
        """Bytes the layer holds on its device (the kernels' copies of W included; the shared prefill
        workspace not: prefill_workspace_bytes counts it once)."""
        inner = self.inner
        return inner.memory_bytes()["total"]


class GatedDecodeMLP(nn.Module):
    """A decoder layer's MLP, down(silu(gate(x)) * up(x)), whose gate and up projections run as one gated kernel
    (sparseforge.compile_gated_mlp: one launch, X read once, silu and the product in its epilogue) at the decode
    widths where both run kernels of a family that has one (delta-runs; bitmap-tc at N >= 8) with one config
    (a width between decode widths where the projections would pad it to a fused one: that gated kernel, its
    rows padded with zeros); every other call runs the MLP as it was. gate_proj, up_proj, down_proj and act_fn are the wrapped MLP's own
    modules, under their names (the state dict is the MLP's). fuse() builds the gated kernels from the two
    layers' kernels, sharing their arrays (nothing copied); after a move to another device, a cast or a copy the
    MLP runs unfused until fuse() is called again (convert and load call it)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for part in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not isinstance(getattr(mlp, part, None), nn.Module):
                raise TypeError(f"{type(mlp).__name__} has no {part}: a gated MLP wraps a Llama-layout MLP")
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, \
            mlp.act_fn
        self.layer_id = register(self)
        self._unfuse()

    def _unfuse(self) -> None:
        # the widths forward branches on: an immutable set, replaced only by fuse() and moves, so a compiled
        # forward's guard on it never fails at run time (the op's body may drop a kernel: it then runs the two
        # projections apart); the kernels: width -> (gated kernel, the gate's kernel, the up's kernel it was
        # built from), read only outside traced code
        self._fused_widths: frozenset[int] = frozenset()
        self._fused: dict = {}

    @property
    def fused_widths(self) -> list[int]:
        """The widths whose gated kernel still stands (a kernel dropped since fuse() runs its MLP unfused)."""
        return sorted(n for n in self._fused_widths if n in self._fused)

    def extra_repr(self) -> str:
        return f"fused_widths={self.fused_widths}"

    def fuse(self) -> list[int]:
        """Build the gated kernels (CUDA) at the widths both projections run kernels on; the widths fused."""
        from ..spmm import compile_gated_mlp

        self._unfuse()
        gate, up = self.gate_proj, self.up_proj
        if not (_is_silu(self.act_fn) and isinstance(gate, DecodeLinear) and isinstance(up, DecodeLinear)
                and isinstance(gate.inner, SparseLinear) and isinstance(up.inner, SparseLinear)):
            return []
        for n in sorted(gate.kernel_widths & up.kernel_widths):
            kg, ku = gate.inner.kernel_at(n), up.inner.kernel_at(n)
            if kg is None or ku is None:
                continue
            try:
                self._fused[n] = (compile_gated_mlp(kg, ku), kg, ku)
            except (TypeError, ValueError):  # another family, configs that differ, an epilogue: kept apart
                continue
        self._fused_widths = frozenset(self._fused)
        return self.fused_widths

    def _gated(self, n: int):
        """The gated kernel of `n` tokens while both projections still run the kernels it was built from (an
        entry whose projections were rebuilt, reloaded or moved is dropped: its arrays are freed)."""
        entry = self._fused.get(n)
        if entry is None:
            return None
        if self.gate_proj.inner.kernel_at(n) is not entry[1] or self.up_proj.inner.kernel_at(n) is not entry[2]:
            del self._fused[n]
            return None
        return entry[0]

    def _records_grad(self, x: torch.Tensor) -> bool:
        """Whether autograd must see this call (the gated kernel records no graph): then the MLP runs unfused."""
        if not torch.is_grad_enabled():
            return False
        return x.requires_grad or any(t is not None and t.requires_grad for part in (self.gate_proj, self.up_proj)
                                      for t in (part.inner.weight_values, part.inner.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[-1] if x.dim() else 0
        width = self._gated_width(n)
        if width is not None and n and x.is_cuda and not self._records_grad(x):
            rows = x.reshape(n, x.shape[-1])
            if width > n:
                rows = F.pad(rows, (0, 0, 0, width - n))
            if torch.compiler.is_compiling():  # the op's body checks the kernels (nothing traced reads them)
                y = torch.ops.sparseforge.gated_mlp(rows, self.gate_proj.inner.device_anchor, self.layer_id,
                                                    self.up_proj.out_features)
                return self.down_proj(y[:n].view(*x.shape[:-1], self.up_proj.out_features))
            kernel = self._gated(width)
            if kernel is not None:
                return self.down_proj(self._run(kernel, rows)[:n].view(*x.shape[:-1], self.up_proj.out_features))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def _gated_width(self, n: int) -> int | None:
        """The fused width a call on n tokens runs the gated kernel at, or None (the projections apart): the
        width the projections' DecodeLinears would run n at (n itself, or the next wider of their kernel widths,
        its rows padded with zeros: rows are independent), where that width is fused. A width the projections
        run kernels at but did not fuse keeps its own kernels, not a wider gated one."""
        gate, up = self.gate_proj, self.up_proj
        if not (isinstance(gate, DecodeLinear) and isinstance(up, DecodeLinear)):
            return None
        own = gate.kernel_widths & up.kernel_widths
        width = n if n in own else _next_width(own, n)
        return width if width in self._fused_widths else None

    def gated_forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): by the gated kernel of x's token count where it still stands, else the two
        projections apart (the body of the torch.library op)."""
        kernel = self._gated(x.numel() // x.shape[-1])
        if kernel is None:
            return self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self._run(kernel, x)

    def _run(self, kernel, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = kernel(rows if rows.is_contiguous() else rows.contiguous())
        return y.view(*x.shape[:-1], self.up_proj.out_features)

    def __getstate__(self):
        # the gated kernels are process- and device-bound (and hold the projections' arrays): copies fuse again
        return {**self.__dict__, "_fused": {}, "_fused_widths": frozenset()}

    def __setstate__(self, state):
        super().__setstate__({"_fused_widths": frozenset(), **state})  # a pickle from before the set: unfused
        self.layer_id = register(self)  # a copy is a layer of its own for the op

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half(): the gated kernels whose projections rebuilt theirs go (fuse() again); a move
        # to where the MLP is keeps the projections' kernels, and so the gated kernels built from them
        out = super()._apply(fn, recurse)
        for n in list(self._fused):
            self._gated(n)
        self._fused_widths = frozenset(self._fused)
        return out


def _is_silu(act: nn.Module) -> bool:
    """Whether `act` computes SiLU (nn.SiLU, transformers' SiLUActivation, ...): the gated kernel's epilogue."""
    probe = torch.linspace(-12, 12, 49)
    try:
        with torch.no_grad():  # a copy in: an in-place activation would overwrite the probe
            return bool(torch.allclose(act(probe.clone()), F.silu(probe), rtol=1e-6, atol=1e-7))
    except (RuntimeError, TypeError):  # an activation that takes other inputs: not this one
        return False


def fuse_gated_mlps(model: nn.Module) -> list[str]:
    """Wrap each decoder layer's MLP in a GatedDecodeMLP where its gate and up projections fuse at some decode
    width (a CUDA model converted for decoding); the names of the MLPs wrapped."""
    layers = model.model.layers
    fused = []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        wrapped = mlp if isinstance(mlp, GatedDecodeMLP) else GatedDecodeMLP(mlp) if all(
            isinstance(getattr(mlp, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
            else None
        if wrapped is not None and wrapped.fuse():
            layer.mlp = wrapped
            fused.append(f"model.layers.{index}.mlp")
    return fused


def _workspace_bytes(layers: Iterable[nn.Module]) -> int:
    """Bytes of the workspaces `layers` (DecodeLinears) share for their prefill: one per dtype and device, of the
    largest shape among them."""
    largest: dict = {}
    for m in layers:
        if isinstance(m, DecodeLinear) and m.uses_workspace:
            key = (m.dtype, m.inner.device)
            largest[key] = max(largest.get(key, 0), m.out_features * m.in_features * m.dtype.itemsize)
    return sum(largest.values())


def prefill_workspace_bytes(model: nn.Module) -> int:
    """The bytes of the dense workspace the model's DecodeLinears share (one per dtype and device, of the
    largest shape), whether or not a prefill has made it yet."""
    return _workspace_bytes(model.modules())


def linear_bytes(model: nn.Module, names: Iterable[str]) -> int:
    """Device bytes of the modules `names` (nn.Linear or DecodeLinear) of `model`, plus the prefill workspace
    their DecodeLinears share (counted once, at the largest of their shapes)."""
    total, modules = 0, [model.get_submodule(name) for name in names]
    for module in modules:
        if isinstance(module, DecodeLinear):
            total += module.device_bytes()
        else:
            total += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return total + _workspace_bytes(modules)


def decoder_linear_names(model: nn.Module) -> list[str]:
    """The qualified names of the nn.Linear / DecodeLinear modules of the decoder layers (lm_head not)."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, DecodeLinear)) and
            name.startswith("model.layers.") and ".inner" not in name]


# -- conversion ----------------------------------------------------------------------------------------------

@dataclass
class CausalLMReport(ModelReport):
    tokens: tuple = ()                 # the decode widths decided
    measured: int = 0                  # distinct (shape, bias, dtype, sparsity bucket) groups timed
    reused: int = 0                    # ... and groups decided by an earlier conversion (the disk cache)
    linear_bytes_before: int = 0       # the candidate Linears' device bytes before
    linear_bytes_after: int = 0        # ... and after (the shared prefill workspaces counted)
    peak_gpu_bytes: int | None = None  # torch.cuda.max_memory_allocated during the conversion
    replaced: list = field(default_factory=list)  # names of the modules now DecodeLinear
    fused_mlps: list = field(default_factory=list)  # names of the MLPs now GatedDecodeMLP (fuse_mlp=True)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "tokens": list(self.tokens), "measured": self.measured, "reused": self.reused,
                "linear_bytes_before": self.linear_bytes_before, "linear_bytes_after": self.linear_bytes_after,
                "peak_gpu_bytes": self.peak_gpu_bytes, "replaced": list(self.replaced),
                "fused_mlps": list(self.fused_mlps)}

    def __str__(self) -> str:
        lines = [super().__str__(),
                 f"{len(self.replaced)} of {len(self.layers)} Linear layers converted for decode widths "
                 f"{list(self.tokens)}; {self.measured} distinct shapes measured, {self.reused} decided by an "
                 "earlier conversion (the disk cache)",
                 f"candidate Linears: {self.linear_bytes_before / 2**20:.1f} MiB -> "
                 f"{self.linear_bytes_after / 2**20:.1f} MiB"]
        if self.peak_gpu_bytes is not None:
            lines.append(f"peak GPU memory during conversion: {self.peak_gpu_bytes / 2**30:.2f} GiB")
        return "\n".join(lines)


def convert_causal_lm(model: nn.Module, tokens=(1,), dtype=None, include: LayerFilter = None,
                      exclude: LayerFilter = None, policy: str = "measure",
                      tune_budget: float | None = TUNE_BUDGET_S, progress: bool | Callable = True,
                      fuse_mlp: bool = False, memory_slack: float = 0.0) -> CausalLMReport:
    """Convert, in place, a transformers causal LM of the Llama layout for decoding (module docstring).

    tokens: the decode batch sizes (an int or several, e.g. (1, 8)): each candidate is decided at these
    widths; every other width runs dense. include / exclude: a regex on the qualified name or a callable
    (name, module) -> bool among the candidates (model.layers.*.* Linears and lm_head). policy: "measure"
    (a CUDA device: keep a sparse path only where measured faster than dense at some decode width), "sparse"
    (replace every candidate holding pruned weights, nothing timed: on a CPU, the dense CPU path) or "dense"
    (replace nothing; the report lists the layers). dtype: cast the model first. tune_budget: seconds per
    kernel shortlist (0 or None: the cost model's pick; tune.choose.tuning_budget). progress: True for a
    progress bar (layer count, ETA), False or None for none, or a callable progress(name, index, total).
    Returns a CausalLMReport: per layer its choice and the times it was decided by (for a layer that took
    its group's decision, the measured layer's times, the reason naming it). fuse_mlp: on a CUDA device, each
    MLP whose gate and up projections run delta-runs kernels of one config at a decode width runs them as one
    gated kernel there (GatedDecodeMLP; report.fused_mlps). memory_slack (policy "measure"): the share of a layer's
    decode time (its kernels' summed over the widths) it may give for a packing of W with fewer bytes among the
    timed candidates, 0 to 0.5 (0: only the chooser's tie in time; on the H200's Llama timings at 70%, 0.07 takes
    delta-runs' 4-bit gaps, 16% fewer bytes, on the gate and up projections).
    """
    started = time.perf_counter()
    memory_slack = check_memory_slack(memory_slack)
    check_causal_lm(model)
    require_transformers()
    check_not_converted(model)
    tokens = check_tokens(tokens)
    if policy not in ("measure", "sparse", "dense"):
        raise ValueError(f"policy must be 'measure', 'sparse' or 'dense', got {policy!r}")
    tune_budget = tuning_budget(tune_budget)  # 0 and None: the cost model's pick, as everywhere
    if dtype is not None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype such as torch.float16, or None; got {dtype!r}")
        model.to(dtype)
    device = model_device(model)
    on_gpu = device.type == "cuda"
    if policy == "measure" and not on_gpu:
        raise ValueError("policy='measure' times the kernels on a CUDA device: move the model there first "
                         "(model.cuda()), or pass policy='sparse' (nothing timed) or 'dense'")
    model.eval()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    chosen, skipped = select_layers(model, include, exclude)
    names = []
    for name, module in chosen:
        if not _CANDIDATE.fullmatch(name):
            skipped.append(Skipped(name, "not a Linear of the decoder layers or lm_head"))
        elif not isinstance(module, nn.Linear):
            skipped.append(Skipped(name, f"{type(module).__name__} is not nn.Linear"))
        else:
            names.append(name)
    del chosen  # no reference to the dense layers beyond the model's own: each is freed as it is replaced
    report = CausalLMReport(tokens=tokens, skipped=skipped, memory_before_bytes=model_bytes(model),
                            linear_bytes_before=linear_bytes(model, names))
    keys = {name: _group_key(model.get_submodule(name)) for name in names}
    firsts = first_of_each_group(keys)
    decided: dict = {}  # group key -> (the measured layer's LayerReport, its kernel widths, its configs)
    gpu = gpu_identity(device) if policy == "measure" else None
    if policy == "measure":  # a group decided by an earlier conversion on this GPU is not measured again
        for name in firsts:
            cached = load_group_decision(keys[name], tokens, (tune_budget, memory_slack), gpu) \
                if keys[name][4] > 0 else None
            if cached is not None:
                decided.setdefault(_group(keys[name]), cached)
    reused = len(decided)
    firsts = [n for n in firsts if _group(keys[n]) not in decided]
    # measuring, each group's first layer first: the others take its decision
    order = sorted(names, key=lambda n: (n not in firsts, names.index(n))) if policy == "measure" else names
    if policy == "measure":  # the measured layers' candidates compiled side by side (nn.convert.prebuild_layers)
        prebuild_layers([(model.get_submodule(n), [(t, keys[n][0][1]) for t in tokens]) for n in firsts
                         if keys[n][4] > 0], tune_budget)
    picked: dict = {}  # policy "sparse": group key -> the configs its first layer's chooser picked
    members_built = False
    for index, name in enumerate(_progress(order, progress)):
        if policy == "measure" and not members_built and name not in firsts:
            _prebuild_members(model, [n for n in order[index:]], keys, decided)
            members_built = True
        if callable(progress) and not isinstance(progress, bool):
            progress(name, index, len(order))
        known = set(decided)
        layer, replacement = _convert_layer(model.get_submodule(name), name, keys[name], tokens, policy,
                                            tune_budget, decided, picked, memory_slack)
        for group in set(decided) - known:  # measured just now: kept on disk for the next conversion
            store_group_decision(keys[name], tokens, (tune_budget, memory_slack), gpu, decided[group])
        report.layers.append(layer)
        if replacement is not None:
            _replace(model, name, replacement)
            report.replaced.append(name)
    if fuse_mlp and on_gpu and policy != "dense":
        report.fused_mlps = fuse_gated_mlps(model)
    report.layers.sort(key=lambda layer: names.index(layer.name))
    report.measured, report.reused = len(decided) - reused, reused
    report.memory_after_bytes = model_bytes(model) + prefill_workspace_bytes(model)
    report.linear_bytes_after = linear_bytes(model, names)
    if on_gpu:
        report.peak_gpu_bytes = torch.cuda.max_memory_allocated(device)
    report.seconds = time.perf_counter() - started
    return report


def check_not_converted(model: nn.Module) -> None:
    """Refuse a model already converted for decoding (it holds DecodeLinears), naming its widths and the fix: a
    DecodeLinear is no nn.Linear, so a second conversion would find no candidate and change nothing."""
    widths = sorted({n for m in model.modules() if isinstance(m, DecodeLinear) for n in m.kernel_widths})
    if widths:
        raise ValueError(f"{type(model).__name__} is already converted for decoding (decode widths {widths}); a "
                         "second conversion changes nothing: convert the dense model (reload it) to convert for "
                         "other tokens; sparseforge.prepare(model, widths) readies it after a move")


def check_memory_slack(value) -> float:
    """memory_slack is a share of a layer's decode time: a real number from 0 to 0.5 (returned as a float)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 0.5:
        raise ValueError(f"memory_slack is the share of a layer's decode time it may give for fewer bytes of W, from "
                         f"0 to 0.5 (e.g. 0.07 for 7%); got {value!r} ({type(value).__name__})")
    return float(value) + 0.0  # -0.0 is 0


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes: its first parameter's device (a transformers model is on one device)."""
    return next(model.parameters()).device


def _group_key(linear: nn.Linear) -> tuple:
    """(weight shape, bias, dtype, sparsity, sparsity bucket index, whether W is 2:4): layers alike in all but
    the exact sparsity share one measurement (a 2:4 weight and an unstructured one of the same sparsity do
    not: the paths open to them differ)."""
    weight = linear.weight.detach()
    sparsity = 1.0 - float(torch.count_nonzero(weight)) / max(weight.numel(), 1)
    try:
        check_weight(weight)
        two_four = True
    except Sparse24Error:
        two_four = False
    return (tuple(weight.shape), linear.bias is not None, weight.dtype, sparsity, round(sparsity / SPARSITY_BUCKET),
            two_four)


def _group(key: tuple) -> tuple:
    """A group key without the exact sparsity: layers alike in shape, bias, dtype and sparsity bucket."""
    return key[:3] + key[4:]


def first_of_each_group(keys: dict) -> list:
    """The first name of each group among `keys` (name -> _group_key), in their order: the layers measured (and
    their candidates prebuilt) for their groups. By group, not by the whole key: layers pruned globally differ
    in exact sparsity, and each would otherwise be measured and prebuilt as a group of its own."""
    firsts: dict = {}
    for name, key in keys.items():
        firsts.setdefault(_group(key), name)
    return list(firsts.values())


# -- group decisions kept on disk: a second conversion of a model of this shape measures nothing ----------------

GROUP_DECISION = "llm-group"


def gpu_identity(device: torch.device) -> tuple[str, int]:
    """(the GPU's name, its arch as 90 for sm_90): what a measured decision holds on (bandwidths differ within
    an arch)."""
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), 10 * major + minor


def group_decision_key(key: tuple, tokens: tuple, tuning: tuple, gpu: tuple[str, int]) -> str:
    """The disk cache's key of a group's decision: shape, bias, dtype, sparsity bucket, whether W is 2:4, the
    decode widths, the tune budget and memory slack (tuning), the GPU and the chooser's own code. Not the weight: within a model one layer's decision
    serves its group already, and a fine-tune or another seed of the same architecture is the same group."""
    from ..runtime import default_compiler, kernel_key
    from ..tune.choose import chooser_digest

    shape, bias, dtype, _, bucket, two_four = key
    tune_budget, memory_slack = tuning
    spec = "|".join([f"{shape[0]}x{shape[1]}", f"bias={bias}", str(dtype), f"bucket={bucket}", f"2:4={two_four}",
                     "tokens=" + ",".join(str(n) for n in tokens), f"budget={tune_budget}",
                     f"memory_slack={float(memory_slack) + 0.0!r}", gpu[0], chooser_digest(), _decision_digest()])
    return kernel_key(GROUP_DECISION, spec, gpu[1], default_compiler().version)


@lru_cache(maxsize=1)
def _decision_digest() -> str:
    """sha256 of the code that turns a layer's measurements into a decoder layer's decision (this module, the
    per-layer measurement, the layer's per-width decisions, 2:4's paths and how they are timed): editing it
    invalidates kept group decisions."""
    import hashlib
    from pathlib import Path

    nn_dir = Path(__file__).parent
    files = [nn_dir / name for name in ("llm.py", "convert.py", "sparse.py", "linear24.py")] + \
        [nn_dir.parent / "semi" / name for name in ("runtime.py", "decide.py", "gemv.py")]
    return hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()


def _is_group_record(record) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("widths"), list)
            and isinstance(record.get("configs"), dict) and isinstance(record.get("report"), dict))


def store_group_decision(key: tuple, tokens: tuple, tuning: tuple, gpu: tuple[str, int], decision: tuple) -> None:
    """Keep a measured group's decision (its layer's report, kernel widths and configs) in the disk cache."""
    from ..runtime import KernelCache
    from ..tune.pipeline import config_record

    first, widths, configs = decision
    report = {"name": first.name, "sparsity": first.sparsity, "input_shapes": first.input_shapes,
              "choice": first.choice, "times_us": first.times_us, "kernel_us": first.kernel_us,
              "mapping": first.mapping, "reason": first.reason}
    # a kernel config per width, or for 2:4 the (eager, graph) paths per width
    records = {str(n): list(c) if first.choice == SPARSE else config_record(c) for n, c in configs.items()}
    KernelCache().put_tuned(group_decision_key(key, tokens, tuning, gpu), gpu[1],
                            {"widths": sorted(widths), "configs": records, "report": report})


def load_group_decision(key: tuple, tokens: tuple, tuning: tuple, gpu: tuple[str, int]) -> tuple | None:
    """A group's decision from the disk cache as _convert_layer holds one (a LayerReport standing for the
    layer that was measured, its kernel widths, its configs), or None where none is kept or this version
    cannot read it (then the group is measured)."""
    from ..runtime import KernelCache
    from ..tune.pipeline import config_from_record

    record = KernelCache().get_tuned(group_decision_key(key, tokens, tuning, gpu), gpu[1],
                                     valid=_is_group_record)
    if record is None:
        return None
    try:
        if record["report"]["choice"] == SPARSE:
            configs = check_pinned({int(n): c for n, c in record["configs"].items()})
        else:
            configs = {int(n): config_from_record(c) for n, c in record["configs"].items()}
        widths = {int(n) for n in record["widths"]}
        r = record["report"]
        first = LayerReport(f"{r['name']} (an earlier conversion's decision)", "Linear", tuple(key[0]),
                            float(r["sparsity"]), list(r["input_shapes"]), str(r["choice"]), dict(r["times_us"]),
                            dict(r["kernel_us"]), r["mapping"], str(r["reason"]))
    except (KeyError, TypeError, ValueError):
        return None
    if any(c is None for c in configs.values()) or first.choice not in (DENSE, UNSTRUCTURED, SPARSE) or \
            not set(configs) <= widths <= set(tokens):
        return None
    if first.choice == UNSTRUCTURED and not set(configs) == widths == set(tokens):
        return None  # a decoder layer runs a kernel at every decode width: a record of fewer is not one of ours
    if first.choice == SPARSE and set(configs) != widths:
        return None  # 2:4 without its paths at every width it runs (an older record): measured again
    return first, widths, configs


def _progress(names: list[str], progress) -> Iterable[str]:
    if progress is True:
        from ..console import progress as bar

        return bar(names, lambda name: name, "converting")
    return names


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _prebuild_members(model, names, keys, decided) -> None:
    """Compile side by side, for the remaining layers, the kernels their group's measured layer runs (its
    configs, pinned: one compile a layer and width, nothing ranked or timed). Only configs whose family
    compiles W into the code: where W is data the measured layer's kernel is the one every layer of its group
    runs (keyed by shape and options), already in the cache."""
    from functools import partial

    from ..runtime.prebuild import prebuild_useful, run_prebuilds
    from ..spmm import prebuild_spmm

    if not prebuild_useful():
        return
    jobs = []
    for name in names:
        rep = decided.get(_group(keys[name]))
        module = model.get_submodule(name)
        if rep is None or rep[0].choice != UNSTRUCTURED or not module.weight.is_cuda:
            continue
        configs = {n: config for n, config in rep[2].items() if family_of(config).weight_in_code}
        if not configs:
            continue
        major, minor = torch.cuda.get_device_capability(module.weight.device)
        sparse = SparseLinear.from_dense(module, policy="sparse")
        sparse.pin(configs)
        jobs += [(f"{name} n={n}", partial(prebuild_spmm, **sparse.kernel_args(n, on_device=False),
                                                        arch=10 * major + minor))
                 for n in sorted(configs)]
        del sparse  # its device buffers: the jobs hold W on the host
    if jobs:
        run_prebuilds(jobs, what="layers")


def _kernels_at_every_width(module: nn.Linear, measured: LayerReport, replacement: SparseLinear, tokens: tuple,
                            tune_budget, memory_slack: float = 0.0) -> nn.Module | None:
    """The measured layer's replacement for decoding: a kernel at every decode width, or None (kept dense).

    measure_layer decides width by width, keeping a dense W for the widths where dense measured faster. A
    DecodeLinear keeps no dense W of its own (prefill densifies into a shared workspace at every call, far
    slower than any kernel, and not inside a CUDA graph), so there it runs its fastest kernel all the same.
    Where the widths' fastest kernels pack W differently, one packing serving every width is taken instead if
    its summed time is within the chooser's margin (W held once: the layer's memory); and with memory_slack, a
    packing holding fewer bytes of W within that share of their time (_one_packing). The layer is replaced
    where the kernels' time summed over the decode widths beats dense's (and 2:4's, where measured) by the
    margin; a width no kernel takes keeps the layer dense."""
    from ..tune.choose import MIN_SPEEDUP, fastest_with_margin

    decisions = [d for d in replacement.decisions if d.mode in ("graph", "any")]
    lost = sorted(d.n for d in decisions if d.path == DENSE)
    configs = replacement.fastest_kernel_configs()
    timed = {d.n: d for d in decisions if d.sparse_us and d.dense_us}
    missing = [n for n in tokens if n not in configs or n not in timed]
    if missing:
        if not lost:
            return replacement
        measured.choice, measured.reason = DENSE, f"{measured.reason}; no kernel measured at width(s) {missing}, " \
                                                  "where a decoder layer keeps no dense W: kept dense"
        return None
    kernel_us = {n: timed[n].sparse_us for n in tokens}
    dense_us = sum(timed[n].dense_us for n in tokens)
    two_four = measured.times_us.get(SPARSE)  # a 2:4 weight: its path keeps its own dense W, so its time stands

    def path(sparse_us: float) -> tuple[str, float]:
        return fastest_with_margin({UNSTRUCTURED: sparse_us, DENSE: dense_us, **({SPARSE: two_four} if two_four
                                                                                 else {})}, DENSE, MIN_SPEEDUP)

    single = _one_packing(replacement, tokens, configs, kernel_us, memory_slack)
    if single is not None and path(sum(single[1].values()))[0] != path(sum(kernel_us.values()))[0]:
        single = None  # one packing would lose the layer's path (to dense or 2:4) where its own kernels win it
    if single is not None:
        configs, kernel_us, by_bytes = single
        measured.mapping = family_of(configs[tokens[0]]).name
    elif not lost:
        return replacement
    sparse_us = sum(kernel_us.values())
    measured.times_us[UNSTRUCTURED] = measured.kernel_us[UNSTRUCTURED] = sparse_us
    picked, ratio = path(sparse_us)
    slower = ", ".join(f"{timed[n].dense_us / kernel_us[n]:.2f}x at {n}" for n in tokens
                       if kernel_us[n] > timed[n].dense_us)
    where = f"its kernels at the decode widths {list(tokens)}" + (
        f" ({family_of(configs[tokens[0]]).name}: one packing of W for every width"
        + (f", the fewest bytes within memory_slack={memory_slack:g})" if single[2] else ")") if single else "")
    if picked == DENSE:
        measured.choice = DENSE
        measured.reason = f"{where} measured {dense_us / sparse_us:.2f}x of dense in sum (" + (
            f"{slower} tokens; " if slower else "") + "a decoder layer keeps no dense W, so it would run them " \
            "at every width): kept dense"
        return None
    if picked == SPARSE:
        measured.choice = SPARSE
        measured.reason = f"2:4 measured {ratio:.2f}x faster than dense, before {where} ({dense_us / sparse_us:.2f}x " \
                          "of dense in sum, run at every width)"
        semi = SparseLinear24.from_dense(module, policy="measure")
        generator = torch.Generator(device="cpu").manual_seed(0)
        for n in tokens:
            semi.runtime().prepare(torch.randn(n, module.in_features, generator=generator).to(module.weight.device,
                                                                                           module.weight.dtype))
        return semi
    inner = SparseLinear.from_dense(module, policy="sparse", tune_budget=tune_budget)
    inner.pin({n: configs[n] for n in tokens})
    try:
        built = inner.prepare(tokens)
    except CompileError as exc:
        built, failure = [], f"{type(exc).__name__}: {str(exc)[:120]}"
    else:
        failure = next((d.reason for d in built if d.path == DENSE), None)
    if failure is not None or len(built) != len(tokens):
        measured.choice, measured.reason = DENSE, f"{where} measured faster in sum, but do not build for this " \
                                                  f"weight ({failure}): kept dense"
        return None
    measured.choice = UNSTRUCTURED
    measured.reason = f"{where} measured {ratio:.2f}x faster than dense in sum; they run at every width" + (
        f" ({slower} tokens, where a decoder layer keeps no dense W)" if slower else "")
    return inner


def _one_packing(replacement: SparseLinear, tokens: tuple, configs: dict, kernel_us: dict,
                 memory_slack: float = 0.0) -> tuple | None:
    """({width: config}, {width: us}, by_bytes) of one packing of W (a family and its format_fields) for every
    width, or None to keep the widths' own kernels (`configs`, timed `kernel_us`). Of the packings every width's
    timed candidates share:
    - where the own kernels pack W differently (W held twice), the fastest whose summed time is within the
      chooser's margin (MIN_SPEEDUP) of theirs; with memory_slack, the one holding fewest bytes of W within
      max(that margin, 1 + memory_slack) of it, where any such packing's bytes are recorded;
    - where they share one packing, with memory_slack only: the one holding fewest bytes of W within 1 +
      memory_slack of their time, if it holds fewer than theirs (both recorded).
    by_bytes: whether bytes decided it."""
    from ..tune.choose import MIN_SPEEDUP

    def packing(config) -> tuple:
        family = family_of(config)
        return (family.name, *(getattr(config, name) for name in family.format_fields))

    own = {packing(configs[n]) for n in tokens}
    mixed = len(own) > 1
    if not mixed and memory_slack <= 0:
        return None
    best: dict = {}  # packing -> {width: (config, us)}
    held_bytes: dict = {}  # packing -> the bytes of W its kernels read as data, where recorded
    for n in tokens:
        for config, us, weight_bytes in replacement.timed_configs(n):
            if family_of(config).weight_in_code:  # W is each kernel's code: no packing to share
                continue
            key = packing(config)
            held = best.setdefault(key, {})
            if n not in held or us < held[n][1]:
                held[n] = (config, us)
            if weight_bytes:
                held_bytes[key] = max(held_bytes.get(key, 0), int(weight_bytes))
    whole = {key: held for key, held in best.items() if set(held) == set(tokens)}

    def summed(key) -> float:
        return sum(us for _, us in whole[key].values())

    allowance = max(MIN_SPEEDUP if mixed else 1.0, 1.0 + memory_slack)
    allowed = [key for key in whole if summed(key) <= sum(kernel_us.values()) * allowance]
    by_bytes = [key for key in allowed if key in held_bytes] if memory_slack > 0 else []
    if not mixed:  # fewer bytes than the own packing, or nothing
        if packing(configs[tokens[0]]) not in held_bytes:
            return None
        by_bytes = [key for key in by_bytes if held_bytes[key] < held_bytes[packing(configs[tokens[0]])]]
        if not by_bytes:
            return None
    if by_bytes:
        key = min(by_bytes, key=lambda k: (held_bytes[k], summed(k)))
    else:  # the own kernels hold W twice: the fastest single packing within the chooser's margin
        allowed = [key for key in allowed if summed(key) <= sum(kernel_us.values()) * MIN_SPEEDUP]
        if not allowed:
            return None
        key = min(allowed, key=summed)
    return {n: whole[key][n][0] for n in tokens}, {n: whole[key][n][1] for n in tokens}, bool(by_bytes)


def _convert_layer(module: nn.Linear, name: str, key: tuple, tokens: tuple, policy: str, tune_budget,
                   decided: dict, picked: dict | None = None,
                   memory_slack: float = 0.0) -> tuple[LayerReport, nn.Module | None]:
    shape, _, _, sparsity, _, _ = key
    shapes = [[n, shape[1]] for n in tokens]
    layer = LayerReport(name, "Linear", shape, sparsity, shapes, DENSE)
    if policy == "dense":
        layer.reason = "policy='dense'"
        return layer, None
    if key[4] == 0:  # the lowest bucket: unpruned, or zeros a 16-bit cast made (no sparse path pays there)
        layer.reason = unpruned_reason(sparsity)
        return layer, None
    on_gpu = module.weight.is_cuda
    if policy == "sparse":
        inner = SparseLinear.from_dense(module, policy="sparse", tune_budget=tune_budget)
        layer.choice, layer.reason = UNSTRUCTURED, "policy='sparse'"
        if on_gpu:
            group, picked = _group(key), {} if picked is None else picked
            try:
                if picked.get(group):  # the kernels its group's first layer picked, compiled for this W
                    inner.pin(picked[group])
                    layer.reason += ", the kernel configs of the first layer of its shape"
                inner.prepare(tokens)
            except CompileError:  # they do not build for this W: its own choice
                inner = SparseLinear.from_dense(module, policy="sparse", tune_budget=tune_budget)
                inner.prepare(tokens)
                layer.reason = "policy='sparse'"
            picked.setdefault(group, inner.kernel_configs())
        return layer, DecodeLinear(inner, tokens)
    group = _group(key)
    if group not in decided:  # the group's first layer: timed
        measured, replacement = measure_layer(name, module, [tuple(s) for s in shapes], "measure", tune_budget)
        if isinstance(replacement, SparseLinear):
            replacement = _kernels_at_every_width(module, measured, replacement, tokens, tune_budget, memory_slack)
        widths = set()
        if replacement is not None:
            widths = {d.n for d in replacement.decisions if d.path != DENSE and d.mode in ("graph", "any")}
        # what the group's other layers run: the kernel configs, or 2:4's paths (cuSPARSELt or the GEMV) per width
        configs = replacement.kernel_configs() if isinstance(replacement, SparseLinear) else \
            replacement.chosen_paths() if isinstance(replacement, SparseLinear24) else {}
        decided[group] = (measured, widths, {n: c for n, c in configs.items() if n in widths})
        if not widths:
            if measured.choice != DENSE:
                measured.choice, measured.reason = DENSE, f"{measured.reason}, but at no decode width: kept dense"
            return measured, None
        decode = DecodeLinear(replacement, widths)
        if isinstance(replacement, SparseLinear24):
            decode.prepare()  # its widths are decided: this only drops the copies of W no chosen path reads
        return measured, decode
    first, widths, configs = decided[group]
    layer.choice, layer.times_us, layer.kernel_us = first.choice, dict(first.times_us), dict(first.kernel_us)
    layer.mapping = first.mapping
    layer.reason = f"as {first.name} measured (same shape, sparsity within {SPARSITY_BUCKET:.0%}): {first.reason}"
    if first.choice == DENSE or not widths:
        return layer, None
    if first.choice == SPARSE:
        try:
            check_weight(module.weight.detach())
        except Sparse24Error as exc:  # its group is 2:4, this weight is not: kept dense, not guessed
            layer.choice, layer.reason = DENSE, f"not 2:4 as {first.name} is ({exc}): kept dense"
            return layer, None
        # the paths the group's first layer measured (the GEMV or cuSPARSELt, per width and mode), nothing timed
        inner = SparseLinear24.from_dense(module, policy="measure")
        inner.pin(configs)
        replacement = DecodeLinear(inner, widths)
        replacement.prepare()
        return layer, replacement
    # The measured layer's kernel configs, compiled for this layer's W: one measurement a group, nothing timed
    # here (the same shape and sparsity run alike whatever the pattern).
    if not configs:  # the group's winner ran no kernel of its own here (nothing to pin): dense, not guessed
        layer.choice, layer.reason = DENSE, f"{first.name} decided {first.choice} without a kernel config: kept dense"
        return layer, None
    inner = SparseLinear.from_dense(module, policy="sparse", tune_budget=tune_budget)
    inner.pin(configs)
    try:
        decisions = inner.prepare(sorted(configs))
    except CompileError as exc:  # the config does not build for this W: dense, and said so
        layer.choice, layer.reason = DENSE, f"{first.name}'s kernel configs do not build for this weight ({exc}): " \
                                            "kept dense"
        return layer, None
    own = {d.n for d in decisions if d.path != DENSE}
    if not own:
        refused = decisions[0].reason if decisions else "no width"
        layer.choice, layer.reason = DENSE, f"{first.name}'s kernel configs are refused for this weight " \
                                            f"({refused}): kept dense"
        return layer, None
    layer.reason = f"as {first.name} measured (same shape, sparsity within {SPARSITY_BUCKET:.0%}): its " \
                   f"{first.mapping or 'kernel'} configs at widths {sorted(own)}, compiled here, not timed"
    if own != set(configs):  # refused at some width: no dense W to run there (see _kernels_at_every_width)
        refused = [d for d in decisions if d.path == DENSE]
        layer.choice, layer.reason = DENSE, f"{first.name}'s kernel configs are refused for this weight at " \
                                            f"{sorted(d.n for d in refused)} tokens ({refused[0].reason}), where " \
                                            "a decoder layer keeps no dense W: kept dense"
        return layer, None
    return layer, DecodeLinear(inner, own)
