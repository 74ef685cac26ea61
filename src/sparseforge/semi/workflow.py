"""2:4 workflow on a trained model: masks computed by magnitude, kept through fine-tuning."""
from __future__ import annotations

from torch import nn

from ..prune import PruneReport, Skipped, prune_model
from ..prune.targets import LayerFilter, select_layers
from .permute import PermutationResult, permute_pair, search_permutation

# cuSPARSELt takes 16-bit 2:4 operands whose dimensions are multiples of 16 (8 for some shapes); layers that
# are not are still pruned (the mask only needs K % 4 == 0) but will run dense.
_FAST_PATH_MULTIPLE = 16


def sparsify_24(model: nn.Module, include: LayerFilter = None, exclude: LayerFilter = None) -> PruneReport:
    """Prune every nn.Linear / nn.Conv2d of `model` (filtered by include/exclude) to 2:4 along the input
    dimension by magnitude, and keep the masks applied (parametrizations) so fine-tuning keeps the model
    2:4. Layers that do not fit are listed in report.skipped with the reason; report.notes names layers
    that are pruned but whose shape keeps them off cuSPARSELt's fast path."""
    report = prune_model(model, nm="2:4", include=include, exclude=exclude, keep_masks=True)
    layers = dict(select_layers(model, include, exclude)[0])
    report.notes = [Skipped(layer.name, f"shape {layer.shape[:2]} not a multiple of {_FAST_PATH_MULTIPLE}: "
                                        "pruned 2:4, will run dense")
                    for layer in report.layers
                    if any(s % _FAST_PATH_MULTIPLE for s in layer.shape[:2]) and layer.name in layers]
    return report


def permute_ffn_pairs(pairs: list[tuple[nn.Linear, nn.Linear]], time_budget: float = 5.0
                      ) -> list[PermutationResult]:
    """For each (producer, consumer) pair, search a permutation raising the consumer's 2:4 kept magnitude
    and apply it to both layers (the pair's function is unchanged). Returns the search results."""
    results = []
    for producer, consumer in pairs:
        result = search_permutation(consumer.weight, time_budget=time_budget)
        permute_pair(producer, consumer, result.permutation)
        results.append(result)
    return results
