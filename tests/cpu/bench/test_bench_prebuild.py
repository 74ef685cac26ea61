"""`sparseforge bench` on a GPU compiles every case's candidates side by side, measuring each case as soon as its
own are compiled (bench/cli.py _start_prebuild over runtime/prebuild.py PrebuildRun). The GPU parts are stubbed here: compile_conv2d / compile_spmm
record the arguments the measuring pass gives them, the check-and-time tail returns a made-up record, and the
prebuilds record theirs. What is checked is what makes the prebuild worth anything: every case is prebuilt,
with the arguments (hence the cache keys) of its measuring call, for the GPU present."""
import importlib
import inspect
import json
import time
import types

import pytest
import torch

import sparseforge.bench.cli as bench_cli
import sparseforge.bench.conv as bench_conv
import sparseforge.bench.gpu as bench_gpu
import sparseforge.bench.memory as bench_memory
import sparseforge.runtime.prebuild as runtime_prebuild
from sparseforge.cli import main
from sparseforge.suite import SAMPLE_DIR

conv_module = importlib.import_module("sparseforge.conv")
spmm_module = importlib.import_module("sparseforge.spmm")  # (sparseforge.spmm is also the function)
# the real signatures, taken before any stub replaces the functions: a call is read as the real one would read it
SIGNATURES = {name: inspect.signature(getattr(module, name)) for module, name in
              ((conv_module, "compile_conv2d"), (conv_module, "prebuild_conv2d"), (spmm_module, "compile_spmm"),
               (spmm_module, "prebuild_spmm"))}
COMPILER = types.SimpleNamespace(version="ptxas (test)")  # the keys' compiler part: alike on both sides
ARCH = 90  # the stubbed GPU's compute capability


def _arguments(name: str, args, kwargs) -> dict:
    bound = SIGNATURES[name].bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.fixture
def calls(monkeypatch):
    """A GPU (sm_90) that compiles and times nothing: {"compile_conv2d": [arguments, ...], ...} per call made."""
    made = {name: [] for name in SIGNATURES}
    failing: set = set()  # case names whose prebuild raises
    made["failing"] = failing
    made["order"] = []  # (name, arguments) of every call, as they were made

    def recorder(name: str, result):
        def call(*args, **kwargs):
            if name.startswith("prebuild"):
                time.sleep(0.02)  # compiling takes a while: a measuring call that did not wait would come first
            arguments = _arguments(name, args, kwargs)
            made[name].append(arguments)
            made["order"].append((name, arguments))
            if name.startswith("prebuild") and arguments["W"].digest() in failing:
                raise OSError("No space left on device")
            return result
        return call

    monkeypatch.setattr(bench_cli, "_gpu_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(ARCH, 10))
    monkeypatch.setattr(runtime_prebuild, "prebuild_useful", lambda: True)
    monkeypatch.setattr(bench_memory, "check_fits", lambda jobs, gpu: None)
    monkeypatch.setattr(conv_module, "compile_conv2d", recorder("compile_conv2d", object()))
    monkeypatch.setattr(conv_module, "prebuild_conv2d", recorder("prebuild_conv2d", 3))
    monkeypatch.setattr(spmm_module, "compile_spmm", recorder("compile_spmm", object()))
    monkeypatch.setattr(spmm_module, "prebuild_spmm", recorder("prebuild_spmm", 2))
    monkeypatch.setattr(bench_conv, "_check_and_time", _conv_record)
    monkeypatch.setattr(bench_gpu, "_check_and_time", _spmm_record)
    return made


def _conv_record(case, kernel, w, dtype_name, tune_budget, seed, layout) -> dict:
    return {**bench_conv._record(case, dtype_name, w, layout), "config": "c", "rel_error": 0.0, "error_ok": True,
            "sparseforge_us": 1.0, "cudnn_us": 2.0, "cudnn_layout": "nchw", "speedup_vs_cudnn": 2.0}


def _spmm_record(case, kernel, w, dtype_name, layout, n, tune_budget, seed, with_cusparse, rotate_weights) -> dict:
    return {"case": case.name, "model": case.model, "sparsity": case.sparsity, "M": case.M, "K": case.K, "N": n,
            "nnz": case.nnz, "dtype": dtype_name, "layout": layout, "config": "c", "mapping": "m", "rel_error": 0.0,
            "error_ok": True, "compile_seconds": 0.0, "sparseforge_us": 1.0, "cublas_us": 2.0,
            "speedup_vs_cublas": 2.0}


def _conv_key(a: dict, arch: int) -> str:
    """compile_conv2d's cached-choice key for these arguments (prebuild_conv2d looks up the same one)."""
    w, geometry, name, bias = conv_module._conv_problem(a["W"], a["input_shape"], a["stride"], a["padding"],
                                                        a["dilation"], a["groups"], a["dtype"], a["bias"],
                                                        a["layout"], a["kernel_size"])
    return conv_module._choice_key(w, geometry, name, bias, a["relu"], a["residual"], a["tune_budget"],
                                   a["time_dense"], arch, COMPILER)


def _spmm_key(a: dict, arch: int) -> str:
    problem = spmm_module._Problem.of(a["W"], a["n"], a["dtype"], a["layout"], a["bias"], a["relu"],
                                      a["deterministic"], a["residual"], arch)
    return problem.choice_key(a["tune_budget"], a["time_dense"], COMPILER)


def _each_measured_after_its_prebuild(order: list, measure: str, prebuild: str, key) -> None:
    """A case is measured only once its own prebuild has run (it waits for that job alone)."""
    seen = set()
    for name, arguments in order:
        if name == prebuild:
            seen.add(key(arguments, arguments["arch"]))
        elif name == measure:
            assert key(arguments, ARCH) in seen  # measured before its candidates were compiled


def _same_problems(measured: list[dict], prebuilt: list[dict], key) -> None:
    """One prebuild per measuring call (the pool runs them in any order), on the GPU's arch, with every argument
    the two share equal (W by its digest) and so the same cache key; the measuring call on no fixed config."""
    by_key = {key(p, p["arch"]): p for p in prebuilt}
    assert len(by_key) == len(prebuilt) == len(measured) > 0  # the cases differ: the keys could tell them apart
    for m in measured:
        assert m["device"] == "cuda" and m["config"] is None
        p = by_key.pop(key(m, ARCH))  # KeyError: this case was not prebuilt as it is measured
        assert p["arch"] == ARCH
        shared = set(m) & set(p) - {"W"}
        assert {k: m[k] for k in shared} == {k: p[k] for k in shared}
        assert m["W"].digest() == p["W"].digest()


@pytest.mark.parametrize("budget, expected", [("0.5", 0.5), ("0", None)])
def test_conv_bench_prebuilds_every_case_with_its_measuring_arguments(calls, tmp_path, capsys, budget, expected):
    out = tmp_path / "r.json"
    assert main(["bench", "conv:textcnn:0.9", "--dtype", "all", "--layout", "nhwc", "--tune-budget", budget,
                 "--out", str(out)]) == 0
    measured, prebuilt = calls["compile_conv2d"], calls["prebuild_conv2d"]
    assert len(measured) == 3 * 3  # three layers in three dtypes
    _same_problems(measured, prebuilt, _conv_key)
    assert {m["layout"] for m in measured} == {"nhwc"} and {m["tune_budget"] for m in measured} == {expected}
    assert {m["dtype"] for m in measured} == {"float32", "float16", "bfloat16"}
    text = capsys.readouterr().out
    _each_measured_after_its_prebuild(calls["order"], "compile_conv2d", "prebuild_conv2d", _conv_key)
    assert "prebuilt 27 kernels for 9 cases in " in text  # the stub reports 3 kernels a case
    assert text.index("prebuilt 27 kernels") < text.index("sparseforge bench (convolutions)")
    data = json.loads(out.read_text())
    assert data["prebuilt_kernels"] == 27 and data["prebuild_seconds"] >= 0 and data["prebuild_failures"] == []
    assert len(data["cases"]) == 9


def test_spmm_bench_prebuilds_every_case_with_its_measuring_arguments(calls, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", str(SAMPLE_DIR / "rn50"), "--limit", "2", "--layout", "both", "--dtype", "fp16",
                 "--tune-budget", "0.5", "--out", str(out)]) == 0
    measured, prebuilt = calls["compile_spmm"], calls["prebuild_spmm"]
    assert len(measured) == 2 * 2  # two matrices in two layouts
    _same_problems(measured, prebuilt, _spmm_key)
    _each_measured_after_its_prebuild(calls["order"], "compile_spmm", "prebuild_spmm", _spmm_key)
    assert {m["layout"] for m in measured} == {"kn", "nk"} and {m["tune_budget"] for m in measured} == {0.5}
    assert "prebuilt 8 kernels for 4 cases in " in capsys.readouterr().out
    assert json.loads(out.read_text())["prebuilt_kernels"] == 8


def test_a_failed_prebuild_is_warned_about_and_the_bench_goes_on(calls, tmp_path, capsys):
    from sparseforge.suite.conv import discover_conv

    first = discover_conv("conv:textcnn:0.9")[0]
    calls["failing"].add(first.load(dtype="float16").digest())
    out = tmp_path / "r.json"
    with pytest.warns(UserWarning, match=rf"1 of 3 cases failed .*{first.name} float16: OSError: No space left"):
        assert main(["bench", "conv:textcnn:0.9", "--dtype", "fp16", "--tune-budget", "0.5",
                     "--out", str(out)]) == 0
    assert len(calls["prebuild_conv2d"]) == 3 and len(calls["compile_conv2d"]) == 3  # every case still measured
    assert "prebuilt 6 kernels for 3 cases in " in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["cases"]) == 3 and len(data["prebuild_failures"]) == 1
    assert first.name in data["prebuild_failures"][0]


@pytest.mark.parametrize("spec", ["conv:textcnn:0.9", str(SAMPLE_DIR / "rn50")])
def test_no_prebuild_skips_it(calls, tmp_path, capsys, spec):
    out = tmp_path / "r.json"
    assert main(["bench", spec, "--limit", "2", "--no-prebuild", "--out", str(out)]) == 0
    assert calls["prebuild_conv2d"] == calls["prebuild_spmm"] == []
    assert len(calls["compile_conv2d"] + calls["compile_spmm"]) == 2  # measured all the same
    assert "prebuilt" not in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["prebuild_seconds"] is None and data["prebuild_skipped"] == "--no-prebuild"


def test_cpu_mode_prebuilds_nothing(calls, monkeypatch, tmp_path):
    """CPU mode assembles one predicted plan per case itself: nothing to prebuild, no GPU arch to ask for."""
    monkeypatch.setattr(bench_cli, "_gpu_present", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("asked for a GPU arch"))
    out = tmp_path / "r.json"
    assert main(["bench", "conv:textcnn:0.9", "--limit", "1", "--out", str(out)]) == 0
    assert calls["prebuild_conv2d"] == [] and "prebuild_seconds" not in json.loads(out.read_text())
