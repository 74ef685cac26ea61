"""The chooser: one way to pick among kernels, used by SpMM (every mapping of tune/space.py), by the 2:4
runtime's per-width decisions (semi/decide.py) and by the kernel families to come.

1. rank: the cost model (tune/cost.py) orders every candidate; ties keep the caller's order, so the ranking
   is deterministic.
2. measure: the shortlist (the best of each mapping, then the next best) is cut where the predicted compile
   seconds, shared over this machine's cores, would pass the time budget (the first always stays); those
   are compiled side by side (threads: ptxas runs in subprocesses) and every one that built is timed by
   CUDA-graph replay on fresh random inputs (milliseconds each: compiling is what the budget buys);
   dense (cuBLAS) is timed beside them where the caller allows it.
3. pick: the fastest, or of the kernels within BYTES_TIE of it that read W as data, the one holding fewest bytes
   of W; a sparse path over dense only with a margin (MIN_SPEEDUP) where the caller asks for that decision
   (fastest_with_margin).
Failures to compile or launch score as "not a winner" (recorded with the message); anything else raises.
"""
from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from .. import env

# A sparse path is taken over dense only when it measured at least this much faster: medians of repeated
# CUDA-event timings still move by ~1-2% between runs, and a tie is better served by the path with no
# extra state to keep.
MIN_SPEEDUP = 1.03
# Timings this close are a tie (graph-replay medians move by 1-2% between runs): of the tied kernels that read W as
# data, the one holding fewest bytes of it wins. A decoder's memory is its weights' bytes, and at the H200's recorded
# Llama timings this takes 4-bit gaps over 8-bit ones (16% fewer bytes) on two of nine shapes at 1% more time.
BYTES_TIE = 1.02
TOP = 6  # candidates timed by default: the best of each mapping (up to six apply to one problem), then
# the next best overall


# Seconds of compiling and timing candidates per problem (one layer at one width) unless the caller says otherwise:
# the default of every API and CLI. On the H200 a rn50 layer's shortlist of 3-4 kernels and dense is timed in
# 1-3 s; 5 leaves room for the compiles of larger layers.
TUNE_BUDGET_S = 5.0


def tuning_budget(value, name: str = "tune_budget") -> float | None:
    """The one meaning of a tuning budget everywhere: None or 0 -> None, the cost model's pick (nothing compiled
    to be timed, nothing timed); seconds > 0 -> that budget. Refuses what check_tune_budget refuses."""
    check_tune_budget(value, name)
    return None if value is None or value == 0 else float(value)


def check_tune_budget(value, name: str = "tune_budget") -> None:
    """A tuning budget is seconds: None (the API's "the cost model's pick") or a finite number >= 0. A negative
    one would be passed on as a budget, NaN compares false with everything, a bool or str fails far from here."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {value!r}: give seconds >= 0 (0: the cost model's pick, nothing timed)")


@dataclass
class Choice:
    """What the chooser did: every candidate with its prediction, and the measured ones with their times."""
    records: list[dict] = field(default_factory=list)
    winner: int | None = None        # index into records
    dense_us: float | None = None    # cuBLAS under the same timing, where timed
    seconds: float = 0.0             # ranking + compiling + timing

    @property
    def sparse_us(self) -> float | None:
        return None if self.winner is None else self.records[self.winner].get("us")

    @property
    def dense_faster(self) -> bool | None:
        if self.dense_us is None or self.sparse_us is None:
            return None
        return self.dense_us < self.sparse_us

    def as_dict(self) -> dict:
        return {"records": self.records, "winner": self.winner, "dense_us": self.dense_us,
                "sparse_us": self.sparse_us, "dense_faster": self.dense_faster, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> "Choice":
        """A Choice back from as_dict(); ValueError when the data is not one (a damaged cache record)."""
        records, winner = data["records"], data["winner"]
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError("a choice's records must be a list of dicts")
        if winner is not None and not (isinstance(winner, int) and 0 <= winner < len(records)):
            raise ValueError(f"a choice's winner must index its records, got {winner!r}")
        return cls(records, winner, data.get("dense_us"), data.get("seconds", 0.0))

    def explain(self) -> str:
        """One line per candidate: mapping, config, predicted and measured time, the winner marked."""
        lines = []
        for i, r in enumerate(self.records):
            measured = f"{r['us']:8.2f} us" if r.get("us") is not None else (
                "  failed   " if r.get("error") else "  not timed")
            mark = "*" if i == self.winner else " "
            lines.append(f"  {mark} {r['mapping']:<13} {r['label']:<26} predicted {r['predicted_us']:8.2f} us"
                         f"  measured {measured}" + (f"  ({r['error'][:60]})" if r.get("error") else ""))
        if self.dense_us is not None:
            lines.append(f"    {'dense':<13} {'cuBLAS':<26} {'':>22}  measured {self.dense_us:8.2f} us")
        return "\n".join(lines)


@lru_cache(maxsize=1)
def chooser_digest() -> str:
    """sha256 of the code that makes a choice (space, cost model, chooser, every kernel family's folder under
    mappings/ with its candidates and estimate, compile_spmm's and compile_conv2d's candidate filters, the
    timing): editing it invalidates cached choices, not compiled kernels."""
    here = Path(__file__).parent
    files = sorted(here.glob("*.py")) + sorted((here.parent / "mappings").rglob("*.py")) + \
        [here.parent / "spmm.py", here.parent / "conv.py", here.parent / "runtime" / "timing.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def rank(predicted: Sequence[float]) -> list[int]:
    """Indices from the fastest predicted to the slowest; equal predictions keep their order."""
    return sorted(range(len(predicted)), key=lambda i: (predicted[i], i))


def shortlist(records: Sequence[dict], top: int) -> list[int]:
    """Which candidates to time: the best-predicted of each mapping first (the model's errors are largest
    between mappings: a layer's best mapping is what decides), then the rest by predicted time."""
    order = rank([r["predicted_us"] for r in records])
    firsts, seen = [], set()
    for i in order:
        if records[i]["mapping"] not in seen:
            seen.add(records[i]["mapping"])
            firsts.append(i)
    firsts.sort(key=lambda i: order.index(i))
    picked = firsts[:top]
    picked += [i for i in order if i not in picked][:max(0, top - len(picked))]
    return picked


def choose(candidates: Sequence, describe: Callable[[object], dict], compile_one: Callable[[object], object],
           load_and_time: Callable[[object, object], tuple[object, float]], budget_s: float, top: int = TOP,
           time_dense: Callable[[], float] | None = None, build_errors: tuple = (), parallel: bool = True
           ) -> tuple[object, Choice]:
    """Rank candidates by describe(c)["predicted_us"], compile the `top` best in parallel, time them within
    budget_s seconds (the best-ranked always), and time dense if given. Returns (winning kernel, Choice).

    describe(c) -> dict with "label", "mapping", "predicted_us" (and anything else worth recording);
    compile_one(c) -> a compiled artefact (no CUDA calls: it runs in a thread);
    load_and_time(c, compiled) -> (kernel, microseconds);
    build_errors: exception types that mean "this candidate cannot build or run" (scored, not raised);
    parallel: compile the shortlist in threads (False: one at a time)."""
    if not candidates:
        raise ValueError("no candidate to choose from: the design space has nothing for this problem")
    started = time.perf_counter()
    records = [describe(c) for c in candidates]
    chosen = to_compile(records, budget_s, top)
    for i in shortlist(records, max(1, top)):
        if i not in chosen:
            records[i]["skipped"] = "its compile would pass the tuning budget"
    with ThreadPoolExecutor(max_workers=len(chosen) if parallel else 1) as pool:
        compiled = dict(zip(chosen, pool.map(lambda i: _attempt(compile_one, build_errors, candidates[i]), chosen)))
    tied, fastest = {}, math.inf  # index -> kernel of the candidates within BYTES_TIE of the fastest so far
    for i in chosen:
        artefact, error = compiled[i]
        if error is None:
            outcome, error = _attempt(lambda c: load_and_time(c, artefact), build_errors, candidates[i])
        if error is not None:
            records[i]["error"] = error
            records[i]["us"] = None
            continue
        kernel, us = outcome
        records[i]["us"] = us
        weight_bytes = getattr(kernel, "weight_bytes", None)
        if weight_bytes is not None and int(weight_bytes) > 0:  # 0: W compiled into the code
            records[i]["weight_bytes"] = int(weight_bytes)
        fastest = min(fastest, us)
        tied[i] = kernel
        tied = {j: k for j, k in tied.items() if records[j]["us"] <= fastest * BYTES_TIE}
    if not tied:
        raise RuntimeError("no candidate built and ran: " + "; ".join(
            f"{records[i]['label']}: {records[i].get('error')}" for i in chosen))
    dense_us = time_dense() if time_dense is not None else None
    winner = fewest_bytes_of_the_tied(records, list(tied), dense_us)
    best = tied[winner]
    choice = Choice(records, winner, dense_us=dense_us)
    choice.seconds = time.perf_counter() - started
    return best, choice


def fewest_bytes_of_the_tied(records: Sequence[dict], tied: list[int], dense_us: float | None = None) -> int:
    """The winner among timed candidates within BYTES_TIE of the fastest: the fastest where it holds no W as data
    (its code is W), else the tied one that holds fewest bytes of W as data (then the faster). Where the fastest
    beats dense (dense_us) by MIN_SPEEDUP, only tied ones that do too: a tie never turns a sparse win into dense."""
    fastest = min(tied, key=lambda i: (records[i]["us"], tied.index(i)))
    if "weight_bytes" not in records[fastest]:
        return fastest
    keeps_its_margin = dense_us is not None and records[fastest]["us"] * MIN_SPEEDUP <= dense_us
    return min((i for i in tied if "weight_bytes" in records[i]
                and (not keeps_its_margin or records[i]["us"] * MIN_SPEEDUP <= dense_us)),
               key=lambda i: (records[i]["weight_bytes"], records[i]["us"]))


def to_compile(records: Sequence[dict], budget_s: float, top: int = TOP, cores: int | None = None) -> list[int]:
    """Which candidates choose() compiles and times: the shortlist, cut where their predicted compile seconds
    spread over the machine's cores pass budget_s (the prebuild of a model's layers compiles the same ones)."""
    return within_budget(records, shortlist(records, max(1, top)), budget_s, cores)


def within_budget(records: Sequence[dict], order: list[int], budget_s: float, cores: int | None = None) -> list[int]:
    """The prefix of `order` whose predicted compile seconds (records[i]["predicted_compile_s"]), spread over
    the machine's cores, fit in budget_s; never empty."""
    cores = cores or env.cpu_cores()
    kept, spent = [], 0.0
    for i in order:
        spent += records[i].get("predicted_compile_s", 0.0) / cores
        if kept and spent > budget_s:
            break
        kept.append(i)
    return kept


def _attempt(fn, errors: tuple, arg):
    try:
        return fn(arg), None
    except errors as err:  # noqa: PERF203 - a candidate that cannot build is recorded, not fatal
        return None, f"{type(err).__name__}: {str(err)[:300]}"


def fastest_with_margin(times: dict[str, float], baseline: str, min_speedup: float = MIN_SPEEDUP
                        ) -> tuple[str, float]:
    """(path, its speedup over the baseline): the fastest path other than the baseline if it is at least
    min_speedup faster than it, else the baseline. Times in any one unit, all positive."""
    if baseline not in times or len(times) < 2:
        raise ValueError(f"need the baseline {baseline!r} and at least one other path, got {sorted(times)}")
    for path, t in times.items():
        if not t > 0:
            raise ValueError(f"timings must be positive, got {path} {t}")
    best = min((p for p in times if p != baseline), key=lambda p: times[p])
    ratio = times[baseline] / times[best]
    return (best, ratio) if ratio >= min_speedup else (baseline, ratio)
