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
