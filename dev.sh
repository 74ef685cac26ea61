#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs sparseforge, then runs the demo or the tests.
#   bash dev.sh demo   - the main job on the data bundled in the repo
#   bash dev.sh test   - the test suite (CPU tests; GPU tests run where a GPU is present)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SPARSEFORGE_VENV:-.venv}"

setup() {
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # Install torch on its own first, pinned: an open range on a fresh CPU machine pulls a multi-GB CUDA build.
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e ".[test]"
}

demo() {
    local sample=src/sparseforge/data/dlmc_sample out=.out/demo
    mkdir -p "$out"
    "$VENV/bin/sparseforge" info "$sample"
    "$VENV/bin/python" examples/make_demo_model.py "$out/tiny_cnn.safetensors"
    "$VENV/bin/sparseforge" prune "$out/tiny_cnn.safetensors" "$out/tiny_cnn_90.safetensors" --sparsity 0.9
    "$VENV/bin/sparseforge" prune "$out/tiny_cnn.safetensors" "$out/tiny_cnn_24.safetensors" --nm 2:4
    # With a GPU: timings against cuBLAS and cuSPARSE; without: CPU reference checks and ptxas assembly.
    "$VENV/bin/sparseforge" bench "$sample" --out "$out/bench.json" --plot "$out/bench.png"
}

case "${1:-}" in
    demo) setup; demo ;;
    test) setup; shift; "$VENV/bin/python" -m pytest -q "$@" ;;
    *) echo "usage: bash dev.sh demo|test [pytest args]" >&2; exit 2 ;;
esac
