"""The generated source is byte-identical to the committed golden hashes (golden_render.json): sha256 of the
rendered text (its name and shared bytes too) of a fixed list of small seeded plans per kernel family x dtype x
layout x epilogue x sm_80 / sm_90, plus a few matrices of the bundled DLMC sample (fixed configs and the cost
model's pick). A refactor of planning or rendering that changes one kernel's text fails here, naming the case;
a plan that is refused records the refusal, so a refusal that starts or stops fails too.

A deliberate change of the generated code: SPARSEFORGE_GOLDEN_REGEN=1 rewrites the JSON; commit it with the
change and say in the message why the kernels changed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.codegen.gemv24 import render_gemv24, render_unpack24
from sparseforge.plan import TileConfig, make_plan
from sparseforge.mappings.bitmap.plan import BitmapConfig, make_bitmap_plan
from sparseforge.plan.conv import ConvGeometry, make_conv_plan
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
from sparseforge.mappings.tc_scatter.plan import TcScatterConfig, make_tc_scatter_plan
from sparseforge.spmm import plan_spmm
from sparseforge.suite.cases import SAMPLE_DIR

GOLDEN = Path(__file__).with_name("golden_render.json")
REGEN = os.environ.get("SPARSEFORGE_GOLDEN_REGEN") == "1"

DTYPES = ("float32", "float16", "bfloat16")
ARCHES = (80, 90)
# epilogue name -> (bias?, relu, residual)
EPILOGUES = {"plain": (False, False, False), "bias_relu": (True, True, False), "residual": (True, False, True)}


def _weight(m: int, k: int, density: float, seed: int) -> SparseMatrix:
    """Seeded W with one empty row and one dense row (the edges of row balancing and padding)."""
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[m // 3] = 0
    dense[m - 1] = rng.standard_normal(k)
    return SparseMatrix.from_dense(dense)


def _bias(m: int, on: bool):
    return np.random.default_rng(m).standard_normal(m) if on else None


def _text_hash(source) -> str:
    h = hashlib.sha256()
    h.update(source.name.encode())
    h.update(str(source.shared_bytes).encode())
    h.update(source.text.encode())
    return h.hexdigest()


def _spmm_cases():
    """(case id, thunk -> KernelSource) over every SpMM family's configs."""
    small = _weight(24, 40, 0.3, 1)   # M x K of the synthetic cases
    wide = _weight(40, 72, 0.15, 2)
    tile = {
        "rowgroup": TileConfig(),
        "rowgroup-clustered": TileConfig(rows_per_group=4, cluster_rows=True, vec=2),
        "row-per-block": TileConfig(rows_per_group=1, warps_per_block=2, vec=2, load_batch=16),
        "split-k": TileConfig(segment_nnz=4),
        "inline": TileConfig(rows_per_group=2, cluster_rows=True, inline=True, load_batch=16),
        "chunk-k": TileConfig(chunk_k=16, groups_per_block=2),
        "nk-transposed": TileConfig(transpose_x=True, vec=2),
        "inline-transposed": TileConfig(rows_per_group=1, warps_per_block=2, inline=True, load_batch=16,
                                        transpose_x=True),
    }
    data = {
        "csr": (CsrConfig(), make_csr_plan, 8, ("kn", "nk")),
        "csr-n1": (CsrConfig(lanes_per_row=8, columns=1), make_csr_plan, 1, ("kn", "nk")),
        "csr-unroll2": (CsrConfig(16, 8, 4, 2), make_csr_plan, 8, ("kn", "nk")),
        "csr-prefetch": (CsrConfig(prefetch=True), make_csr_plan, 8, ("kn", "nk")),
        "csr-staged": (CsrConfig(8, 4, 16, 1, stage_b=True, ctas=132), make_csr_plan, 4, ("kn", "nk")),
        "csr-staged-prefetch": (CsrConfig(8, 4, 8, 2, stage_b=True, ctas=264, prefetch=True), make_csr_plan, 4,
                                ("kn", "nk")),
        "csr-columns": (CsrColumnsConfig(), make_csr_plan, 64, ("kn",)),
        "csr-columns-2x2": (CsrColumnsConfig(2, 2, 2), make_csr_plan, 96, ("kn",)),
        "bitmap": (BitmapConfig(), make_bitmap_plan, 1, ("kn", "nk")),
        "bitmap-8x2x4": (BitmapConfig(8, 2, 4), make_bitmap_plan, 1, ("kn",)),
        "tc-scatter": (TcScatterConfig(), make_tc_scatter_plan, 16, ("kn", "nk")),
        "tc-scatter-4x4": (TcScatterConfig(warps_per_block=4, ahead=4), make_tc_scatter_plan, 40, ("kn",)),
    }
    for label, config in tile.items():
        for layout in (("nk",) if config.transpose_x else ("kn", "nk")):
            n = 96 if layout == "kn" else 16
            for dtype in DTYPES:
                for epi, (bias, relu, residual) in EPILOGUES.items():
                    if residual:
                        continue  # the row-group kernels add no residual
                    for arch in ARCHES:
                        w = wide if label == "split-k" else small
                        yield (f"tile/{label}/{layout}/{dtype}/{epi}/sm{arch}",
                               lambda w=w, n=n, dtype=dtype, layout=layout, config=config, bias=bias, relu=relu,
                               arch=arch: render(make_plan(w, n, dtype, layout, config, _bias(w.shape[0], bias), relu,
                                                           arch)))
    for label, (config, maker, n, layouts) in data.items():
        for layout in layouts:
            for dtype in DTYPES:
                for epi, (bias, relu, residual) in EPILOGUES.items():
                    for arch in ARCHES:
                        w = wide if label.startswith("csr-columns") else small
                        yield (f"{label}/{layout}/{dtype}/{epi}/sm{arch}",
                               lambda w=w, n=n, dtype=dtype, layout=layout, config=config, bias=bias, relu=relu,
                               residual=residual, arch=arch, maker=maker:
                               render(maker(w, n, dtype, layout, config, _bias(w.shape[0], bias), relu, arch,
                                            residual)))


def _conv_cases():
    w = _weight(8, 4 * 9, 0.4, 3)
    grouped = _weight(8, 2 * 9, 0.5, 4)
    geometries = {
        "3x3p1": lambda layout: ConvGeometry.of((1, 4, 6, 6), 8, 3, padding=1, layout=layout),
        "3x3s2": lambda layout: ConvGeometry.of((1, 4, 7, 7), 8, 3, stride=2, padding=1, layout=layout),
        "grouped": lambda layout: ConvGeometry.of((1, 4, 6, 6), 8, 3, padding=1, groups=2, layout=layout),
    }
    configs = {"columns1": CsrColumnsConfig(), "columns2": CsrColumnsConfig(2, 1, 4), "tile": TileConfig(),
               "tile-vec2": TileConfig(vec=2, rows_per_group=2)}
    for gname, geometry in geometries.items():
        weight = grouped if gname == "grouped" else w
        for cname, config in configs.items():
            for layout in ("nchw", "nhwc"):
                for dtype in DTYPES:
                    for epi, (bias, relu, residual) in EPILOGUES.items():
                        for arch in ARCHES:
                            yield (f"conv/{gname}/{cname}/{layout}/{dtype}/{epi}/sm{arch}",
                                   lambda weight=weight, g=geometry(layout), dtype=dtype, config=config, bias=bias,
                                   relu=relu, residual=residual, arch=arch:
                                   render(make_conv_plan(weight, g, dtype, config, _bias(8, bias), relu, residual,
                                                         arch)))


def _gemv24_cases():
    for dtype in ("float16", "bfloat16"):
        for n in (1, 4):
            for bias in (False, True):
                for arch in ARCHES:
                    yield (f"gemv24/n{n}/{dtype}/{'bias' if bias else 'plain'}/sm{arch}",
                           lambda dtype=dtype, n=n, bias=bias, arch=arch: render_gemv24(dtype, n, bias, arch))
    for arch in ARCHES:
        yield f"unpack24/sm{arch}", lambda arch=arch: render_unpack24(arch)


SAMPLE = ("rn50/magnitude_pruning/0.95/initial_conv.smtx",
          "rn50/magnitude_pruning/0.95/bottleneck_1_block_group1_1_1.smtx",
          "rn50/magnitude_pruning/0.95/bottleneck_3_block_group2_1_1.smtx")


def _sample_cases():
    """A few bundled DLMC matrices: fixed configs of each family, and the cost model's pick at decode,
    small-batch and large N (which also pins the candidates and the cost model's ranking)."""
    for path in SAMPLE:
        stem = Path(path).stem
        w = SparseMatrix.from_smtx(SAMPLE_DIR / path, seed=0, dtype="float32")
        fixed = {"tile": (TileConfig(), make_plan, 64, "float32"),
                 "csr": (CsrConfig(), make_csr_plan, 8, "float16"),
                 "csr-columns": (CsrColumnsConfig(2, 2, 2), make_csr_plan, 128, "float32"),
                 "bitmap": (BitmapConfig(), make_bitmap_plan, 1, "float16"),
                 "tc-scatter": (TcScatterConfig(), make_tc_scatter_plan, 16, "bfloat16")}
        for label, (config, maker, n, dtype) in fixed.items():
            yield (f"sample/{stem}/{label}/{dtype}/sm90",
                   lambda w=w, config=config, maker=maker, n=n, dtype=dtype:
                   render(maker(w.astype(dtype), n, dtype, "kn", config)))
        for n, dtype, layout in ((1, "float16", "nk"), (16, "bfloat16", "nk"), (256, "float32", "kn")):
            for arch in ARCHES:
                yield (f"sample/{stem}/chosen/n{n}/{layout}/{dtype}/sm{arch}",
                       lambda w=w, n=n, dtype=dtype, layout=layout, arch=arch:
                       render(plan_spmm(w, n, dtype, layout, arch=arch)[0]))


def _all_cases():
    return [*_spmm_cases(), *_conv_cases(), *_gemv24_cases(), *_sample_cases()]


def rendered_hashes() -> dict[str, str]:
    """Case id -> sha256 of its kernel text, or "refused: <error type>" where the plan is refused."""
    out = {}
    for case, thunk in _all_cases():
        try:
            out[case] = _text_hash(thunk())
        except (ValueError, TypeError) as err:
            out[case] = f"refused: {type(err).__name__}"
    return out


def test_rendered_source_matches_golden_hashes():
    got = rendered_hashes()
    if REGEN:
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want), (f"the case list changed: new {sorted(set(got) - set(want))[:5]}, gone "
                                         f"{sorted(set(want) - set(got))[:5]}; regenerate with "
                                         "SPARSEFORGE_GOLDEN_REGEN=1 if that was meant")
    changed = [case for case in want if got[case] != want[case]]
    assert not changed, (f"{len(changed)} of {len(want)} kernels render differently, e.g. "
                         f"{[(c, want[c][:20], got[c][:20]) for c in changed[:5]]}")


def test_golden_cases_cover_every_family_and_render_most():
    """The list is not vacuous: every family renders somewhere, and refusals stay a minority."""
    want = json.loads(GOLDEN.read_text())
    rendered = [case for case, h in want.items() if not h.startswith("refused")]
    assert len(rendered) >= 0.7 * len(want)
    for prefix in ("tile/row-per-block", "tile/split-k", "tile/inline", "csr/", "csr-staged/", "csr-prefetch/",
                   "csr-columns/", "bitmap/", "tc-scatter/", "conv/3x3p1/tile/", "conv/3x3p1/columns1/", "gemv24/", "unpack24/",
                   "sample/"):
        assert any(case.startswith(prefix) for case in rendered), prefix
    for arch in ARCHES:
        assert any(case.endswith(f"sm{arch}") for case in rendered)
    assert any("/residual/" in case for case in rendered)


@pytest.mark.parametrize("case", ["tile/split-k/kn/float32/plain/sm90"])
def test_golden_hash_is_of_the_text(case):
    """The hash changes with the text (guards against hashing something constant)."""
    thunk = dict(_all_cases())[case]
    source = thunk()
    assert _text_hash(source) != _text_hash(type(source)(source.name, (source.modules[0] + " ",
                                                                       *source.modules[1:]), source.shared_bytes))
