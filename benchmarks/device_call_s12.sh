#!/usr/bin/env bash
# The twelfth session's device calls (carry .dlmc and .whl). Each writes its logs straight into $OUT (the
# device tool returns at most 8 files, and what is there when a timeout strikes), most important stage first.
#   bash benchmarks/device_call_s12.sh a     nn + conv GPU tests (fusion, host-held CSR: CPU-tested only so far),
#                                             ResNet-50 95% fp16 fused, Llama 70% fp16 (memory, latency)
#   bash benchmarks/device_call_s12.sh tests  the whole GPU suite
set -uo pipefail
export PYTHONUNBUFFERED=1 SPARSEFORGE_CACHE_DIR=$PWD/.out_cache
OUT=${OUT:-.out}; mkdir -p "$OUT"
bash benchmarks/device_run.sh probe > "$OUT/probe.log" 2>&1
export PYTHONPATH=src:/tmp/site
D=/tmp/dlmc/dlmc
rn50() {  # name, sparsity, timeout, then model_rn50.py arguments
  local n=$1 s=$2 t=$3; shift 3
  timeout "$t" python3 benchmarks/model_rn50.py $D/rn50/magnitude_pruning/$s "$OUT/model_rn50_$n.json" "$@" > "$OUT/rn50_$n.log" 2>&1
  tail -2 "$OUT/rn50_$n.log"
}
llama() {  # name, timeout, then model_llama.py arguments
  local n=$1 t=$2; shift 2
  timeout "$t" python3 benchmarks/model_llama.py "$OUT/model_llama_$n.json" "$@" --tune-budget 0.5 > "$OUT/llama_$n.log" 2>&1
  tail -2 "$OUT/llama_$n.log"
}
case "${1:-}" in
  a)
    timeout 200 python3 -m pytest tests/gpu/test_nn_sparse_gpu.py tests/gpu/test_conv_gpu.py -q -p no:cacheprovider \
      > "$OUT/gpu_tests_nn_conv.log" 2>&1; tail -3 "$OUT/gpu_tests_nn_conv.log"
    rn50 0.95_fp16_b1 0.95 250 --tune-budget 0.3 --dtype float16
    llama 0.7_fp16_b1 90 --sparsity 0.7 --dtype float16 ;;
  tests)
    timeout 560 python3 -m pytest tests/gpu -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log" ;;
  b)  # the whole GPU suite, then ResNet-50 95% fp32 fused
    timeout 385 python3 -m pytest tests/gpu -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
    rn50 0.95_fp32_b1 0.95 185 --tune-budget 0.3 --dtype float32 ;;
  c)  # the dense convs' cuDNN-fused epilogues: nn GPU tests, ResNet-50 95% fp16 again; MiniLM 80% latency, the
      # digits CNN, ResNet-50 98% fp32 with what time is left
    timeout 150 python3 -m pytest tests/gpu/test_nn_sparse_gpu.py -q -p no:cacheprovider > "$OUT/gpu_tests_nn.log" 2>&1
    tail -3 "$OUT/gpu_tests_nn.log"
    rn50 0.95_fp16_b1 0.95 250 --tune-budget 0.3 --dtype float16
    timeout 130 python3 benchmarks/model_minilm.py "$OUT/model_minilm_0.8_fp16_b1.json" --sparsity 0.8 --tune-budget 0.5 \
      > "$OUT/minilm.log" 2>&1; tail -1 "$OUT/minilm.log"
    timeout 60 python3 examples/digits_cnn.py --device cuda --data .digits/digits.npz --out "$OUT/digits_cnn_gpu.json" > "$OUT/digits.log" 2>&1; tail -2 "$OUT/digits.log"
    rn50 0.98_fp32_b1 0.98 130 --tune-budget 0.3 --dtype float32 ;;
  *) echo "usage: $0 a|b|c|tests"; exit 2 ;;
esac
ls "$OUT"
