"""2:4 structured sparsity: workflow (masks kept through fine-tuning), channel permutations, and the
cuSPARSELt runtime (compressed weights, plans per input width, 2:4-or-dense decisions by measurement)."""
from .cusparselt import Sparse24Error, check_weight
from .decide import Decision
from .permute import PermutationResult, kept_magnitude, permute_pair, search_permutation
from .workflow import permute_ffn_pairs, sparsify_24

__all__ = ["Decision", "PermutationResult", "Sparse24Error", "check_weight", "kept_magnitude", "permute_ffn_pairs",
           "permute_pair", "search_permutation", "sparsify_24"]
