"""benchmarks/gated_mlp.py without a GPU: a clear error and no results file."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gated_mlp.py"


def test_the_gated_mlp_benchmark_needs_a_gpu_and_says_so(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gated_mlp", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path / "g.json")]) == 2
    assert "NVIDIA GPU" in capsys.readouterr().err and not (tmp_path / "g.json").exists()
