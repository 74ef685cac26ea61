"""Epilogue fusion after conversion: a SparseConv2d whose output goes only into a ReLU, or only into an add
with a tensor of its own shape (then, optionally, only into a ReLU), takes them into its kernel, so the model
launches one kernel where it launched two or three (ResNet-50: 49 ReLUs and 16 adds at batch 1, each a
launch of its own).

fuse_epilogues(model, example_inputs) traces the model with torch.fx (sparseforge's layers as leaves),
drops the nn.Identity left by BatchNorm folding, rewrites the graph and returns a new torch.fx.GraphModule
that shares the model's layers: the model itself is not changed, except that each fused SparseConv2d now
computes its epilogue (set_epilogue: its kernels are rebuilt in the config that won, not timed again), so it
should be run through the returned module from then on. Shapes are checked on the example inputs (fx's
ShapeProp): an add fuses only when the other operand has the output's shape and dtype (no broadcasting).

Convolutions the conversion kept dense (plain nn.Conv2d) take a ReLU, or an add then a ReLU, too, as a
FusedDenseConv2d (dense_epilogue.py: cuDNN's fused convolution, kept only where it measured faster than the
separate ops; dense_convs="measure", the default, and only on CUDA).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ..prune.targets import Skipped
from .dense_epilogue import FusedDenseConv2d, measure_fused_dense
from .fold import LeafTracer
from .sparse import SparseConv2d, SparseLinear

_RELU_FUNCTIONS = (torch.relu, F.relu, torch.relu_)
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_IN_PLACE_ADDS = (operator.iadd, "add_")
# ops whose output is a tensor of its own (never a view of an input): where an in-place op edits a tensor made
# by one of these, it edits nothing else
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d,
                  nn.AdaptiveAvgPool2d, SparseConv2d, SparseLinear, FusedDenseConv2d)
_FRESH_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                    torch.cat, torch.conv2d, F.conv2d, F.linear, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d)
_FRESH_METHODS = ("add", "sub", "mul", "div", "clone")
_DENSE_CONVS = ("measure", "fuse", "keep")
_REPLACES = "sparseforge_replaces"  # node.meta key: the traced node whose value a fused node computes


@dataclass
class FuseReport:
    fused: list[tuple[str, str]] = field(default_factory=list)  # (layer, "relu" / "residual" / "residual+relu")
    skipped: list[Skipped] = field(default_factory=list)


def _is_relu(node: torch.fx.Node, modules: dict) -> bool:
    """A ReLU of one tensor (in place or not: the fused conv's output has no other user)."""
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS and len(node.args) == 1 and set(node.kwargs) <= {"inplace"}
    return node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1 and not node.kwargs


def _add_operands(node: torch.fx.Node) -> tuple | None:
    """(a, b) of a plain tensor add (no alpha, no out), else None."""
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS and len(node.args) == 2 and not node.kwargs:
        return node.args
    if node.op == "call_method" and node.target in ("add", "add_") and len(node.args) == 2 and not node.kwargs:
        return node.args
    return None


def _meta(node) -> tuple | None:
    meta = getattr(node, "meta", {}).get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return None if meta is None or not hasattr(meta, "shape") else (tuple(meta.shape), meta.dtype)


def _sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _differs(a, b) -> str | None:
    """Why two outputs (tensors, or tuples / lists / dicts of them) differ beyond rounding, or None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
        if not a.is_floating_point():
            return None if torch.equal(a, b) else "integer outputs differ"
        bound = 1e-2 if a.element_size() <= 2 else 1e-4  # the same ops in the same order: rounding only
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite].isnan(), b[~finite].isnan()):
            return "non-finite values in other places"
        a, b = a[finite].double(), b[finite].double()
        error = float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0
        return None if error <= bound else f"relative difference {error:.1e}"
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return next((p for p in map(_differs, a, b) if p), None)
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return next((p for p in (_differs(a[k], b[k]) for k in a) if p), None)
    return None if type(a) is type(b) and not isinstance(a, (torch.Tensor, tuple, list, dict)) else \
        "outputs of different structure"


def _between(graph: torch.fx.Graph, first: torch.fx.Node, last: torch.fx.Node) -> list:
    """The nodes strictly after `first` and before `last`, in graph order."""
    out, inside = [], False
    for n in graph.nodes:
        if n is last:
            return out
        if inside:
            out.append(n)
        inside = inside or n is first
    return out


def _comes_before(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    for n in graph.nodes:
        if n is a or n is b:
            return n is a
    raise ValueError(f"neither {a} nor {b} is in the graph")


def _drop_identities(gm: torch.fx.GraphModule) -> None:
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(modules.get(node.target)) is nn.Identity and len(node.args) == 1:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def fuse_epilogues(model: nn.Module, example_inputs, dense_convs: str = "measure"
                   ) -> tuple[torch.fx.GraphModule | nn.Module, FuseReport]:
    """(the model with ReLU / residual adds fused into its convolutions, what was fused and why not).
    Where nothing can be fused (no convolution with an epilogue, or fx cannot trace the model) the model itself
    comes back, unchanged. dense_convs, for plain nn.Conv2d layers: "measure" (on CUDA, cuDNN's fused call
    where it measures faster than the separate ops; on the CPU nothing), "fuse" (a FusedDenseConv2d without
    timing, cuDNN's call switched on where the model is on CUDA), "keep" (left as they are)."""
    if dense_convs not in _DENSE_CONVS:
        raise ValueError(f"dense_convs must be one of {_DENSE_CONVS}, got {dense_convs!r}")
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)
    refused: dict[str, str] = {}  # layer -> how its fused form computed otherwise: left unfused on the retry
    for _ in range(2):
        fused, report, failing = _fuse_once(model, inputs, dense_convs, refused)
        if not failing:
            return fused, report
        if "(model)" in failing or set(failing) <= set(refused):
            break
        refused.update(failing)
    why = "; ".join(f"{name}: {problem}" for name, problem in list(failing.items())[:3])
    return model, FuseReport(skipped=report.skipped + [Skipped("(model)", f"the fused graph computes otherwise "
                                                                          f"({why}): nothing fused")])


def _fuse_once(model: nn.Module, inputs: tuple, dense_convs: str, refused: dict
               ) -> tuple[torch.fx.GraphModule | nn.Module, FuseReport, dict]:
    """One trace, rewrite and check: (the fused module or the model, the report, the fused layers whose check
    failed with why ("(model)" where the rewired graph did)); on a failure every layer is put back."""
    report = FuseReport()
    try:
        graph = LeafTracer().trace(model)
    except Exception as exc:  # data-dependent control flow and the like
        report.skipped.append(Skipped("(model)", f"torch.fx cannot trace the model ({type(exc).__name__}: "
                                                 f"{str(exc)[:120]}): nothing fused"))
        return model, report, {}
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__ + "Fused")
    _drop_identities(gm)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    recorder = _Recorder(gm, _epilogue_candidates(gm, modules, dense_convs))
    with torch.no_grad():
        traced = recorder.propagate(*_cloned(inputs))
        problem = _differs(traced, model(*_cloned(inputs)))
    if problem:  # fx records `z += y` as a new tensor: a model that reads an alias of z after it traces wrong
        report.skipped.append(Skipped("(model)", f"the traced graph does not compute what the model does "
                                                 f"({problem}; in-place updates of aliased tensors?): nothing fused"))
        return model, report, {}
    changed: list[tuple[SparseConv2d, tuple]] = []
    try:
        _fuse(gm, modules, calls, report, changed, dense_convs, refused)
        gm.graph.lint()
        gm.recompile()
        failing = _check_fused(gm, recorder.values, inputs, traced) if report.fused else {}
    except BaseException:  # not a refusal: put every layer changed so far back as it was
        _restore(changed)
        raise
    if failing:
        _restore(changed)
        return model, report, failing
    return gm, report, {}


class _Recorder(ShapeProp):
    """fx's ShapeProp (shapes and dtypes into node.meta) that also keeps a copy of the value of each node named
    in `keep`, as the node made it (a later in-place op must not change the copy)."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set[str]):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if n.name in self.keep and isinstance(result, torch.Tensor):
            self.values[n.name] = result.clone()
        return result


def _epilogue_candidates(gm: torch.fx.GraphModule, modules: dict, dense_convs: str) -> set[str]:
    """The nodes a fused convolution may replace the output of: a convolution's sole user (a ReLU, or an add),
    and the users of such an add (its ReLU). Only those are kept: each recorded copy holds an activation on the
    device until the check."""
    keep = set()
    for node in gm.graph.nodes:
        if _conv_kind(node, modules, dense_convs) is not None and len(node.users) == 1:
            user = next(iter(node.users))
            keep.add(user.name)
            if _add_operands(user) is not None:
                keep.update(u.name for u in user.users)
    return keep


class _TeacherForced(torch.fx.Interpreter):
    """Runs the fused graph, checking each fused node's output against the value of the node it replaced in
    the traced run and then handing on that traced value instead of its own. Every other node then computes
    from exactly what it computed in the traced run, so the graph's output checks the rewiring, and each fused
    node is checked alone, on the inputs the graph hands it where it now runs."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict):
        super().__init__(gm)
        self.values, self.problems = values, {}

    def run_node(self, n: torch.fx.Node):
        replaced = n.meta.get(_REPLACES)
        if replaced is None:
            return super().run_node(n)
        if replaced not in self.values:
            raise RuntimeError(f"fuse_epilogues kept no traced value of {replaced!r}, which {n.target} replaced: "
                               "the candidates recorded and the fusions made disagree (a bug: please report it)")
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        result = super().run_node(n)
        # an output sharing memory with an operand would be handed on as the traced value: the check could not
        # see that the kernel overwrote its input or residual in place
        storages = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        if isinstance(result, torch.Tensor) and result.untyped_storage().data_ptr() in storages:
            self.problems[n.target] = "its output shares memory with an operand"
        else:
            problem = _differs(result, self.values[replaced])
            if problem:
                self.problems[n.target] = problem
        return self.values[replaced].clone()


def _check_fused(gm: torch.fx.GraphModule, values: dict, inputs: tuple, traced) -> dict[str, str]:
    """{fused layer: how it computes otherwise}, {"(model)": ...} where the rewired graph does, or {}. Checked
    layer by layer (a fused kernel rounds once where the separate ops rounded two or three times: in 16-bit a
    deep model amplifies that past any bound at its output, ResNet-50 in fp16 to 1.4e-2, as it amplifies its
    own rounding; see benchmarks/rn50_conditioning.py), and the rewired graph whole on the layers' traced
    values."""
    runner = _TeacherForced(gm, values)
    with torch.no_grad():
        out = runner.run(*_cloned(inputs))
    if runner.problems:
        return dict(runner.problems)
    problem = _differs(out, traced)
    return {} if problem is None else {"(model)": f"the rewired graph: {problem}"}


def _restore(changed: list) -> None:
    for layer, state in reversed(changed):
        layer.restore_epilogue(state)


def _cloned(inputs: tuple) -> tuple:
    """The inputs afresh for each run: a model may edit its input in place."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def _mutates(node: torch.fx.Node, modules: dict) -> bool:
    """Whether the node may change a tensor in place (a method or function ending in _, an in-place operator,
    inplace=True, or a module built in place, such as nn.ReLU(inplace=True))."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op == "call_module":
        return bool(getattr(modules.get(node.target), "inplace", False))
    if node.op in ("call_method", "call_function"):
        return name.endswith("_") and not name.endswith("__") or name.startswith("i") and \
            getattr(operator, name, None) is node.target or bool(node.kwargs.get("inplace", False))
    return False


def _storage_root(node, modules: dict) -> torch.fx.Node | None:
    """The node whose fresh output tensor `node`'s value is (followed back through in-place ops, which return
    their first operand), or None where the graph does not show that it is no view of something else
    (a placeholder, an attribute, a view op, an op not known here)."""
    for _ in range(10_000):
        if not isinstance(node, torch.fx.Node):
            return None
        if _mutates(node, modules) and node.args:
            node = node.args[0]
            continue
        if node.op == "call_module":
            return node if isinstance(modules.get(node.target), _FRESH_MODULES) else None
        if node.op == "call_function":
            return node if node.target in _FRESH_FUNCTIONS or node.target in _RELU_FUNCTIONS else None
        if node.op == "call_method":
            return node if node.target in _FRESH_METHODS or node.target == "relu" else None
        return None
    return None


def _moves_safely(gm, modules: dict, reads: list, last, add) -> bool:
    """Whether the fused node may run where `last` ran: for each (tensor, node that read it) in `reads` (the
    conv's input, read by the conv; the residual, read by the add), no op after that read and before `last`
    (the add excepted) edits in place that tensor, or one the graph cannot tell apart from it. (An edit before
    the original read is seen alike by both graphs.)"""
    for tensor, reader in reads:
        edits = [n for n in _between(gm.graph, reader, last) if n is not add and _mutates(n, modules)]
        if not edits:
            continue
        root = _storage_root(tensor, modules)
        if root is None:
            return False
        for n in edits:
            edited = _storage_root(n.args[0], modules) if n.args else None
            if edited is None or edited is root:
                return False
    return True


def _conv_kind(node, modules: dict, dense_convs: str) -> str | None:
    """'sparse' (a SparseConv2d without an epilogue yet), 'dense' (a plain nn.Conv2d that may take one), or
    None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    layer = modules.get(node.target)
    if isinstance(layer, SparseConv2d):
        return None if layer.relu or layer.residual else "sparse"
    if type(layer) is nn.Conv2d and dense_convs != "keep" and layer.padding_mode == "zeros" and \
            not isinstance(layer.padding, str) and (dense_convs == "fuse" or layer.weight.is_cuda):
        return "dense"
    return None


def _takes_the_add(kind: str, partner_kind: str | None, node_first: bool) -> bool:
    """Where two convolutions meet at an add (ResNet's projection shortcut), which takes it as its residual: a
    sparse one over a dense one (its kernel adds it for nothing), else the later of the two."""
    if partner_kind is None:
        return True
    if kind != partner_kind:
        return kind == "sparse"
    return not node_first


def _fuse(gm: torch.fx.GraphModule, modules: dict, calls: dict, report: FuseReport, changed: list,
          dense_convs: str, checked_out: dict | None = None) -> None:
    """Two passes at most: where a conv left a shared add to its partner and the partner then could not take
    it (split K, cuDNN measured slower, an in-place edit), the second pass offers the add to the first."""
    gone: set = set()
    deferred: dict = {}  # partner layer name -> the layer that left it the add
    for name, problem in (checked_out or {}).items():  # fused before, their kernels computed otherwise
        report.skipped.append(Skipped(name, f"its fused form computed otherwise ({problem}): left unfused"))
    skip = set(checked_out or {})
    _fuse_pass(gm, modules, calls, report, changed, dense_convs, gone, deferred, refused=skip, skip=skip)
    refused = {s.name for s in report.skipped} & set(deferred)
    if refused:
        retry = {deferred[name] for name in refused}
        again = FuseReport()
        _fuse_pass(gm, modules, calls, again, changed, dense_convs, gone, {}, refused=refused, only=retry, skip=skip)
        report.fused += again.fused
        report.skipped += [s for s in again.skipped if s.name not in {x.name for x in report.skipped}]


def _fuse_pass(gm: torch.fx.GraphModule, modules: dict, calls: dict, report: FuseReport, changed: list,
               dense_convs: str, gone: set, deferred: dict, refused: set, only: set | None = None,
               skip: set = frozenset()) -> None:
    for node in list(gm.graph.nodes):
        if node in gone or node.op == "call_module" and node.target in skip:
            continue
        kind = _conv_kind(node, modules, dense_convs)
        if kind is None or only is not None and node.target not in only:
            continue
        if calls[node.target] != 1:
            report.skipped.append(Skipped(node.target, "the layer is called at more than one place"))
            continue
        user = _sole_user(node)
        if user is None:
            continue  # its output is used twice (or not at all): nothing to take in
        residual, add, last = None, None, node
        operands = _add_operands(user)
        if operands is not None:
            other = operands[1] if operands[0] is node else operands[0]
            # an add in place into the other operand: fine only where that is a fresh tensor read by nothing else
            if user.target in _IN_PLACE_ADDS and operands[0] is not node and \
                    (_storage_root(operands[0], modules) is not operands[0] or len(operands[0].users) > 1):
                report.skipped.append(Skipped(node.target, "its output is added in place into another tensor "
                                                           "that is read again, which the fused kernel would "
                                                           "leave unchanged"))
                continue
            if other is node or not isinstance(other, torch.fx.Node) or _meta(node) is None or \
                    _meta(other) != _meta(node):
                report.skipped.append(Skipped(node.target, "its add's other operand is not a tensor of the "
                                                           "output's shape and dtype"))
                continue
            partner = _conv_kind(other, modules, dense_convs) if len(other.users) == 1 else None
            if partner is not None and calls.get(other.target) == 1 and other.target not in refused and \
                    not _takes_the_add(kind, partner, _comes_before(gm.graph, node, other)):
                deferred[other.target] = node.target
                continue  # its partner takes the add, with this conv's output as its residual
            residual, add, last = other, user, user
            user = _sole_user(user)
        relu = user is not None and _is_relu(user, modules)
        if relu:
            last = user
        if residual is None and not relu or kind == "dense" and not relu:
            continue  # (cuDNN fuses an add only with a ReLU after it)
        # the fused node runs where the chain's last op ran: nothing after the conv read its input (and the add
        # its residual) may edit those in place before there, or moving the reads there changes them
        reads = [(node.args[0], node)] + ([(residual, add)] if residual is not None else [])
        if not _moves_safely(gm, modules, reads, last, add):
            report.skipped.append(Skipped(node.target, "an in-place operation runs between the convolution and "
                                                       "its epilogue"))
            continue
        part = "+".join(p for p, on in (("residual", residual is not None), ("relu", relu)) if on)
        if kind == "sparse":
            layer = modules[node.target]
            state = layer.epilogue_state()
            try:
                layer.set_epilogue(relu=relu, residual=residual is not None)
            except ValueError as exc:  # a winning config that takes no epilogue (split K)
                report.skipped.append(Skipped(node.target, f"its kernel takes no epilogue ({exc})"))
                continue
            changed.append((layer, state))
        else:
            why = _dense_epilogue(gm, modules, node, residual is not None, dense_convs)
            if why is not None:
                report.skipped.append(Skipped(node.target, why))
                continue
            part += " (cuDNN fused)"
        with gm.graph.inserting_before(last):
            fused = gm.graph.call_module(node.target, node.args, {} if residual is None else {"residual": residual})
        fused.meta = dict(last.meta)
        fused.meta[_REPLACES] = last.name  # what _check_fused compares it with
        last.replace_all_uses_with(fused)
        for dead in (last, add if add is not None and add is not last else None, node):
            if dead is not None:
                gm.graph.erase_node(dead)
                gone.add(dead)
        report.fused.append((node.target, part))


def _dense_epilogue(gm: torch.fx.GraphModule, modules: dict, node, residual: bool, dense_convs: str) -> str | None:
    """Put a FusedDenseConv2d where the plain Conv2d `node` calls was (in gm only: the model keeps its
    Conv2d); None, or why not (cuDNN's fused call measured slower, or has no engine for the layer)."""
    conv = modules[node.target]
    layer = FusedDenseConv2d(conv, residual, cudnn_fused=conv.weight.is_cuda)
    if dense_convs == "measure":
        shapes = _meta(node.args[0]), _meta(node)
        if shapes[0] is None or shapes[1] is None:
            return "its input's shape is unknown: cuDNN's fused convolution not measured"
        try:
            separate, fused = measure_fused_dense(layer, shapes[0][0], shapes[1][0])
        except RuntimeError as exc:
            return f"cuDNN's fused convolution fails here ({str(exc)[:160]}): kept as it was"
        if not fused < separate:
            return f"cuDNN's fused convolution measured {fused:.2f} us against {separate:.2f} us for the separate ops"
    parent, _, name = node.target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, layer)
    modules[node.target] = layer
    return None
