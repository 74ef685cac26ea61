"""benchmarks/gemv24_sets.py and benchmarks/generate_host_profile.py without a GPU: a clear error and no results
file; a shape the 2:4 GEMV cannot take is refused by name before anything runs."""
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("name,says", [("gemv24_sets", "NVIDIA GPU"), ("generate_host_profile", "CUDA GPU")])
def test_the_benchmark_needs_a_gpu_and_says_so(name, says, tmp_path, capsys):
    assert _load(name).main([str(tmp_path / "out.json")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("shape", ["4096x4100", "4096", "ax16"])
def test_the_set_widths_benchmark_refuses_a_shape_it_cannot_run(shape, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _load("gemv24_sets").main([str(tmp_path / "out.json"), "--shapes", shape])
    assert "MxK with K a multiple of 16" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
