"""2:4 structured sparsity: workflow (masks kept through fine-tuning) and channel permutations."""
from .permute import PermutationResult, kept_magnitude, permute_pair, search_permutation
from .workflow import permute_ffn_pairs, sparsify_24

__all__ = ["PermutationResult", "kept_magnitude", "permute_ffn_pairs", "permute_pair", "search_permutation",
           "sparsify_24"]
