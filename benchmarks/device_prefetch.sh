set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-.out}; mkdir -p "$OUT"
bash benchmarks/device_run.sh probe > "$OUT/probe.log" 2>&1
export PYTHONPATH=src:/tmp/site
D=/tmp/dlmc/dlmc
timeout 150 python3 -m pytest tests/gpu/test_spmm_gpu.py -k "staged or prefetching" tests/gpu/test_spmm_fuzz_gpu.py -q -p no:cacheprovider -n 4 > "$OUT/gpu_prefetch_tests.log" 2>&1; tail -2 "$OUT/gpu_prefetch_tests.log"
for dt in float16 bfloat16; do
  timeout 200 python3 benchmarks/designs.py "$OUT/designs_prefetch_$dt.json" $D \
    "llm:0.5,0.7,0.9:llama_4096x4096/1" "llm:0.5,0.7,0.9:llama_4096x4096/8" "llm:0.5,0.7,0.9:llama_4096x4096/16" "llm:0.9:llama_14336x4096/16" --dtype $dt \
    --mappings csr,csr-staged,tc-scatter,bitmap --rotate > "$OUT/designs_prefetch_$dt.log" 2>&1; grep -v "^    " "$OUT/designs_prefetch_$dt.log" | tail -12
done
