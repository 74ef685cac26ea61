"""Prebuilding (spmm.prebuild_spmm, conv.prebuild_conv2d, the nn modules' prebuild, nn.prebuild_layers): without
a GPU, the disk cache gets exactly the kernels the chooser would compile for the same problem, so that the
measuring pass on the GPU finds every candidate built (convert compiles a model's layers side by side first)."""
import numpy as np
import pytest
import torch
from torch import nn

from sparseforge import SparseMatrix, prebuild_conv2d, prebuild_spmm
from sparseforge.conv import _candidates, _conv_problem, _planner
from sparseforge.nn import SparseConv2d, SparseLinear, prebuild_layers
from sparseforge.plan import TileConfig
from sparseforge.nn.convert import CHANNELS_LAST
from sparseforge.runtime import compile_plan
from sparseforge.runtime.compiler import PtxasCompiler
from sparseforge.spmm import _make_plan, _space
from sparseforge.tune.pipeline import compile_candidate, describe as _describe, plans_of as _plans, renderable as _renderable
from sparseforge.tune.choose import rank, to_compile

pytestmark = pytest.mark.skipif(not PtxasCompiler.available(), reason="needs the CUDA toolkit's ptxas")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPARSEFORGE_NO_CACHE", raising=False)
    return tmp_path / "cache"


def _cubins(cache) -> int:
    return len(list(cache.rglob("kernel.cubin")))


def _weight(m: int, k: int, density: float, seed: int = 0) -> SparseMatrix:
    rng = np.random.default_rng(seed)
    return SparseMatrix.from_dense(rng.standard_normal((m, k)) * (rng.random((m, k)) < density))


def _all_hit(make, plans, picked) -> bool:
    return all(compile_plan(_renderable(make, plans[i])).hit for i in picked)


@pytest.mark.parametrize("budget", [5.0, None])
def test_prebuild_spmm_compiles_what_the_chooser_would_and_nothing_else(cache, budget):
    w = _weight(48, 96, 0.2).astype("float16")
    built = prebuild_spmm(w, 16, "float16", "nk", arch=90, tune_budget=budget)
    make = lambda cfg, sketch=False: _make_plan(w, 16, "float16", "nk", cfg, None, False, 90, sketch)  # noqa: E731
    plans = _plans(make, _space(w, 16, "float16", "nk", False, False))
    records = [_describe(p) for p in plans]
    picked = to_compile(records, budget) if budget is not None else [rank([r["predicted_us"] for r in records])[0]]
    assert built == len(picked) == _cubins(cache) and (budget is None or built >= 2)
    assert _all_hit(make, plans, picked)  # what the chooser compiles next is already there
    assert prebuild_spmm(w, 16, "float16", "nk", arch=90, tune_budget=budget) == 0  # found: nothing built
    assert _cubins(cache) == built


def test_a_pinned_config_prebuilds_that_one_kernel(cache):
    from sparseforge.mappings.csr.plan import CsrConfig

    w = _weight(48, 96, 0.2).astype("float16")
    config = CsrConfig(warps_per_block=2)
    assert prebuild_spmm(w, 1, "float16", "nk", arch=90, config=config) == 1 == _cubins(cache)
    make = lambda cfg, sketch=False: _make_plan(w, 1, "float16", "nk", cfg, None, False, 90, sketch)  # noqa: E731
    assert _all_hit(make, [make(config)], [0])  # compile_spmm(config=...) finds it built
    assert prebuild_spmm(w, 1, "float16", "nk", arch=90, config=config) == 0
    with pytest.raises(ValueError, match="deterministic=True excludes split rows"):  # compile_spmm's refusals
        prebuild_spmm(w, 1, "float16", "nk", arch=90, deterministic=True,
                      config=TileConfig(segment_nnz=64))
    linear = nn.Linear(96, 48).half()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w.to_dense()))
    layer = SparseLinear.from_dense(linear, policy="sparse")
    layer.pin({1: config})
    assert layer.prebuild([1], arch=90) == 1 == _cubins(cache) - 1  # its own bias: one more kernel, no shortlist


def test_a_device_csr_with_a_pinned_data_config_is_packed_where_it_lies(cache):
    """W as a DeviceCsr: a config whose family packs on the device (csr) plans from the tensors as they are,
    the same kernel as the host plan's; a config without a device packer (tile), and the chooser (which keys
    its cached choice on W's digest), take the host SparseMatrix."""
    from sparseforge.formats.device import DeviceCsr
    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.spmm import _placed

    w = _weight(48, 96, 0.2).astype("float16")
    device_w = DeviceCsr(torch.from_numpy(w.indptr.copy()), torch.from_numpy(w.indices.copy()),
                         torch.from_numpy(w.values.copy()), w.shape, "float16")
    config = CsrConfig(warps_per_block=2)
    assert _placed(device_w, config) is device_w
    assert _placed(device_w, TileConfig()) == w and _placed(device_w, None) == w
    assert prebuild_spmm(device_w, 1, "float16", "nk", arch=90, config=config) == 1 == _cubins(cache)
    assert prebuild_spmm(w, 1, "float16", "nk", arch=90, config=config) == 0  # the host plan's kernel: built
    assert prebuild_spmm(device_w, 4, "float16", "nk", arch=90, tune_budget=None) == 1  # the chooser's pick


def test_prebuild_conv2d_in_either_layout(cache):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((8, 4, 3, 3)) * (rng.random((8, 4, 3, 3)) < 0.3)
    for layout in ("nchw", "nhwc"):
        before = _cubins(cache)
        built = prebuild_conv2d(weight, (1, 4, 9, 9), padding=1, dtype="float32", layout=layout, arch=90,
                                tune_budget=5.0)
        w, geometry, name, bias = _conv_problem(weight, (1, 4, 9, 9), 1, 1, 1, 1, "float32", None, layout, None)
        make = _planner(w, geometry, name, bias, False, False, 90)
        plans = _plans(make, _candidates(geometry, w))
        picked = to_compile([_describe(p) for p in plans], 5.0)
        assert built == len(picked) == _cubins(cache) - before and _all_hit(make, plans, picked)


def test_the_chooser_takes_a_prebuilt_candidate_without_making_its_whole_plan(cache):
    """compile_candidate on a sketch: a prebuilt kernel is a cache hit that makes no whole plan (measuring a
    large layer's candidates made one each, 0.1-0.7 s of Python); a miss makes it once, to render it, and keeps it."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((16, 8, 3, 3)) * (rng.random((16, 8, 3, 3)) < 0.3)
    prebuild_conv2d(weight, (1, 8, 9, 9), padding=1, dtype="float32", arch=90, tune_budget=5.0)
    w, geometry, name, bias = _conv_problem(weight, (1, 8, 9, 9), 1, 1, 1, 1, "float32", None, "nchw", None)
    planner = _planner(w, geometry, name, bias, False, False, 90)
    made = []

    def make(config, sketch=False):
        made.append(sketch)
        return planner(config, sketch)

    plans = _plans(make, _candidates(geometry, w))
    picked = to_compile([_describe(p) for p in plans], 5.0)
    sketches = [i for i in picked if getattr(plans[i], "sketch", False)]
    assert sketches and made.count(False) == 0
    for i in sketches:
        launch, built, full_plan = compile_candidate(make, plans[i])
        assert launch is plans[i] and built.hit and made.count(False) == 0
    unbuilt = next(i for i, p in enumerate(plans) if getattr(p, "sketch", False) and i not in picked)
    launch, built, full_plan = compile_candidate(make, plans[unbuilt])
    assert not built.hit and made.count(False) == 1 and full_plan() is full_plan() and made.count(False) == 1
    assert full_plan().groups and not full_plan().sketch


def test_prebuild_slots_split_one_problem_into_its_candidates_and_cover_them_all(tmp_path, monkeypatch):
    """slot k compiles only the k-th of the candidates the chooser would compile: the slots together build
    what one unsplit prebuild builds, each exactly once, and a slot past the last builds nothing."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((8, 4, 3, 3)) * (rng.random((8, 4, 3, 3)) < 0.3)
    arguments = dict(padding=1, dtype="float32", arch=90, tune_budget=5.0)
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "whole"))
    whole = prebuild_conv2d(weight, (1, 4, 9, 9), **arguments)
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "slots"))
    per_slot = [prebuild_conv2d(weight, (1, 4, 9, 9), slot=k, **arguments) for k in range(whole + 2)]
    assert whole >= 2 and per_slot == [1] * whole + [0, 0]
    names = {p.parent.name for p in (tmp_path / "whole").rglob("kernel.cubin")}
    assert names == {p.parent.name for p in (tmp_path / "slots").rglob("kernel.cubin")}
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="slot must be a candidate's place"):
            prebuild_conv2d(weight, (1, 4, 9, 9), slot=bad, **arguments)


def test_the_disk_cache_off_means_nothing_is_prebuilt_for_a_model(cache, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_NO_CACHE", "1")
    layer = nn.Linear(32, 16)
    with torch.no_grad():  # pruned: an unpruned layer is not prebuilt anyway
        layer.weight.mul_(torch.rand(layer.weight.shape) > 0.5)
    assert prebuild_layers([(layer, [(4, 32)])], 5.0, arch=90) == 0 and _cubins(cache) == 0


def test_a_layer_with_nothing_pruned_is_not_prebuilt(cache):
    """measure_layer keeps such a layer dense without timing it: its kernels would be compiled for nothing."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    assert prebuild_layers([(layer, [(4, 32)]), (nn.Conv2d(4, 8, 3), [(1, 4, 8, 8)])], 5.0, arch=90) == 0
    assert _cubins(cache) == 0


def test_prebuild_layers_builds_each_layer_as_measure_layer_will_decide_it(cache):
    """Linear widths as token counts, conv shapes in their layout; a layer the sparse modules refuse (reflect
    padding) and a shape they refuse are left to measure_layer."""
    torch.manual_seed(0)
    linear, conv = nn.Linear(64, 24), nn.Conv2d(4, 8, 3, padding=1)
    reflect = nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect")
    for m in (linear, conv, reflect):
        with torch.no_grad():
            m.weight.mul_(torch.rand(m.weight.shape) < 0.3)
    layers = [(linear, [(2, 3, 64), (6, 64)]), (conv, [(1, 4, 8, 8), (1, 4, 8, 8, CHANNELS_LAST)]),
              (reflect, [(1, 4, 8, 8)])]
    built = prebuild_layers(layers, 5.0, arch=90, workers=2)
    assert built == _cubins(cache) > 0
    # the same kernels as each module's own prebuild, into an empty cache
    for path in cache.rglob("kernel.cubin"):
        path.unlink()
    one = SparseLinear.from_dense(linear, tune_budget=5.0).prebuild([6], arch=90)
    nchw = SparseConv2d.from_dense(conv, tune_budget=5.0).prebuild([(1, 4, 8, 8)], arch=90)
    nhwc = SparseConv2d.from_dense(conv, tune_budget=5.0).prebuild([(1, 4, 8, 8)], arch=90, channels_last=True)
    assert one + nchw + nhwc == built and _cubins(cache) == built
    assert prebuild_layers(layers, 5.0, arch=90, workers=2) == 0  # all found: nothing built again


def test_a_failed_prebuild_warns_and_the_rest_goes_on(cache, monkeypatch, tmp_path):
    """A prebuild is a head start: one that fails (here the cache's disk) is named in a warning and the other
    layers are still prebuilt; measure_layer compiles what it needs. (The jobs run in forked workers: each
    call is recorded as a file.)"""
    import importlib

    spmm_module = importlib.import_module("sparseforge.spmm")  # (sparseforge.spmm is also the function)

    real = spmm_module.prebuild_spmm
    (tmp_path / "calls").mkdir()

    def flaky(**arguments):
        (tmp_path / "calls" / str(arguments["n"])).touch()
        if arguments["n"] == 4:
            raise OSError("No space left on device")
        return real(**arguments)

    monkeypatch.setattr(spmm_module, "prebuild_spmm", flaky)
    torch.manual_seed(1)
    linear = nn.Linear(32, 16)
    with torch.no_grad():  # pruned: a layer with nothing pruned is kept dense, so nothing is prebuilt for it
        linear.weight.mul_(torch.rand(linear.weight.shape) > 0.5)
    with pytest.warns(UserWarning, match="1 of 2 layer shapes failed .* OSError: No space left"):
        built = prebuild_layers([(linear, [(4, 32), (8, 32)])], 5.0, arch=90, workers=2)
    calls = sorted(int(p.name) for p in (tmp_path / "calls").iterdir())
    assert calls == [4, 8] and built == _cubins(cache) > 0


def test_prebuild_layers_hands_the_pool_the_largest_layers_first(cache, monkeypatch):
    """Where W is the code a compile grows with the nonzeros: the largest layer's jobs go first, so that none
    of them starts last and ends the pool's work alone."""
    import importlib

    prebuild = importlib.import_module("sparseforge.runtime.prebuild")
    handed = []

    def record(jobs, workers=None, what="", processes=False):
        handed.extend(label for label, _ in jobs)
        return prebuild.Prebuilt(0, len(jobs), (), 0, 1)

    monkeypatch.setattr(prebuild, "run_prebuilds", record)
    torch.manual_seed(2)
    small, large, middle = nn.Linear(16, 8), nn.Conv2d(8, 16, 3, padding=1), nn.Linear(32, 16)  # 128, 1152, 512
    for m in (small, large, middle):
        with torch.no_grad():
            m.weight.mul_(torch.rand(m.weight.shape) < 0.5)
    prebuild_layers([(small, [(3, 16)]), (large, [(1, 8, 6, 6)]), (middle, [(5, 32)])], 5.0, arch=90)
    assert len(handed) > 2 and all(label.startswith("Conv2d (1, 8, 6, 6) #") for label in handed[:-2])
    assert handed[-2:] == ["Linear n=5", "Linear n=3"]
