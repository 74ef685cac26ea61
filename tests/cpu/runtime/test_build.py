"""build_kernel end to end without a GPU: real ptxas + nvlink compile into the disk cache, then a cache hit
that loads without rendering or compiling again (the module loader is replaced by a recorder)."""
import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan
from sparseforge.runtime import KernelCache, PtxasCompiler
from sparseforge.runtime import kernel as kernel_module


class FakeLoaded:
    loads = []

    def __init__(self, cubin, name, ordinal):
        assert cubin[:4] == b"\x7fELF"
        FakeLoaded.loads.append(name)


@pytest.fixture
def fake_gpu(monkeypatch):
    import sys
    import types

    fake_driver = types.ModuleType("sparseforge.runtime.driver")
    fake_driver.LoadedKernel = FakeLoaded
    monkeypatch.setitem(sys.modules, "sparseforge.runtime.driver", fake_driver)
    FakeLoaded.loads.clear()


def test_miss_compiles_hit_skips_render(tmp_path, fake_gpu, monkeypatch):
    w = SparseMatrix.from_dense(np.where(np.random.default_rng(0).random((24, 40)) < 0.2, 1.0, 0.0).astype(np.float32))
    plan = make_plan(w, 64, "float16", "kn", TileConfig(4, 2, 2))
    cache = KernelCache(tmp_path, enabled=True)
    first = kernel_module.build_kernel(plan, 0, cache=cache, compiler=PtxasCompiler.available())
    assert not first.cache_hit and first.compile_seconds > 0 and "fma.rn.f32" in first.source

    def no_render(plan):
        raise AssertionError("a cache hit must not render the source")

    monkeypatch.setattr(kernel_module, "render", no_render)
    second = kernel_module.build_kernel(plan, 0, cache=cache, compiler=PtxasCompiler.available())
    assert second.cache_hit and second.compile_seconds == 0.0
    assert FakeLoaded.loads == [plan.name, plan.name]


def test_dump_source(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_DUMP_SOURCE", str(tmp_path / "dump"))
    w = SparseMatrix.from_dense(np.eye(8, dtype=np.float32))
    plan = make_plan(w, 32)
    kernel_module.build_kernel(plan, 0, cache=KernelCache(tmp_path / "c", enabled=True),
                               compiler=PtxasCompiler.available())
    assert (tmp_path / "dump" / f"{plan.name}.ptx").read_text().startswith("// sparseforge generated kernel")


@pytest.mark.parametrize("config", [TileConfig(4, 2, 2), TileConfig(4, 2, 1, 8, 1, cluster_rows=True),
                                    TileConfig(1, 4, 1, 16, inline=True), TileConfig(2, 2, 1, 8, transpose_x=True)],
                         ids=["row_groups", "clustered", "inline", "nk_transposed"])
def test_a_sketch_loads_the_cached_kernel_and_makes_the_whole_plan_only_when_asked(tmp_path, fake_gpu, monkeypatch,
                                                                                   config):
    """The cached-choice path: the sketch's key, name and launch figures are the whole plan's, a cache hit
    loads from the sketch alone (no planning, no rendering), and k.plan makes the whole plan on first use."""
    from sparseforge.plan import sketch_plan
    from sparseforge.runtime.kernel import plan_key

    rng = np.random.default_rng(3)
    w = SparseMatrix.from_dense(np.where(rng.random((40, 90)) < 0.2, rng.standard_normal((40, 90)), 0).astype(np.float32))
    layout = "nk" if config.transpose_x else "kn"
    full = make_plan(w, 48, "float32", layout, config, bias=np.arange(40.0), relu=False)
    sketch = sketch_plan(w, 48, "float32", layout, config, bias=np.arange(40.0), relu=False)
    assert sketch.sketch and plan_key(sketch, "v") == plan_key(full, "v") and sketch.name == full.name
    assert (sketch.grid, sketch.threads, sketch.partial_rows) == (full.grid, full.threads, full.partial_rows)
    cache, compiler = KernelCache(tmp_path, enabled=True), PtxasCompiler.available()
    kernel_module.build_kernel(full, 0, cache=cache, compiler=compiler)
    made = []

    def whole():
        made.append(1)
        return make_plan(w, 48, "float32", layout, config, bias=np.arange(40.0), relu=False)

    monkeypatch.setattr(kernel_module, "render", lambda plan: (_ for _ in ()).throw(AssertionError("rendered")))
    hit = kernel_module.build_kernel(sketch, 0, cache=cache, compiler=compiler, full_plan=whole)
    assert hit.cache_hit and made == [] and hit.in_shape == ((90, 48) if layout == "kn" else (48, 90))
    assert hit.mapping == full.mapping and not made
    assert hit.plan.groups == full.groups and made == [1] and hit.plan is hit.plan


def test_a_split_sketch_launches_like_its_plan():
    """Split groups: the rows the launch zeroes first and the grid come from the sketch alike."""
    from sparseforge.plan import sketch_plan
    from sparseforge.runtime.kernel import plan_key

    rng = np.random.default_rng(5)
    w = SparseMatrix.from_dense(np.where(rng.random((40, 300)) < 0.3, rng.standard_normal((40, 300)), 0).astype(np.float32))
    config = TileConfig(4, 2, 1, 8, 1, 7, cluster_rows=True)
    full, sketch = make_plan(w, 16, config=config), sketch_plan(w, 16, config=config)
    assert full.partial_rows and (sketch.grid, sketch.partial_rows) == (full.grid, full.partial_rows)
    assert plan_key(sketch, "v") == plan_key(full, "v") and sketch.mapping == full.mapping == "split-k"


def test_a_sketch_on_a_cache_miss_renders_the_whole_plan_once(tmp_path, fake_gpu):
    from sparseforge.plan import sketch_plan

    w = SparseMatrix.from_dense(np.where(np.random.default_rng(4).random((24, 40)) < 0.3, 1.0, 0.0).astype(np.float32))
    made = []

    def whole():
        made.append(1)
        return make_plan(w, 32)

    kernel = kernel_module.build_kernel(sketch_plan(w, 32), 0, cache=KernelCache(tmp_path, enabled=True),
                                        compiler=PtxasCompiler.available(), full_plan=whole)
    assert not kernel.cache_hit and made == [1] and "fma.rn.f32" in kernel.source and made == [1]
    with pytest.raises(ValueError, match="pass full_plan"):
        kernel_module.build_kernel(sketch_plan(w, 32), 0, cache=KernelCache(tmp_path, enabled=True))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_conv_sketch_loads_the_cached_kernel_and_makes_the_whole_plan_only_when_asked(tmp_path, fake_gpu,
                                                                                        monkeypatch, layout):
    """A convolution's cached winner and the chooser's prebuilt candidates load from the sketch: its key, name
    and every launch figure are the whole plan's, and the whole plan (0.1-0.7 s of Python on a large layer) is
    made only when k.plan is read."""
    import torch

    from sparseforge.conv import _conv_problem, _planner
    from sparseforge.runtime import conv as conv_runtime
    from sparseforge.runtime.kernel import plan_key

    rng = np.random.default_rng(6)
    weight = rng.standard_normal((16, 8, 3, 3)) * (rng.random((16, 8, 3, 3)) < 0.3)
    w, geometry, name, bias = _conv_problem(weight, (2, 8, 10, 10), 1, 1, 1, 1, "float16", np.arange(16.0), layout,
                                            None)
    make = _planner(w, geometry, name, bias, False, False, 90)
    for config in (TileConfig(4, 2, 2, 8, 1, 5), TileConfig(4, 2, 2)):  # split groups (rows zeroed first), whole
        full, sketch = make(config), make(config, sketch=True)
        assert sketch.sketch and not full.sketch and bool(full.partial_rows) == bool(config.segment_nnz)
        assert plan_key(sketch, "v") == plan_key(full, "v") and sketch.name == full.name
        for figure in ("grid", "threads", "partial_rows", "shifts", "plane", "output_alignment", "output_strides",
                       "residual", "bordered", "config"):
            assert getattr(sketch, figure) == getattr(full, figure), figure
    monkeypatch.setattr(conv_runtime.ConvKernel, "_bordered_buffer", lambda self, batch: torch.zeros(1))
    monkeypatch.setattr(kernel_module, "weight_data", lambda plan, device, fresh=False: ((), None, None))
    cache, compiler = KernelCache(tmp_path, enabled=True), PtxasCompiler.available()
    conv_runtime.build_conv_kernel(full, 0, cache=cache, compiler=compiler)
    made = []

    def whole():
        made.append(1)
        return make(config)

    monkeypatch.setattr(kernel_module, "render", lambda plan: (_ for _ in ()).throw(AssertionError("rendered")))
    hit = conv_runtime.build_conv_kernel(sketch, 0, cache=cache, compiler=compiler, full_plan=whole)
    assert hit.cache_hit and hit.launch_plan is sketch and hit.config == full.config and hit.layout == layout
    assert hit.mapping == full.mapping and hit.in_shape == (8, 10, 10) and not made
    assert hit.plan.groups == full.groups and made == [1] and hit.plan is hit.plan
