"""LLM cases: Linear layers of Llama-class models, magnitude-pruned from seeded normal weights.

No files: a case is a named shape and a sparsity, and `load` draws W (seeded by seed, M and K) and keeps
its largest |w|. `discover("llm:0.5,0.9:llama_4096x4096")` resolves a spec `llm[:sparsities[:shapes]]`.
The named shapes below are the one list of Linear shapes: `bench24` takes its groups from it too.
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


@dataclass(frozen=True)
class LLMCase(Case):
    """A Case without a file: `path` only names it (llm/<layer>@<sparsity>); load draws and prunes W."""

    def load(self, seed: int = 0, dtype="float32") -> SparseMatrix:
        return magnitude_prune(seeded_weight(self.M, self.K, seed), self.sparsity, dtype)


def is_llm_spec(spec: str | Path) -> bool:
    """`llm` or `llm:...` given as text; a Path (or ./llm) is always a file or directory."""
    return isinstance(spec, str) and (spec == LLM_PREFIX or spec.startswith(LLM_PREFIX + ":"))


def _spec_help() -> str:
    return (f"give llm[:sparsities[:shapes]], e.g. llm:0.5,0.9:llama_4096x4096; sparsities are in [0, 1) "
            f"(default {','.join(map(str, LLM_SPARSITIES))}); shapes are {', '.join(LINEAR_SHAPES)} "
            f"(default {','.join(LLM_LAYERS)})")


def parse_llm_spec(spec: str) -> tuple[list[float], list[str]]:
    """'llm:0.5,0.9:llama_4096x4096' -> ([0.5, 0.9], ['llama_4096x4096']); an empty field is the default."""
    parts = spec.split(":")
    if parts[0] != LLM_PREFIX or len(parts) > 3:
        raise ValueError(f"LLM suite spec {spec!r}: {_spec_help()}")
    fields = [[item.strip() for item in part.split(",") if item.strip()] for part in parts[1:]] + [[], []]
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
    return sparsities or list(LLM_SPARSITIES), fields[1] or list(LLM_LAYERS)


def llm_cases(sparsities=LLM_SPARSITIES, layers=LLM_LAYERS, n: int = LLM_DEFAULT_TOKENS) -> list[LLMCase]:
    """One case per (sparsity, layer), sparsity-major; n: N (tokens) of every case."""
    cases = []
    for sparsity in sparsities:
        for layer in layers:
            m, k = LINEAR_SHAPES[layer]
            cases.append(LLMCase(Path(LLM_PREFIX, f"{layer}@{sparsity:g}"), layer.split("_")[0], "magnitude",
                                 sparsity, layer, m, k, kept_count(m, k, sparsity), n))
    return cases


def discover_llm(spec: str, tokens: int | None = None, n: int | None = None) -> list[LLMCase]:
    """The cases a spec names; N is n if given, else tokens, else LLM_DEFAULT_TOKENS."""
    sparsities, layers = parse_llm_spec(spec)
    return llm_cases(sparsities, layers, n or tokens or LLM_DEFAULT_TOKENS)
