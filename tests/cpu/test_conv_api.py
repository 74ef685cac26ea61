"""compile_conv2d / compile_conv1d refuse bad input with the problem named, before any GPU is needed."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_conv1d, compile_conv2d
from sparseforge.mappings.csr.plan import CsrColumnsConfig


def _weight(cout=8, cin=4, k=3):
    return torch.randn(cout, cin, k, k)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(layout="NHWC"), ValueError, "layout must be 'nchw' or 'nhwc'"),
    (dict(layout="nlc"), ValueError, "layout must be 'nchw' or 'nhwc'"),
    (dict(W=torch.randn(8, 36)), ValueError, "Conv2d weight"),
    (dict(W=SparseMatrix.from_dense(np.ones((8, 36), np.float32))), ValueError, "pass kernel_size"),
    (dict(input_shape=(1, 5, 8, 8)), ValueError, "needs Cout x 45"),
    (dict(groups=3), ValueError, "must divide channels"),
    (dict(kernel_size=5), ValueError, "does not match"),
    (dict(config=CsrColumnsConfig(4)), ValueError, "columns .pixels a lane. in"),
    (dict(bias=np.ones(3)), ValueError, "bias must have M = 8"),
    (dict(dtype=torch.float64), TypeError, "float64"),
    (dict(padding=(1, 2, 3)), TypeError, "padding must be an int or a pair"),
])
def test_bad_arguments_are_named_before_the_gpu(kwargs, error, message):
    args = dict(W=_weight(), input_shape=(1, 4, 8, 8), padding=1)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        compile_conv2d(args.pop("W"), args.pop("input_shape"), **args)


def test_a_good_call_without_a_gpu_says_so():
    # named as itself, with the convolution's CPU reference (was: "compile_spmm needs an NVIDIA GPU")
    with pytest.raises(RuntimeError, match=r"compile_conv2d needs an NVIDIA GPU .*plan\.conv\.execute_conv\(\)"):
        compile_conv2d(_weight(), (1, 4, 8, 8), padding=1)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv2d(_weight(), (1, 4, 8, 8), padding=1, layout="nhwc")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv1d(torch.randn(100, 300, 5), (1, 300, 64))


def test_conv1d_refusals():
    with pytest.raises(ValueError, match="Conv1d weight"):
        compile_conv1d(torch.randn(100, 300), (1, 300, 64))
    with pytest.raises(ValueError, match="batch, channels, length"):
        compile_conv1d(torch.randn(100, 300, 3), (300, 64))
    with pytest.raises(ValueError, match="kernel_size=k"):
        compile_conv1d(SparseMatrix.from_dense(np.ones((4, 9), np.float32)), (1, 3, 64))


def test_conv1d_takes_nn_conv1ds_tuples_and_checks_kernel_size():
    m = torch.nn.Conv1d(300, 100, 5, stride=2, padding=1)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):  # the tuples unwrapped: it reached the device check
        compile_conv1d(m.weight, (1, 300, 64), m.stride, m.padding, m.dilation)
    with pytest.raises(ValueError, match="kernel_size 3 does not match W's 5"):
        compile_conv1d(m.weight, (1, 300, 64), kernel_size=3)
    with pytest.raises(TypeError, match="stride must be an int"):
        compile_conv1d(m.weight, (1, 300, 64), stride=(1, 2))


def test_numpy_int_kernel_size_for_a_sparse_weight():
    w = SparseMatrix.from_dense(np.ones((8, 36), np.float32))
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv2d(w, (1, 4, 8, 8), padding=1, kernel_size=np.int64(3))


def test_a_conv_choice_record_round_trips_through_the_cache_and_a_damaged_one_is_not_used(tmp_path):
    from sparseforge.conv import _cached
    from sparseforge.runtime import KernelCache
    from sparseforge.tune.choose import Choice

    choice = Choice([{"label": "csrc_c1s1r4", "mapping": "conv-csr-columns", "predicted_us": 3.0, "us": 2.5}], 0, 4.0, 0.1)
    record = {"config": {"columns": 1, "warps_per_row": 1, "rows_per_block": 4}, "records": choice.records,
              "choice": choice.as_dict()}
    cache = KernelCache(tmp_path, enabled=True)
    cache.put_tuned("k" * 64, 90, record)
    again = cache.get_tuned("k" * 64, 90)
    assert again is not None and _cached(again)[0] == CsrColumnsConfig(1, 1, 4)
    assert _cached({**record, "config": {"columns": 2.0, "warps_per_row": 1, "rows_per_block": 4}}) is None
    assert _cached({**record, "config": {"columns": 4, "warps_per_row": 1, "rows_per_block": 4}}) is None
    assert _cached({"config": [1]}) is None


def test_a_tileconfig_forces_the_generated_mapping_past_the_argument_checks():
    """config=TileConfig(...) is accepted (the generated kernel over the bordered input, in that tiling):
    what stops it here is only the missing GPU."""
    from sparseforge.plan import TileConfig

    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv2d(_weight(), (1, 4, 8, 8), padding=1, config=TileConfig(1, 2, 1))
    with pytest.raises(ValueError, match="or a TileConfig"):
        compile_conv2d(_weight(), (1, 4, 8, 8), padding=1, config=object())


def test_the_chooser_offers_both_mappings_and_drops_what_a_problem_refuses():
    """plan_conv2d (compile_conv2d's ranking without a GPU): csr-columns and every generated mapping are
    candidates; with a residual or ReLU no split K is offered (its partial sums can do neither); vectors only
    where the bordered input allows them; the pick is a renderable plan."""
    from sparseforge.conv import _candidates, plan_conv2d
    from sparseforge.plan.conv import ConvGeometry

    g = ConvGeometry.of((1, 16, 14, 14), 16, 3, padding=1)
    dense = np.where(np.random.default_rng(0).random(g.weight_shape) < 0.2, 1.0, 0.0).astype(np.float32)
    w = SparseMatrix.from_dense(dense)
    plan, choice = plan_conv2d(w, g)
    mappings = {r["mapping"] for r in choice.records}
    assert {"conv-csr-columns", "conv-row-groups", "conv-row-per-block", "conv-split-k", "conv-inline"} <= mappings
    assert not plan.sketch and plan.mapping == choice.records[choice.winner]["mapping"]
    # 14 x 14 with padding 1: OW = 14, Wp = 16, so pairs of pixels a lane (over two shifted copies), not fours
    assert {r["config"].get("vec", 1) for r in choice.records} == {1, 2}
    for kwargs in (dict(residual=True), dict(relu=True)):
        assert "conv-split-k" not in {r["mapping"] for r in plan_conv2d(w, g, **kwargs)[1].records}
    unequal = ConvGeometry.of((1, 16, 14, 14), 16, 3, stride=(1, 2), padding=1)  # bases are per pixel: offered
    assert any(r["family"] == "tile" for r in plan_conv2d(w, unequal)[1].records)
    assert len(_candidates(g, w)) == len(set(_candidates(g, w)))


def test_a_generated_choice_record_round_trips_and_a_damaged_one_is_not_used():
    from sparseforge.conv import _cached
    from sparseforge.plan import TileConfig
    from sparseforge.tune.pipeline import config_record as _config_record
    from sparseforge.tune.choose import Choice

    choice = Choice([{"label": "r4w8v1b16g1", "mapping": "conv-row-groups", "predicted_us": 3.0, "us": 2.5}], 0)
    config = TileConfig(4, 8, 1, 16, cluster_rows=True)
    record = {**_config_record(config), "records": choice.records, "choice": choice.as_dict()}
    assert record["family"] == "tile" and _cached(record)[0] == config
    assert _cached({**record, "config": {**record["config"], "rows_per_group": 4.0}}) is None
    assert _cached({**record, "config": {**record["config"], "inline": 1}}) is None
    assert _cached({**record, "family": "csr"}) is None  # the small-N kernel is no convolution


def test_the_chooser_in_nhwc_offers_both_mappings_on_channels_last_plans():
    """plan_conv2d on an nhwc geometry: both mappings ranked, every plan in nhwc, and the csr-columns
    kernel's strided loads priced above its NCHW twin's coalesced ones (the generated one's operand is the
    same bordered copy in both layouts)."""
    import dataclasses

    from sparseforge.conv import plan_conv2d
    from sparseforge.plan.conv import ConvGeometry
    from sparseforge.tune.cost import estimate

    g = ConvGeometry.of((1, 64, 14, 14), 64, 3, padding=1, layout="nhwc")
    dense = np.where(np.random.default_rng(0).random(g.weight_shape) < 0.2, 1.0, 0.0).astype(np.float32)
    w = SparseMatrix.from_dense(dense)
    plan, choice = plan_conv2d(w, g)
    assert plan.geometry.layout == "nhwc" and plan.name.startswith(("conv2d_nhwc_", "conv2d_imm_nhwc_"))
    assert {"conv-csr-columns", "conv-row-groups"} <= {r["mapping"] for r in choice.records}
    from sparseforge.plan.conv import make_conv_plan

    columns = [make_conv_plan(w, geometry, config=CsrColumnsConfig(1, 1, 4))
               for geometry in (dataclasses.replace(g, layout="nchw"), g)]
    assert estimate(columns[1]).terms["operand"] > estimate(columns[0]).terms["operand"]
