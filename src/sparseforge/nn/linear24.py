"""SparseLinear24: an nn.Linear whose 2:4 weight runs on Sparse Tensor Cores (cuSPARSELt) for the input
widths where that measured faster than dense cuBLAS, and dense everywhere else."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import register
from ..semi.cusparselt import ALIGN_BYTES, Sparse24Error, check_weight
from ..semi.decide import DENSE, MIN_SPEEDUP, Decision, fixed
from ..semi.packed import unpack_24
from .sparse import changes_nothing
from ..semi.runtime import Linear24Runtime, check_pinned, check_policy



class SparseLinear24(nn.Module):
    """y = x W^T + b with W 2:4 sparse along in_features (float16 or bfloat16, both dimensions multiples of
    16). On a CUDA device each input width n (tokens = x.numel() / in_features) is decided once: cuSPARSELt's
    algorithm search, then 2:4 and dense timed and the faster kept (`policy="measure"`; "sparse" and
    "dense" force a path). `decisions` lists what was chosen and why. On the CPU, and whenever autograd
    needs a gradient, it computes the same result densely.

    Input x: (..., in_features), of the layer's dtype and on its device, any strides (a non-contiguous or
    misaligned x is copied once); anything else raises Sparse24Error naming the problem, on every path (on
    the dense one autocast may still cast the dtype). An x with no tokens returns an empty
    (..., out_features) output; on a CUDA device without deciding or launching anything.

    NaN and inf in x: a NaN at x[t, k] makes y[t, i] NaN for every i with W[i, k] != 0, on every path. Outputs
    y[t, i] with W[i, k] == 0 differ by path: dense (cuBLAS) makes them NaN too (0 * NaN = NaN), the 2:4
    paths multiply only the kept weights and may leave them finite. Rely on neither.

    Memory: the masked dense weight is kept next to the compressed one (about 0.56x of it), since dense
    is the fallback; memory_bytes() counts both, and the packed GEMV weight where a decision uses it.
    release_dense() (nn.DecodeLinear calls it for its decode widths) moves the dense weight to host memory
    where every decided width runs 2:4: the device then holds the packed copy (0.5625x of the dense bytes),
    and cuSPARSELt's compressed one where a width runs it. The parameter stays (state_dict, saving, to_dense
    read it there); `device` is where the layer computes either way, and densify_into writes W back on the
    device. A width decided later, an edit of the weight, a cast or a move to another device brings the dense W
    back to the device (a move to the device it is on, model.to("cuda") on a model there, does not)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=torch.float16, policy: str = "measure", min_speedup: float = MIN_SPEEDUP):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.policy, self.min_speedup = check_policy(policy), min_speedup
        weight = torch.zeros(out_features, in_features, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        # an empty tensor that says where the layer computes, the weight being on the device or in host memory
        # (release_dense): it moves with the module like any buffer and is not in state_dict
        self.register_buffer("_device_anchor", torch.empty(0, device=device, dtype=dtype), persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype),
                                 requires_grad=False) if bias else None
        self.layer_id = register(self)
        self._runtime: Linear24Runtime | None = None
        self._runtime_key: tuple | None = None
        self._capture_fallbacks: dict[int, Decision] = {}
        self._pinned: dict[int, tuple[str, str]] = {}

    @classmethod
    def from_dense(cls, linear: nn.Linear, policy: str = "measure",
                   min_speedup: float = MIN_SPEEDUP) -> "SparseLinear24":
        """A copy of `linear` (a plain or mask-parametrized nn.Linear whose weight is 2:4). Raises
        Sparse24Error naming the problem when the weight cannot run on Sparse Tensor Cores."""
        weight = linear.weight.detach()  # with a mask parametrization: the masked weight
        check_weight(weight, name="weight")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device=weight.device,
                    dtype=weight.dtype, policy=policy, min_speedup=min_speedup)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach().to(weight.dtype))
        return layer

    @property
    def device(self) -> torch.device:
        """Where the layer computes (its inputs, outputs, kernels and bias), wherever the dense weight is."""
        return self._buffers["_device_anchor"].device

    @property
    def dense_on_host(self) -> bool:
        """Whether release_dense moved the dense weight to host memory (the device holds the 2:4 copies only)."""
        return self._parameters["weight"].device != self.device

    def release_dense(self) -> bool:
        """Move the dense weight to host memory where the runtime's decided widths all run 2:4 under graph
        replay (semi.runtime.Linear24Runtime.drop_dense says which, and makes the packed copy that stands for W
        on the device). Call once the widths the layer runs are decided (nn.DecodeLinear.prepare does). Returns
        whether the dense weight is in host memory now; False (kept) on a CPU, while the weight trains, where a
        decided width runs dense, or where a CUDA graph captured before prepare may read the device W."""
        if self.dense_on_host:
            return True
        weight = self._parameters["weight"]
        runtime = self._runtime if self._runtime_key == self._current_key() else None
        if runtime is None or weight.requires_grad or self._capture_fallbacks or not runtime.drop_dense():
            return False
        self._move_weight(torch.device("cpu"))
        self._runtime_key = self._current_key()  # the same W, moved: the runtime stays
        return self.dense_on_host

    def prepare(self, widths, seed: int = 0) -> list[Decision]:
        """Decide each input width of `widths` now, on seeded random inputs (a width decided before is kept),
        so that a later CUDA graph capture finds every decision made; a layer whose dense weight was in host
        memory releases it again where the new widths allow. Returns the decisions of `widths`."""
        if self.device.type != "cuda":
            raise ValueError("prepare needs the model on a CUDA device: call model.cuda() first")
        released, widths = self.dense_on_host, sorted({int(n) for n in widths})
        runtime = self.runtime()
        if runtime is None:
            raise RuntimeError("prepare cannot decide anything inside a CUDA graph capture: call it before capturing")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for n in widths:
            if not runtime.decided(n):
                x = torch.randn(n, self.in_features, generator=generator)
                runtime.prepare(x.to(self.device, self.weight.dtype))
        if released:
            self.release_dense()
        return [d for n in widths for d in runtime.entries[n][0].decisions()]

    def densify_into(self, out: torch.Tensor) -> torch.Tensor:
        """W dense into `out` (out_features x in_features, contiguous, the layer's dtype, on its device): from
        the packed copy on the device where the layer has one (one kernel), else copied from the dense weight
        (where it is). Returns `out`."""
        runtime = self._runtime if self._runtime_key == self._current_key() else None
        if runtime is not None and runtime.gemv is not None:
            return runtime.densify(out)
        if self.dense_on_host and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph captures a dense call of this 2:4 layer, whose dense W is in host "
                               "memory and whose packed copy is not built: prepare it before capturing")
        return out.copy_(self._parameters["weight"])

    def dense_weight(self) -> torch.Tensor:
        """W dense on the layer's device: the weight itself, or, while it is in host memory, a tensor of its
        own written from the packed copy (by torch ops under torch.compile, which traces no kernel launch and
        no pointer comparison), or copied over where autograd needs the weight itself."""
        weight, device = self._parameters["weight"], self.device
        if weight.device == device:
            return weight
        if weight.requires_grad:
            return weight.to(device)  # differentiable: the gradient reaches the parameter
        if torch.compiler.is_compiling():
            runtime = self._runtime
            if runtime is not None and runtime.gemv is not None:
                return unpack_24(runtime.gemv.packed)
            return weight.to(device)
        return self.densify_into(torch.empty(self.out_features, self.in_features, dtype=weight.dtype, device=device))

    def to_dense(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                           device=self.device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def pin(self, paths: dict) -> None:
        """Run these paths, one (eager, graph) pair per input width ({n: ("2:4-gemv", "2:4-gemv")}, e.g. what a
        layer of the same shape measured: chosen_paths()), nothing timed; the widths not given are decided as
        the policy says."""
        self._pinned = {**self.pinned, **check_pinned(paths)}
        self._runtime, self._runtime_key = None, None  # decided again, from the pins, at the next call or prepare

    @property
    def pinned(self) -> dict[int, tuple[str, str]]:
        """{input width: (eager path, graph path)} given to pin."""
        return dict(self.__dict__.get("_pinned", {}))  # a layer pickled before pins had none

    def chosen_paths(self) -> dict[int, tuple[str, str]]:
        """{input width: (eager path, graph path)} the runtime decided (outside a CUDA graph capture), for pin on
        a layer of the same shape."""
        return {} if self._runtime is None else self._runtime.chosen_paths()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the layer holds on its device: its dense W ("weight", the fallback, a parameter; 0 while it is
        in host memory: "weight_host"), the copies of W its runtime holds ("kernels": cuSPARSELt's compressed
        W, the packed GEMV weight, the plans' workspaces), the bias. "dense" is a dense W beyond the parameter
        (made again from the packed copy after release_dense, where a later width needed one)."""
        held = self.weight.numel() * self.weight.element_size()
        weight, host = (0, held) if self.dense_on_host else (held, 0)
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        found = {} if self._runtime is None else self._runtime.device_bytes()
        dense = found.pop("dense", 0)  # W made again on the device after release_dense (a width decided later)
        kernels = sum(found.values())
        return {"weight": weight, "weight_host": host, "kernels": kernels, "dense": dense, "bias": bias,
                "total": weight + kernels + dense + bias}

    @property
    def decisions(self) -> list[Decision]:
        """Per input width and execution mode ("eager", "graph"; "any" where not measured), sorted by width."""
        found = {(d.n, d.mode): d for d in self._capture_fallbacks.values()}
        if self._runtime is not None:
            found.update({(d.n, d.mode): d for d in self._runtime.decisions})
        return [found[key] for key in sorted(found)]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}, policy={self.policy!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, anchor = self._parameters["weight"], self._buffers["_device_anchor"]
        if not x.is_cuda or self.policy == "dense" or (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            # the dense path refuses what the sparse one does, with the same words (autocast may cast dtypes)
            if x.shape[-1] != self.in_features or x.device != anchor.device or (
                    x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)):
                raise Sparse24Error(self._input_problem(x))
            return F.linear(x, self.dense_weight(), self._parameters.get("bias"))
        if torch.compiler.is_compiling():
            # the anchor stands for W (which may wait in host memory): every tensor the op sees is on its device
            return torch.ops.sparseforge.linear24(x, anchor, self._parameters.get("bias"), self.layer_id,
                                                  self.out_features)
        return self.sparse_forward(x)

    def sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path, also the body of the torch.library op. Kept lean: it runs on every call, and the
        host time of small layers is what eager models pay (direct _parameters lookups skip Module's
        __getattr__; 2-D inputs skip the reshapes)."""
        params, anchor = self._parameters, self._buffers["_device_anchor"]
        bias = params.get("bias")
        if x.shape[-1] != self.in_features or x.dtype != anchor.dtype or x.device != anchor.device:
            raise Sparse24Error(self._input_problem(x))
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if not rows.is_contiguous() or rows.data_ptr() % ALIGN_BYTES:
            rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
        runtime = self._runtime if self._current_key() == self._runtime_key else self.runtime()
        if runtime is None:
            if self.dense_on_host:  # a host W cannot be read inside a capture (nor copied over from pageable memory)
                raise RuntimeError("a CUDA graph captures this 2:4 layer before it was prepared since its last change "
                                   "(a cast, a copy, an edit or a pin), and its dense W is in host memory: call "
                                   "prepare (DecodeLinear.prepare, or sparseforge.prepare(model, widths)) first")
            n = rows.shape[0]
            self._capture_fallbacks.setdefault(n, fixed(n, DENSE, "first seen during CUDA graph capture, before "
                                                                  "the layer was prepared: dense"))
            return F.linear(x, params["weight"], bias)
        y = runtime(rows)
        return y if flat else y.view(*x.shape[:-1], self.out_features)

    def runtime(self) -> Linear24Runtime | None:
        """The compressed weight and plans, (re)built when the weights changed place or value. None while a
        CUDA graph is being captured and nothing was built before (that width then runs dense)."""
        if self._runtime_key == self._current_key():
            return self._runtime
        if self.device.type != "cuda":
            raise Sparse24Error(f"the layer's weights are on {self.device}: Sparse Tensor Cores need them on "
                                "a CUDA device (model.cuda())")
        if torch.cuda.is_current_stream_capturing():
            return None
        self._weight_to_device()  # edited or cast since release_dense: built again from the dense W, on the device
        self._runtime = Linear24Runtime(self.weight, self.bias, self.policy, self.min_speedup, self.pinned)
        self._runtime_key = self._current_key()
        return self._runtime

    def _weight_to_device(self) -> None:
        if self.dense_on_host:
            self._move_weight(self.device)

    def _move_weight(self, device: torch.device) -> None:
        # the same Parameter object, its data moved (as Module._apply moves it): references to it stay valid;
        # outside inference mode, so that a later load_state_dict can write it
        with torch.inference_mode(False), torch.no_grad():
            weight = self._parameters["weight"]
            weight.data = weight.data.to(device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if prefix + "weight" in state_dict:  # the incoming W lands on the layer's device; the runtime is rebuilt
            self._weight_to_device()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if local_metadata.get("assign_to_params_buffers", False):  # the layer is where the assigned W is now
            weight = self._parameters["weight"]
            self._buffers["_device_anchor"] = torch.empty(0, device=weight.device, dtype=weight.dtype)

    def _current_key(self) -> tuple:
        # In-place updates (load_state_dict, optimizer steps) bump _version; moves change the pointer.
        weight, bias = self._parameters["weight"], self._parameters.get("bias")
        return (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))

    def _input_problem(self, x: torch.Tensor) -> str:
        if x.shape[-1] != self.in_features:
            return f"input has {x.shape[-1]} features in its last dimension; this layer takes {self.in_features}"
        if x.device != self.device:
            return f"input on {x.device}, layer on {self.device}: move one of them"
        return f"input dtype {x.dtype}, layer dtype {self.weight.dtype}: cast the input (x.to({self.weight.dtype}))"

    def __getstate__(self):
        # cuSPARSELt handles and plans are process- and device-bound: copies and pickles rebuild them
        state = self.__dict__.copy()
        state["_runtime"], state["_runtime_key"] = None, None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_device_anchor" not in self._buffers:  # pickled before the layer had one: W was on its device
            self.register_buffer("_device_anchor", self.weight.new_empty(0), persistent=False)
        self.layer_id = register(self)  # a copy is its own layer for the torch.library op's registry

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() to another device or dtype: the runtime belongs to the old tensors; forget it.
        # One that changes nothing (model.to("cuda") on a model there, as pipelines do) keeps the runtime and its
        # decisions, and a dense W released to host memory stays there.
        host = [self._parameters["weight"]] if self.dense_on_host else []
        if changes_nothing(self, fn, host):
            return super()._apply(lambda t: t if any(t is h for h in host) else fn(t), recurse)
        self._runtime, self._runtime_key = None, None
        return super()._apply(fn, recurse)
