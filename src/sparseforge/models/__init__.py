"""Whole models for the end-to-end figures (issue 13), built here with seeded weights (no downloads)."""
from .resnet import ResNet50, apply_dlmc_masks, calibrate_batchnorm, dlmc_mask, dlmc_name_map, resnet50

__all__ = ["ResNet50", "apply_dlmc_masks", "calibrate_batchnorm", "dlmc_mask", "dlmc_name_map", "resnet50"]
