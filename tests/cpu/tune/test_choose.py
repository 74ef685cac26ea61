"""The chooser (tune/choose.py): deterministic ranking, a shortlist across mappings, timing within a budget,
failures scored not raised, and the sparse-over-dense margin the 2:4 decisions use."""
import pytest

from sparseforge.tune.choose import (BYTES_TIE, MIN_SPEEDUP, Choice, check_tune_budget, choose, fastest_with_margin,
                                     rank, shortlist, within_budget)


def _records(pairs):
    return [{"label": f"c{i}", "mapping": m, "predicted_us": p} for i, (m, p) in enumerate(pairs)]


def test_rank_is_deterministic_and_stable_on_ties():
    assert rank([3.0, 1.0, 2.0, 1.0]) == [1, 3, 2, 0]
    assert rank([5.0] * 4) == [0, 1, 2, 3]


def test_shortlist_takes_each_mappings_best_before_the_next_overall():
    records = _records([("groups", 1.0), ("groups", 1.1), ("groups", 1.2), ("rowblock", 3.0), ("csr", 9.0)])
    assert shortlist(records, 3) == [0, 3, 4]
    assert shortlist(records, 4) == [0, 3, 4, 1]
    assert shortlist(records, 1) == [0]


class Boom(Exception):
    pass


def test_choose_times_the_shortlist_and_keeps_the_fastest_measured():
    cands = [("groups", 1.0, 9.0), ("rowblock", 2.0, 4.0), ("csr", 3.0, None), ("groups", 4.0, 1.0)]
    compiled = []

    def describe(c):
        return {"label": c[0], "mapping": c[0], "predicted_us": c[1]}

    def compile_one(c):
        compiled.append(c)
        if c[2] is None:
            raise Boom("ptxas failed")
        return c

    def load_and_time(c, artefact):
        return f"kernel-{c[0]}-{c[2]}", c[2]

    kernel, choice = choose(cands, describe, compile_one, load_and_time, budget_s=60, top=3,
                            time_dense=lambda: 5.0, build_errors=(Boom,))
    assert kernel == "kernel-rowblock-4.0"  # the unshortlisted 1.0 us candidate is never compiled
    assert len(compiled) == 3 and cands[3] not in compiled
    assert choice.records[2]["error"].startswith("Boom") and choice.records[2]["us"] is None
    assert choice.sparse_us == 4.0 and choice.dense_us == 5.0 and choice.dense_faster is False
    assert "*" in choice.explain().splitlines()[1] and "cuBLAS" in choice.explain()
    assert Choice.from_dict(choice.as_dict()).as_dict() == choice.as_dict()


class _Kernel:
    def __init__(self, name: str, us: float, weight_bytes: int | None):
        self.name, self.us = name, us
        if weight_bytes is not None:
            self.weight_bytes = weight_bytes


def _tie_break(kernels, dense_us=None) -> tuple[str, Choice]:
    def describe(k):
        return {"label": k.name, "mapping": k.name, "predicted_us": 1.0}

    kernel, choice = choose(kernels, describe, lambda k: k, lambda k, a: (k, k.us), budget_s=1e9, top=len(kernels),
                            time_dense=None if dense_us is None else lambda: dense_us)
    return kernel.name, choice


def test_a_tie_in_time_goes_to_the_kernel_holding_fewer_bytes_of_w():
    """Within BYTES_TIE of the fastest, the kernel reading fewer bytes of W as data wins (recorded beside its
    time); past it, or where the fastest holds W as its code (0 bytes as data) or says nothing, the fastest."""
    within, past = 10.0 * (BYTES_TIE - 0.005), 10.0 * (BYTES_TIE + 0.005)
    name, choice = _tie_break([_Kernel("g8", 10.0, 1500), _Kernel("g4", within, 1270), _Kernel("csr", 12.0, 900)])
    assert name == "g4" and choice.sparse_us == within and choice.records[0]["weight_bytes"] == 1500
    assert _tie_break([_Kernel("g8", 10.0, 1500), _Kernel("g4", past, 1270)])[0] == "g8"
    assert _tie_break([_Kernel("g4", within, 1270), _Kernel("g8", 10.0, 1500)])[0] == "g4"  # either order
    # a faster one arriving later unties those no longer within the margin of it
    assert _tie_break([_Kernel("a", 10.0, 1000), _Kernel("b", 9.0, 2000), _Kernel("c", 9.1, 1900)])[0] == "c"
    assert _tie_break([_Kernel("code", 10.0, 0), _Kernel("data", within, 10)])[0] == "code"
    assert _tie_break([_Kernel("opaque", 10.0, None), _Kernel("data", within, 10)])[0] == "opaque"
    assert _tie_break([_Kernel("data", 10.0, 10), _Kernel("code", within, 0)])[0] == "data"
    # never a sparse win against dense turned into a loss: the tie then holds only those that keep the margin
    dense = 10.0 * MIN_SPEEDUP
    name, choice = _tie_break([_Kernel("g8", 10.0, 1500), _Kernel("g4", within, 1270)], dense_us=dense)
    assert name == "g8" and choice.dense_us == dense and not choice.dense_faster
    assert _tie_break([_Kernel("g8", 10.0, 1500), _Kernel("g4", within, 1270)], dense_us=9.0)[0] == "g4"  # lost


def test_choose_raises_real_bugs_and_reports_when_nothing_ran():
    describe = lambda c: {"label": "x", "mapping": "m", "predicted_us": 1.0}  # noqa: E731
    with pytest.raises(ZeroDivisionError):
        choose([1], describe, lambda c: 1 / 0, lambda c, a: (c, 1.0), 10, build_errors=(Boom,))
    with pytest.raises(RuntimeError, match="no candidate built"):
        choose([1], describe, lambda c: (_ for _ in ()).throw(Boom("x")), lambda c, a: (c, 1.0), 10,
               build_errors=(Boom,))


def test_budget_bounds_what_is_compiled_and_every_compiled_candidate_is_timed():
    describe = lambda c: {"label": str(c), "mapping": str(c), "predicted_us": float(c),  # noqa: E731
                          "predicted_compile_s": 10.0}
    kernel, choice = choose([1, 2, 3], describe, lambda c: c, lambda c, a: (c, 10.0 - c), budget_s=0.0)
    assert kernel == 1 and choice.records[0]["us"] == 9.0  # the first always runs
    assert all(r.get("skipped") and "us" not in r for r in choice.records[1:])
    kernel, choice = choose([1, 2, 3], describe, lambda c: c, lambda c, a: (c, 10.0 - c), budget_s=1e9)
    assert kernel == 3 and all(r["us"] for r in choice.records)


def test_within_budget_spreads_compile_seconds_over_cores():
    records = [{"predicted_compile_s": s} for s in (4.0, 4.0, 4.0, 4.0)]
    assert within_budget(records, [3, 2, 1, 0], budget_s=5.0, cores=2) == [3, 2]
    assert within_budget(records, [3, 2, 1, 0], budget_s=5.0, cores=16) == [3, 2, 1, 0]
    assert within_budget(records, [1, 0], budget_s=0.0, cores=1) == [1]


def test_fastest_with_margin():
    assert fastest_with_margin({"2:4": 1.0, "dense": 1.0 * MIN_SPEEDUP}, "dense") == ("2:4", pytest.approx(MIN_SPEEDUP))
    assert fastest_with_margin({"2:4": 1.0, "dense": 1.01}, "dense")[0] == "dense"
    assert fastest_with_margin({"a": 2.0, "b": 1.0, "dense": 3.0}, "dense")[0] == "b"
    with pytest.raises(ValueError):
        fastest_with_margin({"dense": 1.0}, "dense")
    with pytest.raises(ValueError):
        fastest_with_margin({"a": 0.0, "dense": 1.0}, "dense")


def test_serial_compiles_when_asked_and_a_broken_cached_choice_is_made_again():
    import threading

    from sparseforge.tune.pipeline import choice_from_record as _choice_from_record

    threads = set()
    describe = lambda c: {"label": str(c), "mapping": str(c), "predicted_us": float(c)}  # noqa: E731

    def compile_one(c):
        threads.add(threading.get_ident())
        return c

    choose([1, 2, 3], describe, compile_one, lambda c, a: (c, float(c)), 1e9, parallel=False)
    assert len(threads) == 1
    _, choice = choose([1, 2], describe, lambda c: c, lambda c, a: (c, float(c)), 1e9)
    assert _choice_from_record({"choice": choice.as_dict()}).as_dict() == choice.as_dict()
    for broken in ({}, {"choice": {}}, {"choice": {"records": [], "winner": 3}}, {"choice": None}):
        assert _choice_from_record(broken) is None


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), True, "5", [1.0]])
def test_a_tune_budget_that_is_not_seconds_is_refused_with_the_name_given(value):
    with pytest.raises(ValueError, match=r"^--tune-budget .*: give seconds >= 0"):
        check_tune_budget(value, "--tune-budget")


@pytest.mark.parametrize("value", [None, 0, 0.5, 5])
def test_none_and_seconds_are_tune_budgets(value):
    check_tune_budget(value)


def test_a_tuning_budget_means_one_thing_everywhere():
    """0 and None are the cost model's pick (nothing compiled to be timed); seconds stay seconds; the rest is
    refused by name. compile_spmm, compile_conv2d, the nn modules, convert and both CLIs pass through here."""
    from sparseforge.tune.choose import TUNE_BUDGET_S, tuning_budget

    assert tuning_budget(None) is None and tuning_budget(0) is None and tuning_budget(0.0) is None
    assert tuning_budget(2) == 2.0 and tuning_budget(TUNE_BUDGET_S) == TUNE_BUDGET_S
    for bad in (-1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="--tune-budget"):
            tuning_budget(bad, "--tune-budget")


def test_the_modules_and_the_api_share_the_default_budget_and_its_meaning():
    import inspect

    import torch

    from sparseforge import compile_spmm, prebuild_spmm
    from sparseforge.conv import compile_conv2d
    from sparseforge.nn import SparseLinear
    from sparseforge.nn.convert import convert
    from sparseforge.tune.choose import TUNE_BUDGET_S

    for fn in (compile_spmm, prebuild_spmm, compile_conv2d, SparseLinear.from_dense, convert):
        assert inspect.signature(fn).parameters["tune_budget"].default == TUNE_BUDGET_S, fn
    layer = SparseLinear.from_dense(torch.nn.Linear(8, 4), tune_budget=0)
    assert layer.tune_budget is None  # the cost model's pick, as compile_spmm(tune_budget=0) takes it
