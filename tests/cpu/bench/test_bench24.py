"""`sparseforge bench24` pieces that run without a GPU: argument parsing, summary, plot, the no-GPU error."""
import pytest

from sparseforge.bench.cli import parse_shapes
from sparseforge.bench.semi_report import plot24, summarize24
from sparseforge.cli import main


def test_parse_shapes_groups_and_custom():
    shapes = parse_shapes("bert, 4096x11008")
    assert shapes[:3] == [("bert", 768, 768), ("bert", 3072, 768), ("bert", 768, 3072)]
    assert shapes[3] == ("custom", 4096, 11008)
    assert len(parse_shapes("llama")) == 4
    with pytest.raises(ValueError, match="OUTxIN"):
        parse_shapes("gpt")
    with pytest.raises(ValueError, match="no shapes"):
        parse_shapes(" , ")
    with pytest.raises(ValueError, match="OUT and IN must be >= 1"):  # was accepted, to fail on the GPU
        parse_shapes("0x4096")


def record(group, n, dtype, dense, sparse, fallback, torch_ratio=None, ok=True):
    r = {"group": group, "M": 4096, "K": 4096, "N": n, "dtype": dtype, "dense_us": dense, "sparse24_us": sparse,
         "with_fallback_us": fallback, "speedup_vs_dense": dense / sparse,
         "fallback_speedup_vs_dense": dense / fallback, "error_ok": ok, "decision": "2:4", "rel_error": 1e-3}
    if torch_ratio:
        r["speedup_vs_torch_semi_eager"] = torch_ratio
    return r


def test_summary_geomeans_minimums_and_large_n_rows():
    records = [record("llama", 16, "float16", 10.0, 20.0, 10.0, 50.0),
               record("llama", 2048, "float16", 100.0, 80.0, 80.0, 20.0),
               record("llama", 8192, "float16", 400.0, 250.0, 250.0)]
    rows = {(r["dtype"], r["group"]): r for r in summarize24(records)}
    whole, large = rows[("float16", "llama")], rows[("float16", "llama N>=2048")]
    assert whole["cases"] == 3 and large["cases"] == 2
    assert whole["min_2_4_vs_dense"] == pytest.approx(0.5)
    assert whole["min_with_fallback_vs_dense"] == pytest.approx(1.0)
    assert large["geomean_2_4_vs_dense"] == pytest.approx((1.25 * 1.6) ** 0.5)
    assert whole["geomean_vs_torch_semi_eager"] == pytest.approx((50 * 20) ** 0.5)
    assert large["min_vs_torch_semi_eager"] == pytest.approx(20.0)


def test_summary_flags_wrong_results():
    rows = summarize24([record("bert", 64, "bfloat16", 5.0, 4.0, 4.0, ok=False)])
    assert rows[0]["all_correct"] is False


def test_plot_writes_png(tmp_path):
    records = [record("bert", n, d, 10.0, 8.0, 8.0) for n in (16, 256) for d in ("float16", "bfloat16")]
    plot24(tmp_path / "p.png", records)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bench24_without_gpu_says_so(capsys):
    assert main(["bench24", "--shapes", "bert", "--n", "16"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_summary_reports_the_gemv_where_measured():
    r = record("llama", 1, "float16", 30.0, 24.0, 24.0)
    r.update(gemv24_us=20.0, gemv24_error_ok=True)
    rows = summarize24([r, record("llama", 2048, "float16", 300.0, 230.0, 230.0)])
    whole = next(row for row in rows if row["group"] == "llama")
    assert whole["geomean_gemv24_vs_dense"] == pytest.approx(1.5) and whole["gemv24_all_correct"]


@pytest.mark.parametrize("spec", ["", "0,16", "a,b", "-4"])
def test_bad_widths_are_named_before_looking_for_a_gpu(spec, capsys):
    assert main(["bench24", "--shapes", "bert", "--n", spec]) == 2
    assert "--n needs comma-separated positive widths" in capsys.readouterr().err
