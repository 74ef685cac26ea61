"""Hugging Face causal LMs on the GPU (nn/llm.py, saving.py): the tiny seeded Llama converted on the kernels
(forced and measured) against the dense pruned model: logits, 32 greedy tokens in float32, generate with the
static KV cache (which transformers compiles: CUDA graphs through the custom ops), save / load onto the GPU;
and one decoder layer at Llama-3-8B widths measured, its logits within 1.5x of the dense fp16 model's error."""
import copy

import pytest
import torch

import sparseforge
from sparseforge.nn import DecodeLinear
from sparseforge.nn.llm import decoder_linear_names
from sparseforge.prune import prune_model

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512)


def _pruned(dtype, sparsity: float = 0.6, **sizes):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **sizes})
    model = transformers.LlamaForCausalLM(config).eval()
    prune_model(model, sparsity=sparsity, scope="row", include=r"^model\.layers\.", keep_masks=False)
    return model.to("cuda", dtype)


def _ids(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).cuda()


def _greedy(model, ids, new: int, **options) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **options)


def test_forced_kernels_give_the_dense_models_logits_and_32_greedy_tokens_in_float32():
    dense = _pruned(torch.float32)
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1, 8), policy="sparse", progress=False)
    assert len(report.replaced) == 14
    reasons = {layer.name: layer.reason for layer in report.layers}  # one choice per shape, the rest pinned
    assert reasons["model.layers.0.mlp.down_proj"] == "policy='sparse'"
    assert reasons["model.layers.1.mlp.down_proj"].endswith("the kernel configs of the first layer of its shape")
    first, second = (model.model.layers[i].mlp.down_proj.inner for i in (0, 1))
    assert second.pinned == first.kernel_configs()
    with torch.no_grad():
        for ids in (_ids(2, 7), _ids(8, 1), _ids(1, 1)):  # prefill (dense workspace), both kernel widths
            got, want = model(ids).logits, dense(ids).logits
            assert ((got - want).norm() / want.norm()).item() < 1e-5
    for ids in (_ids(1, 6), _ids(8, 6, seed=2)):
        assert torch.equal(_greedy(model, ids, 32), _greedy(dense, ids, 32))


def test_generate_with_the_static_cache_and_compilation_matches_dense():
    dense = _pruned(torch.float32)
    model = copy.deepcopy(dense)
    sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False)
    ids = _ids(1, 6)
    want = _greedy(dense, ids, 16, cache_implementation="static")
    assert torch.equal(_greedy(model, ids, 16, cache_implementation="static"), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_measured_conversion_keeps_the_logits_and_measures_each_shape_once(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))  # nothing decided before
    dense = _pruned(dtype, sparsity=0.7)
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1, 8), tune_budget=1.0, progress=False)
    assert report.measured == 3  # q/k/v/o, gate/up, down: 7 Linears x 2 layers, 3 shapes; lm_head is not pruned
    again = copy.deepcopy(dense)  # the same architecture again: its groups' decisions come from the disk
    second = sparseforge.convert(again, tokens=(1, 8), tune_budget=1.0, progress=False)
    assert (second.measured, second.reused) == (0, 3)
    assert [layer.choice for layer in second.layers] == [layer.choice for layer in report.layers]
    with torch.no_grad():  # the same kernels (split-K ones add atomically: the order may differ)
        ids = _ids(1, 5)
        assert torch.allclose(again(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)
    assert report.peak_gpu_bytes and report.linear_bytes_after > 0
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        assert isinstance(module, DecodeLinear) == (layer.choice != "dense"), (layer.name, layer.choice, layer.reason)
        if isinstance(module, DecodeLinear) and layer.choice == "unstructured":  # no dense W: a kernel at each width
            assert module.kernel_widths == {1, 8}, (layer.name, layer.reason)
    replaced = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    for linear, batch in ((linear, batch) for linear in replaced[:1] for batch in (1, 8)):
        # a decode step of either width captures into a CUDA graph (nothing densified in it)
        x = torch.randn(batch, 1, linear.in_features, device="cuda", dtype=dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            linear(x)
            with torch.cuda.graph(graph):
                y = linear(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
    ids = _ids(1, 5)
    with torch.no_grad():
        reference = copy.deepcopy(dense).double()
        for batch in (_ids(1, 1), _ids(8, 1), ids):
            want = reference(batch).logits
            dense_error = ((dense(batch).logits.double() - want).norm() / want.norm()).item()
            error = ((model(batch).logits.double() - want).norm() / want.norm()).item()
            assert error <= 1.5 * dense_error + 1e-4, (error, dense_error)
    loaded = sparseforge.load(sparseforge.save(model, tmp_path / "tiny"), device="cuda")
    assert sorted(decoder_linear_names(loaded)) == sorted(decoder_linear_names(model))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)


def test_one_decoder_layer_at_llama3_8b_widths_within_the_dense_models_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))  # nothing decided before
    sizes = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=1024)
    dense = _pruned(torch.float16, sparsity=0.7, **sizes)
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1,), tune_budget=1.0, progress=False)
    assert report.measured == 4  # q/o (4096 x 4096), k/v (1024 x 4096), gate/up, down; lm_head is not pruned
    reference = copy.deepcopy(dense).double()
    ids = _ids(1, 4, vocab=1024)
    with torch.no_grad():
        want = reference(ids).logits
        dense_error = ((dense(ids).logits.double() - want).norm() / want.norm()).item()
        error = ((model(ids).logits.double() - want).norm() / want.norm()).item()
    assert error <= 1.5 * dense_error + 1e-4, (error, dense_error)
    assert _greedy(model, ids, 8).shape == (1, 12)


def test_prefill_densifies_from_the_kernels_copy_on_the_gpu():
    """A DecodeLinear whose inner layer runs a csr kernel (its CSR buffers then in host memory) fills the
    prefill workspace from the kernel's own device arrays: the dense call's result is the layer's."""
    from torch import nn

    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.nn import SparseLinear

    torch.manual_seed(0)
    linear = nn.Linear(512, 256).cuda().half()
    prune_model(linear, sparsity=0.7, keep_masks=False)
    inner = SparseLinear.from_dense(linear, policy="sparse")
    inner.pin({1: CsrConfig()})
    layer = DecodeLinear(inner, [1])
    layer.prepare()
    assert inner.csr_on_host  # a kernel holds W on the device: the CSR buffers went to the host
    out = torch.full((256, 512), float("nan"), device="cuda", dtype=torch.float16)
    assert inner.densify_into(out) and torch.equal(out, linear.weight.detach())
    x = torch.randn(2, 5, 512, device="cuda").half()  # 10 tokens: a prefill width, dense from the workspace
    with torch.no_grad():
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        got = layer(x).double()
    assert ((got - want).norm() / want.norm()).item() < 5e-3
    kernel = inner.kernel_at(1)
    layer.to("cuda").half()  # where it is already (pipelines move the models they are given): nothing rebuilt
    assert inner.csr_on_host and inner.kernel_at(1) is kernel


def test_a_layers_widths_share_one_device_packing_of_w():
    """Pinned csr configs at two widths are packed on the GPU from the layer's CSR (no host copy) into one
    set of arrays both kernels read: the layer holds W once, and both widths compute the layer."""
    from torch import nn

    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.nn import SparseLinear

    torch.manual_seed(1)
    linear = nn.Linear(1024, 512).cuda().half()
    prune_model(linear, sparsity=0.7, keep_masks=False)
    inner = SparseLinear.from_dense(linear, policy="sparse")
    inner.pin({1: CsrConfig(), 8: CsrConfig(lanes_per_row=8, columns=8)})
    inner.prepare([1, 8])
    nnz = int(torch.count_nonzero(linear.weight))
    held = inner.memory_bytes()
    # one copy of values and indices (4 bytes a slot, rows padded by up to 3 slots), each kernel's rows and bias
    assert nnz * 4 <= held["kernels"] <= (nnz + 3 * 512) * 4 + 2 * (512 * 8 + 512 * 4)
    for n in (1, 8):
        x = torch.randn(n, 1024, device="cuda").half()
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        assert ((inner(x).double() - want).norm() / want.norm()).item() < 5e-3
    layer = DecodeLinear(inner, [1, 8])  # 4 tokens: the 8-token kernel on padded rows, nothing new decided
    x = torch.randn(4, 1, 1024, device="cuda").half()
    with torch.no_grad():
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        assert ((layer(x).double() - want).norm() / want.norm()).item() < 5e-3
    assert sorted(d.n for d in inner.decisions) == [1, 8]


def _pinned_decode_linear(out_features: int, in_features: int, seed: int, dtype, pinned: dict):
    """A DecodeLinear over a 70%-pruned seeded Linear whose widths run the configs `pinned` names."""
    from sparseforge.nn import SparseLinear

    torch.manual_seed(seed)
    dense = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        dense.weight.mul_(torch.rand_like(dense.weight) > 0.7)  # 70% pruned
    layer = SparseLinear.from_dense(dense.to("cuda", dtype), policy="sparse", tune_budget=None)
    layer.pin(pinned)
    return DecodeLinear(layer, tuple(pinned))


def _fused_mlp(dtype, pinned: dict, seeds=(1, 2)):
    """(the Llama-layout MLP, its GatedDecodeMLP, fuse()'s widths): gate / up 2048 x 1024 DecodeLinears running the
    configs `pinned` names at its widths, their kernels built, a dense down projection."""
    from sparseforge.nn import GatedDecodeMLP

    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = (_pinned_decode_linear(2048, 1024, s, dtype, pinned) for s in seeds)
    mlp.down_proj = torch.nn.Linear(2048, 1024, bias=False).to("cuda", dtype)
    mlp.act_fn = torch.nn.SiLU()
    for part in (mlp.gate_proj, mlp.up_proj):
        part.prepare()
    fused = GatedDecodeMLP(mlp)
    return mlp, fused, fused.fuse()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_gated_mlp_runs_gate_and_up_as_one_kernel_in_eager_calls_graphs_and_the_op(dtype):
    """GatedDecodeMLP over delta-runs gate / up layers: fuse() builds the gated kernels at both widths; eager,
    graph-captured and torch.library-op calls give the unfused MLP's result (float64 reference of silu(G x) *
    (U x) through the same down projection)."""
    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig

    mlp, fused, widths = _fused_mlp(dtype, {1: DeltaRunsConfig(), 2: DeltaRunsConfig()})
    assert widths == [1, 2]
    fused.to("cuda").to(dtype)  # where it is already: the gated kernels stand
    assert fused.fused_widths == [1, 2]
    g, u = (p.inner.to_dense().weight.double() for p in (mlp.gate_proj, mlp.up_proj))
    tolerance = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for n in (1, 2):
        x = torch.randn(n, 1, 1024, device="cuda").to(dtype)
        with torch.no_grad():
            want = mlp.down_proj.weight.double() @ ((x.double() @ g.T) * torch.sigmoid(x.double() @ g.T)
                                                    * (x.double() @ u.T)).reshape(n, 2048).T
            eager = fused(x)
            op = torch.ops.sparseforge.gated_mlp(x, mlp.gate_proj.inner.device_anchor, fused.layer_id, 2048)
            graph, out = torch.cuda.CUDAGraph(), None
            fused(x)  # warm
            with torch.cuda.graph(graph):
                out = fused(x)
            graph.replay()
            torch.cuda.synchronize()
        with torch.no_grad():
            compiled = torch.compile(fused, fullgraph=True)(x)  # the op under Dynamo: nothing traced reads kernels
        for got in (eager.reshape(n, 1024).T, out.reshape(n, 1024).T, compiled.reshape(n, 1024).T):
            assert ((got.double() - want).norm() / want.norm()).item() <= tolerance
        y = (x.double() @ g.T) * torch.sigmoid(x.double() @ g.T) * (x.double() @ u.T)
        assert ((op.double() - y).norm() / y.norm()).item() <= tolerance


def test_a_gated_mlp_under_reduce_overhead_compiles_once_a_width_and_is_graphed():
    """torch.compile(mode="reduce-overhead") of a fused GatedDecodeMLP (what transformers' generate does with the
    static cache): one graph a token count, none of them skipped by CUDA graphs, and no recompile after a gated
    kernel is dropped (its call then runs the two projections apart inside the op)."""
    from torch._dynamo.utils import counters

    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig

    dtype = torch.float16
    mlp, fused, widths = _fused_mlp(dtype, {1: DeltaRunsConfig(), 2: DeltaRunsConfig()})
    assert widths == [1, 2]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fused, mode="reduce-overhead", fullgraph=True, dynamic=False)
    xs = {n: torch.randn(n, 1, 1024, device="cuda", dtype=dtype) for n in (1, 2)}
    with torch.no_grad():
        for _ in range(4):
            for n, x in xs.items():
                got = compiled(x).clone()
                want = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
                assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3
        graphs = counters["stats"]["unique_graphs"]
        del fused._fused[1]  # as when the gate's kernel is rebuilt: the op's body runs the projections apart
        compiled(xs[1])
    torch.cuda.synchronize()
    assert graphs == 2, f"{graphs} graphs compiled for 2 token counts"
    assert counters["stats"]["unique_graphs"] == graphs, "dropping a gated kernel recompiled the forward"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_a_gated_mlp_at_eight_tokens_runs_the_bitmap_tc_gated_kernel():
    """GatedDecodeMLP over gate / up layers pinned to delta-runs at 1 token and bitmap-tc at 8: fuse() builds a
    gated kernel of each family; at 8 tokens (and at 5, padded to 8) the bitmap-tc one, eager and graph-captured,
    gives the float64 MLP."""
    from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig
    from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig

    dtype = torch.float16
    mlp, fused, widths = _fused_mlp(dtype, {1: DeltaRunsConfig(), 8: BitmapTcConfig()}, seeds=(3, 4))
    assert widths == [1, 8]
    assert fused._gated(8).mapping == "bitmap-tc" and fused._gated(1).mapping == "delta-runs"
    g, u = (p.inner.to_dense().weight.double() for p in (mlp.gate_proj, mlp.up_proj))
    for n in (8, 5):
        x = torch.randn(n, 1, 1024, device="cuda").to(dtype)
        with torch.no_grad():
            want = ((x.double() @ g.T) * torch.sigmoid(x.double() @ g.T) * (x.double() @ u.T)) \
                @ mlp.down_proj.weight.double().T
            eager = fused(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = fused(x)
            graph.replay()
            torch.cuda.synchronize()
        for got in (eager, captured):
            assert torch.isfinite(got).all()
            assert ((got.double() - want).norm() / want.norm()).item() <= 5e-3, n


def test_2of4_groups_run_their_first_layers_paths_saved_reused_and_counted(tmp_path, monkeypatch):
    """A 2:4-pruned model whose decoder Linears the chooser takes to 2:4 (forced here: the tiny shapes may not
    pay): every later layer of a shape runs the paths its first layer measured (pinned, nothing timed), the
    copies of W no chosen path reads are released and the rest counted, no layer keeps its dense W on the GPU
    (prefill writes it into the shared workspace from the packed copy), a second conversion measures nothing,
    and a saved model loads with the same paths; the logits stay within the dense model's own error."""
    import importlib

    from sparseforge.nn import SparseLinear24
    from sparseforge.semi.decide import GEMV, SPARSE

    # the modules (sparseforge.nn and sparseforge.tune export functions of these names)
    choose, convert_module, decide_module = (importlib.import_module(f"sparseforge.{name}")
                                             for name in ("tune.choose", "nn.convert", "semi.decide"))

    real = choose.fastest_with_margin

    def two_four_first(times, baseline, margin):  # the faster 2:4 path wherever one is timed
        paths = [path for path in times if path in (SPARSE, GEMV)]
        if not paths:
            return real(times, baseline, margin)
        path = min(paths, key=times.get)
        return path, times[baseline] / times[path]

    for module in (choose, convert_module, decide_module):
        monkeypatch.setattr(module, "fastest_with_margin", two_four_first)
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    prune_model(dense, nm="2:4", include=r"^model\.layers\.", keep_masks=False)
    dense = dense.to("cuda", torch.float16)
    model = copy.deepcopy(dense)
    report = sparseforge.convert(model, tokens=(1, 8), tune_budget=0.5, progress=False)
    two_four = [layer for layer in report.layers if layer.choice == SPARSE]
    assert len(two_four) == 14, [(layer.name, layer.choice, layer.reason) for layer in report.layers]
    by_shape = {}
    for layer in two_four:
        inner = model.get_submodule(layer.name).inner
        assert isinstance(inner, SparseLinear24)
        paths = inner.chosen_paths()
        first = by_shape.setdefault(tuple(layer.weight_shape), (layer.name, paths))
        assert paths and all(first[1][n] == pair for n, pair in paths.items()), (layer.name, paths, first)
        if layer.name != first[0]:
            assert inner.pinned == paths and layer.reason.startswith(f"as {first[0]}"), layer.reason
        held = inner.runtime().device_bytes()
        used = {path for pair in paths.values() for path in pair}
        # the packed copy stands for W on the device whichever path runs: the dense W waits in host memory
        assert (held["compressed"] > 0) == (SPARSE in used) and held["packed"] > 0 and held["dense"] == 0
        assert inner.dense_on_host and inner.weight.device.type == "cpu"
        bias = 0 if inner.bias is None else inner.bias.numel() * 2
        assert inner.memory_bytes()["total"] == bias + sum(held.values())
        assert inner.memory_bytes()["weight_host"] == inner.weight.numel() * 2
    decode_ids, prefill_ids = _ids(1, 5), _ids(1, 12)  # 5 tokens: the 8-token kernels; 12: the prefill, dense
    with torch.no_grad():
        wants = {ids: copy.deepcopy(dense).double()(ids).logits for ids in (decode_ids, prefill_ids)}
        dense_errors = {ids: ((dense(ids).logits.double() - want).norm() / want.norm()).item()
                        for ids, want in wants.items()}

        def worst(converted) -> float:  # its error over the dense model's own, at the larger of the two
            return max(((converted(ids).logits.double() - want).norm() / want.norm()).item() /
                       (1.5 * dense_errors[ids] + 1e-4) for ids, want in wants.items())

        assert worst(model) <= 1, (worst(model), dense_errors)
    again = copy.deepcopy(dense)
    second = sparseforge.convert(again, tokens=(1, 8), tune_budget=0.5, progress=False)
    assert second.measured == 0 and [layer.choice for layer in second.layers] == [layer.choice for layer in report.layers]
    loaded = sparseforge.load(sparseforge.save(model, tmp_path / "tiny24"), device="cuda")
    for layer in two_four:
        original, copied = model.get_submodule(layer.name).inner, loaded.get_submodule(layer.name).inner
        assert copied.pinned == {**original.chosen_paths(), **original.pinned}
        assert copied.dense_on_host
    with torch.no_grad():  # cuSPARSELt searches its algorithm again on load (split K may sum in another order)
        assert worst(loaded) <= 1, (worst(loaded), dense_errors)
