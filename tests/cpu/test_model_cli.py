"""`sparseforge convert` and `sparseforge profile` (model_cli.py) on the CPU: policies that need no timing,
the saved model loads back and computes the same, the report and plot are written, and bad input is
refused with the fix named (exit code 2, no traceback)."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from sparseforge.cli import main
from sparseforge.nn import SparseConv2d, SparseLinear


def _saved_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10)).eval()
    with torch.no_grad():
        for layer in (model[0], model[4]):
            layer.weight.mul_((torch.rand_like(layer.weight) < 0.2).float())
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return model, path


def test_convert_saves_a_model_that_loads_and_computes_the_same(tmp_path):
    model, path = _saved_model(tmp_path)
    out, report = tmp_path / "sparse.pt", tmp_path / "report.json"
    assert main(["convert", str(path), str(out), "--example-shape", "2,3,6,6", "--cpu", "--policy", "sparse",
                 "--report", str(report)]) == 0
    converted = torch.load(out, weights_only=False)
    # fused by default: a GraphModule whose conv took the ReLU after it
    assert isinstance(converted, torch.fx.GraphModule)
    conv, fc = converted.get_submodule("0"), converted.get_submodule("4")
    assert isinstance(conv, SparseConv2d) and conv.relu and isinstance(fc, SparseLinear)
    assert not any(node.op == "call_module" and isinstance(converted.get_submodule(node.target), nn.ReLU)
                   for node in converted.graph.nodes)
    x = torch.randn(2, 3, 6, 6)
    assert torch.allclose(converted(x), model(x), atol=1e-5)
    layers = json.loads(report.read_text())["layers"]
    assert [layer["choice"] for layer in layers] == ["unstructured", "unstructured"]
    # and it loads in a fresh process that imports sparseforge
    code = (f"import torch, sparseforge; m = torch.load({str(out)!r}, weights_only=False); "
            "print(tuple(m(torch.randn(2, 3, 6, 6)).shape))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "(2, 10)", done.stderr[-2000:]


def test_convert_with_no_fuse_keeps_the_model_class(tmp_path):
    model, path = _saved_model(tmp_path)
    out = tmp_path / "sparse.pt"
    assert main(["convert", str(path), str(out), "--example-shape", "2,3,6,6", "--cpu", "--policy", "sparse",
                 "--no-fuse"]) == 0
    converted = torch.load(out, weights_only=False)
    assert isinstance(converted, nn.Sequential) and isinstance(converted[0], SparseConv2d) and not converted[0].relu
    x = torch.randn(2, 3, 6, 6)
    assert torch.allclose(converted(x), model(x), atol=1e-5)


def test_profile_on_a_cpu_is_refused_and_writes_nothing(tmp_path, capsys):
    _, path = _saved_model(tmp_path)
    plot, report = tmp_path / "layers.png", tmp_path / "r.json"
    # was: nothing measured, a table of "-", an empty plot, exit 0
    message = _cli_error(capsys, "profile", path, "--example-shape", "1,3,6,6", "--cpu", "--policy", "dense",
                         "--plot", plot, "--report", report)
    assert "profile measures" in message and "NVIDIA GPU" in message and "--cpu" in message
    assert not plot.exists() and not report.exists()
    assert "--cpu" not in _help("profile")  # not offered where it cannot work


def _help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_plot_layers_draws_the_measured_times(tmp_path):
    from sparseforge.model_cli import plot_layers
    from sparseforge.nn import LayerReport, ModelReport

    layers = [LayerReport(f"layer{i}", "Linear", (8, 8), 0.9, [[1, 8]], "unstructured",
                          {"dense": 10.0 + i, "unstructured": 4.0 + i}) for i in range(3)]
    plot_layers(tmp_path / "layers.png", ModelReport(layers=layers))
    assert (tmp_path / "layers.png").stat().st_size > 1000


def test_bad_input_is_named(tmp_path, capsys):
    _, path = _saved_model(tmp_path)
    state = tmp_path / "state.pt"
    torch.save(torch.load(path, weights_only=False).state_dict(), state)
    assert main(["convert", str(state), str(tmp_path / "o.pt"), "--example-shape", "1,3,6,6", "--cpu", "--policy",
                 "dense"]) == 2
    assert "not a model: give --model NAME" in capsys.readouterr().err
    assert main(["convert", str(path), str(tmp_path / "o.pt"), "--example-shape", "1,x", "--cpu", "--policy",
                 "dense"]) == 2
    assert "positive integers" in capsys.readouterr().err
    assert main(["convert", str(path), str(tmp_path / "o.pt"), "--example-shape", "1,3,6,6", "--cpu"]) == 2
    err = capsys.readouterr().err  # was Python's words: model.cuda(), policy='sparse'
    assert "--policy sparse" in err and "model.cuda()" not in err and "policy='" not in err


def _cli_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def test_a_file_that_is_not_a_torch_model_is_named(tmp_path, capsys):
    text, truncated = tmp_path / "text.pt", tmp_path / "cut.pt"
    text.write_text("hello\n")  # was an UnpicklingError traceback, exit code 1
    _, path = _saved_model(tmp_path)
    truncated.write_bytes(path.read_bytes()[:300])
    for bad, words in ((text, "not a torch checkpoint"), (truncated, "truncated or damaged")):
        message = _cli_error(capsys, "convert", bad, tmp_path / "o.pt", "--example-shape", "1,3,6,6", "--cpu",
                             "--policy", "dense")
        assert f"{bad}: {words}" in message
    from safetensors.torch import save_file

    save_file({"w": torch.randn(2, 2)}, str(tmp_path / "w.safetensors"))
    message = _cli_error(capsys, "convert", tmp_path / "w.safetensors", tmp_path / "o.pt", "--example-shape",
                         "1,3,6,6", "--cpu", "--policy", "dense")
    assert "holds tensors only, not a model; give --model NAME" in message


def test_an_example_shape_the_model_does_not_take_is_named(tmp_path, capsys):
    _, path = _saved_model(tmp_path)
    message = _cli_error(capsys, "convert", path, tmp_path / "o.pt", "--example-shape", "1,5,6,6", "--cpu",
                         "--policy", "sparse")
    assert "the model fails on a random torch.float32 input of shape (1, 5, 6, 6)" in message
    assert "give --example-shape the shape of the model's one input" in message
    assert not (tmp_path / "o.pt").exists()
    message = _cli_error(capsys, "convert", path, tmp_path / "o.pt", "--example-shape", "100000,100000,100000",
                         "--cpu", "--policy", "dense")
    assert "the example input needs 3725290.3 GiB" in message


def test_a_model_without_parameters_is_named(tmp_path, capsys):
    torch.save(nn.Sequential(nn.ReLU()), tmp_path / "relu.pt")  # was a StopIteration traceback
    message = _cli_error(capsys, "convert", tmp_path / "relu.pt", tmp_path / "o.pt", "--example-shape", "1,4",
                         "--cpu", "--policy", "dense")
    assert "the model has no parameters" in message


def test_convert_refuses_to_overwrite_its_input_and_a_negative_budget(tmp_path, capsys):
    _, path = _saved_model(tmp_path)
    before = path.read_bytes()
    message = _cli_error(capsys, "convert", path, tmp_path / "." / path.name, "--example-shape", "1,3,6,6", "--cpu",
                         "--policy", "dense")
    assert "is the input file" in message and path.read_bytes() == before
    message = _cli_error(capsys, "convert", path, tmp_path / "o.pt", "--example-shape", "1,3,6,6", "--cpu",
                         "--policy", "sparse", "--tune-budget", "-1")
    assert "--tune-budget -1.0: give seconds >= 0" in message


@pytest.mark.parametrize("layer, shape, kind", [(nn.Linear(16, 8), (2, 16), SparseLinear),
                                                (nn.Conv2d(4, 8, 3, padding=1), (1, 4, 6, 6), SparseConv2d)])
def test_convert_a_model_that_is_itself_a_layer(tmp_path, capsys, layer, shape, kind):
    torch.manual_seed(0)
    with torch.no_grad():
        layer.weight.mul_((torch.rand_like(layer.weight) < 0.3).float())
    path, out, report = tmp_path / "layer.pt", tmp_path / "sparse.pt", tmp_path / "report.json"
    torch.save(layer, path)
    example = ",".join(map(str, shape))
    # was: skipped (the module named ""), an empty report, the layer saved as it was, exit 0
    assert main(["convert", str(path), str(out), "--example-shape", example, "--cpu", "--policy", "sparse",
                 "--report", str(report)]) == 0
    converted = torch.load(out, weights_only=False)
    assert isinstance(converted, kind)
    x = torch.randn(shape)
    assert torch.allclose(converted(x), layer(x), atol=1e-5)
    assert [entry["name"] for entry in json.loads(report.read_text())["layers"]] == [""]
    # --include / --exclude see the model's own name "", as the Python API does: a pattern that would match only
    # the name of a layer inside a model matches nothing here, and nothing is written
    out.unlink()
    assert main(["convert", str(path), str(out), "--example-shape", example, "--cpu", "--policy", "sparse",
                 "--include", "conv|fc"]) == 2
    assert "--include matched no layer: 'conv|fc' is found in none of the names of the 1 Linear / Conv2d layers " \
           "(the model itself)" in capsys.readouterr().err and not out.exists()


def test_the_readmes_main_job_chains_prune_into_convert():
    """The README's command-line main job: convert reads the file prune wrote, with --model naming the model (a
    state dict alone is refused), and both lines parse."""
    import re
    import shlex
    from pathlib import Path

    from sparseforge.cli import build_parser

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    job = readme.split("## The main job", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", job, re.S).group(1).replace("\\\n", " ")
    lines = {words[1]: words[1:] for words in (shlex.split(line, comments=True) for line in block.splitlines())
             if words and words[0] == "sparseforge"}
    prune, convert = build_parser().parse_args(lines["prune"]), build_parser().parse_args(lines["convert"])
    assert str(convert.input) == prune.output and convert.model


def test_profile_help_says_it_needs_a_cuda_gpu():
    assert "needs a CUDA GPU" in _help("profile")


def test_a_model_name_without_torchvision_or_timm_names_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setitem(sys.modules, "timm", None)
    state = tmp_path / "w.pt"
    torch.save(nn.Linear(12, 4).state_dict(), state)
    message = _cli_error(capsys, "convert", state, tmp_path / "o.pt", "--model", "resnet50", "--example-shape",
                         "1,12", "--cpu", "--policy", "sparse")
    assert "--model resnet50: neither torchvision nor timm is installed" in message
    assert "pip install torchvision" in message and "give a torchvision or timm model name" not in message
    assert not (tmp_path / "o.pt").exists()


def test_include_or_exclude_leaving_no_layer_is_named_with_the_option(tmp_path, capsys):
    _, path = _saved_model(tmp_path)
    message = _cli_error(capsys, "convert", path, tmp_path / "o.pt", "--example-shape", "1,3,6,6", "--cpu",
                         "--policy", "sparse", "--include", "nomatch")
    assert "--include matched no layer: 'nomatch' is found in none of the names of the 2 Linear / Conv2d layers " \
           "(0, 4)" in message and not (tmp_path / "o.pt").exists()
