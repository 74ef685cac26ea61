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
    assert parse_llm_spec("llm") == ([0.5, 0.7, 0.9], list(llm.LLM_LAYERS))
    assert parse_llm_spec("llm:0.9") == ([0.9], list(llm.LLM_LAYERS))
    assert parse_llm_spec("llm:0.5,0.7") == ([0.5, 0.7], list(llm.LLM_LAYERS))
    assert parse_llm_spec("llm:0.9:llama_4096x4096") == ([0.9], ["llama_4096x4096"])
    assert parse_llm_spec("llm::bert_768x768,llama_1024x4096") == ([0.5, 0.7, 0.9], ["bert_768x768", SMALL])
    assert [c.N for c in discover("llm:0.9", tokens=64)] == [64] * 5
    assert {c.N for c in discover("llm:0.9", tokens=64, n=3)} == {3}


@pytest.mark.parametrize("spec, problem", [("llm:x", "sparsity 'x'"), ("llm:1.0", "sparsity '1.0'"),
                                           ("llm:0.9:nope", "unknown shape 'nope'"), ("llm:0.9:a:b", "give llm")])
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


def test_bench_cpu_mode_runs_an_llm_case(tmp_path, monkeypatch):
    monkeypatch.setitem(llm.LINEAR_SHAPES, "llama_tiny", (96, 128))  # the CLI path, not the big matrices
    out = tmp_path / "r.json"
    assert main(["bench", "llm:0.9:llama_tiny", "--cpu", "--limit", "1", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["cases"]
    assert record["case"] == "llama/magnitude/0.9/llama_tiny" and record["N"] == 16
    assert record["nnz"] == round(0.1 * 96 * 128) and record["reference_rel_error"] < 1e-12


def test_info_lists_llm_cases(capsys):
    assert main(["info", f"llm:0.9:{SMALL}"]) == 0
    assert f"llama/magnitude/0.9/{SMALL}" in capsys.readouterr().out
