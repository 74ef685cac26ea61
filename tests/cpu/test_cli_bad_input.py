"""Bad input to every command, run as a user runs the command (a subprocess, so torch's warnings and any
traceback show): exit code 2, exactly one line `error: ...` on stderr that names the problem, and nothing
written. Each case once passed silently, wrote a useless file, or answered with a traceback or with torch's,
numpy's or Python's words."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sparseforge
from sparseforge.suite import SAMPLE_DIR

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uses /proc, /sys and /dev files")

SAMPLE = SAMPLE_DIR / "rn50/magnitude_pruning/0.9"
SHAPE = ["--example-shape", "1,3,6,6"]
CPU = ["--cpu", "--policy", "sparse"]
NETDEFS = '''
import torch
from torch import nn


def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def wider():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 10))


def other():
    return nn.Sequential(nn.Identity(), nn.Linear(4, 4))


def broken():
    raise RuntimeError("no weights here")


def not_a_model():
    return {}
'''


def run_cli(args, cwd: Path, pythonpath: tuple = ()) -> subprocess.CompletedProcess:
    """`sparseforge ARGS` in a fresh process, in cwd, on this checkout's code."""
    src = str(Path(sparseforge.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "sparseforge", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _files(folder: Path) -> dict:
    """What the folder holds, Python's bytecode caches aside (an import of a stand-in package there may write them)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def refused(folder: Path, *args) -> tuple[str, str]:
    """Run the command; check it failed as every CLI error must and wrote nothing. Returns (error line, stdout)."""
    before = _files(folder)
    done = run_cli(args, folder)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        (done.returncode, done.stderr[-3000:])
    assert _files(folder) == before, "a refused command wrote a file"
    return lines[0], done.stdout


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The inputs: a model and state dicts good and bad, a FIFO, a directory, the factory module netdefs.py (and
    badsyntax.py, one that does not parse)."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "netdefs.py").write_text(NETDEFS)
    (folder / "badsyntax.py").write_text("def net(:\n")  # a factory module that does not even parse
    sys.path.insert(0, str(folder))
    try:
        import netdefs

        torch.manual_seed(0)
        model = netdefs.net().eval()
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("netdefs", None)
    torch.save(model, folder / "model.pt")
    torch.save(model.state_dict(), folder / "state.pt")
    with open(folder / "model.pkl", "wb") as f:
        pickle.dump(model, f)  # a plain pickle of a model
    with open(folder / "state.pkl", "wb") as f:
        pickle.dump({"fc.weight": torch.randn(4, 8)}, f)
    torch.save({"fc.weight": torch.randn(0, 8), "conv.weight": torch.randn(0, 0, 3, 3)}, folder / "zero.pt")
    torch.save({"fc.weight": torch.randn(4, 8).to(torch.float8_e4m3fn)}, folder / "fp8.pt")
    (folder / "cr.smtx").write_bytes(b"2, 3, 2\r0 1 2\r2 0\r")  # old Mac line endings
    (folder / "adir").mkdir()
    os.mkfifo(folder / "fifo")
    return folder


STATE_ERRORS = [
    ("/dev/null", "/dev/null is a character device, not a file"),  # all three were "does not exist"
    ("fifo", "fifo is a FIFO (named pipe), not a file"),
    ("adir", "adir is a directory, not a file"),
    ("/proc/self/mem", "/proc/self/mem cannot be read (Input/output error)"),  # was "[Errno 5]", no path
    ("nothere.pt", "nothere.pt does not exist"),
]


@pytest.mark.parametrize("source, message", STATE_ERRORS + [
    ("state.pkl", "state.pkl: a plain Python pickle (pickle.dump), not a file torch.save wrote"),  # was "damaged"
])
def test_prune_names_an_input_that_is_not_a_checkpoint_file(folder, source, message):
    assert message in refused(folder, "prune", source, "o.pt", "--sparsity", "0.5")[0]


@pytest.mark.parametrize("source, reason", [
    ("zero.pt", "holds no values"),  # was a ZeroDivisionError traceback
    ("fp8.pt", "is not one pruning ranks"),  # was '"isfinite" not implemented for Float8_e4m3fn'
])
def test_prune_with_only_weights_it_cannot_prune_writes_nothing(folder, source, reason):
    message, out = refused(folder, "prune", source, "o.pt", "--sparsity", "0.5")
    assert "nothing was pruned" in message and reason in out


@pytest.mark.parametrize("how, message", [
    (["--sparsity", "0"], "--sparsity 0 removes no weight"),  # these three wrote an unpruned copy
    (["--sparsity", "-0"], "--sparsity -0 removes no weight"),  # labelled "magnitude -0"
    (["--sparsity", "0.0"], "--sparsity 0 removes no weight"),
    (["--nm", "4:4"], "--nm 4:4 keeps every weight (N = M)"),
])
def test_prune_that_would_remove_nothing_is_refused(folder, how, message):
    assert message in refused(folder, "prune", "state.pt", "o.pt", *how)[0]


UNWRITABLE = [
    ("/sys/o.safetensors", "cannot be written"),  # was a SafetensorError traceback, exit code 1
    ("/proc/o.pt", "cannot be written"),  # was "enforce fail at inline_container.cc", after the pruning
    ("/dev/full", "is a character device, not a file"),  # was "unexpected pos" / "iostream error"
    ("fifo", "is a FIFO (named pipe), not a file"),
]


@pytest.mark.parametrize("target, message", UNWRITABLE)
def test_prune_checks_its_output_before_the_work(folder, target, message):
    error, out = refused(folder, "prune", "state.pt", target, "--sparsity", "0.5")
    assert f"output {target} {message}" in error and out == ""  # refused before the report: nothing pruned


@pytest.mark.parametrize("option, target, message", [
    *[("OUTPUT", target, message) for target, message in UNWRITABLE],
    ("--report", "/proc/report.json", "cannot be written"),  # was found only after the conversion
    ("--report", "/dev/full", "is a character device"),
])
def test_convert_checks_every_output_before_the_work(folder, option, target, message):
    output = target if option == "OUTPUT" else "o.pt"
    extra = [] if option == "OUTPUT" else [option, target]
    error, out = refused(folder, "convert", "model.pt", output, *SHAPE, *CPU, *extra)
    assert f"{option} {target} {message}" in error and out == ""


@pytest.mark.parametrize("source, message", STATE_ERRORS + [
    ("model.pkl", "model.pkl: a plain Python pickle (pickle.dump), not a file torch.save wrote"),
    ("state.pt", "holds a state dict (weights only), not a model: give --model NAME"),
])
def test_convert_names_an_input_that_is_not_a_model_file(folder, source, message):
    assert message in refused(folder, "convert", source, "o.pt", *SHAPE, *CPU)[0]


@pytest.mark.parametrize("source, spec, message", [
    ("state.pt", "no_such_net", "--model no_such_net: "),
    ("state.pt", "nosuchmodule:net", "--model nosuchmodule:net: cannot import nosuchmodule"),
    ("state.pt", "netdefs:nothing", "--model netdefs:nothing: netdefs has no nothing"),
    ("state.pt", "badsyntax:net", "--model badsyntax:net: importing badsyntax failed (SyntaxError"),
    ("state.pt", "netdefs:broken", "broken() failed (RuntimeError: no weights here)"),
    ("state.pt", "netdefs:not_a_model", "not_a_model() returned a dict, not a torch.nn.Module"),
    ("state.pt", ":net", "give module:factory"),
    ("state.pt", "netdefs:wider", "state.pt does not fit --model netdefs:wider: size mismatch for 0.weight"),
    ("state.pt", "netdefs:other",
     "its keys differ from the model's, 2 missing (first: 1.weight, 1.bias); 4 unexpected (first: "),
    ("model.pt", "netdefs:net", "holds a Python object of class"),  # --model takes weights, not a whole model
    ("zero.pt", "netdefs:net", "does not fit --model netdefs:net"),
    *[(source, "netdefs:net", message) for source, message in STATE_ERRORS],
])
def test_convert_names_what_is_wrong_with_a_state_dict_and_its_model(folder, source, spec, message):
    assert message in refused(folder, "convert", source, "o.pt", "--model", spec, *SHAPE, *CPU)[0]


def test_convert_on_the_cpu_names_the_cli_flags(folder):
    # was Python's words: "move the model there first (model.cuda()), or pass policy='sparse' / 'dense'"
    error, _ = refused(folder, "convert", "model.pt", "o.pt", *SHAPE, "--cpu")
    assert "--policy sparse" in error and "model.cuda()" not in error and "policy='" not in error


def test_profile_on_the_cpu_says_it_needs_a_gpu(folder):
    # was: nothing measured, a table of "-", an empty plot, exit 0
    error, _ = refused(folder, "profile", "model.pt", *SHAPE, "--cpu", "--plot", "p.png", "--report", "r.json")
    assert "profile measures" in error and "NVIDIA GPU" in error


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU exists")
def test_profile_without_a_gpu_says_so_without_offering_cpu(folder):
    error, _ = refused(folder, "profile", "model.pt", *SHAPE)
    assert "no CUDA GPU here: profile measures on one" in error and "--cpu" not in error


@pytest.mark.parametrize("args, message", [
    (["--n", "99999999999999999999"], "--n 99999999999999999999: N must be < 2**31 = 2147483648"),  # MemoryError
    (["--n", "2147483648", "--cpu"], "--n 2147483648: N must be < 2**31"),  # was shown as N, checked at N <= 64
    (["--tokens", "2147483648", "--cpu"], "tokens = 2147483648: N must be < 2**31"),
    (["--batch", "1000000000", "--cpu"], "= 3136000000000: N must be < 2**31"),  # pixels x batch
    (["--out", "/proc/b.json"], "--out /proc/b.json cannot be written"),
    (["--plot", "/dev/full"], "--plot /dev/full is a character device"),
])
def test_bench_bounds_n_and_checks_its_outputs(folder, args, message):
    assert message in refused(folder, "bench", SAMPLE, *args)[0]


@pytest.mark.parametrize("args, message", [
    (["--n", "99999999999999999999"], "--n 99999999999999999999: N must be < 2**31"),  # was a MemoryError on a GPU
    (["--shapes", "4096x2147483648"], "shape '4096x2147483648': OUT and IN must be < 2**31"),
    (["--out", "/proc/b.json"], "--out /proc/b.json cannot be written"),  # was found after every case ran
    (["--plot", "/dev/full"], "--plot /dev/full is a character device"),
])
def test_bench24_bounds_its_sizes_and_checks_its_outputs_before_looking_for_a_gpu(folder, args, message):
    assert message in refused(folder, "bench24", *args)[0]


@pytest.mark.parametrize("command", ["info", "bench"])
@pytest.mark.parametrize("path, message", [
    ("/dev/null", "/dev/null is neither a file nor a directory"),  # was "does not exist"
    ("fifo", "fifo is neither a file nor a directory"),
    ("/proc/self/mem", "/proc/self/mem: cannot be read (Input/output error)"),
    ("cr.smtx", "cr.smtx: line 1: a carriage return (\\r) that does not end a line"),
])
def test_info_and_bench_name_a_path_that_is_not_a_matrix(folder, command, path, message):
    assert message in refused(folder, command, path)[0]


def test_prune_then_convert_with_the_model_named(folder, tmp_path):
    """The CLI chain: prune writes a state dict; convert builds the model --model names and loads it."""
    (tmp_path / "netdefs.py").write_text(NETDEFS)
    torch.save(torch.load(folder / "state.pt"), tmp_path / "state.pt")
    done = run_cli(["prune", "state.pt", "pruned.pt", "--sparsity", "0.8"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_cli(["convert", "pruned.pt", "sparse.pt", "--model", "netdefs:net", *SHAPE, *CPU,
                    "--report", "report.json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check = ("import torch, sparseforge, netdefs\n"
             "from sparseforge.nn import SparseConv2d, SparseLinear\n"
             "converted = torch.load('sparse.pt', weights_only=False)\n"
             "dense = netdefs.net().eval(); dense.load_state_dict(torch.load('pruned.pt'))\n"
             "assert isinstance(converted.get_submodule('0'), SparseConv2d)\n"
             "assert isinstance(converted.get_submodule('3'), SparseLinear)\n"
             "x = torch.randn(2, 3, 6, 6)\n"
             "assert torch.allclose(converted(x), dense(x), atol=1e-5)\n")
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(tmp_path), str(Path(sparseforge.__file__).parents[1])])})
    assert done.returncode == 0, done.stderr[-3000:]


def test_convert_takes_a_torchvision_name(tmp_path):
    """--model NAME asks torchvision first (a stand-in package here: the test machines have no torchvision)."""
    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "models.py").write_text(
        "from torch import nn\n"
        "def list_models():\n    return ['tinynet']\n"
        "def get_model(name, weights=None):\n"
        "    assert name == 'tinynet' and weights is None\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(12, 4))\n")
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).state_dict(), tmp_path / "w.pt")
    done = run_cli(["convert", "w.pt", "o.pt", "--model", "tinynet", "--example-shape", "1,12", *CPU], tmp_path,
                   pythonpath=(tmp_path / "fake",))
    assert done.returncode == 0 and (tmp_path / "o.pt").is_file(), done.stderr[-3000:]
    done = run_cli(["convert", "w.pt", "o2.pt", "--model", "bignet", "--example-shape", "1,12", *CPU], tmp_path,
                   pythonpath=(tmp_path / "fake",))
    assert done.returncode == 2 and "--model bignet: not a torchvision model" in done.stderr
    assert not (tmp_path / "o2.pt").exists()


def test_convert_takes_a_timm_name(tmp_path):
    """--model NAME asks timm where torchvision has no such model (stand-ins for both here)."""
    fake = tmp_path / "fake"
    (fake / "torchvision").mkdir(parents=True)
    (fake / "torchvision" / "__init__.py").write_text("")
    (fake / "torchvision" / "models.py").write_text("def list_models():\n    return []\n")
    (fake / "timm.py").write_text(
        "from torch import nn\n"
        "def is_model(name):\n    return name == 'tinyvit'\n"
        "def create_model(name, pretrained=True):\n"
        "    assert name == 'tinyvit' and not pretrained\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(12, 4))\n")
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).state_dict(), tmp_path / "w.pt")
    done = run_cli(["convert", "w.pt", "o.pt", "--model", "tinyvit", "--example-shape", "1,12", *CPU], tmp_path,
                   pythonpath=(fake,))
    assert done.returncode == 0 and (tmp_path / "o.pt").is_file(), done.stderr[-3000:]
    before = _files(tmp_path)
    done = run_cli(["convert", "w.pt", "o2.pt", "--model", "bignet", "--example-shape", "1,12", *CPU], tmp_path,
                   pythonpath=(fake,))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--model bignet: not a torchvision model, not a timm model" \
        in lines[0] and _files(tmp_path) == before
