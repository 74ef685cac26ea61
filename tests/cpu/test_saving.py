"""sparseforge.save / load (saving.py): what load says of a directory it cannot load, and of a device this machine
does not have."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import sparseforge
from sparseforge.prune import prune_model
from sparseforge.saving import SavedModelError


@pytest.fixture(scope="module")
def tiny_lm():
    """A seeded one-layer Llama, its decoder Linears pruned per row to 50% and converted (policy 'sparse')."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    prune_model(model, sparsity=0.5, scope="row", include=r"^model\.layers\.", keep_masks=False)
    sparseforge.convert(model, tokens=(1,), policy="sparse", progress=False)
    return model


def test_a_cuda_device_on_a_machine_without_one_is_refused_with_the_fix(tiny_lm, tmp_path, monkeypatch):
    saved = sparseforge.save(tiny_lm, tmp_path / "lm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU here: load with device='cpu'"):
        sparseforge.load(saved, device="cuda")


def test_a_deleted_config_json_is_named_with_the_fix(tiny_lm, tmp_path):
    saved = sparseforge.save(tiny_lm, tmp_path / "lm")
    (saved / "config.json").unlink()
    with pytest.raises(SavedModelError, match="has no config.json.*save the model again"):
        sparseforge.load(saved)


def test_a_tensor_missing_from_a_saved_lm_is_damage_not_a_wrong_model(tiny_lm, tmp_path):
    saved = sparseforge.save(tiny_lm, tmp_path / "lm")
    tensors = load_file(str(saved / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(SavedModelError, match="model.norm.weight") as raised:
        sparseforge.load(saved)
    message = str(raised.value)
    assert "damaged" in message and "save the model again" in message and "pass a model" not in message


def test_a_save_pretrained_directory_is_named_as_not_sparseforge_saved(tiny_lm, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_lm.config)
    plain.save_pretrained(tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="not a sparseforge-saved model") as raised:
        sparseforge.load(tmp_path / "hf")
    assert "sparseforge.convert" in str(raised.value) and "sparseforge.save" in str(raised.value)


def test_a_plain_module_that_does_not_fit_still_asks_for_the_saved_architecture(tmp_path):
    torch.manual_seed(0)
    saved = sparseforge.save(nn.Sequential(nn.Linear(8, 4)), tmp_path / "mlp")
    assert json.loads((saved / "sparseforge.json").read_text())["source"] == "module"
    with pytest.raises(SavedModelError, match="pass a model of the architecture that was saved"):
        sparseforge.load(saved, model=nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))
