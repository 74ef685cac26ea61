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
from .fold import _LeafTracer
from .sparse import SparseConv2d

_RELU_FUNCTIONS = (torch.relu, F.relu, torch.relu_)
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


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


def _drop_identities(gm: torch.fx.GraphModule) -> None:
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(modules.get(node.target)) is nn.Identity and len(node.args) == 1:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def fuse_epilogues(model: nn.Module, example_inputs) -> tuple[torch.fx.GraphModule | nn.Module, FuseReport]:
    """(the model with ReLU / residual adds fused into its SparseConv2d layers, what was fused and why not).
    Where nothing can be fused (no sparse convolution, or fx cannot trace the model) the model itself comes
    back, unchanged."""
    report = FuseReport()
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)
    try:
        graph = _LeafTracer().trace(model)
    except Exception as exc:  # data-dependent control flow and the like
        report.skipped.append(Skipped("(model)", f"torch.fx cannot trace the model ({type(exc).__name__}: "
                                                 f"{str(exc)[:120]}): nothing fused"))
        return model, report
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__ + "Fused")
    _drop_identities(gm)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    with torch.no_grad():
        ShapeProp(gm).propagate(*inputs)
    for node in list(gm.graph.nodes):
        layer = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(layer, SparseConv2d) or len(node.args) != 1 or node.kwargs:
            continue
        if layer.relu or layer.residual:
            continue  # built with its epilogue already
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
            if other is node or not isinstance(other, torch.fx.Node) or _meta(node) is None or \
                    _meta(other) != _meta(node):
                report.skipped.append(Skipped(node.target, "its add's other operand is not a tensor of the "
                                                           "output's shape and dtype"))
                continue
            residual, add, last = other, user, user
            user = _sole_user(user)
        relu = user is not None and _is_relu(user, modules)
        if relu:
            last = user
        if residual is None and not relu:
            continue
        try:
            layer.set_epilogue(relu=relu, residual=residual is not None)
        except ValueError as exc:  # a winning config that takes no epilogue (split K)
            report.skipped.append(Skipped(node.target, f"its kernel takes no epilogue ({exc})"))
            continue
        with gm.graph.inserting_before(last):  # after the residual's own node, which may follow the conv
            fused = gm.graph.call_module(node.target, node.args, {} if residual is None else {"residual": residual})
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        for dead in (last, add if add is not None and add is not last else None, node):
            if dead is not None:
                gm.graph.erase_node(dead)
        report.fused.append((node.target, "+".join(part for part, on in (("residual", residual is not None),
                                                                         ("relu", relu)) if on)))
    gm.graph.lint()
    gm.recompile()
    return gm, report
