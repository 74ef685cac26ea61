"""Benchmark reports: the per-case table, geomean speedups per group, JSON with provenance, a PNG plot."""
from __future__ import annotations

import datetime
import functools
import json
import math
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def plan_traffic(plan) -> dict[str, int]:
    """The bytes a plan makes its kernel move and the floor (its family's operand_bytes: B re-read per row
    group, split groups' atomics, C written once; against B and C moved once): their ratio is the plan's
    traffic cost."""
    from ..mappings.registry import plan_family

    return plan_family(plan).hook("operand_bytes")(plan)


def geomean(values) -> float:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(records: list[dict]) -> list[dict]:
    """Geomean speedups per (model, sparsity, dtype, layout, N-kind) over the timed records."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if "sparseforge_us" in r:
            # a forced width (bench --n, record["n"]) is a row of its own: bench --n 1,2,4,8 gives a row a width
            groups[(r["model"], r["sparsity"], r["dtype"], r["layout"], r.get("batch", 1), r.get("n"))].append(r)
    rows = []
    for (model, sparsity, dtype, layout, batch, _), items in sorted(groups.items(), key=_group_order):
        widths = {r.get("N") for r in items}
        # n: the token count of a decode run (one N for every case); None where the cases' N differ (a model's
        # layers at their own widths, a convolution's output pixels)
        row = {"model": model, "sparsity": sparsity, "dtype": dtype, "layout": layout, "batch": batch,
               "n": widths.pop() if len(widths) == 1 else None,
               "cases": len(items), "all_correct": all(r["error_ok"] for r in items)}
        # SpMM cases against cuBLAS / cuSPARSE; convolutions (bench/conv.py) against cuDNN
        baselines = ("speedup_vs_cudnn",) if "cudnn_us" in items[0] else \
            ("speedup_vs_cublas", "speedup_vs_cublas_tf32", "speedup_vs_cusparse")
        if "speedup_vs_cublas_rotating" in items[0]:  # weights streamed from HBM (bench's rotating protocol)
            baselines += ("speedup_vs_cublas_rotating",)
        for key in baselines:
            row[f"geomean_{key}"] = geomean(r.get(key) for r in items)
        # what a caller of the chooser gets: dense (cuBLAS / cuDNN in the kernel's layout) where the chooser
        # measured dense faster (without the nn modules' margin). Below 1 only where the chooser misjudged or,
        # for convolutions, where cuDNN's other layout (in the baseline) beats cuDNN in the kernel's layout
        base = "cudnn" if "cudnn_us" in items[0] else "cublas"
        row[f"geomean_speedup_chosen_vs_{base}"] = geomean(_chosen_speedup(r, base) for r in items)
        # the roofline in two numbers: how far from the byte/FLOP floor, and the fetch rate that explains it
        row["median_floor_fraction"] = _median(r["floor_us"] / r["sparseforge_us"] for r in items if "floor_us" in r)
        row["median_fetched_tbs"] = _median(r.get("fetched_tbs") for r in items)
        if "sparseforge_rotating_tbs" in items[0]:  # streamed from HBM: the rates and the format's bytes
            for key in ("sparseforge_rotating_tbs", "cublas_rotating_tbs", "sparse_bytes_per_weight"):
                row[f"median_{key}"] = _median(r.get(key) for r in items)
        wins: dict[str, int] = defaultdict(int)
        for r in items:
            wins[r.get("mapping", "?")] += 1
        row["mapping_wins"] = dict(sorted(wins.items()))  # which mapping the chooser picked, how often
        row["dense_faster_cases"] = [r["case"] for r in items if r.get("dense_faster")]
        rows.append(row)
    return rows


def _group_order(item) -> tuple:
    """Summary rows by model, sparsity, dtype, layout and batch as text, forced widths in numeric order."""
    (*named, n), _ = item
    return str(tuple(named)), n or 0


def _chosen_speedup(record: dict, base: str) -> float | None:
    """The baseline's time over the time of what the chooser keeps: its kernel, or dense where it measured
    dense faster (a convolution's dense runs cuDNN in the kernel's layout)."""
    baseline = record.get(f"{base}_us")
    if not baseline or not record.get("sparseforge_us"):
        return None
    if not record.get("dense_faster"):
        return baseline / record["sparseforge_us"]
    if base == "cudnn":
        in_layout = record.get("cudnn_channels_last_us" if record.get("layout") == "nhwc" else "cudnn_nchw_us")
        return baseline / (in_layout or baseline)
    return 1.0


def _median(values) -> float | None:
    kept = sorted(v for v in values if v is not None)
    return kept[len(kept) // 2] if kept else None


def top_functions(profiler, count: int = 25) -> list[dict]:
    """The functions a cProfile.Profile spent the most cumulative time in: file:line name, calls, seconds
    (where a benchmark's conversion seconds go, kept in its JSON)."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:count]
    return [{"function": f"{Path(f).name}:{line} {name}", "calls": calls, "cumulative_s": round(cum, 3),
             "own_s": round(own, 3)} for (f, line, name), (_, calls, own, cum, _) in rows]


def provenance(command: list[str]) -> dict:
    from ..runtime.timing import TIMING_PROTOCOL

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(command), "python": platform.python_version(), "host": platform.node(),
            "timing": TIMING_PROTOCOL}
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent)
        info["commit"] = done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"
        info["tree"] = _working_tree_hash(Path(__file__).resolve().parent)
    except OSError:
        info["commit"] = "unknown (no git)"
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
    except Exception:
        pass
    return info


@functools.lru_cache(maxsize=4)  # benchmarks rewrite their JSON after every case: hash the tree once
def _working_tree_hash(where: Path) -> str | None:
    """The git tree of the files as they are (a copy's HEAD can be stale: the GPU machine gets the working
    tree, not the history). `git log --format='%h %T'` maps it back to the commit it was run at."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=where)
        if top.returncode:
            return None
        root = top.stdout.strip()
        if subprocess.run(["git", "add", "-A"], capture_output=True, cwd=root, env=env).returncode:
            return None
        tree = subprocess.run(["git", "write-tree"], capture_output=True, text=True, cwd=root, env=env)
        return tree.stdout.strip() if tree.returncode == 0 else None


def write_json(path: Path, records: list[dict], summary: list[dict], extra: dict) -> None:
    payload = {"provenance": provenance(sys.argv), **extra, "summary": summary, "cases": records}
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path: Path, records: list[dict]) -> None:
    plt = _pyplot()
    timed = [r for r in records if "sparseforge_us" in r]
    if not timed:
        return
    series = sorted({(r["dtype"], r["layout"]) for r in timed})
    colors = plt.cm.tab20.colors
    fig, ax = plt.subplots(figsize=(11, 6))
    for i, (dtype, layout) in enumerate(series):
        items = [r for r in timed if r["dtype"] == dtype and r["layout"] == layout]
        ax.scatter([r["cublas_us"] for r in items], [r["speedup_vs_cublas"] for r in items], s=18,
                   color=colors[i % len(colors)], marker="o" if layout == "kn" else "^",
                   label=f"{dtype} {layout} (geomean {geomean(r['speedup_vs_cublas'] for r in items):.2f}x)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("dense cuBLAS time, same dtype (us)")
    ax.set_ylabel("speedup of sparseforge over cuBLAS")
    gpu = next((r.get("gpu") for r in timed if r.get("gpu")), "")
    ax.set_title(f"sparseforge generated SpMM vs cuBLAS {gpu}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_plans(path: Path, records: list[dict]) -> None:
    """CPU mode's plot (no timings there): each case's predicted traffic over its byte floor, the re-reads
    of B that bound a kernel before anything is timed, against the floor itself."""
    plt = _pyplot()
    series = sorted({(r["dtype"], r["layout"]) for r in records})
    fig, ax = plt.subplots(figsize=(11, 6))
    for i, (dtype, layout) in enumerate(series):
        items = [r for r in records if r["dtype"] == dtype and r["layout"] == layout]
        ratios = [r["fetched_bytes"] / r["floor_bytes"] for r in items]
        ax.scatter([r["floor_bytes"] / 1e6 for r in items], ratios, s=18, color=plt.cm.tab20.colors[i % 20],
                   marker="o" if layout == "kn" else "^", label=f"{dtype} {layout} (geomean {geomean(ratios):.2f}x)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("byte floor: B and C moved once (MB)")
    ax.set_ylabel("predicted bytes moved / floor (plan.operand_bytes)")
    ax.set_title("sparseforge plans, CPU mode (no GPU: traffic predicted from each plan, not timed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_summary_keys(result: dict) -> dict:
    """A whole-model result with the summary keys of every benchmark file: one model is one case, so its
    geomean_speedup_vs_cublas (Linear models against cuBLAS) or geomean_speedup_vs_cudnn (CNNs against
    cuDNN) is its speedup."""
    out = dict(result)
    for baseline in ("cublas", "cudnn"):
        if out.get(f"speedup_vs_{baseline}") is not None and out.get(f"geomean_speedup_vs_{baseline}") is None:
            out[f"geomean_speedup_vs_{baseline}"] = out[f"speedup_vs_{baseline}"]
    if out.get("geomean_speedup_vs_cublas") is None:
        out.pop("geomean_speedup_vs_cublas", None)  # a CNN against cuDNN has no cuBLAS figure
    return out


def finish_model_run(path: Path, result: dict, report, line: str) -> int:
    """The end of a whole-model benchmark (benchmarks/model_*.py): the JSON written, the per-layer report and
    one summary line printed with the correctness verdict; the exit code (1 when the output was wrong). The
    result carries the summary keys every benchmark file has (model_summary_keys)."""
    result = model_summary_keys(result)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(report)
    verdict = "ok" if result["error_ok"] else "FAIL"
    if result.get("dense_rel_error_vs_float64") is not None:  # the bound against what the dtype itself gives
        verdict += f"; the dense model's own {result['dense_rel_error_vs_float64']:.1e}"
    print(f"{line}; rel. error vs float64 {result['rel_error_vs_float64']:.1e} ({verdict})")
    return 0 if result["error_ok"] else 1
