import pytest

from sparseforge.semi.decide import DENSE, MIN_SPEEDUP, SPARSE, decide, fixed


def test_sparse_only_with_margin():
    assert decide(64, sparse_us=10.0, dense_us=20.0).path == SPARSE
    assert decide(64, sparse_us=10.0, dense_us=10.0 * MIN_SPEEDUP).path == SPARSE
    tie = decide(64, sparse_us=10.0, dense_us=10.2)
    assert tie.path == DENSE and "dense kept" in tie.reason
    assert decide(64, sparse_us=30.0, dense_us=10.0).path == DENSE


def test_decision_records_timings_and_speedup():
    d = decide(2048, sparse_us=8.0, dense_us=12.0, config_id=3, padded_n=2048)
    assert d.speedup == pytest.approx(1.5)
    assert d.as_dict() == {"n": 2048, "path": SPARSE, "reason": d.reason, "sparse_us": 8.0, "dense_us": 12.0,
                           "config_id": 3, "padded_n": 2048, "mode": "any", "speedup": pytest.approx(1.5)}
    assert "1.50x faster" in d.reason


def test_custom_margin():
    assert decide(1, sparse_us=10.0, dense_us=10.5, min_speedup=1.0).path == SPARSE
    assert decide(1, sparse_us=10.0, dense_us=14.0, min_speedup=1.5).path == DENSE


@pytest.mark.parametrize("sparse_us,dense_us", [(0.0, 1.0), (1.0, 0.0), (-1.0, 2.0), (float("nan"), 1.0)])
def test_bad_timings_rejected(sparse_us, dense_us):
    with pytest.raises(ValueError, match="positive"):
        decide(1, sparse_us, dense_us)


def test_fixed_decisions():
    d = fixed(16, DENSE, "policy 'dense'")
    assert d.speedup is None and d.sparse_us is None
    with pytest.raises(ValueError, match="path must be one of"):
        fixed(16, "sparse", "typo")


def test_transpose_columns_small_path_on_cpu():
    import torch

    from sparseforge.semi.transpose import transpose_columns

    src = torch.arange(5 * 8, dtype=torch.float16).view(5, 8)
    got = transpose_columns(src, 3)
    assert got.is_contiguous() and torch.equal(got, src[:, :3].t())


def test_modes_decide_apart_and_pick_by_capture():
    from sparseforge.semi.decide import WidthChoice, decide_modes

    # a small width: faster replayed in a graph, slower eagerly (host time) -> 2:4 only under capture
    choice = decide_modes(16, {SPARSE: (20.0, 60.0)}, dense=(30.0, 35.0), config_id=3)
    assert (choice.graph.path, choice.eager.path) == (SPARSE, DENSE)
    assert choice.sparse(capturing=True) and not choice.sparse(capturing=False) and choice.any_sparse
    assert "under graph replay" in choice.graph.reason and "called eagerly" in choice.eager.reason
    assert [d.mode for d in choice.decisions()] == ["eager", "graph"]
    both = WidthChoice.both(fixed(8, DENSE, "policy 'dense'"))
    assert both.decisions() == [both.eager] and not both.any_sparse and not both.sparse(True)


def test_fastest_sparse_path_per_mode_then_dense_margin():
    from sparseforge.semi.decide import GEMV, decide_modes

    # (graph us, eager us): the GEMV wins eagerly (one launch), cuSPARSELt under graph replay
    choice = decide_modes(1, {SPARSE: (10.0, 50.0), GEMV: (12.0, 20.0)}, dense=(20.0, 25.0))
    assert choice.path(capturing=True) == SPARSE and choice.path(capturing=False) == GEMV
    assert choice.uses(SPARSE) and choice.uses(GEMV) and "2:4-gemv measured" in choice.eager.reason
    slow = decide_modes(1, {SPARSE: (30.0, 50.0), GEMV: (29.0, 40.0)}, dense=(20.0, 25.0))
    assert not slow.any_sparse and slow.path(True) == DENSE
    with pytest.raises(ValueError, match="no sparse path"):
        decide_modes(1, {}, dense=(1.0, 1.0))


def test_gpus_older_than_sm80_are_refused_by_name(monkeypatch):
    import torch

    from sparseforge.semi import Sparse24Error
    from sparseforge.semi.cusparselt import Library

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
    with pytest.raises(Sparse24Error, match="Tesla T4 is sm_75; Sparse Tensor Cores need sm_80"):
        Library.on(torch.device("cuda", 7))
