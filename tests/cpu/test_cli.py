import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from sparseforge.cli import main
from sparseforge.prune import is_nm
from sparseforge.suite import SAMPLE_DIR


def test_top_level_help_describes_the_tool_for_users(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "Make pruned neural networks run faster" in out and "examples:" in out
    assert "bench/" not in out  # no pointers into the source tree


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


def test_prune_warns_about_a_layer_it_empties(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(128, 10))
    with torch.no_grad():
        model[1].weight.mul_(1e-4)
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    torch.save(model.state_dict(), src)
    assert main(["prune", str(src), str(dst), "--sparsity", "0.9", "--scope", "global"]) == 0
    assert not torch.load(dst, weights_only=True)["1.weight"].any()  # kept as pruned, as asked
    assert "WARNING: 1.weight (10x128) has no nonzero weight left" in capsys.readouterr().err


def test_prune_nested_checkpoint_keeps_its_other_keys(tmp_path, capsys):
    src, dst = tmp_path / "ckpt.pt", tmp_path / "p.pt"
    torch.save({"state_dict": nn.Linear(16, 8).state_dict(), "epoch": 5}, src)
    assert main(["prune", str(src), str(dst), "--sparsity", "0.75"]) == 0
    out = torch.load(dst, weights_only=True)
    assert out["epoch"] == 5 and int((out["state_dict"]["weight"] == 0).sum()) == 96
    assert "1 layers pruned" in capsys.readouterr().out


def test_prune_with_nothing_to_prune_fails_and_writes_nothing(tmp_path, cli_error):
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    torch.save({"fc.bias": torch.randn(4), "scale": torch.randn(4)}, src)
    assert "nothing was pruned" in cli_error("prune", src, dst, "--sparsity", "0.5")
    assert not dst.exists()


def test_prune_refuses_to_overwrite_its_input_unless_forced(tmp_path, cli_error):
    src = tmp_path / "m.pt"
    torch.save(nn.Linear(16, 8).state_dict(), src)
    before = src.read_bytes()
    assert "is the input file" in cli_error("prune", src, tmp_path / "." / "m.pt", "--sparsity", "0.5")
    assert src.read_bytes() == before
    os.link(src, tmp_path / "same.pt")  # another name for the same file
    assert "--force" in cli_error("prune", src, tmp_path / "same.pt", "--sparsity", "0.5")
    assert main(["prune", str(src), str(src), "--sparsity", "0.5", "--force"]) == 0
    assert int((torch.load(src, weights_only=True)["weight"] == 0).sum()) == 64


def _truncated_safetensors(path):
    save_file({"fc.weight": torch.randn(8, 16)}, str(path))
    path.write_bytes(path.read_bytes()[:40])


def _truncated_pt(path):
    torch.save({"fc.weight": torch.randn(8, 16)}, path)
    path.write_bytes(path.read_bytes()[:200])


@pytest.mark.parametrize("name, make, extra, expected", [
    ("m.safetensors", _truncated_safetensors, [], "not a readable .safetensors file"),
    ("m.pt", lambda p: p.write_bytes(bytes(range(7, 250))), [], "not a torch checkpoint"),
    ("m.pt", _truncated_pt, [], "truncated or damaged"),
    ("m.pt", lambda p: torch.save(nn.Linear(4, 4), p), [], "class torch.nn.modules.linear.Linear"),
    ("m.pt", lambda p: torch.save({"fc.weight": torch.randn(4, 4)}, p), ["--include", "("], "not a valid regular"),
])
def test_prune_bad_input_is_one_clear_error(tmp_path, cli_error, name, make, extra, expected):
    make(tmp_path / name)
    message = cli_error("prune", tmp_path / name, tmp_path / "out.pt", "--sparsity", "0.5", *extra)
    assert expected in message and "weights_only" not in message
    assert not (tmp_path / "out.pt").exists()


def test_prune_skips_entries_it_cannot_prune_with_the_reason(tmp_path, capsys):
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    # an int key was an AttributeError traceback; a sparse tensor, a page of torch dispatcher text
    torch.save({1: torch.randn(4, 4), "s.weight": torch.randn(4, 4).to_sparse(), "fc.weight": torch.randn(4, 8)}, src)
    assert main(["prune", str(src), str(dst), "--sparsity", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "not a parameter name" in out and "to_dense()" in out
    assert int((torch.load(dst, weights_only=True)["fc.weight"] == 0).sum()) == 16


def test_prune_names_the_tensor_holding_nan(tmp_path, cli_error):
    src = tmp_path / "m.pt"
    torch.save({"good.weight": torch.randn(4, 4), "bad.weight": torch.full((4, 4), float("nan"))}, src)
    assert "bad.weight holds NaN or inf" in cli_error("prune", src, tmp_path / "p.pt", "--sparsity", "0.5")
    assert not (tmp_path / "p.pt").exists()


def test_prune_with_an_include_that_matches_no_tensor_names_the_option(tmp_path, cli_error):
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    torch.save(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).state_dict(), src)
    message = cli_error("prune", src, dst, "--sparsity", "0.5", "--include", "nomatch")
    assert "--include matched no tensor: 'nomatch' is found in none of the names of the 2 weights that can be " \
           "pruned (0.weight, 2.weight)" in message and not dst.exists()
    assert "--exclude matched every tensor" in cli_error("prune", src, dst, "--sparsity", "0.5", "--exclude", "weight")


def test_prune_scope_row_prunes_every_row_alike(tmp_path):
    src, dst = tmp_path / "m.pt", tmp_path / "p.pt"
    torch.save(nn.Linear(16, 8).state_dict(), src)
    assert main(["prune", str(src), str(dst), "--sparsity", "0.75", "--scope", "row"]) == 0
    assert (torch.load(dst, weights_only=True)["weight"] != 0).sum(dim=1).tolist() == [4] * 8


def _help(*command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(out.getvalue().split())  # argparse wraps lines at the terminal's width


def test_prune_help_describes_the_command_and_every_argument():
    text = _help("prune")
    assert "Prune the Linear (2-D) and Conv2d (4-D) floating-point weights of a saved state dict" in text
    assert "input a state dict saved with torch.save" in text and "output where the pruned state dict" in text
    assert "--scope {layer,row,global}" in text and "each output row of every tensor" in text


@pytest.mark.parametrize("command, description", [
    ("info", "Statistics of one .smtx file or a DLMC-style directory."),
    ("bench", "Benchmark sparseforge's generated kernels against cuBLAS and cuSPARSE"),
    ("bench24", "Time 2:4 matrix products on Sparse Tensor Cores (cuSPARSELt)"),
])
def test_each_command_help_opens_with_a_description(command, description):
    assert description in _help(command)
