"""Whole models for the end-to-end figures, built here with seeded weights (no downloads)."""
from .bert import MINILM_L6, BertEncoder, BertShape, bert_encoder, load_bert_weights, mean_pool
from .llama import LLAMA3_8B, LlamaDecoder, LlamaShape, llama_decoder
from .resnet import ResNet50, apply_dlmc_masks, calibrate_batchnorm, dlmc_mask, dlmc_name_map, resnet50

__all__ = ["LLAMA3_8B", "MINILM_L6", "BertEncoder", "BertShape", "bert_encoder", "load_bert_weights", "mean_pool", "LlamaDecoder", "LlamaShape", "ResNet50", "apply_dlmc_masks", "calibrate_batchnorm", "dlmc_mask",
           "dlmc_name_map", "llama_decoder", "resnet50"]
