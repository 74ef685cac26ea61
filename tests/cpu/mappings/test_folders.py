"""The shape of mappings/: the registry imports no pipeline stage (its records name hooks, resolved on use),
no family folder imports another family's, every folder is some registered family's, and each family's
hooks that live under mappings/ live in its own folder."""
from __future__ import annotations

import ast
from pathlib import Path

import sparseforge
from sparseforge.mappings import registry

MAPPINGS = Path(sparseforge.__file__).parent / "mappings"
FOLDERS = sorted(p for p in MAPPINGS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative ones resolved against its package)."""
    package = ["sparseforge", *path.relative_to(MAPPINGS.parent).with_suffix("").parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.add(".".join(base + (node.module.split(".") if node.module else [])))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_registry_imports_no_stage():
    assert not {m for m in _imports(MAPPINGS / "registry.py") if m.startswith("sparseforge")}


def test_no_family_folder_imports_another():
    assert FOLDERS, "no family folders under mappings/"
    for folder in FOLDERS:
        for path in folder.rglob("*.py"):
            others = {m for m in _imports(path) if m.startswith("sparseforge.mappings.")
                      and not m.startswith(f"sparseforge.mappings.{folder.name}")}
            assert not others, f"{path.relative_to(MAPPINGS)} imports {sorted(others)}"


def _hook_folders(family) -> set[str]:
    paths = [getattr(family, f.name) for f in family.__dataclass_fields__.values()
             if isinstance(getattr(family, f.name), str) and ":" in getattr(family, f.name)]
    return {p.split(":")[0].split(".")[2] for p in paths if p.startswith("sparseforge.mappings.")}


def test_every_folder_is_a_registered_familys_and_each_family_keeps_to_one():
    used = set()
    for family in registry.FAMILIES:
        folders = _hook_folders(family)
        assert len(folders) <= 1, f"{family.name}'s hooks live in {sorted(folders)}"
        used |= folders
    assert {f.name for f in FOLDERS} == used
