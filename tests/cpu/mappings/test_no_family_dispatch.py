"""Kernel families are dispatched by the registry only: outside mappings/ no module of src/ tests whether an
object is of a family's config or plan class (isinstance / issubclass / `type(x) is`) or compares its family
or mapping name with a string (`plan.family == "tile"`), so a new family needs no edit there."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import sparseforge
from sparseforge.mappings import registry

ROOT = Path(sparseforge.__file__).parent


def _family_class_names() -> set[str]:
    """The config and plan classes of every family, and the package's own bases of the plan classes."""
    names = set()
    for f in registry.FAMILIES:
        names.add(f.config_class.__name__)
        for cls in inspect.getmro(registry.resolve(f.plan_class)):
            if cls.__module__.startswith("sparseforge."):
                names.add(cls.__name__)
    return names


def _class_tests(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """`file:line` of every isinstance / issubclass / `type(...) is` whose class operand names a family class."""
    found = []

    def named(node) -> bool:
        if isinstance(node, ast.Tuple):
            return any(named(e) for e in node.elts)
        return (isinstance(node, ast.Name) and node.id in names) or \
            (isinstance(node, ast.Attribute) and node.attr in names)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("isinstance", "issubclass") and len(node.args) == 2 and named(node.args[1]):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and \
                isinstance(node.left.func, ast.Name) and node.left.func.id == "type" and \
                any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops) and \
                any(named(c) for c in node.comparators):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


NAMED = ("family", "mapping")  # the attributes that name a plan's family or kernel mapping


def _name_tests(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line` of every comparison (==, !=, in, not in) of a `.family` / `.mapping` attribute with a string
    or a collection of strings: a family told by its name instead of asked of its registry record."""
    def strings(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(strings(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    def named(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in NAMED

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and \
                any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(named(n) for n in sides) and any(strings(n) for n in sides):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_class_names_cover_every_family():
    names = _family_class_names()
    assert {"TileConfig", "CsrConfig", "CsrColumnsConfig", "BitmapConfig", "TcScatterConfig", "Split24Config",
            "Plan", "CsrPlan", "ConvPlan", "ConvTilePlan", "BitmapPlan", "TcScatterPlan", "Split24Plan"} <= names


def test_the_walk_finds_a_class_test(tmp_path):
    """The AST walk is not vacuous: each form it looks for is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("isinstance(c, TileConfig)\nisinstance(p, (int, plan.CsrPlan))\ntype(c) is BitmapConfig\n"
                     "isinstance(c, int)\n")
    assert _class_tests(probe, _family_class_names(), tmp_path) == ["probe.py:1", "probe.py:2", "probe.py:3"]


def test_the_walk_finds_a_name_test(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('plan.family == "tile"\n"csr" != p.family\nplan.mapping in ("csr", "bitmap")\n'
                     'plan.family == other.family\nname == "tile"\n')
    assert _name_tests(probe, tmp_path) == ["probe.py:1", "probe.py:2", "probe.py:3"]


def test_no_family_name_test_outside_mappings():
    outside = [p for p in sorted(ROOT.rglob("*.py")) if "mappings" not in p.relative_to(ROOT).parts]
    found = [hit for p in outside for hit in _name_tests(p)]
    assert not found, f"a family told by its name outside mappings/ (ask mappings.registry's record): {found}"


def test_no_family_class_test_outside_mappings():
    names = _family_class_names()
    outside = [p for p in sorted(ROOT.rglob("*.py")) if "mappings" not in p.relative_to(ROOT).parts]
    found = [hit for p in outside for hit in _class_tests(p, names)]
    assert not found, f"dispatch on a family's class outside mappings/ (ask mappings.registry): {found}"
