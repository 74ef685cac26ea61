"""The Llama-architecture decoder (models/llama.py): a prompt run whole and the same tokens decoded one at a
time through the static KV cache agree, and a layer matches a float64 re-derivation of Llama's equations
(RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU)."""
import math

import torch

from sparseforge.models import LlamaShape, llama_decoder

TINY = LlamaShape(hidden=64, intermediate=96, heads=4, kv_heads=2, layers=2, rope_theta=10000.0)


def test_decoding_token_by_token_matches_the_whole_prompt():
    model = llama_decoder(TINY, max_len=16).eval()
    x = torch.randn(2, 6, 64)
    with torch.no_grad():
        model.reset_cache(2)
        whole = model(x, torch.tensor(0))
        model.reset_cache(2)
        steps = torch.cat([model(x[:, i:i + 1], torch.tensor(i)) for i in range(6)], dim=1)
    assert torch.allclose(steps, whole, atol=1e-5)


def _reference_layer(layer, x):
    """Llama's decoder layer in float64 from its equations, for a prompt from position 0."""
    s, hd = layer.shape, layer.shape.head_dim
    x = x.double()
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    norm = lambda v, g: v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + s.eps) * g  # noqa: E731
    b, t, _ = x.shape
    h = norm(x, w["input_layernorm.weight"])
    q = (h @ w["q_proj.weight"].T).view(b, t, s.heads, hd)
    k = (h @ w["k_proj.weight"].T).view(b, t, s.kv_heads, hd)
    v = (h @ w["v_proj.weight"].T).view(b, t, s.kv_heads, hd)
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]  # (t, hd/2)
    def rope(z):  # pairs (i, i + hd/2) rotated by the position's angle
        a, c = z[..., : hd // 2], z[..., hd // 2:]
        cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
        return torch.cat([a * cos - c * sin, c * cos + a * sin], dim=-1)
    q, k = rope(q), rope(k)
    group = s.heads // s.kv_heads
    out = torch.zeros(b, t, s.heads, hd, dtype=torch.float64)
    for head in range(s.heads):
        scores = q[:, :, head] @ k[:, :, head // group].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        out[:, :, head] = torch.softmax(scores, -1) @ v[:, :, head // group]
    x = x + out.reshape(b, t, -1) @ w["o_proj.weight"].T
    h = norm(x, w["post_attention_layernorm.weight"])
    gate, up = h @ w["gate_proj.weight"].T, h @ w["up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w["down_proj.weight"].T


def test_a_layer_follows_llamas_equations():
    model = llama_decoder(TINY, max_len=8).eval()
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        model.reset_cache(1)
        t = torch.tensor(0)
        index = torch.arange(5)
        cos = model.cos_table[index][None, None]
        sin = model.sin_table[index][None, None]
        got = model.layers[0](x, cos, sin, *model.caches[0], t)
    assert torch.allclose(got.double(), _reference_layer(model.layers[0], x), atol=1e-5)


def test_llama3_8b_widths():
    from sparseforge.models import LLAMA3_8B

    assert (LLAMA3_8B.hidden, LLAMA3_8B.intermediate, LLAMA3_8B.heads, LLAMA3_8B.kv_heads) == (4096, 14336, 32, 8)
    assert LLAMA3_8B.head_dim == 128


def test_a_pruned_decoder_converts_and_decodes_the_same():
    from sparseforge.nn import SparseLinear, convert
    from sparseforge.prune import prune_model

    model = llama_decoder(TINY, max_len=8).eval()
    prune_model(model, sparsity=0.7, include=r"_proj$", keep_masks=False)
    model.reset_cache(2)
    x, position = torch.randn(2, 1, 64), torch.tensor(3)
    with torch.no_grad():
        want = model(x, position)
    model.reset_cache(2)
    report = convert(model, (x, position), policy="sparse", fold_bn=False)
    assert len(report.layers) == 14 and all(isinstance(m, SparseLinear) for n, m in model.named_modules()
                                            if n.endswith("_proj"))
    model.reset_cache(2)
    with torch.no_grad():
        assert torch.allclose(model(x, position), want, atol=1e-5)


def test_the_cache_moves_with_the_model_and_is_required():
    import pytest

    model = llama_decoder(TINY, max_len=8)
    x = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match=r"call reset_cache\(1\)"):
        model(x, torch.tensor(0))
    model.reset_cache(1)
    model.double()
    assert all(k.dtype == torch.float64 and v.dtype == torch.float64 for k, v in model.caches)
    assert model(x.double(), torch.tensor(0)).dtype == torch.float64
    assert not any("cache" in key for key in model.state_dict())  # not saved
