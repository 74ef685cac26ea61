"""The decode prototypes under benchmarks/proto/ stay runnable while no GPU runs them: each bench's CPU
emulation of its kernel matches the dense product, and each kernel compiles for sm_90 without spilling."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO = Path(__file__).resolve().parents[3] / "benchmarks" / "proto"


@pytest.mark.parametrize("bench", ["rowlane_walk_bench.py", "bitmap_walk_bench.py"])
def test_the_emulation_matches_the_dense_product(bench):
    done = subprocess.run([sys.executable, bench, "--check"], cwd=PROTO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "emulation matches the dense product in every case" in done.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("defines", [["-DPF=4"], ["-DPF=8", "-DWARPS=8"], ["-DBF16", "-DPF=4"]])
def test_the_rowlane_kernel_compiles_without_spills(tmp_path, defines):
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v",
                           *defines, "rowlane_walk.cu"], cwd=PROTO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spills and not any(spills), done.stderr
