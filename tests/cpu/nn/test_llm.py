"""Hugging Face causal LMs on the CPU path (nn/llm.py, saving.py): a tiny seeded LlamaForCausalLM pruned per row
converted for decode widths (1, 8): the decoder Linears replaced and nothing else, logits and greedy tokens those
of the dense pruned model, save / load in this process and in a fresh one, Mistral and Qwen2 alike, and the
errors: the missing extra (transformers hidden), bad arguments, a missing or corrupt directory."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import sparseforge
from sparseforge.nn import DecodeLinear, SparseLinear
from sparseforge.nn.sparse import TimedConfig
from sparseforge.nn.llm import decoder_linear_names, require_transformers
from sparseforge.prune import prune_model
from sparseforge.saving import SavedModelError

from .training import assert_trains_like_dense

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _pruned_lm(config_class: str = "LlamaConfig", model_class: str = "LlamaForCausalLM", **overrides):
    """A seeded tiny causal LM, its attention projections pruned per row to 50%, its MLP to 70%."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**SIZES, **overrides})).eval()
    prune_model(model, sparsity=0.5, scope="row", include=r"^model\.layers\.\d+\.self_attn\.", keep_masks=False)
    prune_model(model, sparsity=0.7, scope="row", include=r"^model\.layers\.\d+\.mlp\.", keep_masks=False)
    return model


@pytest.fixture(scope="module")
def converted():
    """(the dense pruned model, its converted copy, the conversion report)."""
    dense = _pruned_lm()
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(8, 1), policy="sparse", progress=False)
    return dense, model, report


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, new: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def test_every_decoder_linear_is_replaced_and_nothing_else(converted):
    dense, model, report = converted
    want = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert sorted(report.replaced) == sorted(want) and sorted(decoder_linear_names(model)) == sorted(want)
    for name in want:
        module = model.get_submodule(name)
        assert isinstance(module, DecodeLinear) and isinstance(module.inner, SparseLinear)
        assert module.kernel_widths == {1, 8}
        assert torch.equal(module.inner.dense_weight_2d(), dense.get_submodule(name).weight)
    assert type(model.lm_head) is nn.Linear  # a candidate, but nothing of it is pruned
    assert {layer.name: layer.reason for layer in report.layers}["lm_head"] == "nothing pruned: kept dense"
    assert len(report.layers) == 15 and report.tokens == (1, 8) and report.measured == 0
    sparsities = {layer.name.rsplit(".", 1)[-1]: round(layer.sparsity, 2) for layer in report.layers}
    assert sparsities["q_proj"] == 0.5 and sparsities["down_proj"] == 0.7
    assert report.linear_bytes_before > 0 and report.seconds > 0


def test_a_weight_with_a_few_stray_zeros_counts_as_unpruned():
    # a 16-bit cast rounds some random weights to exactly zero: no sparse path pays there, so none is tried
    model = _pruned_lm()
    with torch.no_grad():
        model.lm_head.weight[0, :3] = 0
    report = sparseforge.convert(model, tokens=(1,), policy="sparse", include="lm_head", progress=False)
    assert type(model.lm_head) is nn.Linear and report.replaced == []
    assert report.layers[0].reason.endswith("not pruned, kept dense") and "zeros, under 2.5%" in report.layers[0].reason


def test_logits_equal_the_dense_pruned_models_at_prefill_and_decode_widths(converted):
    dense, model, _ = converted
    with torch.no_grad():
        for ids in (_ids(2, 5), _ids(8, 1, seed=2), _ids(1, 1, seed=3)):  # prefill (10 tokens, dense), decode widths
            got, want = model(ids).logits, dense(ids).logits
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_greedy_generate_gives_the_dense_pruned_models_tokens(converted):
    dense, model, _ = converted
    for ids in (_ids(1, 6), _ids(8, 4, seed=4)):  # decoding at batch 1 and batch 8: both kernel widths
        want = _greedy(dense, ids)
        assert want.shape[1] == ids.shape[1] + 8
        assert torch.equal(_greedy(model, ids), want)


def test_save_and_load_round_trip(converted, tmp_path):
    dense, model, _ = converted
    sparseforge.save(model, tmp_path / "tiny")
    manifest = json.loads((tmp_path / "tiny" / "sparseforge.json").read_text())
    assert manifest["class"] == "LlamaForCausalLM" and manifest["source"] == "transformers"
    record = manifest["modules"]["model.layers.1.mlp.down_proj"]
    assert record["class"] == "DecodeLinear" and record["kernel_widths"] == [1, 8]
    assert record["inner"]["nnz"] == model.model.layers[1].mlp.down_proj.inner.nnz
    loaded = sparseforge.load(tmp_path / "tiny")
    assert sorted(decoder_linear_names(loaded)) == sorted(decoder_linear_names(model))
    assert all(isinstance(loaded.get_submodule(n), DecodeLinear) for n in decoder_linear_names(model))
    assert not any(t.is_meta for t in (*loaded.parameters(), *loaded.buffers()))
    ids = _ids(2, 5)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(_greedy(loaded, _ids(1, 6)), _greedy(dense, _ids(1, 6)))


def test_a_fresh_process_loads_and_generates_the_same_tokens(converted, tmp_path):
    dense, model, _ = converted
    sparseforge.save(model, tmp_path / "tiny")
    script = ("import sys, torch, sparseforge\n"
              "from sparseforge.nn import convert as c\n"
              "c.measure_layer = None  # loading measures nothing: a call would fail\n"
              f"m = sparseforge.load(sys.argv[1])\n"
              f"ids = torch.randint(0, {SIZES['vocab_size']}, (1, 6), generator=torch.Generator().manual_seed(1))\n"
              "print(m.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0].tolist())\n")
    src = str(Path(sparseforge.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tiny")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == _greedy(dense, _ids(1, 6))[0].tolist()


def test_a_pruned_lm_head_is_converted_and_tied_embeddings_survive_saving(tmp_path):
    tied = _pruned_lm(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    model = copy.deepcopy(tied)
    sparseforge.convert(model, tokens=1, policy="sparse", progress=False)
    assert type(model.lm_head) is nn.Linear
    loaded = sparseforge.load(sparseforge.save(model, tmp_path / "tied"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # stored once, tied again
    head = _pruned_lm()
    prune_model(head, sparsity=0.6, scope="row", include=r"^lm_head$", keep_masks=False)
    model = copy.deepcopy(head)
    report = sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False)
    assert isinstance(model.lm_head, DecodeLinear) and "lm_head" in report.replaced
    assert torch.equal(_greedy(model, _ids(1, 6)), _greedy(head, _ids(1, 6)))
    excluded = copy.deepcopy(head)
    report = sparseforge.convert(excluded, tokens=(1,), policy="sparse", exclude=r"lm_head", progress=False)
    assert type(excluded.lm_head) is nn.Linear and len(report.replaced) == 14


@pytest.mark.parametrize("family", [("MistralConfig", "MistralForCausalLM"), ("Qwen2Config", "Qwen2ForCausalLM")])
def test_mistral_and_qwen2_convert_alike(family):
    dense = _pruned_lm(*family)
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False)
    assert len(report.replaced) == 14
    if family[0] == "Qwen2Config":  # q/k/v carry biases there
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = _ids(1, 6)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(_greedy(model, ids, 4), _greedy(dense, ids, 4))


def test_a_plain_module_saves_and_loads_into_a_model_of_its_architecture(tmp_path):
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))  # noqa: E731
    model = make()
    prune_model(model, sparsity=0.6, keep_masks=False)
    x = torch.randn(3, 16)
    sparseforge.convert(model, x, policy="sparse", time_model=False)
    assert isinstance(model[0], SparseLinear)
    with pytest.raises(TypeError, match="pass model="):
        sparseforge.load(sparseforge.save(model, tmp_path / "mlp"))
    loaded = sparseforge.load(tmp_path / "mlp", model=make())
    assert isinstance(loaded[0], SparseLinear) and torch.equal(loaded(x), model(x))


def test_progress_shows_each_layer_with_the_count(capsys):
    calls = []
    model = _pruned_lm()
    sparseforge.convert(model, tokens=(1,), policy="dense", progress=lambda *a: calls.append(a))
    assert len(calls) == 15 and calls[0] == ("model.layers.0.self_attn.q_proj", 0, 15)
    sparseforge.convert(model, tokens=(1,), policy="dense")  # the default: a bar, or a line per layer when piped
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("converting")]
    assert len(lines) == 15 and lines[-1].startswith("converting [15/15]")


def test_bad_arguments_are_refused_with_the_fix():
    model = _pruned_lm()
    with pytest.raises(ValueError, match="CUDA device.*policy='sparse'"):
        sparseforge.convert(model, tokens=(1,))
    with pytest.raises(ValueError, match="positive integers"):
        sparseforge.convert(model, tokens=(0, 8), policy="sparse")
    with pytest.raises(TypeError, match="batch sizes"):
        sparseforge.convert(model, tokens="8", policy="sparse")
    with pytest.raises(TypeError, match="not both"):
        sparseforge.convert(model, _ids(1, 4), tokens=(1,), policy="sparse")
    with pytest.raises(TypeError, match="transformers causal LM"):
        sparseforge.convert(nn.Sequential(nn.Linear(4, 4)), tokens=(1,), policy="sparse")
    assert all(type(model.get_submodule(n)) is nn.Linear for n in decoder_linear_names(model))  # left as it was


def test_load_refuses_a_missing_unfinished_or_corrupt_directory(converted, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        sparseforge.load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no sparseforge.json"):
        sparseforge.load(tmp_path / "empty")
    saved = sparseforge.save(converted[1], tmp_path / "tiny")
    (saved / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(SavedModelError, match="model.safetensors is missing or corrupt"):
        sparseforge.load(saved)
    (saved / "sparseforge.json").write_text("{not json")
    with pytest.raises(SavedModelError, match="sparseforge.json is corrupt"):
        sparseforge.load(saved)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sparseforge.save(converted[1], tmp_path / "no" / "such")


def test_without_transformers_the_error_names_the_extra(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'sparseforge\[llm\]'"):
        require_transformers()
    save_file({}, str(tmp_path / "model.safetensors"))
    (tmp_path / "sparseforge.json").write_text(json.dumps({"format": 1, "class": "LlamaForCausalLM",
                                                           "source": "transformers", "aliases": {}, "modules": {}}))
    with pytest.raises(ImportError, match=r"pip install 'sparseforge\[llm\]'"):
        sparseforge.load(tmp_path)


def test_converting_without_transformers_names_the_extra(monkeypatch):
    model = _pruned_lm()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'sparseforge\[llm\]'"):
        sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in decoder_linear_names(model))


@pytest.mark.parametrize("refused", ["none", "all", "one", "slower", "rebuilt"])
def test_measuring_times_each_shape_once_and_the_others_take_its_decision(monkeypatch, tmp_path, refused):
    """The grouping of policy='measure', its timing stubbed (the GPU tests time it): the first layer of each
    (shape, sparsity) is measured; every other layer of the group compiles its kernel configs (pinned, not
    timed). The first layers' kernels win at 1 token and lose at 8 (1.25x slower), yet win in sum: a decoder
    layer keeps no dense W, so they run at both widths. refused: the kernels refuse the pinned configs for the
    other layers' weights at no width ("none"), at every width ("all") or at one of two ("one"): those layers
    stay dense. "slower": the kernels lose in sum over the widths, so every layer stays dense. "rebuilt": the
    measured layers' own kernels do not build again at 8 tokens, so they stay dense too."""
    from sparseforge.nn import llm
    from sparseforge.semi.decide import DENSE, UNSTRUCTURED, Decision, fixed

    from sparseforge.mappings.csr.plan import CsrConfig

    picked = CsrConfig(warps_per_block=4)
    at_one = 16.0 if refused == "slower" else 10.0  # the kernel's time at 1 token, dense's 20 (25 and 20 at 8)

    class Measured(SparseLinear):
        decisions = property(lambda self: [Decision(1, UNSTRUCTURED, "stub: faster", at_one, 20.0, mode="graph"),
                                           Decision(8, DENSE, "stub: slower", 25.0, 20.0, mode="graph")])

        def fastest_kernel_configs(self):  # what the measured kernels ran: the others compile the same configs
            return {1: picked, 8: picked}

    measured = []

    def measure_layer(name, module, shapes, policy, tune_budget):
        measured.append((name, [tuple(s) for s in shapes], policy))
        layer = llm.LayerReport(name, "Linear", tuple(module.weight.shape), 0.5, shapes, UNSTRUCTURED,
                                reason="stub: unstructured measured faster")
        return layer, Measured.from_dense(module, policy="sparse")

    monkeypatch.setattr(llm, "measure_layer", measure_layer)
    monkeypatch.setattr(llm, "prebuild_layers", lambda *args, **kwargs: 0)
    monkeypatch.setattr(llm, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(llm, "gpu_identity", lambda device: ("stub GPU", 90))
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))  # nothing decided before
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 123)
    # kernels: none on a CPU; a layer built from its group's decision compiles the configs (nothing timed),
    # and the stub says which widths the kernels refuse for its weight (the measured layers' own: none)
    refuses = {"none": set(), "all": {1, 8}, "one": {8}, "slower": set(), "rebuilt": {8}}[refused]

    def prepare(self, ws):
        spared = getattr(self, "_first", False) and refused != "rebuilt"
        self._decided = {n: fixed(n, DENSE, "stub: refused") if n in refuses and not spared
                         else fixed(n, UNSTRUCTURED, "stub") for n in ws}
        return self.decisions

    monkeypatch.setattr(SparseLinear, "prepare", prepare)
    monkeypatch.setattr(SparseLinear, "kernel_configs", lambda self: {  # the pinned configs that built
        n: config for n, config in self.pinned.items() if n in self._decided and self._decided[n].path != DENSE})
    original = llm._kernels_at_every_width

    def kernels_at_every_width(*args):
        with monkeypatch.context() as patched:  # the measured layer's own kernels build: the stub refuses the others'
            patched.setattr(SparseLinear, "_first", True, raising=False)
            return original(*args)

    monkeypatch.setattr(llm, "_kernels_at_every_width", kernels_at_every_width)
    dense = _pruned_lm()
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1, 8), progress=False)
    firsts = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"]
    assert [m[0] for m in measured] == firsts and report.measured == 3 and report.peak_gpu_bytes == 123
    assert measured[0][1:] == ([(1, 256), (8, 256)], "measure")
    reasons = {layer.name: layer.reason for layer in report.layers}
    choices = {layer.name: layer.choice for layer in report.layers}
    member = "model.layers.1.mlp.up_proj"
    if refused == "rebuilt":
        assert report.replaced == [] and choices[firsts[0]] == DENSE
        assert reasons[firsts[0]].endswith("do not build for this weight (stub: refused): kept dense")
    elif refused == "slower":  # 41 us of kernels against 40 of dense: nothing replaced
        assert report.replaced == [] and choices[firsts[0]] == DENSE
        assert reasons[firsts[0]].startswith("its kernels at the decode widths [1, 8] measured 0.98x of dense")
        assert reasons[firsts[0]].endswith("kept dense") and "0.80x at 8 tokens" in reasons[firsts[0]]
    else:
        first = model.get_submodule(firsts[1])
        assert type(first) is DecodeLinear and first.kernel_widths == {1, 8} and first.inner.pinned == \
            {1: picked, 8: picked}
        assert reasons[firsts[1]].startswith("its kernels at the decode widths [1, 8] measured 1.14x faster")
    if refused in ("all", "one"):  # kept dense, and the report says so: no dense W to run a refused width
        assert sorted(report.replaced) == sorted(firsts) and type(model.get_submodule(member)) is nn.Linear
        assert choices[member] == DENSE and reasons[member].startswith(
            "model.layers.0.mlp.gate_proj's kernel configs are refused for this weight")
        assert reasons[member].endswith("kept dense")
    elif refused == "none":
        assert sorted(report.replaced) == sorted(decoder_linear_names(dense))
        assert reasons["model.layers.1.self_attn.v_proj"].startswith("as model.layers.0.self_attn.q_proj measured")
        inner = model.get_submodule(member).inner
        assert model.get_submodule(member).kernel_widths == {1, 8} and inner.pinned == {1: picked, 8: picked}
        assert inner.policy == "sparse" and "compiled here, not timed" in reasons[member]
    with torch.no_grad():
        for ids in (_ids(1, 1), _ids(8, 1), _ids(2, 3)):
            assert torch.allclose(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    if refused == "none":  # the same architecture again: every group's decision from the disk, nothing timed
        again = copy.deepcopy(dense)
        second = sparseforge.convert(again, tokens=(1, 8), progress=False)
        assert len(measured) == 3 and (second.measured, second.reused) == (0, 3)
        assert sorted(second.replaced) == sorted(report.replaced)
        first = {layer.name: layer.reason for layer in second.layers}["model.layers.0.mlp.gate_proj"]
        assert first.startswith("as model.layers.0.mlp.gate_proj (an earlier conversion's decision) measured")
        assert again.get_submodule(member).inner.pinned == {1: picked, 8: picked}
        monkeypatch.setattr(llm, "gpu_identity", lambda device: ("another GPU", 90))  # decided there: measured
        sparseforge.convert(copy.deepcopy(dense), tokens=(1, 8), progress=False)
        assert len(measured) == 6


def test_group_decisions_round_trip_through_the_disk_cache(monkeypatch, tmp_path):
    """What a measured group leaves on disk comes back as the same decision; anything else (another GPU,
    widths, budget, memory slack or bucket, 2:4 against unstructured, a record this version cannot read) is no
    decision: the group is measured."""
    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.nn import llm
    from sparseforge.runtime import KernelCache
    from sparseforge.semi.decide import UNSTRUCTURED

    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    key = ((4096, 4096), False, torch.float16, 0.7, 14, False)
    gpu = ("NVIDIA H200", 90)
    first = llm.LayerReport("model.layers.0.self_attn.q_proj", "Linear", (4096, 4096), 0.7, [[1, 4096], [8, 4096]],
                            UNSTRUCTURED, {"dense": 30.0, UNSTRUCTURED: 20.0}, {UNSTRUCTURED: 20.0}, "csr", "faster")
    configs = {1: CsrConfig(prefetch=True), 8: CsrConfig(columns=8, stage_b=True, ctas=132)}
    llm.store_group_decision(key, (1, 8), (1.0, 0.0), gpu, (first, {1, 8}, configs))
    loaded, widths, again = llm.load_group_decision(key, (1, 8), (1.0, 0.0), gpu)
    assert widths == {1, 8} and again == configs
    assert (loaded.choice, loaded.times_us, loaded.kernel_us, loaded.mapping) == \
        (UNSTRUCTURED, first.times_us, first.kernel_us, "csr")
    other_bucket, two_four = key[:4] + (13, False), key[:5] + (True,)  # a 2:4 W of that sparsity: its own group
    for args in [(key, (1,), (1.0, 0.0), gpu), (key, (1, 8), (2.0, 0.0), gpu), (key, (1, 8), (1.0, 0.07), gpu),
                 (key, (1, 8), (1.0, 0.0), ("NVIDIA H100", 90)), (other_bucket, (1, 8), (1.0, 0.0), gpu),
                 (two_four, (1, 8), (1.0, 0.0), gpu)]:
        assert llm.load_group_decision(*args) is None
    path_key = llm.group_decision_key(key, (1, 8), (1.0, 0.0), gpu)
    KernelCache().put_tuned(path_key, 90, {"widths": [1, 8], "configs": {"1": {"family": "gone", "config": {}}},
                                           "report": {}})
    assert llm.load_group_decision(key, (1, 8), (1.0, 0.0), gpu) is None  # unreadable here: measured again
    # a kernel at fewer widths than the decode widths is no decoder layer's decision (it would densify W there)
    llm.store_group_decision(key, (1, 8), (1.0, 0.0), gpu, (first, {1}, {1: configs[1]}))
    assert llm.load_group_decision(key, (1, 8), (1.0, 0.0), gpu) is None


def test_2of4_group_decisions_keep_their_paths_through_the_disk_cache(monkeypatch, tmp_path):
    """A 2:4 group's record holds the (eager, graph) paths its first layer measured at each width it runs, so
    the group's layers are pinned to them in a later conversion; a record without them (or with a path this
    version does not run) is no decision: the group is measured again."""
    from sparseforge.nn import llm
    from sparseforge.runtime import KernelCache
    from sparseforge.semi.decide import DENSE, GEMV, SPARSE

    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    key = ((14336, 4096), False, torch.float16, 0.5, 10, True)
    gpu, tuning = ("NVIDIA H200", 90), (1.0, 0.0)
    first = llm.LayerReport("model.layers.0.mlp.gate_proj", "Linear", (14336, 4096), 0.5, [[1, 4096], [8, 4096]],
                            SPARSE, {"dense": 40.0, SPARSE: 30.0}, {SPARSE: 30.0}, None, "faster")
    paths = {1: (DENSE, GEMV), 8: (SPARSE, SPARSE)}
    llm.store_group_decision(key, (1, 8), tuning, gpu, (first, {1, 8}, paths))
    loaded, widths, again = llm.load_group_decision(key, (1, 8), tuning, gpu)
    assert widths == {1, 8} and again == paths and loaded.choice == SPARSE
    path_key = llm.group_decision_key(key, (1, 8), tuning, gpu)
    report = {"name": first.name, "sparsity": 0.5, "input_shapes": first.input_shapes, "choice": SPARSE,
              "times_us": first.times_us, "kernel_us": first.kernel_us, "mapping": None, "reason": "faster"}
    KernelCache().put_tuned(path_key, 90, {"widths": [1, 8], "configs": {"1": list(paths[1]), "8": list(paths[8])},
                                           "report": report})
    assert llm.load_group_decision(key, (1, 8), tuning, gpu)[2] == paths  # the record as written here is read
    for configs in ({}, {"1": ["2:4", "2:4"]}, {"1": ["csr", "csr"], "8": ["2:4", "2:4"]}):
        KernelCache().put_tuned(path_key, 90, {"widths": [1, 8], "configs": configs, "report": report})
        assert llm.load_group_decision(key, (1, 8), tuning, gpu) is None


def test_2of4_and_decode_modules_save_and_load_with_their_widths(tmp_path):
    from sparseforge.nn import SparseLinear24

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).half()  # noqa: E731
    model = make()
    prune_model(model, nm="2:4", keep_masks=False)
    model[0] = SparseLinear24.from_dense(model[0], policy="sparse")
    model[1] = DecodeLinear(SparseLinear24.from_dense(model[1]), [1, 4])
    x = torch.randn(4, 32).half()
    with torch.no_grad():
        want = model(x)
        loaded = sparseforge.load(sparseforge.save(model, tmp_path / "m"), model=make())
        assert isinstance(loaded[0], SparseLinear24) and loaded[0].policy == "sparse"
        assert isinstance(loaded[1], DecodeLinear) and loaded[1].kernel_widths == {1, 4}
        assert torch.equal(loaded(x), want)


def test_2of4_paths_pinned_or_measured_save_and_load_pinned(tmp_path):
    """What a 2:4 layer runs at each width (measured, or pinned from its group's first layer) is saved, so a
    loaded model times nothing again; a corrupt record is refused by name."""
    from sparseforge.nn import SparseLinear24
    from sparseforge.saving import SavedModelError
    from sparseforge.semi.decide import DENSE, GEMV, SPARSE

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).half()  # noqa: E731
    model = make()
    prune_model(model, nm="2:4", keep_masks=False)
    model[0] = SparseLinear24.from_dense(model[0])
    model[0].pin({1: (GEMV, GEMV)})
    model[1] = DecodeLinear(SparseLinear24.from_dense(model[1]), [1, 4])
    model[1].inner.chosen_paths = lambda: {4: (DENSE, SPARSE)}  # as a measured runtime reports them
    path = sparseforge.save(model, tmp_path / "m")
    loaded = sparseforge.load(path, model=make())
    assert loaded[0].pinned == {1: (GEMV, GEMV)} and loaded[1].inner.pinned == {4: (DENSE, SPARSE)}
    edited = 0
    for record in (f for f in path.iterdir() if f.suffix == ".json"):
        text = record.read_text()
        if '"2:4-gemv"' in text:
            record.write_text(text.replace('"2:4-gemv"', '"csr"'))
            edited += 1
    assert edited == 1
    with pytest.raises(SavedModelError, match="pinned paths"):
        sparseforge.load(path, model=make())


def test_pinned_configs_save_and_load(tmp_path):
    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).half()  # noqa: E731
    model = make()
    prune_model(model, sparsity=0.7, keep_masks=False)
    pinned = {1: CsrConfig(warps_per_block=2), 8: TcScatterConfig()}
    inner = SparseLinear.from_dense(model[1], policy="sparse")
    inner.pin(pinned)
    model[1] = DecodeLinear(inner, [1, 8])
    loaded = sparseforge.load(sparseforge.save(model, tmp_path / "m"), model=make())
    assert loaded[1].inner.pinned == pinned and loaded[1].inner.policy == "sparse"
    manifest = json.loads((tmp_path / "m" / "sparseforge.json").read_text())
    manifest["modules"] = json.loads(json.dumps(manifest["modules"]).replace('"csr"', '"no-such-family"'))
    (tmp_path / "m" / "sparseforge.json").write_text(json.dumps(manifest))
    with pytest.raises(SavedModelError, match="kernel config is not one this sparseforge version can rebuild"):
        sparseforge.load(tmp_path / "m", model=make())


def test_pin_refuses_what_is_not_a_token_count_and_a_config():
    from sparseforge.mappings.csr.plan import CsrConfig

    layer = SparseLinear.from_dense(nn.Linear(16, 8), policy="sparse")
    with pytest.raises(ValueError, match="token count"):
        layer.pin({0: CsrConfig()})
    with pytest.raises(TypeError):
        layer.pin({1: "csr"})
    layer.pin({2: CsrConfig(unroll=2), np.int64(4): CsrConfig()})  # any integer type, as prepare takes
    assert layer.kernel_args(2)["config"] == CsrConfig(unroll=2) and layer.kernel_args(1)["config"] is None
    assert layer.pinned == {2: CsrConfig(unroll=2), 4: CsrConfig()} and all(type(n) is int for n in layer.pinned)


def test_the_shared_prefill_workspace_serves_calls_in_and_out_of_inference_mode():
    torch.manual_seed(0)
    linears = [nn.Linear(16, 8) for _ in range(2)]
    prune_model(nn.ModuleList(linears), sparsity=0.5, keep_masks=False)
    layers = [DecodeLinear(SparseLinear.from_dense(lin, policy="sparse"), [1]) for lin in linears]
    x = torch.randn(3, 16)  # 3 tokens: not a decode width, so dense from the workspace both layers share
    with torch.inference_mode():
        assert torch.allclose(layers[0](x), linears[0](x), atol=1e-6)
    with torch.no_grad():
        for layer, lin in zip(layers, linears):
            assert torch.allclose(layer(x), lin(x), atol=1e-6)
    assert torch.allclose(layers[1](x), linears[1](x), atol=1e-6)
    assert layers[0].dense_weight().data_ptr() == layers[1].dense_weight().data_ptr()  # one buffer


def test_layers_of_every_shape_share_one_workspace_grown_to_the_largest():
    """Prefill writes each layer's W into one buffer per (dtype, device), read by its matmul before the next
    layer writes: shapes of different sizes in turn stay right, the buffer grows to the largest, and the
    memory counts it once, at that size."""
    from sparseforge.nn.llm import linear_bytes, prefill_workspace_bytes

    torch.manual_seed(0)
    linears = [nn.Linear(16, 8), nn.Linear(16, 40), nn.Linear(40, 16)]
    prune_model(nn.ModuleList(linears), sparsity=0.5, keep_masks=False)
    model = nn.Sequential(*[DecodeLinear(SparseLinear.from_dense(lin, policy="sparse"), [1]) for lin in linears])
    for _ in range(2):  # the second round: the grown buffer serves the smaller shape too
        for layer, lin in zip(model, linears):
            x = torch.randn(3, lin.in_features)
            assert torch.allclose(layer(x), lin(x), atol=1e-6)
    views = [layer.dense_weight() for layer in model]
    assert views[0].data_ptr() == views[1].data_ptr() == views[2].data_ptr()
    assert prefill_workspace_bytes(model) == 40 * 16 * 4
    assert linear_bytes(model, ["0", "1"]) == sum(model[i].device_bytes() for i in (0, 1)) + 40 * 16 * 4
    assert linear_bytes(model, ["0"]) == model[0].device_bytes() + 8 * 16 * 4


def test_prepare_of_a_converted_model_on_a_cpu_names_the_fix(converted):
    _, model, _ = converted
    with pytest.raises(ValueError, match=r"CUDA device: call model.cuda\(\) first"):
        sparseforge.prepare(model, [1])


def test_prepare_fuses_again_the_gated_mlps_a_move_left_unfused(converted, monkeypatch):
    from sparseforge.nn import GatedDecodeMLP

    _, model, _ = converted
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.mlp = GatedDecodeMLP(layer.mlp)
    model.model.layers[1].mlp._fused_widths = frozenset({1})  # still fused: left as it is
    model.model.layers[1].mlp._fused = {1: ("a kernel", None, None)}
    fused = []
    # what a CUDA device would do, scripted: each layer prepared, each fuse() recorded
    monkeypatch.setattr(SparseLinear, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(DecodeLinear, "prepare", lambda self: None)
    monkeypatch.setattr(GatedDecodeMLP, "fuse", lambda self: fused.append(self) or [1])
    sparseforge.prepare(model, [1])
    assert fused == [model.model.layers[0].mlp]


def test_the_workspace_grows_to_the_largest_shape_and_keeps_a_buffer_a_capture_used(monkeypatch):
    from sparseforge.nn import llm

    monkeypatch.setattr(llm, "_WORKSPACES", {})
    monkeypatch.setattr(llm, "_RETIRED", [])
    small = llm.reserve_workspace(8 * 16, torch.float32, torch.device("cpu"))
    assert small[0].numel() == 128 and not small[1]
    assert llm.reserve_workspace(100, torch.float32, "cpu") is small  # fits: the same buffer
    grown = llm.reserve_workspace(640, torch.float32, "cpu")
    assert grown[0].numel() == 640 and llm._RETIRED == []  # the outgrown one is freed: no capture used it
    grown[1] = True  # as when a CUDA graph captured a prefill on it
    larger = llm.reserve_workspace(1000, torch.float32, "cpu")
    assert larger[0].numel() == 1000 and len(llm._RETIRED) == 1 and llm._RETIRED[0] is grown[0]
    assert llm.reserve_workspace(10, torch.float16, "cpu")[0].dtype == torch.float16  # one per dtype
    view = llm._workspace(8, 16, torch.float32, torch.device("cpu"))
    assert view.shape == (8, 16) and view.is_contiguous() and view.data_ptr() == larger[0].data_ptr()


def test_the_workspace_refuses_to_grow_inside_a_capture(monkeypatch):
    from sparseforge.nn import llm

    monkeypatch.setattr(llm, "_WORKSPACES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare the model .* before capturing"):
        llm.reserve_workspace(16, torch.float16, torch.device("cuda"))
    assert llm._WORKSPACES == {}


def test_prefills_of_several_host_threads_take_turns_on_the_shared_workspace():
    """Two threads prefilling layers of different shapes at once: each layer's W stays in the workspace until
    its own matmul is done (a lock from the write to the matmul)."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    linears = [nn.Linear(512, 256), nn.Linear(256, 512)]
    prune_model(nn.ModuleList(linears), sparsity=0.5, keep_masks=False)
    layers = [DecodeLinear(SparseLinear.from_dense(lin, policy="sparse"), [1]) for lin in linears]

    def run(i: int) -> int:
        wrong = 0
        x = torch.randn(3, linears[i].in_features)
        with torch.no_grad():
            want = linears[i](x)
            for _ in range(200):
                wrong += not torch.allclose(layers[i](x), want, atol=1e-5)
        return wrong

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(run, [0, 1])) == [0, 0]


def test_a_2of4_layer_without_its_dense_w_prefills_from_the_shared_workspace():
    """A 2:4 DecodeLinear whose dense W is off the device (its weight stands in host memory: a meta tensor
    here, which holds no values, so that only the packed copy can give W) runs its prefill on the workspace
    of its shape, written by the runtime's packed copy; its memory counts no dense W, the workspace once."""
    from sparseforge.nn import SparseLinear24
    from sparseforge.nn.llm import linear_bytes, prefill_workspace_bytes
    from sparseforge.prune import nm_mask
    from sparseforge.semi.packed import pack_24, unpack_24

    class PackedOnly:  # the runtime after drop_dense: W only as its packed copy
        def __init__(self, weight):
            self.gemv = pack_24(weight)

        def densify(self, out):
            return out.copy_(unpack_24(self.gemv))

        def device_bytes(self):
            return {"compressed": 0, "packed": self.gemv.nbytes, "workspace": 0, "dense": 0}

    model = nn.Sequential()
    weights = []
    for seed in range(2):
        w = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
        weights.append((w * nm_mask(w)).to(torch.float16))
        linear = nn.Linear(64, 32, bias=False).half().requires_grad_(False)
        linear.weight.copy_(weights[-1])
        inner = SparseLinear24.from_dense(linear)
        inner._parameters["weight"] = nn.Parameter(torch.empty(32, 64, dtype=torch.float16, device="meta"),
                                                   requires_grad=False)
        inner._runtime, inner._runtime_key = PackedOnly(weights[-1]), inner._current_key()
        model.append(DecodeLinear(inner, [1]))
    assert all(layer.inner.dense_on_host and layer.uses_workspace for layer in model)
    x = torch.randn(5, 64, dtype=torch.float16)  # 5 tokens: not a decode width, so dense from the workspace
    for layer, w in zip(model, weights):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, w))
    assert model[0].dense_weight().data_ptr() == model[1].dense_weight().data_ptr()  # one buffer
    packed = pack_24(weights[0]).nbytes
    assert model[0].device_bytes() == packed
    assert prefill_workspace_bytes(model) == 32 * 64 * 2
    assert linear_bytes(model, ["0", "1"]) == 2 * packed + 32 * 64 * 2


def test_a_2of4_weight_and_an_unstructured_one_of_its_sparsity_are_different_groups():
    from sparseforge.nn import llm
    from sparseforge.prune import prune_model

    torch.manual_seed(0)
    two_four, unstructured = nn.Linear(64, 32, bias=False).half(), nn.Linear(64, 32, bias=False).half()
    prune_model(two_four, nm="2:4", keep_masks=False)
    prune_model(unstructured, sparsity=0.5, keep_masks=False)
    a, b = llm._group_key(two_four), llm._group_key(unstructured)
    assert a[3] == b[3] == 0.5 and a[5] and not b[5]
    assert llm._group(a) != llm._group(b)
    gpu = ("NVIDIA H200", 90)
    assert llm.group_decision_key(a, (1,), (1.0, 0.0), gpu) != llm.group_decision_key(b, (1,), (1.0, 0.0), gpu)


def test_a_width_between_the_decode_widths_runs_the_next_ones_kernel_on_padded_rows(monkeypatch):
    """tokens=(1, 8), where kernels run (a CUDA device, stubbed here): 4 tokens run the 8-token path on 4 zero
    rows beyond them (nothing dense, nothing new decided), and the result is the layer's; wider inputs (a
    prefill) run dense. Off a CUDA device every width runs dense, the inner layer not called."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    prune_model(linear, sparsity=0.7, keep_masks=False)
    layer = DecodeLinear(SparseLinear.from_dense(linear, policy="sparse"), [1, 8])
    seen = []
    forward = SparseLinear.forward
    monkeypatch.setattr(SparseLinear, "forward", lambda self, x: seen.append(tuple(x.shape)) or forward(self, x))
    x = torch.randn(2, 2, 32)
    with torch.no_grad():
        want = linear(x)
        assert torch.allclose(layer(x), want, atol=1e-6) and torch.allclose(layer(x[:1, :1]), want[:1, :1], atol=1e-6)
        assert seen == []
    monkeypatch.setattr(DecodeLinear, "_runs_kernels", staticmethod(lambda x: True))
    monkeypatch.setattr(DecodeLinear, "dense_weight", lambda self, x=None: linear.weight)
    with torch.no_grad():
        assert torch.allclose(layer(x), want, atol=1e-6) and seen == [(8, 32)]
        assert torch.allclose(layer(x[:1, :1]), want[:1, :1], atol=1e-6) and seen[-1] == (1, 1, 32)
        prefill = torch.randn(3, 5, 32)
        assert torch.allclose(layer(prefill), linear(prefill), atol=1e-6) and len(seen) == 2


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("batch, length", [(1, 1), (4, 1), (8, 1), (4, 5)])
def test_a_converted_model_traces_whole_at_decode_padded_and_prefill_widths(converted, monkeypatch, kernels, batch,
                                                                            length):
    """torch.compile traces every DecodeLinear's choice of path, at a decode width, one between them (batch 4 of
    (1, 8)) and a prefill, with no graph break; `kernels`: as on a CUDA device (stubbed: the inner layers run
    their CPU path)."""
    _, model, _ = converted
    model = copy.deepcopy(model)
    if kernels:
        monkeypatch.setattr(DecodeLinear, "_runs_kernels", staticmethod(lambda x: True))
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(_ids(batch, length))
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]


def test_a_gated_mlp_compiles_fullgraph_at_widths_around_its_fused_one(converted):
    from sparseforge.nn import GatedDecodeMLP

    _, model, _ = converted
    wrapped = GatedDecodeMLP(copy.deepcopy(model.model.layers[0].mlp))
    wrapped._fused_widths = frozenset({8})  # as fuse() leaves it where width 8 fused (on a GPU)
    for n in (1, 4, 20):
        x = torch.randn(1, n, SIZES["hidden_size"])
        torch._dynamo.reset()
        with torch.no_grad():
            want = wrapped(x)
            assert torch.allclose(torch.compile(wrapped, fullgraph=True, backend="eager")(x), want, atol=1e-6)


def test_a_gated_mlp_runs_the_width_its_projections_would_and_fused_only_where_that_width_fused(converted):
    from sparseforge.nn import GatedDecodeMLP

    _, model, _ = converted
    wrapped = GatedDecodeMLP(copy.deepcopy(model.model.layers[0].mlp))
    assert wrapped.gate_proj.kernel_widths == wrapped.up_proj.kernel_widths == frozenset({1, 8})
    wrapped._fused_widths = frozenset({8})  # 8 fused, 1 not: one token keeps the projections' own kernels
    assert [wrapped._gated_width(n) for n in (1, 4, 8, 20)] == [None, 8, 8, None]
    wrapped._fused_widths = frozenset({1, 8})
    assert [wrapped._gated_width(n) for n in (1, 4, 8, 20)] == [1, 8, 8, None]
    wrapped._fused_widths = frozenset({1})  # 4 tokens run at 8 apart: not padded to a fused 1
    assert [wrapped._gated_width(n) for n in (1, 4, 8, 20)] == [1, None, None, None]


def test_each_group_is_measured_once_whatever_its_layers_exact_sparsity():
    from sparseforge.nn.llm import _group_key, first_of_each_group

    torch.manual_seed(0)
    layers = {f"model.layers.{i}.mlp.up_proj": nn.Linear(64, 32, bias=False) for i in range(4)}
    for i, layer in enumerate(layers.values()):  # globally pruned: 70.0%, 70.5%, 71.0%, 71.5%, one bucket
        prune_model(layer, sparsity=0.70 + 0.005 * i, keep_masks=False)
    other = nn.Linear(32, 64, bias=False)
    prune_model(other, sparsity=0.7, keep_masks=False)
    keys = {name: _group_key(layer) for name, layer in layers.items()}
    keys["model.layers.0.mlp.down_proj"] = _group_key(other)
    assert len({keys[name][3] for name in layers}) == 4  # the up projections' exact sparsities all differ
    assert first_of_each_group(keys) == ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]


def test_a_decode_linear_compiles_fullgraph_at_a_padded_width_and_a_prefill(monkeypatch):
    from sparseforge.nn.llm import _next_width

    assert [_next_width(frozenset({8, 1}), n) for n in (0, 1, 4, 8, 20)] == [1, 8, 8, None, None]
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    prune_model(linear, sparsity=0.7, keep_masks=False)
    layer = DecodeLinear(SparseLinear.from_dense(linear, policy="sparse"), [1, 8])
    monkeypatch.setattr(DecodeLinear, "_runs_kernels", staticmethod(lambda x: True))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for n in (3, 20):
        x = torch.randn(n, 32)
        with torch.no_grad():
            assert torch.allclose(compiled(x), linear(x), atol=1e-6)


@pytest.mark.parametrize("kernels", [True, False])
def test_values_being_trained_get_their_gradient_at_decode_padded_and_prefill_widths(monkeypatch, kernels):
    """W's values requiring grad: at a decode width, a width between them and a prefill, values.grad is the
    dense layer's weight gradient at the stored positions, step after step; `kernels`: the path a CUDA device
    takes (stubbed: the inner layer's CPU path)."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16).double()
    prune_model(linear, sparsity=0.7, keep_masks=False)
    layer = DecodeLinear(SparseLinear.from_dense(linear, policy="sparse"), [1, 8])
    if kernels:
        monkeypatch.setattr(DecodeLinear, "_runs_kernels", staticmethod(lambda x: True))
    inner = layer.inner
    stored = (torch.repeat_interleave(torch.arange(16), torch.diff(inner.weight_indptr)), inner.weight_indices.long())
    values = inner.weight_values.requires_grad_(True)
    inputs = (torch.randn(n, 32, dtype=torch.float64) for n in (1, 3, 20, 1))
    assert_trains_like_dense(layer, linear, values, stored, inputs)
    assert inner._dense is None  # W made at each call, from the values of that step


def test_generate_on_a_cpu_leaves_no_layer_a_dense_w_of_its_own(converted):
    """Off a CUDA device every width runs dense from the shared workspace: after generate, no DecodeLinear's
    inner layer holds a dense W (the converted model stays smaller than the dense one)."""
    dense, model, _ = converted
    model = copy.deepcopy(model)
    decoders = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert len(decoders) == 14
    for ids in (_ids(1, 6), _ids(4, 3, seed=2)):  # batch 1 (a decode width), batch 4 (between)
        assert torch.equal(_greedy(model, ids, new=3), _greedy(dense, ids, new=3))
    assert all(m.inner._dense is None for m in decoders)


def test_converting_a_converted_model_again_is_refused_naming_its_widths_and_the_fix(converted):
    from sparseforge.nn.llm import convert_causal_lm

    _, model, _ = converted
    for convert in (lambda: sparseforge.convert(model, tokens=(1, 4), policy="sparse", progress=False),
                    lambda: sparseforge.convert(model, policy="sparse", progress=False),
                    lambda: convert_causal_lm(model, tokens=(1, 8), policy="dense", progress=False)):
        with pytest.raises(ValueError, match=r"already converted for decoding \(decode widths \[1, 8\]\).*"
                                             r"convert the dense model \(reload it\).*sparseforge.prepare"):
            convert()
    assert all(m.kernel_widths == {1, 8} for m in model.modules() if isinstance(m, DecodeLinear))


@pytest.mark.parametrize("delta_runs_at_8, dense_us, switched", [(20.5, (20.0, 28.0), True), (25.0, (20.0, 28.0), False),
                                                             (20.6, (10.4, 20.7), False)])
def test_one_packing_serves_every_width_where_it_costs_no_more_than_the_margin(monkeypatch, delta_runs_at_8, dense_us,
                                                                                switched):
    """The widths' fastest kernels pack W differently (delta-runs at 1 token, tc-scatter at 8): the layer runs
    delta-runs at both, W held once, where its summed time is within the chooser's margin (30.5 us against
    30: switched; 35: the fastest kernel at each width, two packings) and still beats dense by the margin (30.6
    against dense's 31.1, where each width's fastest kernel wins: the fastest kernels, not dense)."""
    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig
    from sparseforge.semi.decide import UNSTRUCTURED

    runs, scatter = DeltaRunsConfig(), TcScatterConfig()
    timed = {1: [TimedConfig(runs, 10.0), TimedConfig(scatter, 14.0)],
             8: [TimedConfig(scatter, 20.0), TimedConfig(runs, delta_runs_at_8)]}
    out, layer, measured = _decided(monkeypatch, timed, {1: runs, 8: scatter}, dict(zip((1, 8), dense_us)), 0.0)
    if switched:
        assert out is not measured and out.pinned == {1: runs, 8: runs}
        assert "(delta-runs: one packing of W for every width)" in layer.reason
        assert layer.times_us[UNSTRUCTURED] == 10.0 + delta_runs_at_8
    else:
        assert out is measured and layer.reason == "stub: faster"


def _decided(monkeypatch, timed: dict, own: dict, dense_us: dict, memory_slack: float, two_four_us=None):
    """_kernels_at_every_width on a stub layer: `timed` {width: [TimedConfig]} the chooser's candidates, `own`
    {width: config} its picks (their times the decisions'), dense's times; (the module it returns, the report)."""
    from sparseforge.nn import llm
    from sparseforge.semi.decide import SPARSE, UNSTRUCTURED, Decision

    own_us = {n: next(t.us for t in timed[n] if t.config == own[n]) for n in own}

    class Measured(SparseLinear):
        decisions = property(lambda self: [Decision(n, UNSTRUCTURED, "stub", own_us[n], dense_us[n], mode="graph")
                                           for n in sorted(own)])

        def fastest_kernel_configs(self):
            return dict(own)

        def timed_configs(self, n):
            return timed[n]

    def prepare(self, ws):  # the pinned configs build (no kernel on a CPU)
        self._decided = {n: Decision(n, UNSTRUCTURED, "stub: pinned") for n in ws}
        return self.decisions

    monkeypatch.setattr(SparseLinear, "prepare", prepare)
    monkeypatch.setattr(llm.SparseLinear24, "from_dense", lambda module, policy: "2:4 module")
    linear = nn.Linear(64, 32, bias=False)
    times = {"dense": sum(dense_us.values()), UNSTRUCTURED: sum(own_us.values())}
    if two_four_us:
        times[SPARSE] = two_four_us
    layer = llm.LayerReport("q", "Linear", (32, 64), 0.7, [[n, 64] for n in sorted(own)], UNSTRUCTURED, times,
                            dict(times), "delta-runs", "stub: faster")
    measured = Measured.from_dense(linear, policy="sparse")
    return llm._kernels_at_every_width(linear, layer, measured, tuple(sorted(own)), None, memory_slack), layer, measured


@pytest.mark.parametrize("memory_slack, g4_us, g4_bytes, picked", [
    (0.07, 10.6, 1270, "g4"), (0.05, 10.6, 1270, "g8"), (0.07, 10.6, None, "g8"), (0.07, 10.6, 1600, "g8"),
    (0.0, 10.1, 1270, "g8")])
def test_memory_slack_takes_the_packing_with_fewer_bytes_within_that_share_of_the_time(monkeypatch, memory_slack,
                                                                                      g4_us, g4_bytes, picked):
    """One decode width: delta-runs with 4-bit gaps (fewer bytes) within memory_slack of the 8-bit kernel's time
    is taken; past it, without its bytes recorded, with more bytes, or with no slack (a tie in time is the
    chooser's own), the chooser's kernel stands."""
    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
    from sparseforge.semi.decide import UNSTRUCTURED

    g8, g4 = DeltaRunsConfig(gap_bits=8), DeltaRunsConfig(gap_bits=4)
    timed = {1: [TimedConfig(g8, 10.0, 1500), TimedConfig(g4, g4_us, g4_bytes)]}
    out, layer, measured = _decided(monkeypatch, timed, {1: g8}, {1: 20.0}, memory_slack)
    if picked == "g4":
        assert out is not measured and out.pinned == {1: g4}
        assert f"the fewest bytes within memory_slack={memory_slack:g}" in layer.reason
        assert layer.times_us[UNSTRUCTURED] == g4_us
    else:
        assert out is measured and layer.reason == "stub: faster"


def test_memory_slack_weighs_bytes_only_where_it_is_given_and_they_are_known(monkeypatch):
    """Widths whose own kernels pack W twice: with no slack, the fastest single packing within the chooser's
    margin (not the fewest bytes); with a slack, the fewest bytes. An own packing whose bytes are unknown (W as
    code) is never replaced for bytes. A pick that would hand the layer to 2:4 keeps its own kernels."""
    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig
    from sparseforge.plan.config import TileConfig

    g8, g4, scatter = DeltaRunsConfig(gap_bits=8), DeltaRunsConfig(gap_bits=4), TcScatterConfig()
    timed = {1: [TimedConfig(g8, 10.0, 1500), TimedConfig(g4, 10.4, 1270), TimedConfig(scatter, 14.0, 3000)],
             8: [TimedConfig(scatter, 20.0, 3000), TimedConfig(g8, 20.1, 1500), TimedConfig(g4, 20.5, 1270)]}
    own, dense = {1: g8, 8: scatter}, {1: 20.0, 8: 40.0}
    assert _decided(monkeypatch, timed, own, dense, 0.0)[0].pinned == {1: g8, 8: g8}  # 30.1: the fastest
    assert _decided(monkeypatch, timed, own, dense, 0.05)[0].pinned == {1: g4, 8: g4}  # 30.9: fewest bytes
    tile = TileConfig(4, 4, 4)
    coded = {1: [TimedConfig(tile, 10.0, None), TimedConfig(g4, 10.2, 1270)]}
    out, _, measured = _decided(monkeypatch, coded, {1: tile}, {1: 20.0}, 0.07)
    assert out is measured
    slowed = {1: [TimedConfig(g8, 10.0, 1500), TimedConfig(g4, 10.6, 1270)]}
    out, layer, measured = _decided(monkeypatch, slowed, {1: g8}, {1: 20.0}, 0.07, two_four_us=10.3)
    assert out is measured and layer.reason == "stub: faster"  # g8 beats 2:4's 10.3, g4 would not


def test_memory_slack_is_refused_for_models_other_than_causal_lms():
    with pytest.raises(TypeError, match="memory_slack applies to transformers causal LMs .*leave it out"):
        sparseforge.convert(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), policy="dense", memory_slack=0.07)


@pytest.mark.parametrize("value", [-0.1, 0.6, float("nan"), True, "0.05"])
def test_memory_slack_is_a_share_of_the_time(value):
    from sparseforge.nn import llm

    with pytest.raises(ValueError, match="memory_slack is the share of a layer's decode time"):
        llm.check_memory_slack(value)


def test_a_gated_mlp_wraps_the_mlp_computes_the_same_and_survives_saving(converted, tmp_path):
    """GatedDecodeMLP: the MLP's own modules under their names (the same state dict), the MLP's result where no
    gated kernel is built (a CPU: fuse() builds none), wrapped again by load."""
    from sparseforge.nn import GatedDecodeMLP

    _, model, _ = converted
    model = copy.deepcopy(model)
    plain = model.model.layers[0].mlp
    keys = set(plain.state_dict())
    wrapped = GatedDecodeMLP(plain)
    assert wrapped.fuse() == [] and wrapped.fused_widths == [] and set(wrapped.state_dict()) == keys
    x = torch.randn(3, 1, SIZES["hidden_size"])
    with torch.no_grad():
        assert torch.equal(wrapped(x), plain(x))
    model.model.layers[0].mlp = wrapped
    ids = _ids(2, 5)
    with torch.no_grad():
        want = model(ids).logits
    sparseforge.save(model, tmp_path / "gated")
    assert json.loads((tmp_path / "gated" / "sparseforge.json").read_text())["gated_mlps"] == ["model.layers.0.mlp"]
    loaded = sparseforge.load(tmp_path / "gated")
    assert isinstance(loaded.model.layers[0].mlp, GatedDecodeMLP)
    assert not isinstance(loaded.model.layers[1].mlp, GatedDecodeMLP)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    with pytest.raises(TypeError, match="has no gate_proj"):
        GatedDecodeMLP(nn.Linear(4, 4))


def test_fuse_mlp_on_a_cpu_fuses_nothing_and_other_models_refuse_it():
    model = _pruned_lm()
    report = sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False, fuse_mlp=True)
    assert report.fused_mlps == [] and report.as_dict()["fused_mlps"] == []
    with pytest.raises(TypeError, match="fuse_mlp applies to transformers causal LMs"):
        sparseforge.convert(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), policy="sparse", fuse_mlp=True)


def test_the_gated_kernel_is_for_silu_whatever_class_computes_it():
    from sparseforge.nn.llm import _is_silu

    transformers = pytest.importorskip("transformers")
    assert _is_silu(transformers.activations.ACT2FN["silu"]) and _is_silu(nn.SiLU())
    assert not _is_silu(transformers.activations.ACT2FN["gelu"]) and not _is_silu(nn.ReLU())


def test_a_gated_mlp_copies_and_casts_unfused_and_an_in_place_silu_is_recognised(converted):
    from sparseforge.nn import GatedDecodeMLP
    from sparseforge.nn.llm import _is_silu

    _, model, _ = converted
    wrapped = GatedDecodeMLP(copy.deepcopy(model.model.layers[1].mlp))
    kernels = object(), object()  # the projections' kernels a gated kernel was built from (fuse() on a GPU)
    for proj, kernel in zip((wrapped.gate_proj.inner, wrapped.up_proj.inner), kernels):
        proj._refresh()
        proj._paths[1] = kernel
    wrapped._fused, wrapped._fused_widths = {1: ("a kernel", *kernels)}, frozenset({1})
    twin = copy.deepcopy(wrapped)
    assert twin._fused == {} and twin.layer_id != wrapped.layer_id
    wrapped.float()  # already float32: the projections keep their kernels, so the gated one stands
    assert wrapped._fused == {1: ("a kernel", *kernels)} and wrapped._fused_widths == frozenset({1})
    assert wrapped.gate_proj.inner.kernel_at(1) is kernels[0]
    wrapped.double()  # a cast: the projections build their kernels again, the gated one goes
    assert wrapped._fused == {} and wrapped._fused_widths == frozenset()
    wrapped.float()
    assert _is_silu(nn.SiLU(inplace=True))
    x = torch.randn(1, SIZES["hidden_size"])
    assert torch.is_grad_enabled() and not wrapped._records_grad(x)  # nothing requires grad: fused is fine
    assert wrapped._records_grad(x.requires_grad_())  # autograd must see it: the MLP runs unfused
    wrapped.gate_proj.inner.weight_values.requires_grad_()  # values being trained
    assert wrapped._records_grad(torch.randn(1, SIZES["hidden_size"]))
    with torch.no_grad():
        assert not wrapped._records_grad(x)
