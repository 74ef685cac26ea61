#!/usr/bin/env bash
# Device call: every mapping on a representative dozen layers (designs.py), the reference kernel
# beside it, then the SpMM GPU tests and the fuzz test. Carried: .dlmc/ (the DLMC archive and
# rowblock_reference.py from ../shared/baselines).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
[ -d /tmp/dlmc/dlmc ] || { mkdir -p /tmp/dlmc && tar -xJf .dlmc/dlmc-subset.tar.xz -C /tmp/dlmc; }
R=/tmp/dlmc/dlmc; M=rn50/magnitude_pruning/${SPARSITY:-0.9}; T=transformer/magnitude_pruning/${SPARSITY:-0.9}
RN50="final_dense bottleneck_1_block_group4_1_1 bottleneck_2_block_group4_1_1 bottleneck_3_block_group4_1_1
  bottleneck_1_block_group3_1_1 bottleneck_2_block_group3_1_1 bottleneck_3_block_group3_1_1
  bottleneck_2_block_group2_1_1 bottleneck_3_block_group2_1_1 bottleneck_1_block_group1_1_1
  bottleneck_3_block_group1_1_1 initial_conv"
stage() { [[ " $STAGES " == *" $1 "* ]]; }
STAGES=" ${*:-designs reference tests} "
if stage designs; then
  cases=$(for l in $RN50; do echo $M/$l; done)
  cases="$cases $T/body_encoder_layer_0_ffn_conv1_fully_connected:256 $T/body_encoder_layer_0_self_attention_multihead_attention_q_fully_connected:256 $T/body_encoder_layer_0_ffn_conv2_fully_connected:1 $T/body_encoder_layer_0_ffn_conv2_fully_connected:8"
  timeout ${DESIGNS_S:-300} python3 benchmarks/designs.py "$OUT/designs_${SPARSITY:-0.9}_${DTYPE:-float32}${MAPPINGS:+_$MAPPINGS}.json" $R $cases \
    --dtype ${DTYPE:-float32} --mappings "${MAPPINGS:-}" 2>&1 | tee "$OUT/designs${MAPPINGS:+_$MAPPINGS}.log"
fi
if stage reference; then
  mkdir -p /tmp/ref/rn50/x && cp $R/rn50_batchsizes.txt /tmp/ref/rn50/ && for l in $RN50; do cp $R/$M/$l.smtx /tmp/ref/rn50/x/; done
  timeout ${REF_S:-120} python3 .dlmc/rowblock_reference.py /tmp/ref/rn50 --max-nnz 60000 --out "$OUT/rowblock_reference.json" 2>&1 | tail -14
fi
if stage tests; then
  timeout ${TESTS_S:-200} python3 -m pytest tests/gpu/test_spmm_gpu.py tests/gpu/test_spmm_fuzz_gpu.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
