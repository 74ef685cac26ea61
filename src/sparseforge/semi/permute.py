"""Channel permutations for N:M sparsity (after Pool & Yu, "Channel Permutations for N:M Sparsity",
NeurIPS 2021): reorder a layer's input channels so that large weights fall in different groups of M and
the N:M mask keeps more magnitude. The model's function is unchanged when the producer of those channels
is permuted the same way (e.g. a transformer FFN: the first Linear's output rows and bias, the second
Linear's input columns, with an elementwise activation between them).

The search here is greedy channel swapping: batches of random swaps between two groups are scored exactly
(only the two groups change), the best non-overlapping improving swaps are applied, and it stops after a
run of batches without gain. It never lowers the kept magnitude: only improving swaps are taken.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PermutationResult:
    permutation: torch.Tensor   # new column j is old column permutation[j]
    kept_before: float          # sum |w| kept by the N:M mask, identity order
    kept_after: float           # ... after permuting
    total: float                # sum |w|

    @property
    def gain(self) -> float:
        return self.kept_after / self.kept_before - 1.0 if self.kept_before else 0.0


def kept_magnitude(weight: torch.Tensor, n: int = 2, m: int = 4) -> float:
    """Sum of |w| that an N:M magnitude mask along the input dimension keeps."""
    w = weight.detach().abs().float().reshape(weight.shape[0], -1, m)
    return float(w.topk(n, dim=2).values.sum())


def _group_kept(w_abs: torch.Tensor, cols: torch.Tensor, n: int) -> torch.Tensor:
    """Kept magnitude of candidate groups: w_abs (rows, K), cols (C, m) column indices -> (C,)."""
    return w_abs[:, cols].topk(n, dim=2).values.sum(dim=(0, 2))


def search_permutation(weight: torch.Tensor, n: int = 2, m: int = 4, batch: int = 512, patience: int = 20,
                       time_budget: float = 10.0, seed: int = 0) -> PermutationResult:
    """Greedy swap search for an input-channel permutation of `weight` (out x in, in % m == 0)."""
    w_abs = weight.detach().abs().float().reshape(weight.shape[0], -1)
    k = w_abs.shape[1]
    if k % m:
        raise ValueError(f"input dimension {k} is not a multiple of M = {m}")
    groups = k // m
    perm = torch.arange(k)
    before = kept_magnitude(w_abs, n, m)
    if groups < 2:
        return PermutationResult(perm, before, before, float(w_abs.sum()))
    gen = torch.Generator().manual_seed(seed)
    start, idle = time.perf_counter(), 0
    while idle < patience and time.perf_counter() - start < time_budget:
        current = perm.reshape(groups, m)
        ga = torch.randint(0, groups, (batch,), generator=gen)
        gb = (ga + torch.randint(1, groups, (batch,), generator=gen)) % groups
        ia, ib = torch.randint(0, m, (batch,), generator=gen), torch.randint(0, m, (batch,), generator=gen)
        old = _group_kept(w_abs, current[ga], n) + _group_kept(w_abs, current[gb], n)
        new_a, new_b = current[ga].clone(), current[gb].clone()
        rows = torch.arange(batch)
        new_a[rows, ia], new_b[rows, ib] = current[gb][rows, ib], current[ga][rows, ia]
        gain = _group_kept(w_abs, new_a, n) + _group_kept(w_abs, new_b, n) - old
        applied, used = 0, set()
        for i in torch.argsort(gain, descending=True).tolist():
            if gain[i] <= 1e-6 * max(before, 1e-30):
                break
            a, b = int(ga[i]), int(gb[i])
            if a in used or b in used:
                continue
            used.update((a, b))
            pa, pb = a * m + int(ia[i]), b * m + int(ib[i])
            perm[pa], perm[pb] = perm[pb].clone(), perm[pa].clone()
            applied += 1
        idle = 0 if applied else idle + 1
    after = kept_magnitude(w_abs[:, perm], n, m)
    if after < before:  # cannot happen (only gains are applied), but never hand back a worse order
        perm, after = torch.arange(k), before
    return PermutationResult(perm, before, after, float(w_abs.sum()))


@torch.no_grad()
def permute_pair(producer: nn.Linear, consumer: nn.Linear, permutation: torch.Tensor) -> None:
    """Reorder the channels between producer and consumer: producer's output rows (and bias) and
    consumer's input columns, so consumer(act(producer(x))) is unchanged for elementwise act."""
    if producer.out_features != consumer.in_features or len(permutation) != consumer.in_features:
        raise ValueError(f"producer has {producer.out_features} outputs, consumer {consumer.in_features} inputs, "
                         f"permutation {len(permutation)} entries: they must all agree")
    permutation = permutation.to(producer.weight.device)
    producer.weight.copy_(producer.weight[permutation])
    if producer.bias is not None:
        producer.bias.copy_(producer.bias[permutation])
    consumer.weight.copy_(consumer.weight[:, permutation])
