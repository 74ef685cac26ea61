"""Generated PTX: readable, immediates in the FMA stream, and it assembles for sm_90 and sm_80 without
spills (ptxas runs on CPU-only machines)."""
import re
import subprocess

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.codegen.emitter import f32_immediate
from sparseforge.plan import TileConfig, make_plan
from sparseforge.runtime import PtxasCompiler, find_tool
from sparseforge.suite import SAMPLE_DIR


def _tiny(layout="kn", dtype="float32", **kw):
    dense = np.array([[1.5, 0, 0, 2.0], [0, 0, -3.0, 0], [0, 0, 0, 0]], np.float32)
    return make_plan(SparseMatrix.from_dense(dense), 64, dtype, layout, TileConfig(rows_per_group=2), **kw)


def test_immediates():
    assert f32_immediate(1.0) == "0f3F800000"
    assert f32_immediate(-2.5) == "0fC0200000"


def test_weights_are_immediate_fma_operands_and_loads_constant_offsets():
    source = render(_tiny())
    text = source.text
    fmas = re.findall(r"fma\.rn\.f32 %a\d+, %b\d+, (0f[0-9A-F]{8}), %a\d+;", text)
    assert sorted(set(fmas)) == sorted({f32_immediate(1.5), f32_immediate(2.0), f32_immediate(-3.0)})
    loads = re.findall(r"ld\.global\.nc\.\S+ \S+, \[%rdb0(?:\+(\d+))?\];", text)
    assert sorted(int(o or 0) for o in loads) == [0, 2 * 64 * 4, 3 * 64 * 4]  # k = 0, 2, 3; N = 64 fp32
    assert "// group 0: rows 0; k 0..3" in text and "// group 1: rows 1..2" in text


def test_render_is_pure():
    assert render(_tiny()) == render(_tiny())


def test_bias_relu_epilogue_in_source():
    text = render(_tiny(bias=[1.0, 2.0, -1.0], relu=True)).text
    assert f"mov.b32 %a0, {f32_immediate(1.0)};" in text
    assert "max.NaN.f32" in text  # ReLU keeps NaN, as torch.relu does


def _assemble(text: str, arch: int) -> str:
    ptxas = find_tool("ptxas")
    assert ptxas, "ptxas (CUDA toolkit) is needed for the codegen tests"
    done = subprocess.run([ptxas, f"-arch=sm_{arch}", "-c", "-v", "-o", "/dev/null", "-"], input=text,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _assemble_without_spills_and_link(source, arch: int) -> None:
    for module in source.modules:
        report = _assemble(module, arch)
        assert re.search(r"[1-9]\d* bytes spill", report) is None, report
    assert PtxasCompiler.available().compile(source.modules, arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_module_assembles_without_spills(arch, layout, dtype):
    case = SAMPLE_DIR / "rn50/magnitude_pruning/0.95/bottleneck_1_block_group1_1_1.smtx"
    w = SparseMatrix.from_smtx(case)
    for config in (TileConfig(4, 4, 4), TileConfig(8, 2, 2, 16, 2)):
        plan = make_plan(w, 196, dtype, layout, config, bias=np.ones(w.shape[0]), relu=True, arch=arch)
        for module in render(plan).modules:
            report = _assemble(module, arch)
            assert "bytes spill" not in report or re.search(r"[1-9]\d* bytes spill", report) is None, report


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("name, n", [("bottleneck_3_block_group2_1_1", 784), ("initial_conv", 12544),
                                     ("bottleneck_1_block_group3_1_1", 196)])
def test_dlmc_kernels_assemble_without_spills_and_link(name, n, arch):
    from sparseforge.tune import default_config

    w = SparseMatrix.from_smtx(SAMPLE_DIR / f"rn50/magnitude_pruning/0.9/{name}.smtx")
    for dtype in ("float32", "float16"):
        plan = make_plan(w, n, dtype, "kn", default_config(n, "kn"), arch=arch)
        modules = render(plan).modules
        for module in modules:
            report = _assemble(module, arch)
            assert re.search(r"[1-9]\d* bytes spill", report) is None, report
        cubin = PtxasCompiler.available().compile(modules, arch)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


def test_large_offsets_get_region_bases():
    dense = np.zeros((2, 3000), np.float32)
    dense[0, 2999] = 1.0
    plan = make_plan(SparseMatrix.from_dense(dense), 200_000, config=TileConfig(vec=4))
    text = render(plan).text
    assert "%rdb1" in text  # 2999 * 200000 * 4 bytes is past a 32-bit immediate
    for module in render(plan).modules:
        _assemble(module, 90)


# bf16 atomic adds need sm_90: make_plan refuses bf16 splits for sm_80 (tested in test_plan)
SPLIT_TARGETS = [(a, d) for a in (90, 80) for d in ("float32", "float16", "bfloat16") if (a, d) != (80, "bfloat16")]


@pytest.mark.parametrize("arch,dtype", SPLIT_TARGETS)
@pytest.mark.parametrize("layout,vec", [("kn", 1), ("kn", 2), ("kn", 4), ("nk", 1)])
def test_split_rows_add_atomically_and_assemble(arch, layout, vec, dtype):
    rng = np.random.default_rng(1)
    dense = np.where(rng.random((6, 300)) < 0.3, rng.standard_normal((6, 300)), 0).astype(np.float32)
    plan = make_plan(SparseMatrix.from_dense(dense), 256, dtype, layout,
                     TileConfig(rows_per_group=2, vec=vec, segment_nnz=40), bias=np.arange(6.0), arch=arch)
    assert any(g.partial for g in plan.groups)
    text = render(plan).text
    kind = {"float32": "red.global.add.f32", "float16": "red.global.add.noftz.f16",
            "bfloat16": "red.global.add.noftz.bf16"}[dtype]
    assert kind in text and "(piece 1 of" in text
    if dtype != "float32" and vec > 1:
        assert kind + "x2" in text
    bias_starts = re.findall(r"mov\.b32 %a0, (0f[0-9A-F]{8});", text)
    assert f32_immediate(0.0) in bias_starts  # later pieces start from zero, the first from the bias
    for module in render(plan).modules:
        report = _assemble(module, arch)
        assert re.search(r"[1-9]\d* bytes spill", report) is None, report


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("config", [TileConfig(4, 2, 1, 8, 4, 0, 64), TileConfig(2, 4, 4, 16, 3, 30, 100),
                                    TileConfig(4, 8, 1, 16, 8, 0, 64, cluster_rows=True)], ids=lambda c: c.short())
def test_chunked_runs_assemble_one_function_per_run(arch, dtype, config):
    case = SAMPLE_DIR / "rn50/magnitude_pruning/0.9/bottleneck_1_block_group1_1_1.smtx"
    w = SparseMatrix.from_smtx(case, seed=0)
    plan = make_plan(w, 256, dtype, "kn", config, arch=arch)
    source = render(plan)
    runs = plan.grid[1]
    assert source.modules[0].count("call.uni") == runs and "acc_in" not in source.text
    assert [source.text.count(f"_run{r}(.param") for r in range(runs)] == [2] * runs  # extern + definition
    _assemble_without_spills_and_link(source, arch)


def test_chunk_k_is_for_kn_only():
    w = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="chunk_k applies to layout 'kn' or to 'nk' with transpose_x"):
        make_plan(w, 8, layout="nk", config=TileConfig(chunk_k=2))
    with pytest.raises(ValueError, match="chunk_k"):
        TileConfig(chunk_k=-1)


@pytest.mark.parametrize("arch,dtype", SPLIT_TARGETS)
@pytest.mark.parametrize("extra", [{}, {"segment_nnz": 30}, {"groups_per_block": 3, "chunk_k": 100}],
                         ids=["plain", "split", "chunked"])
def test_nk_with_transposed_x_reads_like_kn_and_assembles(arch, dtype, extra):
    rng = np.random.default_rng(2)
    dense = np.where(rng.random((40, 300)) < 0.1, rng.standard_normal((40, 300)), 0).astype(np.float32)
    plan = make_plan(SparseMatrix.from_dense(dense), 200, dtype, "nk",
                     TileConfig(rows_per_group=4, warps_per_block=4, transpose_x=True, **extra), arch=arch)
    assert plan.direct and plan.grid == (2, -(-len(plan.groups) // plan.config.groups_per_block))
    text = render(plan).text
    assert "ld.global.nc" in text and ".shared" not in text
    es = plan.element_bytes
    assert re.search(rf"\[%rdb0\+{200 * es * 7}\]", text) or 7 not in {c.k for g in plan.groups for c in g.columns}
    source = render(plan)
    _assemble_without_spills_and_link(source, arch)


def test_transpose_x_is_for_nk_only():
    w = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="transpose_x applies to layout 'nk'"):
        make_plan(w, 8, layout="kn", config=TileConfig(transpose_x=True))
