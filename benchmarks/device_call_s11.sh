#!/usr/bin/env bash
# The eleventh session's device calls after `device_next.sh eleventh` (carry .dlmc and .whl):
#   bash benchmarks/device_call_s11.sh rn50h   ResNet-50 95% fp16 batch 1, then Llama 0.7 bf16
#   bash benchmarks/device_call_s11.sh last    Llama 2:4 and 50% fp16, the dense fp16 ResNet-50's own error
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT/logs"; L=$OUT/logs
bash benchmarks/device_run.sh probe > "$L/probe.log" 2>&1
export PYTHONPATH=src:/tmp/site
D=/tmp/dlmc/dlmc
llama() {  # name, then model_llama.py arguments
  local n=$1; shift
  timeout 160 python3 benchmarks/model_llama.py "$OUT/model_llama_$n.json" "$@" --tune-budget 0.5 > "$L/llama_$n.log" 2>&1
  tail -1 "$L/llama_$n.log"
}
case "${1:-}" in
  rn50h)
    timeout 330 python3 benchmarks/model_rn50.py $D/rn50/magnitude_pruning/0.95 "$OUT/model_rn50_0.95_fp16_b1.json" \
      --tune-budget 0.3 --dtype float16 > "$L/rn50_h95.log" 2>&1; tail -3 "$L/rn50_h95.log"
    llama 0.7_bf16_b1 --sparsity 0.7 --dtype bfloat16 ;;
  last)
    timeout 60 python3 benchmarks/model_rn50.py $D/rn50/magnitude_pruning/0.95 "$OUT/dense_rn50_0.95_fp16_b1.json" \
      --dtype float16 --dense-only > "$L/rn50_dense.log" 2>&1; tail -1 "$L/rn50_dense.log"
    llama 2of4_fp16_b1 --nm 2:4 --dtype float16
    llama 0.5_fp16_b1 --sparsity 0.5 --dtype float16 ;;
  *) echo "usage: $0 rn50h|last"; exit 2 ;;
esac
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"; ls "$OUT"
