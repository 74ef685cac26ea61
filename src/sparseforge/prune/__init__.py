"""Pruning: magnitude (per layer, per row, global) or another importance (Wanda), N:M masks, gradual schedules,
masks kept during fine-tuning."""
from .api import Importance, LayerPruned, PruneReport, find_state_dict, parse_nm, prune_model, prune_state_dict
from .importance import ActivationNorms, wanda_scores
from .magnitude import global_magnitude_masks, magnitude_mask, row_magnitude_mask
from .masking import FixedMask, apply_mask, current_mask, masked_modules, remove_masks
from .nm import NMError, check_nm, is_nm, nm_mask, nm_violations
from .schedule import GradualPruner, cubic_sparsity
from .targets import NothingSelectedError, Skipped, select_layers, select_state_dict, weight_matrix_view

__all__ = [
    "ActivationNorms", "FixedMask", "GradualPruner", "Importance", "LayerPruned", "NMError", "NothingSelectedError",
    "PruneReport", "Skipped", "apply_mask", "check_nm", "cubic_sparsity", "current_mask", "find_state_dict",
    "global_magnitude_masks", "is_nm", "magnitude_mask", "masked_modules", "nm_mask", "nm_violations", "parse_nm",
    "prune_model", "prune_state_dict", "remove_masks", "row_magnitude_mask", "select_layers", "select_state_dict",
    "wanda_scores", "weight_matrix_view",
]
