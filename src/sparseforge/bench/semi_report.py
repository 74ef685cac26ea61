"""Reports for `sparseforge bench24`: per-case table, summary against the targets, a PNG plot."""
from __future__ import annotations

from collections import defaultdict

from .report import geomean

# Targets of the 2:4 work (fp16 on the H200).
LARGE_N = 2048
TARGET_LARGE = 1.3      # 2:4 over cuBLAS, Llama-class shapes, N >= LARGE_N
TARGET_FLOOR = 0.95     # with the fallback on, never slower than this fraction of dense
TARGET_VS_TORCH = 10.0  # over torch's semi-structured path, eager (its per-call setup included)


def summarize24(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in (r for r in records if "speedup_vs_dense" in r):
        groups[(r["dtype"], r["group"])].append(r)
        if r["N"] >= LARGE_N:
            groups[(r["dtype"], f"{r['group']} N>={LARGE_N}")].append(r)
    rows = []
    for (dtype, group), items in sorted(groups.items()):
        torch_ratios = [r["speedup_vs_torch_semi_eager"] for r in items if "speedup_vs_torch_semi_eager" in r]
        fallback_ratios = [r["fallback_speedup_vs_torch_semi_eager"] for r in items
                           if "fallback_speedup_vs_torch_semi_eager" in r]
        gemv = [r["dense_us"] / r["gemv24_us"] for r in items if "gemv24_us" in r]
        rows.append({
            "dtype": dtype, "group": group, "cases": len(items), "all_correct": all(r["error_ok"] for r in items),
            "geomean_2_4_vs_dense": geomean(r["speedup_vs_dense"] for r in items),
            "min_2_4_vs_dense": min(r["speedup_vs_dense"] for r in items),
            "max_2_4_vs_dense": max(r["speedup_vs_dense"] for r in items),
            "geomean_with_fallback_vs_dense": geomean(r["fallback_speedup_vs_dense"] for r in items),
            "min_with_fallback_vs_dense": min(r["fallback_speedup_vs_dense"] for r in items),
            "geomean_vs_torch_semi_eager": geomean(torch_ratios) if torch_ratios else None,
            "min_vs_torch_semi_eager": min(torch_ratios) if torch_ratios else None,
            "geomean_with_fallback_vs_torch_semi_eager": geomean(fallback_ratios) if fallback_ratios else None,
            "geomean_gemv24_vs_dense": geomean(gemv) if gemv else None,
            "gemv24_all_correct": all(r.get("gemv24_error_ok", True) for r in items),
        })
    return rows


def print24(console, records: list[dict], summary: list[dict], overhead: dict) -> None:
    from rich.table import Table

    table = Table(title="2:4 (cuSPARSELt via sparseforge) vs dense cuBLAS, CUDA-graph replay")
    for col in ("shape", "N", "dtype", "dense us", "2:4 us", "x dense", "decision graph / eager", "fallback x",
                "torch semi us",
                "x torch (eager)", "rel err"):
        table.add_column(col, justify="left" if col in ("shape", "decision") else "right")
    for r in records:
        if "speedup_vs_dense" not in r:
            table.add_row(f"{r['group']} {r['M']}x{r['K']}", str(r["N"]), r["dtype"], "-", "-", "-",
                          f"refused: {r.get('sparse24_error', '?')[:60]}", "-", "-", "-", "FAIL")
            continue
        table.add_row(f"{r['group']} {r['M']}x{r['K']}", str(r["N"]), r["dtype"], f"{r['dense_us']:.1f}",
                      f"{r['sparse24_us']:.1f}", f"{r['speedup_vs_dense']:.2f}",
                      r["decision"] + (f" / {r['decision_eager']}" if "decision_eager" in r else ""),
                      f"{r['fallback_speedup_vs_dense']:.2f}",
                      f"{r['torch_semi_eager_us']:.0f}" if "torch_semi_eager_us" in r else r.get("torch_semi_error", "-")[:30],
                      f"{r['speedup_vs_torch_semi_eager']:.1f}" if "speedup_vs_torch_semi_eager" in r else "-",
                      f"{r['rel_error']:.1e}" + ("" if r["error_ok"] else " FAIL"))
    console.print(table)
    s = Table(title="summary")
    for col in ("dtype", "group", "cases", "2:4 x dense (geomean)", "min", "max", "with fallback (geomean)",
                "fallback min", "x torch eager (geomean)", "correct"):
        s.add_column(col)
    for row in summary:
        torch_ratio = row["geomean_vs_torch_semi_eager"]
        s.add_row(row["dtype"], row["group"], str(row["cases"]), f"{row['geomean_2_4_vs_dense']:.2f}",
                  f"{row['min_2_4_vs_dense']:.2f}", f"{row['max_2_4_vs_dense']:.2f}",
                  f"{row['geomean_with_fallback_vs_dense']:.2f}", f"{row['min_with_fallback_vs_dense']:.2f}",
                  "-" if torch_ratio is None else f"{torch_ratio:.1f}", str(row["all_correct"]))
    console.print(s)
    gemv = [r for r in records if "gemv24_us" in r]
    if gemv:
        g = Table(title="packed 2:4 GEMV (CUDA cores, decode widths) vs dense cuBLAS, graph replay")
        for col in ("shape", "N", "dtype", "dense us", "gemv us", "x dense", "eager x dense", "cuSPARSELt us", "rel err"):
            g.add_column(col)
        for r in gemv:
            g.add_row(f"{r['group']} {r['M']}x{r['K']}", str(r["N"]), r["dtype"], f"{r['dense_us']:.1f}",
                      f"{r['gemv24_us']:.1f}", f"{r['dense_us'] / r['gemv24_us']:.2f}",
                      f"{r['dense_eager_us'] / r['gemv24_eager_us']:.2f}", f"{r['sparse24_us']:.1f}",
                      f"{r['gemv24_rel_error']:.1e}" + ("" if r["gemv24_error_ok"] else " FAIL"))
        console.print(g)
    console.print("host us per call (768x768, N=16, no sync): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in overhead.items() if isinstance(v, float)))


def plot24(path, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "speedup_vs_dense" in r]
    dtypes = sorted({r["dtype"] for r in records})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 5.5), squeeze=False, sharey=True)
    for ax, dtype in zip(axes[0], dtypes):
        shapes = sorted({(r["group"], r["M"], r["K"]) for r in records if r["dtype"] == dtype})
        for i, (group, m, k) in enumerate(shapes):
            items = sorted((r for r in records if (r["dtype"], r["group"], r["M"], r["K"]) == (dtype, group, m, k)),
                           key=lambda r: r["N"])
            color = plt.cm.tab10.colors[i % 10]
            ax.plot([r["N"] for r in items], [r["speedup_vs_dense"] for r in items], "o-", color=color,
                    label=f"{group} {m}x{k}")
            ax.plot([r["N"] for r in items], [r["fallback_speedup_vs_dense"] for r in items], ":", color=color)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(TARGET_LARGE, color="green", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_title(f"{dtype}: 2:4 (solid) and with fallback (dotted) vs cuBLAS")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("speedup over dense cuBLAS (graph replay)")
    gpu = next((r.get("gpu") for r in records if r.get("gpu")), "")
    fig.suptitle(f"sparseforge 2:4 on Sparse Tensor Cores, {gpu}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
