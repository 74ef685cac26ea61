import json
import math

import pytest

from sparseforge.bench.report import geomean, plot, plot_plans, summarize
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
        assert record["fetched_bytes"] >= record["floor_bytes"] > 0  # the plan's predicted traffic, for the plot
    assert "Timings need an NVIDIA GPU" in capsys.readouterr().out


def test_bench_cpu_mode_shows_progress_off_a_terminal_and_plots_the_plans(tmp_path, capsys):
    png = tmp_path / "plans.png"
    assert main(["bench", str(SAMPLE_DIR / "rn50"), "--cpu", "--limit", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out  # captured: not a terminal, where rich's bar shows nothing until the end
    assert "CPU reference + ptxas [1/2] rn50/magnitude_pruning/0.9/bottleneck_1_block_group1_1_1 float32 kn" in out
    assert "CPU reference + ptxas [2/2] " in out and f"wrote {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plans_plot_shows_predicted_traffic_over_the_floor(tmp_path):
    records = [{"dtype": "float32", "layout": layout, "fetched_bytes": 3e6, "floor_bytes": 1e6}
               for layout in ("kn", "nk")]
    plot_plans(tmp_path / "p.png", records)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_bench_refuses_a_missing_output_directory_before_running(tmp_path, option, cli_error):
    target = SAMPLE_DIR / "rn50/magnitude_pruning/0.95/initial_conv.smtx"
    message = cli_error("bench", target, "--cpu", option, tmp_path / "missing" / "r.out")
    assert f"{option} " in message and "does not exist" in message
    assert not (tmp_path / "missing").exists()


def test_geomean_and_summary():
    assert math.isclose(geomean([2.0, 8.0]), 4.0)
    records = [{"model": "rn50", "sparsity": 0.9, "dtype": "float32", "layout": "kn", "batch": 1,
                "sparseforge_us": 1.0, "error_ok": True, "speedup_vs_cublas": s, "speedup_vs_cusparse": 10.0,
                "floor_us": s / 10, "fetched_tbs": s} for s in (1.0, 4.0, 2.0)]
    row = summarize(records)[0]
    assert math.isclose(row["geomean_speedup_vs_cublas"], 2.0) and row["all_correct"]
    assert math.isclose(row["median_floor_fraction"], 0.2) and row["median_fetched_tbs"] == 2.0
    assert row["n"] is None  # no N in the records
    assert "median_sparse_bytes_per_weight" not in row  # not timed with the weights rotated


def test_a_rotated_decode_summary_carries_both_rates_and_the_formats_bytes():
    records = [{"model": "llama", "sparsity": 0.5, "dtype": "float16", "layout": "kn", "batch": 1, "N": 1,
                "sparseforge_us": 1.0, "error_ok": True, "speedup_vs_cublas": 1.2, "speedup_vs_cublas_rotating": r,
                "sparseforge_rotating_tbs": 3.0 * r, "cublas_rotating_tbs": 3.5, "sparse_bytes_per_weight": b}
               for r, b in ((1.1, 1.52), (1.3, 1.27), (1.2, 1.5))]
    row = summarize(records)[0]
    assert math.isclose(row["geomean_speedup_vs_cublas_rotating"], (1.1 * 1.3 * 1.2) ** (1 / 3))
    assert math.isclose(row["median_sparseforge_rotating_tbs"], 3.6) and row["median_cublas_rotating_tbs"] == 3.5
    assert row["median_sparse_bytes_per_weight"] == 1.5 and row["n"] == 1


def test_a_summary_row_names_the_token_count_of_a_decode_run():
    """Decode rows carry n beside model, sparsity, dtype, batch and layout; rows over layers of different
    widths (a model at its own batch sizes, a convolution's pixels) say None instead of one layer's N."""
    def record(n):
        return {"model": "llama", "sparsity": 0.7, "dtype": "float16", "layout": "nk", "batch": 1, "N": n,
                "sparseforge_us": 1.0, "error_ok": True, "speedup_vs_cublas": 2.0}
    assert summarize([record(8), record(8)])[0]["n"] == 8
    assert summarize([record(8), record(16)])[0]["n"] is None


def test_the_summary_counts_dense_where_the_chooser_measured_it_faster():
    """geomean_speedup_chosen_vs_*: what a caller of the chooser gets; a case whose chooser measured dense
    faster counts dense (a convolution: cuDNN in the kernel's own layout), never the slower kernel."""
    spmm = [{"model": "m", "sparsity": 0.9, "dtype": "float16", "layout": "nk", "batch": 1, "error_ok": True,
             "sparseforge_us": us, "cublas_us": 10.0, "speedup_vs_cublas": 10.0 / us, "dense_faster": us > 10.0}
            for us in (5.0, 20.0)]
    for i, r in enumerate(spmm):
        r["case"] = f"c{i}"
    row = summarize(spmm)[0]
    assert math.isclose(row["geomean_speedup_vs_cublas"], 1.0)
    assert math.isclose(row["geomean_speedup_chosen_vs_cublas"], math.sqrt(2.0))
    conv = [{"model": "vgg16", "sparsity": 0.9, "dtype": "float16", "layout": "nhwc", "batch": 8, "error_ok": True,
             "sparseforge_us": 40.0, "cudnn_us": 10.0, "cudnn_nchw_us": 10.0, "cudnn_channels_last_us": 12.5,
             "speedup_vs_cudnn": 0.25, "dense_faster": True, "case": "conv1"}]
    row = summarize(conv)[0]
    assert math.isclose(row["geomean_speedup_vs_cudnn"], 0.25)
    assert math.isclose(row["geomean_speedup_chosen_vs_cudnn"], 0.8)  # cuDNN as the nhwc layer runs it


def test_working_tree_hash_names_the_files_as_they_are(tmp_path):
    import subprocess

    from sparseforge.bench.report import _working_tree_hash

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert _working_tree_hash(tmp_path) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.txt").write_text("two")  # uncommitted edits change it; the index is left alone
    _working_tree_hash.cache_clear()  # hashed once per process otherwise
    assert _working_tree_hash(tmp_path) != git("rev-parse", "HEAD^{tree}")
    assert git("status", "--porcelain") == "M a.txt"


def test_plot_writes_png(tmp_path):
    records = [{"dtype": "float32", "layout": "kn", "sparseforge_us": 2.0, "cublas_us": 8.0,
                "speedup_vs_cublas": 4.0}]
    plot(tmp_path / "p.png", records)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_tables_print_with_and_without_roofline_figures():
    from rich.console import Console

    from sparseforge.bench.cli import _print

    record = {"case": "rn50/x", "dtype": "float32", "layout": "kn", "M": 64, "K": 64, "N": 49, "nnz": 400,
              "config": "r4w2v1b16g1", "sparseforge_us": 3.0, "cublas_us": 6.0, "speedup_vs_cublas": 2.0,
              "speedup_vs_cublas_tf32": 1.5, "cusparse_us": 30.0, "speedup_vs_cusparse": 10.0, "rel_error": 1e-7,
              "error_ok": True, "compile_seconds": 0.2, "model": "rn50", "sparsity": 0.9, "batch": 1,
              "floor_us": 0.3, "fetched_tbs": 1.7}
    console = Console(record=True, width=300)
    _print(console, [record], summarize([record]), gpu=True)
    _print(console, [record], summarize([{k: v for k, v in record.items() if k not in ("floor_us", "fetched_tbs")}]),
           gpu=True)
    text = console.export_text()
    assert "10%" in text and "1.70" in text and "2.00" in text


def test_bench_cpu_mode_on_convolution_cases(tmp_path, capsys):
    """`bench conv:...` without a GPU: each layer's pick assembled, its plan checked against torch's float64
    conv2d on a cropped image, JSON written; options that do not apply to convolutions are refused."""
    import json

    from sparseforge.cli import main

    out = tmp_path / "conv.json"
    assert main(["bench", "conv:textcnn:0.9", "--cpu", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["cases"]
    assert len(records) == 3 and all(r["error_ok"] and r["reference_rel_error"] < 1e-12 for r in records)
    assert all(r["mapping"].startswith("conv-") and r["assemble_seconds"] > 0 for r in records)
    # both mappings were candidates: the csr-columns kernel and the generated one over the bordered input
    assert all({"conv-csr-columns", "conv-row-groups"} <= {c["mapping"] for c in r["choice"]} for r in records)
    assert main(["bench", "conv:vgg16", "--cpu", "--layout", "nk"]) != 0
    assert "do not apply to convolution cases" in capsys.readouterr().err


def test_bench_cpu_mode_on_convolution_cases_in_nhwc(tmp_path, capsys):
    """`bench conv:... --layout nhwc`: the pick planned for channels_last tensors, assembled, its reference
    checked on the cropped image; --layout nchw / nhwc is refused for SpMM cases."""
    import json

    from sparseforge.cli import main

    out = tmp_path / "conv.json"
    assert main(["bench", "conv:textcnn:0.9", "--cpu", "--layout", "nhwc", "--limit", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["cases"]
    assert len(records) == 2 and all(r["layout"] == "nhwc" and r["error_ok"] for r in records)
    assert all(r["reference_rel_error"] < 1e-12 and r["assemble_seconds"] > 0 for r in records)
    capsys.readouterr()
    assert main(["bench", str(SAMPLE_DIR / "rn50/magnitude_pruning/0.9/initial_conv.smtx"), "--cpu", "--layout",
                 "nhwc"]) != 0
    assert "applies to convolution cases" in capsys.readouterr().err


@pytest.mark.parametrize("spec", [str(SAMPLE_DIR / "rn50/magnitude_pruning/0.95/initial_conv.smtx"), "conv:textcnn:0.9"])
@pytest.mark.parametrize("option, value, expected", [
    ("--limit", "0", "--limit 0: give the number of cases to run, >= 1"),  # ran nothing and exited 0
    ("--limit", "-1", "--limit -1: give the number of cases"),  # silently dropped the last case
    ("--tune-budget", "-1", "--tune-budget -1.0: give seconds >= 0"),
    ("--tune-budget", "nan", "--tune-budget nan: give seconds >= 0"),
])
def test_bench_refuses_bad_numbers_before_running(spec, option, value, expected, cli_error):
    assert expected in cli_error("bench", spec, "--cpu", option, value)


def test_several_forced_widths_run_every_case_at_each_and_summarize_a_row_a_width():
    base = {"model": "llama", "sparsity": 0.7, "dtype": "float16", "layout": "nk", "batch": 1,
            "sparseforge_us": 1.0, "error_ok": True, "speedup_vs_cublas_tf32": None, "speedup_vs_cusparse": 9.0}
    records = [{**base, "N": n, "n": n, "speedup_vs_cublas": s} for n, s in ((16, 1.0), (2, 3.0), (16, 4.0), (2, 3.0))]
    rows = summarize(records)
    assert [(row["n"], row["cases"]) for row in rows] == [(2, 2), (16, 2)]  # numeric order, not "16" < "2"
    assert math.isclose(rows[0]["geomean_speedup_vs_cublas"], 3.0) and math.isclose(
        rows[1]["geomean_speedup_vs_cublas"], 2.0)


def test_bench_takes_comma_separated_widths_and_dtypes(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "llm:0.9:llama_1024x4096", "--n", "2,8", "--dtype", "fp16,bf16", "--layout", "nk",
                 "--cpu", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert sorted((c["N"], c["dtype"]) for c in cases) == [(2, "bfloat16"), (2, "float16"), (8, "bfloat16"),
                                                           (8, "float16")]


@pytest.mark.parametrize("option, value", [("--n", "2,x"), ("--n", "0"), ("--n", "4,4"), ("--dtype", "fp8"),
                                           ("--dtype", "fp16,fp16")])
def test_bench_refuses_bad_width_and_dtype_lists(option, value, cli_error):
    message = cli_error("bench", "llm:0.9:llama_1024x4096", "--cpu", option, value)
    assert option in message and repr(value) in message
