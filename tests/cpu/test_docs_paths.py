"""What README.md, docs/*.md and benchmarks/README.md cite exists: every file or folder named in backticks
(`src/...`, `tests/...`, `benchmarks/...`, a module path such as `tune/space.py` relative to src/sparseforge,
a script's bare name), every relative link, every `sparseforge.xxx` module or attribute and every name a code
example imports from sparseforge. A file moved or renamed without its docs fails here instead of sending a
reader nowhere."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "sparseforge"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
ROOTS = ("src", "tests", "benchmarks", "docs", "examples")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# a word of an inline code span that names a file or folder: under one of the repository's top folders, a
# module path under the package (`tune/space.py`, `formats/`), or a bare script / source name
ROOTED = re.compile(rf"^(?:{'|'.join(ROOTS)})/[\w./-]*$")
MODULE_PATH = re.compile(r"^[a-z_]+/(?:[a-z_]+(?:/[a-z_]+)*(?:\.py)?)?$")
BARE_FILE = re.compile(r"^[\w-]+\.(?:py|sh|cu|md)$")
DOTTED = re.compile(r"(?<![\w.])sparseforge(?:\.\w+)+")


def _split(doc: Path) -> tuple[str, list[tuple[str, str]]]:
    """(the prose with fenced blocks blanked, [(language, block text)])."""
    text = doc.read_text()
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    return FENCE.sub("", text), blocks


def _cited_paths(prose: str) -> list[str]:
    words = [w for span in re.findall(r"`([^`\n]+)`", prose) for w in span.split()]
    return [w for w in words if ROOTED.match(w) or MODULE_PATH.match(w) or BARE_FILE.match(w)]


def _exists(word: str, doc: Path) -> bool:
    if (REPO / word).exists() or (doc.parent / word).exists() or (PACKAGE / word).exists():
        return True
    if "/" not in word:  # a bare name: a script or source file somewhere in the tree
        return any(next(iter((REPO / top).rglob(word)), None) for top in ROOTS)
    return False


def _resolves(dotted: str) -> bool:
    """A module (importable) or an attribute of one, e.g. sparseforge.runtime.timing, sparseforge.convert."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _code_lines(blocks: list[tuple[str, str]]) -> list[str]:
    """The python of the fenced python blocks, comments dropped (they may name files such as sparseforge.json)."""
    return [line.split("#")[0] for lang, body in blocks if lang == "python" for line in body.splitlines()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_cited_paths_exist(doc):
    prose, _ = _split(doc)
    cited = _cited_paths(prose)
    missing = sorted({w for w in cited if not _exists(w, doc)})
    assert not missing, f"{doc.name} cites paths that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_relative_links_exist(doc):
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", doc.read_text())]
    missing = sorted({t for t in links if t and "://" not in t and not (doc.parent / t).exists()})
    assert not missing, f"{doc.name} links to files that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_cited_modules_and_imports_resolve(doc):
    prose, blocks = _split(doc)
    code = _code_lines(blocks)
    spans = " ".join(re.findall(r"`([^`\n]+)`", prose))
    dotted = set(DOTTED.findall(spans)) | {d for line in code for d in DOTTED.findall(line)}
    for line in code:  # from sparseforge[.x] import a, b
        found = re.match(r"\s*from (sparseforge(?:\.\w+)*) import ([\w, ]+)", line)
        if found:
            dotted |= {f"{found.group(1)}.{name.strip()}" for name in found.group(2).split(",")}
    missing = sorted(d for d in dotted if not _resolves(d))
    assert not missing, f"{doc.name} names what sparseforge does not have: {missing}"


def test_the_extraction_is_not_vacuous():
    prose, blocks = _split(REPO / "docs" / "design.md")
    assert {"tune/space.py", "codegen/operands.py", "formats/"} <= set(_cited_paths(prose))
    assert _cited_paths("`bash benchmarks/run.sh STAGE` and `git show C^:benchmarks/x` `a.json`") == \
        ["benchmarks/run.sh"]
    assert not _exists("tune/nowhere.py", REPO / "README.md") and not _exists("nowhere_script.py", REPO / "README.md")
    assert _resolves("sparseforge.runtime.timing") and _resolves("sparseforge.convert")
    assert not _resolves("sparseforge.no_such_module") and not _resolves("sparseforge.prune.no_such_name")
