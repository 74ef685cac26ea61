import json

import numpy as np
import pytest
import torch

from sparseforge.bench.cli import parse_shapes
from sparseforge.bench.semi import SHAPES
from sparseforge.cli import main
from sparseforge.prune.magnitude import magnitude_mask
from sparseforge.suite import LLMCase, discover, llm_cases, magnitude_prune, parse_llm_spec
from sparseforge.suite import llm

SMALL = "llama_1024x4096"  # the smallest Llama-class layer: 4M weights


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_loaded_case_has_exactly_the_sparsity_it_names(sparsity):
    case = discover(f"llm:{sparsity}:{SMALL}")[0]
    w = case.load(seed=3)
    assert w.shape == (1024, 4096) and w.nnz == case.nnz == round((1 - sparsity) * 1024 * 4096)


def test_same_seed_same_matrix_other_seed_or_shape_another():
    case = llm_cases([0.9], [SMALL])[0]
    assert case.load(seed=1) == case.load(seed=1)
    assert case.load(seed=1) != case.load(seed=2)
    assert not np.array_equal(llm.seeded_weight(8, 16, 0).ravel()[:64], llm.seeded_weight(16, 8, 0).ravel()[:64])


def test_kept_values_are_the_largest_in_magnitude():
    w = llm.seeded_weight(64, 96, 5)
    pruned = magnitude_prune(w, 0.7)
    dense = pruned.to_dense()
    kept = dense != 0
    assert np.array_equal(dense[kept], w[kept])  # values kept as drawn
    assert np.abs(w[kept]).min() >= np.abs(w[~kept]).max()


def test_ties_keep_the_same_entries_as_prune_magnitude_mask():
    w = np.tile(np.array([1.0, -2.0, 2.0, 3.0, -1.0, 2.0], dtype=np.float32), (4, 1))  # many ties at |2| and |1|
    for sparsity in (0.25, 0.5, 0.75):
        expected = magnitude_mask(torch.from_numpy(w), sparsity).numpy()
        assert np.array_equal(magnitude_prune(w, sparsity).to_dense() != 0, expected), sparsity


def test_values_take_the_requested_dtype_with_the_same_pattern():
    case = llm_cases([0.9], ["bert_768x768"])[0]
    half, single = case.load(dtype="float16"), case.load(dtype="float32")
    assert half.dtype == "float16" and np.array_equal(half.indices, single.indices)


def test_cases_are_named_sparsity_major_and_have_no_file():
    cases = discover("llm")
    assert len(cases) == 15 and all(isinstance(c, LLMCase) for c in cases)
    assert [c.sparsity for c in cases[:5]] == [0.5] * 5 and [c.layer for c in cases[:5]] == list(llm.LLM_LAYERS)
    first = cases[0]
    assert (first.model, first.method, first.M, first.K, first.N) == ("llama", "magnitude", 4096, 4096, 16)
    assert str(first.path) == "llm/llama_4096x4096@0.5" and not first.path.exists()
    assert first.name == "llama/magnitude/0.5/llama_4096x4096"


def test_spec_parsing():
    mag = ["magnitude"]
    assert parse_llm_spec("llm") == ([0.5, 0.7, 0.9], list(llm.LLM_LAYERS), mag)
    assert parse_llm_spec("llm:0.9") == ([0.9], list(llm.LLM_LAYERS), mag)
    assert parse_llm_spec("llm:0.5,0.7") == ([0.5, 0.7], list(llm.LLM_LAYERS), mag)
    assert parse_llm_spec("llm:0.9:llama_4096x4096") == ([0.9], ["llama_4096x4096"], mag)
    assert parse_llm_spec("llm::bert_768x768,llama_1024x4096") == ([0.5, 0.7, 0.9], ["bert_768x768", SMALL], mag)
    assert parse_llm_spec("llm:0.5::wanda,magnitude") == ([0.5], list(llm.LLM_LAYERS), ["wanda", "magnitude"])
    assert [c.N for c in discover("llm:0.9", tokens=64)] == [64] * 5
    assert {c.N for c in discover("llm:0.9", tokens=64, n=3)} == {3}


@pytest.mark.parametrize("spec, problem", [("llm:x", "sparsity 'x'"), ("llm:1.0", "sparsity '1.0'"),
                                           ("llm:0.9:nope", "unknown shape 'nope'"),
                                           ("llm:0.9::sparsegpt", "unknown pruning method 'sparsegpt'"),
                                           ("llm:0.9:a:b:c", "give llm")])
def test_spec_errors_name_the_problem_and_what_is_valid(spec, problem):
    with pytest.raises(ValueError, match=problem) as err:
        discover(spec)
    assert "llama_4096x4096" in str(err.value) and "0.5,0.7,0.9" in str(err.value)


def test_a_path_named_llm_is_still_a_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="llm\\[:sparsities"):
        discover(tmp_path / "llm")


def test_bench24_takes_its_shapes_from_the_suite_list():
    assert SHAPES == {"bert": [(768, 768), (3072, 768), (768, 3072)],
                      "llama": [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)]}
    assert SHAPES == {group: [llm.LINEAR_SHAPES[name] for name in names] for group, names in llm.BENCH24_GROUPS.items()}
    assert parse_shapes("bert")[0] == ("bert", 768, 768)
    assert all(llm.LINEAR_SHAPES[name] for name in llm.LLM_LAYERS)


@pytest.mark.parametrize("method, name, nnz", [("", "llama/magnitude", round(0.1 * 96 * 128)),
                                               (":wanda", "llama_wanda/wanda", 96 * (128 - round(0.9 * 128)))])
def test_bench_cpu_mode_runs_an_llm_case(tmp_path, monkeypatch, method, name, nnz):
    monkeypatch.setitem(llm.LINEAR_SHAPES, "llama_tiny", (96, 128))  # the CLI path, not the big matrices
    out = tmp_path / "r.json"
    assert main(["bench", f"llm:0.9:llama_tiny{method}", "--cpu", "--limit", "1", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["cases"]
    assert record["case"] == f"{name}/0.9/llama_tiny" and record["N"] == 16
    assert record["nnz"] == nnz and record["reference_rel_error"] < 1e-12


def test_info_lists_llm_cases(capsys):
    assert main(["info", f"llm:0.9:{SMALL}"]) == 0
    assert f"llama/magnitude/0.9/{SMALL}" in capsys.readouterr().out


def test_wanda_cases_keep_each_rows_loudest_products_and_skew_the_columns():
    """Per row exactly K - round(sKt) entries, the largest |w_ij| * s_j (s: the seeded feature norms); the
    outlier features' columns stay nearly dense where global magnitude pruning keeps every column alike."""
    (case,) = discover("llm:0.7:qwen2_512x3584:wanda")
    assert (case.model, case.method, case.M, case.K) == ("qwen2_wanda", "wanda", 512, 3584)
    assert str(case.path) == "llm/qwen2_512x3584@0.7~wanda" and case.name == "qwen2_wanda/wanda/0.7/qwen2_512x3584"
    w = case.load(seed=4)
    keep = 3584 - round(0.7 * 3584)
    assert w.nnz == case.nnz == 512 * keep and np.all(np.diff(w.indptr) == keep)
    assert w == case.load(seed=4) and w != case.load(seed=5)
    dense, drawn, norms = w.to_dense(), llm.seeded_weight(512, 3584, 4), llm.feature_norms(3584, 4)
    kept = dense != 0
    assert np.array_equal(dense[kept], drawn[kept])
    score = np.abs(drawn) * norms
    assert np.all(np.where(kept, score, np.inf).min(axis=1) >= np.where(kept, -np.inf, score).max(axis=1))
    column_density = kept.mean(axis=0)
    loud = norms > 10 * np.median(norms)
    assert loud.sum() >= 3 and column_density[loud].min() > 0.9  # an outlier feature's column stays
    magnitude = discover("llm:0.7:qwen2_512x3584")[0].load(seed=4).to_dense() != 0
    assert column_density.std() > 3 * magnitude.mean(axis=0).std()


def test_wanda_ties_keep_the_later_column_and_bad_norms_are_refused():
    w = np.tile(np.array([1.0, -1.0, 2.0, 1.0], dtype=np.float32), (2, 1))
    pruned = llm.wanda_prune(w, np.ones(4, np.float32), 0.5).to_dense()
    assert np.array_equal(pruned != 0, np.tile([False, False, True, True], (2, 1)))
    with pytest.raises(ValueError, match="need 4 feature norms"):
        llm.wanda_prune(w, np.ones(3, np.float32), 0.5)
    with pytest.raises(ValueError, match="sparsity must be in"):
        llm.wanda_prune(w, np.ones(4, np.float32), 1.0)


def test_wanda_may_empty_every_row_and_results_name_their_cases():
    """A sparsity that prunes a whole row keeps nothing (as magnitude_prune does); case_of_path reads back
    what results files record, the method included, and refuses what names no case."""
    empty = llm.wanda_prune(np.ones((4, 8), np.float32), np.ones(8, np.float32), 0.95)
    assert empty.nnz == 0 and empty.indptr.tolist() == [0] * 5
    (case,) = discover("llm:0.7:qwen2_512x3584:wanda")
    assert llm.case_of_path(case.path) == case
    assert llm.case_of_path("llm/llama_1024x4096@0.5") == discover("llm:0.5:llama_1024x4096")[0]
    for bad in ("llm/llama_1024x4096@x", "llm/nope@0.5", "llm/llama_1024x4096@0.5~sparsegpt", "rn50/a@0.5"):
        with pytest.raises(ValueError, match="names no LLM case"):
            llm.case_of_path(bad)
    assert len(discover("llm:0.5,0.5:qwen2_512x3584:wanda,wanda")) == 1  # a field named twice: one set
