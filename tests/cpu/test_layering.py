"""The data flows one way (prune -> inspect -> plan -> lower -> compile and cache -> launch -> nn -> model):
no module imports a later stage, not even inside a function, and the stages up to lowering import without
torch."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sparseforge

ROOT = Path(sparseforge.__file__).parent
# stage -> the stages it must never import (later ones in the flow)
LATER = {
    "formats": {"prune", "plan", "codegen", "runtime", "tune", "semi", "ops", "nn", "models", "bench", "cli", "spmm",
                "suite"},
    "plan": {"codegen", "runtime", "tune", "semi", "ops", "nn", "models", "bench", "cli", "spmm"},
    "codegen": {"runtime", "tune", "semi", "ops", "nn", "models", "bench", "cli", "spmm"},
    "runtime": {"tune", "semi", "ops", "nn", "models", "bench", "cli", "spmm"},
    "tune": {"semi", "ops", "nn", "models", "bench", "cli", "spmm"},
    "semi": {"ops", "nn", "models", "bench", "cli", "spmm", "conv"},
    "ops": {"nn", "models", "bench", "cli"},
    "nn": {"models", "bench", "cli", "model_cli"},
    "models": {"bench", "cli", "model_cli"},
    "bench": {"cli", "model_cli"},
}


def _imported_stages(path: Path) -> set[str]:
    """First components under sparseforge of every import in the file, relative ones resolved."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts] if node.module else [parts + [a.name] for a in node.names]
            else:
                names = [node.module.split(".")] if node.module else []
            found |= {n[1] for n in names if len(n) > 1 and n[0] == "sparseforge"}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("sparseforge.")}
    return found


@pytest.mark.parametrize("stage", sorted(LATER))
def test_no_stage_imports_a_later_one(stage):
    files = sorted((ROOT / stage).rglob("*.py")) if (ROOT / stage).is_dir() else [ROOT / f"{stage}.py"]
    wrong = {str(f.relative_to(ROOT)): sorted(_imported_stages(f) & LATER[stage]) for f in files}
    assert not {f: s for f, s in wrong.items() if s}


def test_formats_plan_codegen_and_the_cost_model_import_without_torch():
    code = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
sys.meta_path.insert(0, NoTorch())
import numpy as np
import sparseforge.formats, sparseforge.plan, sparseforge.codegen, sparseforge.tune
from sparseforge.codegen import render
from sparseforge.plan import make_plan
from sparseforge.tune.cost import estimate
plan = make_plan(sparseforge.SparseMatrix.from_dense(np.eye(4, dtype=np.float32)), 8)
assert render(plan).text and estimate(plan).us > 0 and callable(sparseforge.spmm) and "torch" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_module_imports_a_private_name_of_another():
    """A leading underscore means "this module's own": a name another module needs is made public (and
    documented) where it lives, not reached into."""
    reached = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                reached += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not reached


def test_layout_defaults_refer_to_the_one_default():
    """A left-out layout means plan.DEFAULT_LAYOUT everywhere: a function that wrote "kn" (or "nk") as its own
    default would drift from the rest the day the default changes. Naming a specific layout in a comparison
    or a fixed attribute (split-24 runs "nk" only) is not a default and stays."""
    from sparseforge.plan import DEFAULT_LAYOUT, LAYOUTS

    assert DEFAULT_LAYOUT in LAYOUTS
    literal = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
                literal += [f"{path.relative_to(ROOT)}:{d.lineno} {getattr(node, 'name', 'lambda')}={d.value!r}"
                            for d in defaults if isinstance(d, ast.Constant) and d.value in LAYOUTS]
    assert not literal, f"write layout: str = DEFAULT_LAYOUT instead of a literal: {literal}"
