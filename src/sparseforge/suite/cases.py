"""The benchmark case suite: DLMC-style directories of `<model>/<method>/<sparsity>/<layer>.smtx`, and the
LLM cases (suite/llm.py) that a spec `llm[:sparsities[:shapes[:methods]]]` names instead of a path.

A case is one weight matrix W (M x K) and the N of the dense operand it multiplies:
- ResNet-50 (`rn50`): N = output pixels per image (rn50_batchsizes.txt) x batch size;
- Transformer: N = tokens (default 256);
- anything else: N must be given.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..formats import SparseMatrix, read_smtx
from ..formats.exact import INDEX_LIMIT

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "data" / "dlmc_sample"
BATCHSIZES_FILE = "rn50_batchsizes.txt"
DEFAULT_TOKENS = 256


@dataclass(frozen=True)
class Case:
    path: Path          # the .smtx file; for cases without one (LLMCase) a name such as llm/<layer>@<sparsity>
    model: str          # "rn50", "transformer", or the folder name
    method: str         # pruning method folder, e.g. "magnitude_pruning"
    sparsity: float | None  # from the folder name; None when the path does not say
    layer: str          # file stem
    M: int
    K: int
    nnz: int
    N: int | None       # columns of the dense operand; None when unknown (give n=...)

    @property
    def name(self) -> str:
        tag = f"{self.sparsity:g}" if self.sparsity is not None else "?"
        return f"{self.model}/{self.method}/{tag}/{self.layer}"

    @property
    def density(self) -> float:
        return self.nnz / (self.M * self.K)

    def load(self, seed: int = 0, dtype="float32") -> SparseMatrix:
        return SparseMatrix.from_smtx(self.path, seed=seed, dtype=dtype)


def read_batchsizes(path: Path) -> dict[str, int]:
    """rn50_batchsizes.txt: lines of `layer,N` (N = output pixels at batch 1)."""
    table = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            layer, n = line.rsplit(",", 1)
            layer, n = layer.strip(), int(n)
        except ValueError:
            raise ValueError(f"{path}: line {lineno}: expected 'layer,N', found {line!r}") from None
        # N < 1 would reach the kernels as a negative width; a second line would silently replace the first
        if n < 1:
            raise ValueError(f"{path}: line {lineno}: N = {n} for {layer}; N is output pixels per image, >= 1")
        if layer in table:
            raise ValueError(f"{path}: line {lineno}: {layer} is listed twice; keep one line per layer")
        table[layer] = n
    return table


def check_width(n: int | None, what: str = "N") -> None:
    """Refuse an input width N (columns of the dense operand) the kernels cannot index: N < 2**31, like M and
    K, since indices are 32-bit; a larger one failed deep in code generation (a MemoryError) or, in CPU mode,
    was shown as N while the reference checked N <= 64."""
    if n is not None and n >= INDEX_LIMIT:
        raise ValueError(f"{what} = {n}: N must be < 2**31 = {INDEX_LIMIT}, as M and K are (sparseforge's kernels "
                         "index with 32-bit integers); give a smaller n, tokens or batch (--n, --tokens, --batch)")


def find_batchsizes(start: Path) -> dict[str, int]:
    for folder in [start, *start.parents]:
        candidate = folder / BATCHSIZES_FILE
        if candidate.is_file():
            return read_batchsizes(candidate)
    return read_batchsizes(SAMPLE_DIR / BATCHSIZES_FILE)


def parse_sparsity(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value < 1.0 else None


def _case(path: Path, batch: int, tokens: int, n: int | None, batchsizes: dict[str, int]) -> Case:
    (m, k), indptr, _ = read_smtx(path)
    folder = path.absolute().parent  # "w.smtx" given in its own folder: its parent "." names no model
    sparsity = parse_sparsity(folder.name)
    model = folder.parent.parent.name if sparsity is not None else folder.name
    method = folder.parent.name if sparsity is not None else ""
    if n is None and model == "rn50" and path.stem in batchsizes:
        n = batchsizes[path.stem] * batch
    elif n is None and model == "transformer":
        n = tokens
    check_width(n, f"N of {path.stem}")
    return Case(path, model, method, sparsity, path.stem, m, k, int(indptr[-1]), n)


def discover(root: str | Path, batch: int = 1, tokens: int | None = None, n: int | None = None,
             progress=None) -> list[Case]:
    """All cases under `root` (a DLMC-style directory at any level, or one .smtx file), sorted by path; or,
    for a string `llm[:sparsities[:shapes[:methods]]]`, the LLM cases it names (suite/llm.py; ./llm is a path).

    batch: ResNet-50 batch size (N = pixels x batch); tokens: N for Transformer layers (default 256) and
    LLM layers (default 16); n: force one N for every case. progress: optional callable wrapping the file
    list (e.g. a progress bar).
    """
    if batch < 1 or (tokens is not None and tokens < 1) or (n is not None and n < 1):
        raise ValueError(f"batch, tokens and n must be >= 1, got batch={batch}, tokens={tokens}, n={n}")
    for what, value in (("n", n), ("tokens", tokens)):
        check_width(value, what)
    from .llm import discover_llm, is_llm_spec  # llm builds on Case: imported here, not at the top

    if is_llm_spec(root):
        return discover_llm(root, tokens=tokens, n=n)
    if isinstance(root, str) and root.startswith("conv:") and not Path(root).exists():
        raise ValueError(f"{root}: convolution specs (conv:...) are cases for `sparseforge bench` only; here give a "
                         ".smtx file, a DLMC-style directory, or llm[:sparsities[:shapes[:methods]]]")
    tokens = DEFAULT_TOKENS if tokens is None else tokens
    root = Path(root)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(root.rglob("*.smtx"))
        if not files:
            raise FileNotFoundError(f"no .smtx files under {root}; expected <model>/<method>/<sparsity>/<layer>.smtx")
    elif root.exists():  # /dev/null, a FIFO: "does not exist" would be wrong
        raise ValueError(f"{root} is neither a file nor a directory (a device, FIFO or socket); give a .smtx file, "
                         "a DLMC-style directory, or llm[:sparsities[:shapes[:methods]]] for the LLM cases")
    else:
        raise FileNotFoundError(f"{root} does not exist; give a .smtx file, a DLMC-style directory, "
                                "or llm[:sparsities[:shapes[:methods]]] for the LLM cases")
    batchsizes = find_batchsizes(root if root.is_dir() else root.parent)
    iterate = progress(files) if progress else files
    return [_case(path, batch, tokens, n, batchsizes) for path in iterate]
