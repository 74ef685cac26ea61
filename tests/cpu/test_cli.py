import torch
from safetensors.torch import save_file
from torch import nn

from sparseforge.cli import main
from sparseforge.prune import is_nm
from sparseforge.suite import SAMPLE_DIR


def test_info_directory(capsys):
    assert main(["info", str(SAMPLE_DIR / "rn50/magnitude_pruning/0.9")]) == 0
    out = capsys.readouterr().out
    assert "bottleneck_1_block_group1_1_1" in out and "3136" in out and "0.1000" in out


def test_info_missing_path_is_a_clear_error(capsys, tmp_path):
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_prune_state_dict_file(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    torch.save(model.state_dict(), src)
    assert main(["prune", str(src), str(dst), "--sparsity", "0.75"]) == 0
    state = torch.load(dst, weights_only=True)
    assert int((state["0.weight"] == 0).sum()) == 96
    out = capsys.readouterr().out
    assert "0.weight" in out and "not a weight" in out


def test_prune_safetensors_nm(tmp_path):
    src, dst = tmp_path / "m.safetensors", tmp_path / "p.safetensors"
    save_file({"fc.weight": torch.randn(8, 16), "fc.bias": torch.randn(8)}, str(src))
    assert main(["prune", str(src), str(dst), "--nm", "2:4"]) == 0
    from safetensors.torch import load_file

    assert is_nm(load_file(str(dst))["fc.weight"])


def test_prune_rejects_non_state_dict(tmp_path, capsys):
    src = tmp_path / "m.pt"
    torch.save(torch.randn(3), src)
    assert main(["prune", str(src), str(tmp_path / "o.pt"), "--sparsity", "0.5"]) == 2
    assert "expected a state dict" in capsys.readouterr().err


def test_prune_refuses_a_missing_output_directory(tmp_path, cli_error):
    src = tmp_path / "m.pt"
    torch.save(nn.Linear(8, 4).state_dict(), src)
    message = cli_error("prune", src, tmp_path / "missing" / "p.pt", "--sparsity", "0.5")
    assert "missing does not exist" in message and not (tmp_path / "missing").exists()
