"""`sparseforge bench` refuses, before allocating anything, a case whose dense operands cannot fit."""
from sparseforge.bench import cli as bench_cli
from sparseforge.bench import memory
from sparseforge.suite import SAMPLE_DIR


def test_cpu_mode_refuses_a_matrix_too_wide_for_host_memory(tmp_path, cli_error):
    m, k = 64, 2**30  # a valid int32 pattern with 3 nonzeros whose dense W alone takes 768 GiB in float64
    path = tmp_path / "wide.smtx"
    path.write_text(f"{m}, {k}, 3\n0 1 2 3" + " 3" * (m - 3) + f"\n5 1000000 {k - 1}\n")
    message = cli_error("bench", path, "--cpu", "--n", "4096")
    assert "needs 1.3 TiB of host memory" in message and "W as a dense matrix: 768.0 GiB" in message
    assert "is available; leave this matrix out" in message


def test_gpu_mode_counts_b_and_c_at_large_n_against_free_gpu_memory(monkeypatch, cli_error):
    monkeypatch.setattr(bench_cli, "_gpu_present", lambda: True)
    monkeypatch.setattr(memory, "gpu_bytes_available", lambda: 2**30)
    target = SAMPLE_DIR / "rn50/magnitude_pruning/0.9/initial_conv.smtx"  # 64 x 147
    message = cli_error("bench", target, "--n", str(2**22), "--dtype", "fp16")
    assert "N = 4194304, float16) needs 17.0 GiB of GPU memory" in message and "1.0 GiB is available" in message
