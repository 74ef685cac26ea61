#!/usr/bin/env bash
# The GPU machine's one entry point: set-up, then the named stages in order, results under $OUT.
#
#   bash benchmarks/run_device.sh STAGE [STAGE ...]
#
# Stages (each step runs under `timeout`; a benchmark rewrites its JSON after every case, so a cut step keeps
# what it measured):
#   probe         GPU, driver, ptxas, torch and cuSPARSELt versions
#   tests         the whole tests/gpu suite (16 xdist workers: 366 s on one H200, more than 430 s on another), then
#                 the tests that time (marker serial) alone; GPU_TESTS names some of its files instead (those the code
#                 changed since the last whole run touches); GPU_TESTS_SHARD=k/n runs every n-th file from the k-th,
#                 so that the suite spreads over n commands (1/2 then 2/2); GPU_TESTS_ARGS adds pytest options
#                 (e.g. "-v --durations=20": which test ran how long)
#   sample        `sparseforge bench` on the bundled 24-matrix DLMC sample, every dtype
#   spmm          DLMC ResNet-50 layers at batch $BATCH, $SPARSITIES x $DTYPES (the chooser, kn)
#   transformer   the DLMC Transformer layer-0 matrices (16 a sparsity) at N = 256, $SPARSITIES x $DTYPES, kn
#   decode        Llama-shaped layers at 50 / 70 / 90% for each width in $WIDTHS and dtype in $DTYPES16
#                 ($SHAPES), weights timed both resident in L2 and rotated through HBM
#   decode_table  the decode chooser's table: every width in $TABLE_NS ("1,2,4,8,16,32,64") x dtype in $TABLE_DTYPES
#                 ("fp16,bf16") on $TABLE_SHAPES (the three Llama shapes) at 50 / 70 / 90%, X as N x K, one `bench`
#                 process (one compile pool), width by width; weights timed resident in L2 and rotated through HBM
#   decode_heldout  the decode chooser on what its mechanisms were not tuned on: Wanda's per-row masks (skewed
#                 columns) on the Llama shapes, then Qwen2-7B's shapes, at 50 / 70 / 90%, N = 1 then 8, fp16, X as
#                 N x K, weights rotated
#   designs       every decode candidate side by side (benchmarks/designs.py --rotate), $DTYPES16
#   conv          direct convolution against cuDNN: DLMC ResNet-50 3x3 + stem ($SPARSITIES x $DTYPES),
#                 VGG-16 and the text CNN at 90%
#   compile_time  cold and warm compile time of the cost model's pick: rn50 90% SpMM, then its convolutions
#   rn50          ResNet-50 end to end (benchmarks/model_rn50.py), $SPARSITIES x $DTYPES at batch $BATCH
#                 (16-bit runs channels_last); conversion seconds cold (an empty cache) and warm
#   llama         a 2-layer Llama decoder at Llama-3-8B widths, 70% and 2:4, fp16 (benchmarks/model_llama.py)
#   llama_hf      transformers' Llama-3-8B (32 layers, seeded weights) at 70% then 50%, fp16, batch 1 and 8, context
#                 128: conversion cold and warm, memory, one decode step each side, generate of 128 tokens
#                 (benchmarks/llama_hf_decode.py; its phases' times in the log as they end; LLAMA_HF_S 560 unless set)
#   llama_hf_b1   the same converted for batch 1 alone (a batch-1 deployment: one format a layer), 70%, 50%, then 2:4
#                 (LLAMA_HF_PATTERNS picks some of them; LLAMA_HF_DTYPE bfloat16 for bf16; LLAMA_HF_GENERATE 0 skips
#                 generate)
#   llama_hf_24   llama_hf_b1 for 2:4 alone, its decode step only (one conversion, no generate): the shortest 2:4 run
#   llama_hf_deferred  llama_hf_b1 at 70% (LLAMA_HF_PATTERNS) whose generate defers transformers' stop check on the
#                 GPU too (--deferred-stop: no host sync a token); where the image's transformers lacks the check,
#                 the wheels in .whl/transformers/ (transformers 5.25 and the versions it needs) for this stage alone
#   generate_host  where the host's time goes in generate, dense against converted at 70% (the 8B widths, $GEN_LAYERS
#                 layers, default 8; cProfile's top functions, sparseforge's calls a token: generate_host_profile.py)
#   llama_hf_fused  llama_hf_b1 at 70% with fuse_mlp: each MLP's gate and up in one gated kernel
#   llama_hf_memory  llama_hf_b1 with memory_slack 0.07 (a layer may give 7% of its decode time for fewer bytes of
#                 W), 70% then 50%: the decoder Linears' memory against their speed
#   minilm        all-MiniLM-L6-v2's encoder at 80%, fp16, batch $BATCH x 128 tokens (benchmarks/model_minilm.py)
#   host_time     eager host time per call against dense (benchmarks/host_time.py)
#   walk          the nonzero-driven bitmap decode prototypes (benchmarks/proto/bitmap_walk*.cu): ncu, then
#                 the first design, persistent warps (rows) and the transposed-x variant side by side
#   rowlane       the one-row-a-lane bitmap decode (benchmarks/proto/rowlane_walk.cu) at N = 1, fp16: 4096^2 at
#                 50 / 70 / 90% first, then the large shapes
#   delta_runs    the 8-bit-gap run decode prototype (benchmarks/proto/delta_runs.cu) at N = 1, fp16 then bf16
#   delta_trials  delta-runs' configs, every one timed at N = 1; then N = 8's candidates (csr-staged, bitmap-tc);
#                 Llama shapes at 50 / 70 / 90%, fp16, weights rotated (benchmarks/designs.py)
#   bitmap_tc     bitmap-tc's configs beside csr-staged and tc-scatter at N = 8 and 16, X as N x K (a Linear's) then
#                 K x N; Llama shapes at 50 / 70 / 90%, fp16, weights rotated (benchmarks/designs.py)
#   occupancy     bitmap-tc's proposed configs beside the trials that ask for more blocks an SM (fewer registers a
#                 thread) or load B a chunk ahead, N = 8 then 16, X as N x K, the same Llama shapes and protocol;
#                 then K split over blocks on the 1024-row (k / v) and 4096-row shapes at N = 8
#   b_shared      bitmap-tc with B's chunk staged once a block (b_shared) beside tc-scatter, csr-staged and dense at
#                 N = 64, 32, then 16 beside the proposed bitmap-tc configs; X as N x K, the same Llama shapes and
#                 protocol (benchmarks/designs.py)
#   b_shared_profile  ncu on bitmap-tc with B staged a block at N = 64 (its best config, 4096 x 14336 at 70%, fp16)
#   bitmap_tc_probe  which part of bitmap-tc bounds it: the kernel as built, then with B's loads replaced by
#                 register moves or all from one line (L1 hits), the value loads or the stored starts replaced
#                 (benchmarks/proto/bitmap_tc_probe.py; N = 8, X as N x K, fp16, weights rotated; timing only)
#   gemv24        the packed 2:4 GEMV's register-set widths (1, 2, 4 chunks) beside cuBLAS on the Llama shapes,
#                 N in $G24_NS ("1 2 4 8 16"), dtypes $G24_DTYPES ("float16"), weights rotated (benchmarks/gemv24_sets.py)
#   gated_mlp     the Llama MLP's gate and up in one kernel against the pair apart and dense, 14336 x 4096 at
#                 50 / 70 / 90%, fp16, weights rotated: bitmap-tc at N = 8, then delta-runs at N = 1
#                 (benchmarks/gated_mlp.py)
#   timing        graph timing beside busy Python threads, held and unheld; then beside a thread syncing on the
#                 default stream, held on the current stream or on one of its own (benchmarks/timing_contention.py)
#   bench24       2:4 on Sparse Tensor Cores against cuBLAS and torch's semi-structured path
#   minilm24      examples/minilm_24.py on the GPU (needs .minilm/model)
#
# Knobs (environment): DTYPES (default "fp32"), DTYPES16 ("fp16 bf16"), SPARSITIES ("0.9 0.95"), BATCH (1),
# WIDTHS ("1 8 16"), SHAPES ("llama_4096x4096"), TUNE (tune budget in seconds, 0.5), STEP_S (a step's time
# limit, 300), BUDGET_S (the whole invocation's seconds: later steps are cut or skipped; unset: none), OUT (.out);
# TABLE_NS, TABLE_DTYPES, TABLE_SHAPES (decode_table).
#
# Carried, git-ignored inputs: .dlmc/dlmc-subset.tar.xz (the DLMC archive from ../shared/dlmc: every stage but
# probe, tests, sample, decode and the models but rn50), .whl/ (nvmath-python for the image's Python, and
# .whl/fallback/ cuda-pathfinder: the 2:4 path), .minilm/ (minilm24 only).
# The device returns few files from $OUT: the stages' logs and JSON go into one results.tgz at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-.out}; mkdir -p "$OUT/logs"; L=$OUT/logs
DTYPES=${DTYPES:-fp32} DTYPES16=${DTYPES16:-fp16 bf16} SPARSITIES=${SPARSITIES:-0.9 0.95} BATCH=${BATCH:-1}
WIDTHS=${WIDTHS:-1 8 16} SHAPES=${SHAPES:-llama_4096x4096} TUNE=${TUNE:-0.5} STEP_S=${STEP_S:-300}
TABLE_NS=${TABLE_NS:-1,2,4,8,16,32,64} TABLE_DTYPES=${TABLE_DTYPES:-fp16,bf16}
TABLE_SHAPES=${TABLE_SHAPES:-llama_4096x4096 llama_14336x4096 llama_4096x14336}
SF="python3 -m sparseforge"
D=/tmp/dlmc/dlmc
declare -A LONG=([fp32]=float32 [fp16]=float16 [bf16]=bfloat16)

# -- set-up: nvmath-python from the carried wheels (the image lacks it), the DLMC archive unpacked -----------
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
  # nvmath-python wants cuda-pathfinder >= 1.5.1; bring ours only where the image's is older
  python3 -c "from nvmath.bindings import cusparseLt as L; L.init()" 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fallback/*.whl
fi
if [ -f .dlmc/dlmc-subset.tar.xz ] && [ ! -d $D ]; then mkdir -p /tmp/dlmc && tar -xJf .dlmc/dlmc-subset.tar.xz -C /tmp/dlmc; fi

# run NAME CMD...: one step under STEP_S, its output in logs/NAME.log, its last line on stdout
# BUDGET_S (seconds for the whole invocation, set-up included) cuts the last step short and skips those after it,
# so the results tarball is always written inside a device command's limit
START_S=0  # SECONDS counts from the shell's start: the set-up above is inside the budget
run() {
  local name=$1 limit=$STEP_S; shift
  if [ -n "${BUDGET_S:-}" ]; then
    local left=$(( BUDGET_S - (SECONDS - START_S) - 10 ))
    (( left < 20 )) && { echo "$name: skipped, ${BUDGET_S} s budget spent"; return; }
    (( left < limit )) && limit=$left
  fi
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; echo "$name: rc $? | $(tail -1 "$L/$name.log")"
}
need_dlmc() { [ -d $D ] || { echo "stage $1 needs .dlmc/dlmc-subset.tar.xz (carry it)" >&2; return 1; }; }
# the Transformer layer-0 matrices (encoder and decoder) that the N = 256 figures use
tf_subset() {
  local T=/tmp/tf_subset/transformer/magnitude_pruning s
  for s in $SPARSITIES; do mkdir -p $T/$s && cp $D/transformer/magnitude_pruning/$s/body_*layer_0_*.smtx $T/$s/; done
}

stage() {
  case "$1" in
    probe)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
      ptxas --version | tail -1
      python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
      python3 -c "import nvmath; from nvmath.bindings import cusparseLt as L; print('nvmath', nvmath.__version__, \
'cuSPARSELt', L.get_version(L.init()))" || echo "no cuSPARSELt: carry .whl for the 2:4 path" ;;
    tests)
      local files=${GPU_TESTS:-tests/gpu}
      if [ -n "${GPU_TESTS_SHARD:-}" ]; then  # k/n: every n-th file of tests/gpu from the k-th (a part per command)
        local k=${GPU_TESTS_SHARD%/*} n=${GPU_TESTS_SHARD#*/}
        files=$(ls tests/gpu/test_*.py | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
      fi
      STEP_S=${TESTS_S:-480} run gpu_tests python3 -m pytest $files -q -p no:cacheprovider -n 16 \
        --dist worksteal -m "not serial" -rf ${GPU_TESTS_ARGS:-}
      run gpu_tests_serial python3 -m pytest $files -q -p no:cacheprovider -m serial -rf ${GPU_TESTS_ARGS:-} ;;
    sample)
      run sample $SF bench src/sparseforge/data/dlmc_sample --dtype all --tune-budget "$TUNE" --out "$OUT/sample.json" ;;
    spmm)
      need_dlmc spmm || return
      for dt in $DTYPES; do for s in $SPARSITIES; do
        run "rn50_${s}_${dt}_b$BATCH" $SF bench $D/rn50/magnitude_pruning/$s --batch "$BATCH" --dtype "$dt" \
          --tune-budget "$TUNE" --out "$OUT/rn50_${s}_${dt}_b$BATCH.json"
      done; done ;;
    transformer)
      need_dlmc transformer || return
      tf_subset
      for dt in $DTYPES; do for s in $SPARSITIES; do
        run "transformer_${s}_n256_kn_$dt" $SF bench /tmp/tf_subset/transformer/magnitude_pruning/$s --dtype "$dt" \
          --layout kn --tune-budget "$TUNE" --out "$OUT/transformer_${s}_n256_kn_$dt.json"
      done; done ;;
    decode)
      for n in $WIDTHS; do for dt in $DTYPES16; do
        run "decode_n${n}_$dt" $SF bench "llm:0.5,0.7,0.9:${SHAPES// /,}" --n "$n" --dtype "$dt" --tune-budget "$TUNE" \
          --out "$OUT/decode_n${n}_$dt.json"
      done; done ;;
    decode_table)
      run "decode_table_nk" $SF bench "llm:0.5,0.7,0.9:${TABLE_SHAPES// /,}" --n "$TABLE_NS" --dtype "$TABLE_DTYPES" \
        --layout nk --tune-budget "$TUNE" --out "$OUT/decode_table_nk.json" ;;
    decode_heldout)
      for n in 1 8; do
        run "decode_wanda_n${n}_fp16" $SF bench "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336:wanda" \
          --n "$n" --dtype fp16 --layout nk --tune-budget "$TUNE" --out "$OUT/decode_wanda_n${n}_fp16.json"
        run "decode_qwen2_n${n}_fp16" $SF bench "llm:0.5,0.7,0.9:qwen2_3584x3584,qwen2_18944x3584,qwen2_3584x18944" \
          --n "$n" --dtype fp16 --layout nk --tune-budget "$TUNE" --out "$OUT/decode_qwen2_n${n}_fp16.json"
      done ;;
    designs)
      for dt in $DTYPES16; do
        run "designs_decode_$dt" python3 benchmarks/designs.py "$OUT/designs_decode_$dt.json" "$D" \
          $(for n in $WIDTHS; do echo "llm:0.5,0.7,0.9:${SHAPES// /,}/$n"; done) --dtype "${LONG[$dt]}" \
          --mappings csr,csr-staged,tc-scatter,bitmap --rotate
      done ;;
    conv)
      need_dlmc conv || return
      for dt in $DTYPES; do
        for s in $SPARSITIES; do
          run "conv_rn50_${s}_$dt" $SF bench "conv:$D/rn50/magnitude_pruning/$s" --dtype "$dt" --tune-budget "$TUNE" \
            --out "$OUT/conv_rn50_${s}_$dt.json"
        done
        run "conv_vgg16_0.9_$dt" $SF bench conv:vgg16:0.9 --dtype "$dt" --tune-budget "$TUNE" --out "$OUT/conv_vgg16_0.9_$dt.json"
        run "conv_textcnn_0.9_$dt" $SF bench conv:textcnn:0.9 --dtype "$dt" --tune-budget "$TUNE" \
          --out "$OUT/conv_textcnn_0.9_$dt.json"
      done ;;
    compile_time)
      need_dlmc compile_time || return
      run compile_time python3 benchmarks/compile_time.py $D/rn50/magnitude_pruning/0.9 "$OUT/compile_time.json"
      run compile_time_conv python3 benchmarks/compile_time.py conv:$D/rn50/magnitude_pruning/0.9 \
        "$OUT/compile_time_conv_rn50_0.9.json" ;;
    rn50)
      need_dlmc rn50 || return
      for dt in $DTYPES; do for s in $SPARSITIES; do
        local layout=(); [ "$dt" = fp32 ] || layout=(--channels-last)
        run "model_rn50_${s}_${dt}_b$BATCH" python3 benchmarks/model_rn50.py $D/rn50/magnitude_pruning/$s \
          "$OUT/model_rn50_${s}_${dt}_b$BATCH.json" --tune-budget "$TUNE" --dtype "${LONG[$dt]}" --batch "$BATCH" "${layout[@]}"
      done; done ;;
    llama_hf)
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_fp16 python3 benchmarks/llama_hf_decode.py --layers 32 --patterns 0.7,0.5 \
        --dtype float16 --batches 1 8 --contexts 128 --generate 128 --tune-budget 1 --out "$OUT/llama_hf_fp16.json" ;;
    llama_hf_b1)
      local dt=${LLAMA_HF_DTYPE:-float16}
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_b1_$dt python3 benchmarks/llama_hf_decode.py --layers 32 --patterns "${LLAMA_HF_PATTERNS:-0.7,0.5,2:4}" \
        --dtype $dt --batches 1 --contexts 128 --generate ${LLAMA_HF_GENERATE:-128} --tune-budget 1 --out "$OUT/llama_hf_b1_$dt.json" ;;
    llama_hf_24)
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_24_fp16 python3 benchmarks/llama_hf_decode.py --layers 32 --patterns 2:4 \
        --dtype float16 --batches 1 --contexts 128 --generate 0 --tune-budget 1 --no-warm --out "$OUT/llama_hf_24_fp16.json" ;;
    llama_hf_deferred)
      # the image's transformers may lack DeferredStopCheck: then this stage alone imports the carried wheels
      local saved=$PYTHONPATH path=$PYTHONPATH
      if ! python3 -c "from transformers.generation.utils import DeferredStopCheck" 2>/dev/null && \
          ls .whl/transformers/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_tf \
          .whl/transformers/*.whl && path=/tmp/site_tf:$PYTHONPATH
      fi
      export PYTHONPATH=$path
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_deferred_fp16 python3 benchmarks/llama_hf_decode.py --layers 32 \
        --patterns "${LLAMA_HF_PATTERNS:-0.7}" --dtype float16 --batches 1 --contexts 128 --generate 128 --tune-budget 1 \
        --no-warm --deferred-stop --out "$OUT/llama_hf_deferred_fp16.json"
      export PYTHONPATH=$saved ;;
    generate_host)
      run generate_host_profile python3 benchmarks/generate_host_profile.py "$OUT/generate_host_profile.json" \
        --layers ${GEN_LAYERS:-8} --tokens 64 ;;
    llama_hf_memory)
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_memory_fp16 python3 benchmarks/llama_hf_decode.py --layers 32 \
        --patterns 0.7,0.5 --dtype float16 --batches 1 --contexts 128 --generate 0 --tune-budget 1 --memory-slack 0.07 \
        --no-warm --out "$OUT/llama_hf_memory_fp16.json" ;;
    llama_hf_fused)
      STEP_S=${LLAMA_HF_S:-560} run llama_hf_fused_fp16 python3 benchmarks/llama_hf_decode.py --layers 32 --patterns 0.7 \
        --dtype float16 --batches 1 --contexts 128 --generate 128 --tune-budget 1 --fuse-mlp \
        --out "$OUT/llama_hf_fused_fp16.json" ;;
    llama)
      run model_llama_0.7_fp16_b1 python3 benchmarks/model_llama.py "$OUT/model_llama_0.7_fp16_b1.json" --sparsity 0.7 \
        --dtype float16 --tune-budget "$TUNE"
      run model_llama_2of4_fp16_b1 python3 benchmarks/model_llama.py "$OUT/model_llama_2of4_fp16_b1.json" --nm 2:4 \
        --dtype float16 --tune-budget "$TUNE" ;;
    minilm)
      run "model_minilm_0.8_fp16_b$BATCH" python3 benchmarks/model_minilm.py "$OUT/model_minilm_0.8_fp16_b$BATCH.json" \
        --sparsity 0.8 --batch "$BATCH" --tune-budget "$TUNE" ;;
    host_time)
      run host_time python3 benchmarks/host_time.py "$OUT/host_time_fp16.json" --dtype float16 ;;
    walk)
      # the nonzero-driven bitmap decode prototypes at N = 1: an ncu profile of the first design first, then
      # the designs side by side (benchmarks/proto/bitmap_walk_bench.py; fp16, weights rotated)
      PROFILE=1 NS=1 SHAPES=4096x4096 SPS=0.5 PFS=4 WARPS=16 run walk_ncu ncu --kernel-name bitmap_walk \
        --launch-skip 1 --launch-count 1 --set full python3 benchmarks/proto/bitmap_walk_bench.py /tmp/unused.json
      for variant in first rows transposed; do
        VARIANT=$variant NS=1 SHAPES="4096x4096 14336x4096" PFS="4 8" WARPS="8 16" \
          DEFINES=$([ $variant = transposed ] && echo -DSTAGE16) \
          run walk_$variant python3 benchmarks/proto/bitmap_walk_bench.py "$OUT/walk_$variant.json"
      done ;;
    rowlane)
      # the first shape alone first, so a cut step still leaves its figures
      SHAPES=4096x4096 run rowlane_4096 python3 benchmarks/proto/rowlane_walk_bench.py "$OUT/rowlane_4096.json"
      SHAPES="14336x4096 4096x14336 1024x4096" SLICES="256 512 1024" WARPS=4 \
        run rowlane_large python3 benchmarks/proto/rowlane_walk_bench.py "$OUT/rowlane_large.json" ;;
    delta_trials)
      run designs_delta_trials python3 benchmarks/designs.py "$OUT/designs_delta_trials_fp16.json" "$D" \
        "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336,llama_1024x4096/1" --dtype float16 \
        --mappings delta-runs --rotate-all
      run designs_delta_trials_n8 python3 benchmarks/designs.py "$OUT/designs_delta_trials_n8_fp16.json" "$D" \
        "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336/8" --dtype float16 \
        --mappings delta-runs,csr-staged,bitmap-tc --rotate-all ;;
    bitmap_tc)
      for layout in nk kn; do for n in 8 16; do
        run "designs_bitmap_tc_n${n}_$layout" python3 benchmarks/designs.py "$OUT/designs_bitmap_tc_n${n}_${layout}_fp16.json" \
          "$D" "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336/$n" --dtype float16 --layout $layout \
          --mappings bitmap-tc,csr-staged,tc-scatter --rotate-all
      done; done ;;
    occupancy)
      for n in 8 16; do
        run "designs_bitmap_tc_occupancy_n${n}_nk" python3 benchmarks/designs.py \
          "$OUT/designs_bitmap_tc_occupancy_n${n}_nk_fp16.json" "$D" \
          "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336/$n" --dtype float16 --layout nk \
          --mappings bitmap-tc --rotate-all \
          --configs btc_w8s3,btc_w8s2g4,btc_w4s4,btc_w8s2g4o3,btc_w8s2g4o4,btc_w8s2g4o5,btc_w8s3o3,btc_w8s2g8o4,btc_w4s2g4o8,btc_w4s3g4o6,btc_w16s2g4o2,btc_w8s3a1,btc_w8s2g4a1,btc_w4s4a1,btc_w8s2g4o3a1
      done
      run designs_bitmap_tc_k_split_n8_nk python3 benchmarks/designs.py "$OUT/designs_bitmap_tc_k_split_n8_nk_fp16.json" \
        "$D" "llm:0.5,0.7,0.9:llama_1024x4096,llama_4096x4096/8" --dtype float16 --layout nk --mappings bitmap-tc \
        --rotate-all --configs btc_w8s3,btc_w8s2g4,btc_w4s4,btc_w8s3k2,btc_w8s2g4k4,btc_w4s4k4,btc_w8s2g4k8 ;;
    b_shared)
      shared=btc_w8s2g4x,btc_w8s3g4x,btc_w4s3g4x,btc_w4s4g2x,btc_w8s2g4k2x,btc_w8s2g4k4x,btc_w4s3g4k4x,btc_w4s3g4k8x
      for n in 64 32; do
        run "designs_bitmap_tc_b_shared_n${n}_nk" python3 benchmarks/designs.py \
          "$OUT/designs_bitmap_tc_b_shared_n${n}_nk_fp16.json" "$D" \
          "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336/$n" --dtype float16 --layout nk \
          --mappings bitmap-tc,tc-scatter,csr-staged --rotate-all
      done
      run designs_bitmap_tc_b_shared_n16_nk python3 benchmarks/designs.py "$OUT/designs_bitmap_tc_b_shared_n16_nk_fp16.json" \
        "$D" "llm:0.5,0.7,0.9:llama_4096x4096,llama_14336x4096,llama_4096x14336/16" --dtype float16 --layout nk \
        --mappings bitmap-tc --rotate-all --configs "btc_w8s3,btc_w8s2g4,btc_w4s4,$shared" ;;
    b_shared_profile)
      # what bounds B staged a block at N = 64 (0.44x of cuBLAS; as slow at 90% as at 70%, so not W's bytes): an
      # ncu profile of its best config on 4096 x 14336 at 70% (stall reasons, shared-memory wavefronts, tensor pipe)
      run b_shared_ncu ncu --kernel-name "regex:spmm_nk_.*btc_w4s3g4k4x" --launch-skip 3 --launch-count 1 --set full \
        python3 benchmarks/designs.py /tmp/b_shared_ncu.json "$D" "llm:0.7:llama_4096x14336/64" --dtype float16 \
        --layout nk --mappings bitmap-tc --configs btc_w4s3g4k4x ;;
    bitmap_tc_probe)
      for variant in base nob bl1 nolds nostarts nolds_nob nocopy_nolds_nob; do
        run "bitmap_tc_probe_$variant" python3 benchmarks/proto/bitmap_tc_probe.py $variant
      done ;;
    delta_runs)
      WARPS="4 8" US="2 4 8" run delta_runs_fp16 python3 benchmarks/proto/delta_runs_bench.py "$OUT/delta_runs_fp16.json"
      BF16=1 WARPS=8 US="2 4" run delta_runs_bf16 python3 benchmarks/proto/delta_runs_bench.py "$OUT/delta_runs_bf16.json" ;;
    gemv24)
      run gemv24_sets python3 benchmarks/gemv24_sets.py "$OUT/gemv24_sets.json" --ns ${G24_NS:-1 2 4 8 16} \
        --dtypes ${G24_DTYPES:-float16} ;;
    gated_mlp)
      run gated_mlp_n8_fp16 python3 benchmarks/gated_mlp.py "$OUT/gated_mlp_n8_fp16.json" --sparsities 0.5 0.7 0.9 --n 8
      run gated_mlp_fp16 python3 benchmarks/gated_mlp.py "$OUT/gated_mlp_fp16.json" --sparsities 0.5 0.7 0.9 ;;
    timing)
      run timing_contention python3 benchmarks/timing_contention.py ;;
    bench24)
      run bench24 $SF bench24 --out "$OUT/bench24.json" --plot "$OUT/bench24.png" ;;
    minilm24)
      run minilm24 python3 examples/minilm_24.py --device cuda --model-dir .minilm/model --out "$OUT/minilm_24_gpu.json" ;;
    *) echo "unknown stage $1 (see the list at the top of benchmarks/run_device.sh)" >&2; return 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
for s in "$@"; do echo "== $s"; stage "$s" 2>&1 | tee -a "$L/stages.log"; done
# one file back: the device returns at most a few files from $OUT; the JSON stay beside the tarball only where it
# would pass the size a returned file may have
# a second invocation in one command adds to the first's tarball (files of this one win)
( cd "$OUT" && { [ ! -f results.tgz ] || tar xzf results.tgz --skip-old-files; } && tar czf results.tgz logs $(ls *.json *.png 2>/dev/null) \
    && if (( $(stat -c %s results.tgz) < 15000000 )); then rm -rf logs ./*.json ./*.png; else rm -rf logs; fi )
tar tzf "$OUT/results.tgz"
