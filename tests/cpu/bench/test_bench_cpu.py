import json
import math

from sparseforge.bench.report import geomean, plot, summarize
from sparseforge.cli import main
from sparseforge.suite import SAMPLE_DIR


def test_bench_cpu_mode_checks_plans_and_assembles(tmp_path, capsys):
    target = SAMPLE_DIR / "rn50/magnitude_pruning/0.95/initial_conv.smtx"
    out = tmp_path / "r.json"
    assert main(["bench", str(target), "--layout", "both", "--out", str(out), "--cpu"]) == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu" and len(data["cases"]) == 2
    for record in data["cases"]:
        assert record["reference_rel_error"] < 1e-12 and record["cubin_bytes"] > 0
    assert "Timings need an NVIDIA GPU" in capsys.readouterr().out


def test_geomean_and_summary():
    assert math.isclose(geomean([2.0, 8.0]), 4.0)
    records = [{"model": "rn50", "sparsity": 0.9, "dtype": "float32", "layout": "kn", "batch": 1,
                "sparseforge_us": 1.0, "error_ok": True, "speedup_vs_cublas": s, "speedup_vs_cusparse": 10.0}
               for s in (1.0, 4.0)]
    row = summarize(records)[0]
    assert math.isclose(row["geomean_speedup_vs_cublas"], 2.0) and row["all_correct"]


def test_plot_writes_png(tmp_path):
    records = [{"dtype": "float32", "layout": "kn", "sparseforge_us": 2.0, "cublas_us": 8.0,
                "speedup_vs_cublas": 4.0}]
    plot(tmp_path / "p.png", records)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
