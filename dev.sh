#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs sparseforge, then runs the demo or the tests.
#   bash dev.sh demo   - the main job on data bundled in the repo: prune a small CNN, convert it, check it,
#                        then the kernels on a DLMC sample (timed against cuBLAS on a GPU)
#   bash dev.sh test   - the test suite (CPU tests; GPU tests run where a GPU is present)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SPARSEFORGE_VENV:-.venv}"

setup() {
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # Install torch on its own first, pinned: an open range on a fresh CPU machine pulls a multi-GB CUDA build.
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q torch==2.13.0
    # sparseforge itself, editable, with the test extras and the Hugging Face extra (its CPU tests); skipped where the environment already has them (a
    # shared venv with PYTHONPATH=src, or a second run)
    "$VENV/bin/python" -c "import sparseforge, safetensors, rich, pytest, hypothesis, xdist, transformers" 2>/dev/null \
        || "$VENV/bin/pip" install -q -e ".[test,llm]"
}

demo() {
    local sample=src/sparseforge/data/dlmc_sample out=.out/demo py="$VENV/bin/python"
    local sf=("$py" -m sparseforge) convert_args=(--tune-budget 1)
    mkdir -p "$out"
    "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || convert_args=(--cpu --policy sparse)  # no GPU: nothing to time, the layers' CPU path is checked below
    echo "== 1. a small CNN, pruned to 90% by magnitude"
    "$py" examples/make_demo_model.py weights "$out/tiny_cnn.safetensors"
    "${sf[@]}" prune "$out/tiny_cnn.safetensors" "$out/tiny_cnn_90.safetensors" --sparsity 0.9
    "$py" examples/make_demo_model.py model "$out/tiny_cnn_90.safetensors" "$out/tiny_cnn_90.pt"
    echo "== 2. converted: each Conv2d / Linear measured dense against its sparse kernels (on a GPU), the faster kept"
    "${sf[@]}" convert "$out/tiny_cnn_90.pt" "$out/tiny_cnn_90_sparse.pt" --example-shape 1,3,32,32 \
        "${convert_args[@]}" --report "$out/convert.json"
    echo "== 3. the converted model against the pruned one, float64"
    "$py" examples/make_demo_model.py check "$out/tiny_cnn_90.pt" "$out/tiny_cnn_90_sparse.pt"
    echo "== 4. the kernels on the bundled DLMC sample (24 pruned ResNet-50 / Transformer layers)"
    # With a GPU: each layer's chosen kernel timed against cuBLAS and cuSPARSE; without: each plan checked
    # against float64 on the CPU reference and its PTX assembled by ptxas.
    "${sf[@]}" bench "$sample" --out "$out/bench.json"
}

case "${1:-}" in
    demo) setup; demo ;;
    test) setup; shift
        # every core (xdist; work stealing evens out the few long ptxas and interpreter tests), then the tests
        # that time the GPU, alone. With a GPU, at most a worker per 3 GB of its free memory: each worker holds
        # its own CUDA context and test tensors
        workers=${SPARSEFORGE_TEST_WORKERS:-$("$VENV/bin/python" -c "
import os
n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
try:
    import torch
    if torch.cuda.is_available():
        n = min(n, max(1, int(torch.cuda.mem_get_info()[0] // 3e9)))
except Exception:
    pass
print(n)")}
        # a -m EXPR among the arguments narrows both runs (pytest keeps only the last -m, so it is joined here)
        args=() mark=""
        while [ $# -gt 0 ]; do
            case "$1" in
                -m) mark=$2; shift 2 ;;
                -m=*) mark=${1#-m=}; shift ;;
                *) args+=("$1"); shift ;;
            esac
        done
        parallel=0 serial=0
        "$VENV/bin/python" -m pytest -q -n "$workers" --dist worksteal -m "${mark:+($mark) and }not serial" \
            ${args[@]+"${args[@]}"} || parallel=$?
        "$VENV/bin/python" -m pytest -q -m "${mark:+($mark) and }serial" ${args[@]+"${args[@]}"} || serial=$?
        # 5: the arguments chose no test of that run; the other run's result stands (both 5: nothing chosen)
        [ "$parallel" = 5 ] && [ "$serial" = 5 ] && exit 5
        [ "$parallel" = 5 ] && parallel=0
        [ "$serial" = 5 ] && serial=0
        [ "$parallel" != 0 ] && exit "$parallel"
        exit "$serial" ;;
    *) echo "usage: bash dev.sh demo|test [pytest args]" >&2; exit 2 ;;
esac
