"""benchmarks/llama_hf_decode.py --tiny on the CPU: the script runs end to end on a small Llama and writes the
JSON a GPU run writes (provenance, summary rows with the usual keys, per-context cases)."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_hf_decode.py"


def test_tiny_run_writes_summary_rows_and_cases(tmp_path, capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("llama_hf_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny.json"
    status = script.main(["--tiny", "--patterns", "0.6,2:4", "--batches", "1", "2", "--contexts", "4",
                          "--generate", "3", "--generate-batches", "1", "2", "--out", str(out)])
    assert status == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert {"date", "commit", "command"} <= set(result["provenance"])
    assert [(row["sparsity"], row["batch"]) for row in result["summary"]] == [(0.6, 1), (0.6, 2), ("2:4", 1),
                                                                              ("2:4", 2)]
    for row in result["summary"]:
        assert {"model", "dtype", "layout", "n", "geomean_speedup_vs_cublas", "conversion_seconds_cold",
                "decoder_linear_bytes_before", "decoder_linear_bytes_after"} <= set(row)
        assert row["all_correct"] and row["geomean_speedup_vs_cublas"] > 0 and row["n"] == row["batch"]
    assert len(result["cases"]) == 4 and all(case["generate_tokens_equal"] == 1.0 for case in result["cases"])
    assert all(case["sparseforge_prefill_s"] > 0 and case["dense_tbps"] > 0 for case in result["cases"])
    assert result["notes"] == []
    assert all(p["conversion"]["replaced"] == 14 for p in result["patterns"])
    assert all(p["conversion"]["two_four_paths"] == {} for p in result["patterns"])  # the CPU path: unstructured
    for p in result["patterns"]:  # where the warm conversion's seconds went, the conversion itself at the top
        profile = p["conversion"]["warm_profile"]
        assert len(profile) == 25 and any(" convert" in row["function"] for row in profile[:5])


def test_bad_arguments_stop_before_any_work(capsys):
    spec = importlib.util.spec_from_file_location("llama_hf_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit):
        script.parse_args(["--tiny", "--patterns", "1.5"])
    assert "neither a sparsity" in capsys.readouterr().err


def test_a_16_bit_run_checks_logits_against_a_float32_copy(tmp_path, capsys):
    """16-bit: the converted model's logits against the pruned model's float32 copy, within ERROR_FACTOR of the
    dense 16-bit model's own error (a fixed bound would be bf16's rounding, not the kernels')."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("llama_hf_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny_bf16.json"
    status = script.main(["--tiny", "--dtype", "bfloat16", "--patterns", "0.6", "--batches", "1", "--contexts", "4",
                          "--generate", "0", "--no-warm", "--out", str(out)])
    assert status == 0, capsys.readouterr().out
    (case,) = json.loads(out.read_text())["cases"]
    assert 0 < case["dense_rel_error_vs_float32"] < 0.05 and case["error_ok"]
    assert case["rel_error_vs_float32"] <= script.ERROR_FACTOR * case["dense_rel_error_vs_float32"]



def test_two_four_paths_counts_each_widths_paths_over_the_2of4_layers():
    import torch
    from torch import nn

    from sparseforge.nn import DecodeLinear, SparseLinear24
    from sparseforge.prune import nm_mask

    spec = importlib.util.spec_from_file_location("llama_hf_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class Decided:
        def __init__(self, paths):
            self.paths = paths

        def chosen_paths(self):
            return self.paths

    def layer(paths):
        linear = nn.Linear(32, 16).half()
        with torch.no_grad():
            linear.weight.mul_(nm_mask(linear.weight.float()).half())
        inner = SparseLinear24.from_dense(linear)
        inner._runtime = Decided(paths)
        return DecodeLinear(inner, [1])

    model = nn.Sequential(layer({1: ("dense", "2:4-gemv")}), layer({1: ("dense", "2:4-gemv"), 8: ("2:4", "2:4")}),
                          nn.Linear(16, 16))
    assert script.two_four_paths(model) == {"1: dense / 2:4-gemv": 2, "8: 2:4 / 2:4": 1}


def test_deferred_stop_passes_transformers_rule_off_mps_and_restores_it(capsys):
    """stop_check_deferred: within it, DeferredStopCheck.is_supported answers as on MPS (its own rules: a cache
    it can crop back, never for an assistant model) on a CUDA device too, and its rule is back after; a
    transformers without the check stops the run naming the version and the fix; on the CPU (--tiny) the flag
    is refused before any work (the check records device events)."""
    pytest.importorskip("transformers")
    import torch
    from transformers.generation import utils

    spec = importlib.util.spec_from_file_location("llama_hf_decode", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit):
        script.parse_args(["--tiny", "--deferred-stop"])
    assert "runs on a GPU" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as patch:  # a transformers without the check
        patch.delattr(utils, "DeferredStopCheck", raising=False)
        with pytest.raises(SystemExit, match="DeferredStopCheck.*upgrade"), script.stop_check_deferred(True):
            pass
    checker = getattr(utils, "DeferredStopCheck", None)
    if checker is None:  # the installed transformers predates it: the refusal above is all there is to check
        return
    original = checker.__dict__["is_supported"]

    class Cache:
        is_croppable = True

    cuda = torch.device("cuda")
    assert not checker.is_supported(cuda, Cache(), True, is_assistant=False)
    with script.stop_check_deferred(True):
        assert checker.is_supported(cuda, Cache(), True, is_assistant=False)
        assert not checker.is_supported(cuda, Cache(), True, is_assistant=True)
        Cache.is_croppable = False
        assert not checker.is_supported(cuda, Cache(), True, is_assistant=False)  # returned, not croppable
    assert checker.__dict__["is_supported"] is original
    with script.stop_check_deferred(False):
        assert checker.__dict__["is_supported"] is original
