"""LLM cases: Linear layers of Llama-class models, pruned from seeded normal weights.

No files: a case is a named shape, a sparsity and a pruning method, and `load` draws W (seeded by seed, M
and K) and prunes it:
- "magnitude" keeps the largest |w| of the whole matrix: every column about equally dense (the default);
- "wanda" keeps, in each row, the largest |w_ij| * s_j, where s_j stands for input feature j's activation norm
  (seeded, log-normal with a few outlier features, as LLM activations have): Wanda's masks (Sun et al. 2023),
  whose columns are skewed (a loud feature's column stays nearly dense, a quiet one's nearly empty) and whose
  rows all hold the same count. Formats and kernels whose cost depends on column gaps or tile fill see
  different inputs here than under global magnitude pruning.
`discover("llm:0.5,0.9:llama_4096x4096:wanda")` resolves a spec `llm[:sparsities[:shapes[:methods]]]`. The
named shapes below are the one list of Linear shapes: `bench24` takes its groups from it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..formats import SparseMatrix
from .cases import Case

# Linear layers (out_features M, in_features K) by name; the prefix is the model family.
LINEAR_SHAPES = {
    "bert_768x768": (768, 768),            # BERT-base attention projections
    "bert_3072x768": (3072, 768),          # BERT-base FFN up
    "bert_768x3072": (768, 3072),          # BERT-base FFN down
    "llama_4096x4096": (4096, 4096),       # Llama 2/3 7-8B q and o projections
    "llama_1024x4096": (1024, 4096),       # Llama 3 8B k and v projections (grouped-query attention)
    "llama_11008x4096": (11008, 4096),     # Llama 2 7B gate and up
    "llama_4096x11008": (4096, 11008),     # Llama 2 7B down
    "llama_14336x4096": (14336, 4096),     # Llama 3 8B gate and up
    "llama_4096x14336": (4096, 14336),     # Llama 3 8B down
    "llama_5120x13824": (5120, 13824),     # Llama 2 13B down
    "qwen2_3584x3584": (3584, 3584),       # Qwen2 7B q and o projections
    "qwen2_512x3584": (512, 3584),         # Qwen2 7B k and v projections (4 key-value heads)
    "qwen2_18944x3584": (18944, 3584),     # Qwen2 7B gate and up
    "qwen2_3584x18944": (3584, 18944),     # Qwen2 7B down
}
# What `bench llm` runs when the spec names no shapes or sparsities.
LLM_LAYERS = ("llama_4096x4096", "llama_1024x4096", "llama_14336x4096", "llama_4096x14336", "llama_5120x13824")
LLM_SPARSITIES = (0.5, 0.7, 0.9)
# bench24's shape groups, in the order it runs them.
BENCH24_GROUPS = {
    "bert": ("bert_768x768", "bert_3072x768", "bert_768x3072"),
    "llama": ("llama_4096x4096", "llama_11008x4096", "llama_4096x11008", "llama_14336x4096"),
}
LLM_DEFAULT_TOKENS = 16  # decode: a handful of sequences, one token each
LLM_PREFIX = "llm"
LLM_METHODS = ("magnitude", "wanda")  # the first is the default
# Wanda's stand-in activation norms: log-normal spread (sigma) and every OUTLIER_EVERY-th feature OUTLIER_GAIN
# times louder (LLMs' massive activations sit in a few fixed features)
WANDA_NORM_SIGMA, WANDA_OUTLIER_EVERY, WANDA_OUTLIER_GAIN = 0.5, 512, 20.0


def kept_count(m: int, k: int, sparsity: float) -> int:
    """Entries magnitude pruning keeps: round(sparsity * M K) are pruned, as prune.magnitude_mask does."""
    return m * k - int(round(sparsity * m * k))


def seeded_weight(m: int, k: int, seed: int) -> np.ndarray:
    """A dense float32 (M, K) standard normal, the same for the same (seed, M, K) and different otherwise."""
    return np.random.default_rng([seed, m, k]).standard_normal((m, k), dtype=np.float32)


def magnitude_prune(w: np.ndarray, sparsity: float, dtype="float32") -> SparseMatrix:
    """The largest-|w| entries of a 2-D float array as a SparseMatrix, exactly kept_count(M, K, sparsity).

    Ties at the threshold keep the later positions (row-major), as prune.magnitude_mask's stable sort does.
    Memory (14336 x 4096 at 50%: w is 224 MiB): besides w, one float32 |w| buffer partitioned in place (no
    int64 index array over all M K entries, as argpartition would make) and two boolean masks; then the kept
    entries' int64 positions, turned into column indices in place, and their values. Peak ~2.3 x w here,
    before SparseMatrix validates its copies.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}: it is the fraction of weights removed")
    m, k = w.shape
    n_keep = kept_count(m, k, sparsity)
    if n_keep == 0:
        return SparseMatrix(np.zeros(m + 1, dtype=np.int64), [], [], (m, k), dtype)
    magnitude = np.abs(w, dtype=np.float32)
    n_prune = m * k - n_keep
    flat = magnitude.reshape(-1)
    flat.partition(n_prune)  # flat[n_prune] is now the smallest kept magnitude
    threshold = flat[n_prune]
    np.abs(w, out=magnitude)  # back in position order for the masks
    keep = magnitude > threshold
    tied = magnitude == threshold
    del magnitude
    ties_kept = n_keep - int(np.count_nonzero(keep))
    if ties_kept:
        tied_positions = np.flatnonzero(tied)
        keep.reshape(-1)[tied_positions[len(tied_positions) - ties_kept:]] = True
    del tied
    positions = np.flatnonzero(keep)
    indptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.count_nonzero(keep, axis=1), out=indptr[1:])
    del keep
    values = w.reshape(-1)[positions]
    indices = np.remainder(positions, k, out=positions).astype(np.int32)  # in place: no second int64 array
    del positions
    return SparseMatrix(indptr, indices, values, (m, k), dtype)


def feature_norms(k: int, seed: int) -> np.ndarray:
    """K positive float32 stand-ins for a layer's input activation norms (seeded by seed and K): log-normal,
    and every WANDA_OUTLIER_EVERY-th feature from a seeded offset WANDA_OUTLIER_GAIN times louder."""
    rng = np.random.default_rng([seed, k, 1])
    norms = np.exp(rng.normal(0.0, WANDA_NORM_SIGMA, k)).astype(np.float32)
    norms[int(rng.integers(WANDA_OUTLIER_EVERY))::WANDA_OUTLIER_EVERY] *= WANDA_OUTLIER_GAIN
    return norms


def row_kept_count(m: int, k: int, sparsity: float) -> int:
    """Entries a per-row pruning keeps: round(sparsity * K) pruned in each of the M rows."""
    return m * (k - int(round(sparsity * k)))


def wanda_prune(w: np.ndarray, norms: np.ndarray, sparsity: float, dtype="float32") -> SparseMatrix:
    """Each row's largest |w_ij| * norms_j, exactly K - round(sparsity K) a row (ties kept at the later column),
    as a SparseMatrix with w's values. Memory: the kept columns (int32) and values, and the scores and their
    sort order a block of rows at a time (~128 MiB of int64 indices)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}: it is the fraction of weights removed")
    m, k = w.shape
    if norms.shape != (k,):
        raise ValueError(f"need {k} feature norms for a {m} x {k} weight, got shape {norms.shape}")
    keep = k - int(round(sparsity * k))
    indices = np.empty((m, keep), dtype=np.int32)
    block = max(1, (1 << 24) // max(k, 1))  # rows a step: the argsort's int64 indices stay ~128 MiB
    for start in range(0, m, block):
        score = np.abs(w[start:start + block]) * norms[None, :]
        # a stable ascending sort ranks a tie's later column higher: it is the one kept, as in magnitude_prune
        order = np.argsort(score, axis=1, kind="stable")[:, k - keep:]
        indices[start:start + block] = np.sort(order, axis=1)
    values = np.take_along_axis(w, indices, axis=1)
    indptr = np.arange(m + 1, dtype=np.int64) * keep  # keep may be 0: every row emptied
    return SparseMatrix(indptr, indices.reshape(-1), values.reshape(-1), (m, k), dtype)


@dataclass(frozen=True)
class LLMCase(Case):
    """A Case without a file: `path` only names it (llm/<layer>@<sparsity>, then ~<method> unless magnitude);
    load draws W and prunes it by the case's method."""

    def load(self, seed: int = 0, dtype="float32") -> SparseMatrix:
        w = seeded_weight(self.M, self.K, seed)
        if self.method == "wanda":
            return wanda_prune(w, feature_norms(self.K, seed), self.sparsity, dtype)
        return magnitude_prune(w, self.sparsity, dtype)


def is_llm_spec(spec: str | Path) -> bool:
    """`llm` or `llm:...` given as text; a Path (or ./llm) is always a file or directory."""
    return isinstance(spec, str) and (spec == LLM_PREFIX or spec.startswith(LLM_PREFIX + ":"))


def _spec_help() -> str:
    return (f"give llm[:sparsities[:shapes[:methods]]], e.g. llm:0.5,0.9:llama_4096x4096:wanda; sparsities are "
            f"in [0, 1) (default {','.join(map(str, LLM_SPARSITIES))}); shapes are {', '.join(LINEAR_SHAPES)} "
            f"(default {','.join(LLM_LAYERS)}); methods are {', '.join(LLM_METHODS)} (default {LLM_METHODS[0]})")


def parse_llm_spec(spec: str) -> tuple[list[float], list[str], list[str]]:
    """'llm:0.5,0.9:llama_4096x4096:wanda' -> ([0.5, 0.9], ['llama_4096x4096'], ['wanda']); an empty or
    missing field is the default."""
    parts = spec.split(":")
    if parts[0] != LLM_PREFIX or len(parts) > 4:
        raise ValueError(f"LLM suite spec {spec!r}: {_spec_help()}")
    fields = [[item.strip() for item in part.split(",") if item.strip()] for part in parts[1:]] + [[], [], []]
    sparsities = []
    for item in fields[0]:
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0.0 <= value < 1.0:
            raise ValueError(f"LLM suite spec {spec!r}: sparsity {item!r} is not a number in [0, 1); {_spec_help()}")
        sparsities.append(value)
    unknown = [name for name in fields[1] if name not in LINEAR_SHAPES]
    if unknown:
        raise ValueError(f"LLM suite spec {spec!r}: unknown shape {unknown[0]!r}; {_spec_help()}")
    unknown = [name for name in fields[2] if name not in LLM_METHODS]
    if unknown:
        raise ValueError(f"LLM suite spec {spec!r}: unknown pruning method {unknown[0]!r}; {_spec_help()}")
    unique = lambda items: list(dict.fromkeys(items))  # noqa: E731 - a field named twice is one set of cases
    return (unique(sparsities) or list(LLM_SPARSITIES), unique(fields[1]) or list(LLM_LAYERS),
            unique(fields[2]) or [LLM_METHODS[0]])


def llm_cases(sparsities=LLM_SPARSITIES, layers=LLM_LAYERS, n: int = LLM_DEFAULT_TOKENS,
              methods=LLM_METHODS[:1]) -> list[LLMCase]:
    """One case per (method, sparsity, layer), in that order; n: N (tokens) of every case. A wanda case's model
    is its family with "_wanda" (llama_wanda), so summaries keep the two kinds of mask apart."""
    cases = []
    for method in methods:
        if method not in LLM_METHODS:
            raise ValueError(f"unknown pruning method {method!r}: one of {', '.join(LLM_METHODS)}")
        suffix = "" if method == LLM_METHODS[0] else f"_{method}"
        for sparsity in sparsities:
            for layer in layers:
                m, k = LINEAR_SHAPES[layer]
                count = kept_count if method == LLM_METHODS[0] else row_kept_count
                cases.append(LLMCase(Path(LLM_PREFIX, f"{layer}@{sparsity:g}" + (f"~{method}" if suffix else "")),
                                     layer.split("_")[0] + suffix, method, sparsity, layer, m, k,
                                     count(m, k, sparsity), n))
    return cases


def case_of_path(path: str | Path, n: int = LLM_DEFAULT_TOKENS) -> LLMCase:
    """The case an LLMCase's path names (llm/<layer>@<sparsity>[~<method>], as results files record it)."""
    name = Path(path).name
    layer, _, rest = name.partition("@")
    sparsity, _, method = rest.partition("~")
    try:
        value = float(sparsity)
    except ValueError:
        value = -1.0
    if Path(path).parent.name != LLM_PREFIX or layer not in LINEAR_SHAPES or not 0.0 <= value < 1.0 \
            or (method or LLM_METHODS[0]) not in LLM_METHODS:
        raise ValueError(f"{str(path)!r} names no LLM case: llm/<layer>@<sparsity>[~<method>], layers "
                         f"{', '.join(LINEAR_SHAPES)}, methods {', '.join(LLM_METHODS)}")
    return llm_cases([value], [layer], n, [method or LLM_METHODS[0]])[0]


def discover_llm(spec: str, tokens: int | None = None, n: int | None = None) -> list[LLMCase]:
    """The cases a spec names; N is n if given, else tokens, else LLM_DEFAULT_TOKENS."""
    sparsities, layers, methods = parse_llm_spec(spec)
    return llm_cases(sparsities, layers, n or tokens or LLM_DEFAULT_TOKENS, methods)
