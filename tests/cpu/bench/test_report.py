"""bench/report.py: what every benchmark file carries."""
def test_model_results_carry_the_summary_keys_of_every_benchmark_file():
    from sparseforge.bench.report import model_summary_keys

    linear = model_summary_keys({"model": "llama", "speedup_vs_cublas": 1.15})
    cnn = model_summary_keys({"model": "rn50", "speedup_vs_cudnn": 3.0, "geomean_speedup_vs_cublas": None})
    assert linear["geomean_speedup_vs_cublas"] == 1.15 and "geomean_speedup_vs_cudnn" not in linear
    assert cnn["geomean_speedup_vs_cudnn"] == 3.0 and "geomean_speedup_vs_cublas" not in cnn
    assert model_summary_keys({"speedup_vs_cublas": 2.0, "geomean_speedup_vs_cublas": 1.5})["geomean_speedup_vs_cublas"] == 1.5


def test_provenance_names_the_timing_protocol():
    # results timed before the held stream (some with host stalls counted) have no "timing" key: the key is
    # what tells a reader which files to trust
    from sparseforge.bench.report import provenance
    from sparseforge.runtime.timing import TIMING_PROTOCOL

    info = provenance(["sparseforge", "bench"])
    assert info["timing"] == TIMING_PROTOCOL and "held" in TIMING_PROTOCOL
    assert info["command"] == "sparseforge bench"


def test_a_model_run_over_its_bound_fails_and_names_the_dense_models_own_error(tmp_path, capsys):
    import json

    from sparseforge.bench.report import finish_model_run

    result = {"model": "rn50", "speedup_vs_cudnn": 1.0, "rel_error_vs_float64": 2.6e-2, "error_ok": False,
              "dense_rel_error_vs_float64": 2.7e-2}
    assert finish_model_run(tmp_path / "r.json", result, "report", "rn50 float16") == 1  # the bound still fails
    out = capsys.readouterr().out
    assert "rel. error vs float64 2.6e-02 (FAIL; the dense model's own 2.7e-02)" in out
    assert json.loads((tmp_path / "r.json").read_text())["geomean_speedup_vs_cudnn"] == 1.0
    result.update(rel_error_vs_float64=1e-5, error_ok=True, dense_rel_error_vs_float64=None)
    assert finish_model_run(tmp_path / "r.json", result, "report", "rn50 float32") == 0
    assert "(ok)" in capsys.readouterr().out
