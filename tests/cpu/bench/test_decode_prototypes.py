"""The decode prototypes under benchmarks/proto/ stay runnable while no GPU runs them: each bench's CPU
emulation of its kernel (or read-back of its format) matches the dense product, each kernel compiles for sm_90 without spilling, and the
row-a-lane kernel itself (nvcc's PTX, run by the PTX interpreter) matches float64 into NaN-poisoned outputs."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTO = Path(__file__).resolve().parents[3] / "benchmarks" / "proto"


@pytest.mark.parametrize("bench, says", [
    ("rowlane_walk_bench.py", "emulation matches the dense product in every case"),
    ("bitmap_walk_bench.py", "emulation matches the dense product in every case"),
    ("delta_runs_bench.py", "the format reads back to W in every case"),
])
def test_the_emulation_matches_the_dense_product(bench, says):
    done = subprocess.run([sys.executable, bench, "--check"], cwd=PROTO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert says in done.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("defines", [["-DPF=4"], ["-DPF=8", "-DWARPS=8"], ["-DBF16", "-DPF=4"]])
def test_the_rowlane_kernel_compiles_without_spills(tmp_path, defines):
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v",
                           *defines, "rowlane_walk.cu"], cwd=PROTO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spills and not any(spills), done.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
@pytest.mark.parametrize("warps, m, k, slice_cols, density, dtype", [
    (1, 32, 64, 32, 0.3, "float16"),     # one group, two slices
    (2, 70, 200, 64, 0.3, "float16"),    # a partial group and a partial last slice
    (4, 100, 300, 96, 0.1, "bfloat16"),  # sparse runs: words with no bit, sentinels soon
    (2, 40, 130, 64, 0.9, "float16"),    # dense runs: a warp's longest run near the slice
])
def test_the_rowlane_kernel_matches_float64_in_the_ptx_interpreter(tmp_path, warps, m, k, slice_cols, density,
                                                                    dtype):
    import numpy as np
    import torch

    sys.path.insert(0, str(PROTO))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
    from ptx_interp import launch
    from rowlane_walk_bench import pack

    ptx = tmp_path / "k.ptx"
    defines = [f"-DWARPS={warps}", "-DPF=4"] + (["-DBF16"] if dtype == "bfloat16" else [])
    done = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", "-o", str(ptx), *defines, "rowlane_walk.cu"], cwd=PROTO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    torch.manual_seed(m + k)
    torch_dtype = getattr(torch, dtype)
    w = (torch.randn(m, k) * (torch.rand(m, k) < density)).to(torch_dtype)
    w[1] = 0                      # an empty row
    w[2, :slice_cols] = 1.0        # a full run in the first slice
    p = pack(w.float(), slice_cols)
    x = torch.randn(k).to(torch_dtype)
    bits = (lambda t: t.view(torch.int16).numpy().view(np.uint16))
    want = w.double().numpy() @ x.double().numpy()
    ws, counters = np.zeros(m, np.float32), np.zeros(p["G"], np.uint32)
    smem = 2 * slice_cols * 4 + warps * 2 * (slice_cols // 32) * 32 * 4
    for _ in range(2):  # a second call finds the workspace and counters as the first left them
        y = np.full(m, 0x7FC0 if dtype == "bfloat16" else 0x7E00, np.uint16)  # NaN
        launch(ptx.read_text(), "rowlane_walk", (-(-p["G"] // warps), p["S"], 1), 32 * warps,
               p["bm"].numpy().view(np.uint32), bits(p["vals"].to(torch_dtype)), p["gbase"].numpy(),
               p["off"].numpy().view(np.uint16), bits(x), ws, y, counters, m, k, p["S"], slice_cols,
               shared_bytes=smem)
        got = torch.from_numpy(y.view(np.int16)).view(torch_dtype).double().numpy()
        assert np.isfinite(got).all(), "an output was never written"
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= (5e-3 if dtype == "float16" else 3e-2)
        assert not ws.any() and not counters.any()
