"""`sparseforge bench PATH`: every case of a DLMC-style directory (or one .smtx) on the GPU against cuBLAS
and cuSPARSE, or, without a GPU, the CPU reference and ptxas assembly of every generated kernel."""
from __future__ import annotations

import argparse
import contextlib
from functools import partial
from pathlib import Path

from typing import Callable

from ..dtypes import SHORT_NAMES
from ..formats.exact import INDEX_LIMIT
from ..tune.choose import TUNE_BUDGET_S, tuning_budget

DTYPES = SHORT_NAMES  # the one table lives in dtypes.py


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark generated kernels against cuBLAS and cuSPARSE",
                           description="Benchmark sparseforge's generated kernels against cuBLAS and cuSPARSE (and "
                                       "convolutions against cuDNN) on an NVIDIA GPU; without one, check every "
                                       "kernel plan on the CPU and assemble its PTX instead of timing it.")
    bench.add_argument("path", help="a .smtx file, a DLMC-style directory, llm[:sparsities[:shapes[:methods]]] "
                                    "(e.g. llm:0.9:llama_4096x4096 or llm:0.7:qwen2_3584x3584:wanda): Llama- or "
                                    "Qwen2-shaped layers pruned by global magnitude or by Wanda-style row masks, or "
                                    "convolutions against cuDNN: conv:vgg16[:sparsities], conv:textcnn[:sparsities], "
                                    "conv:DIR (a DLMC rn50 sparsity directory's 3x3 and 7x7 layers)")
    bench.add_argument("--batch", type=int, default=1, help="ResNet-50 batch size (N = pixels x batch)")
    bench.add_argument("--tokens", type=int, default=None,
                       help="N for Transformer layers (default 256) and llm layers (default 16)")
    bench.add_argument("--n", default=None,
                       help="force N for every case; several, comma-separated (e.g. 1,2,4,8 for decode token "
                            "counts), run every case at each, one summary row a width")
    bench.add_argument("--dtype", default="fp32",
                       help=f"one of {', '.join(DTYPES)}, several comma-separated, or all (default fp32)")
    bench.add_argument("--layout", choices=["kn", "nk", "both", "nchw", "nhwc"], default="kn",
                       help="SpMM cases: kn, nk or both; convolution cases: nchw (the default there) or nhwc "
                            "(channels_last tensors)")
    bench.add_argument("--tune-budget", type=float, default=TUNE_BUDGET_S,
                       help="seconds the chooser may spend timing candidates per kernel (default 5, compile_spmm's "
                            "default; 0: the cost model's pick, nothing timed)")
    bench.add_argument("--rotate-weights", action=argparse.BooleanOptionalAction, default=None,
                       help="also time kernel and cuBLAS with W rotated through copies that exceed the L2 twice, "
                            "so every call streams it from HBM as a many-layer model does (default: on for llm "
                            "cases, whose weights would otherwise sit in the 50-60 MB L2)")
    bench.add_argument("--explain", action="store_true",
                       help="print, per case, every candidate mapping: predicted and measured time, the winner")
    bench.add_argument("--no-prebuild", action="store_true",
                       help="on a GPU, do not compile every case's candidates side by side (all cores, into the disk "
                            "cache) before measuring; each case then compiles its own when measured")
    bench.add_argument("--limit", type=int, default=None, help="only the first LIMIT cases")
    bench.add_argument("--out", type=Path, default=None, help="write results JSON here")
    bench.add_argument("--plot", type=Path, default=None, help="write a speedup plot (PNG) here")
    bench.add_argument("--cpu", action="store_true", help="CPU mode even where a GPU is present")
    bench.set_defaults(run=run_bench)


def _forced_widths(spec: str | None) -> list[int | None]:
    """--n: None -> [None] (each case's own N); '8' or '1,2,4,8' -> the widths every case runs at, each once."""
    if spec is None:
        return [None]
    widths = parse_widths(spec)
    if len(set(widths)) != len(widths):
        raise ValueError(f"--n names a width twice: give each once (e.g. 1,2,4,8); got {spec!r}")
    return widths


def _dtypes(spec: str) -> list[str]:
    """--dtype: 'fp16', 'fp16,bf16' or 'all' -> the dtypes' short names, each once, in the order given."""
    names = list(DTYPES) if spec == "all" else spec.split(",")
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--dtype needs one of {', '.join(DTYPES)}, several comma-separated (each once) or all; "
                         f"got {spec!r}")
    return names


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _check_numbers(args) -> None:
    from ..tune.choose import check_tune_budget

    check_tune_budget(args.tune_budget, "--tune-budget")
    # cases[:limit] with limit 0 runs nothing and exits 0; with -1 it silently drops the last case
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: give the number of cases to run, >= 1 (leave it out for all)")


def run_bench(args) -> int:
    from ..console import console, progress
    from ..suite import discover
    from .memory import check_fits
    from .report import plot, plot_plans, summarize, write_json

    _check_outputs(args)
    _check_numbers(args)
    from ..suite.conv import is_conv_spec

    if is_conv_spec(args.path):
        return run_conv_bench(args)
    if args.layout in ("nchw", "nhwc"):
        raise ValueError(f"--layout {args.layout} applies to convolution cases (conv:...); SpMM cases take kn, nk "
                         "or both")
    # every case at each forced width, width by width (a decode table: --n 1,2,4,8)
    cases = [case for n in _forced_widths(args.n)
             for case in discover(args.path, batch=args.batch, tokens=args.tokens, n=n)][: args.limit]
    missing = [c.name for c in cases if c.N is None]
    if missing:
        raise ValueError(f"no N known for {missing[:3]}...: pass --n")
    dtypes = [DTYPES[name] for name in _dtypes(args.dtype)]
    layouts = ["kn", "nk"] if args.layout == "both" else [args.layout]
    gpu = _gpu_present() and not args.cpu
    jobs = [(c, d, l) for c in cases for d in dtypes for l in layouts]
    check_fits(jobs, gpu)
    records = []
    describe = lambda job: f"{job[0].name} {job[1]} {job[2]}"  # noqa: E731
    run = None
    if gpu:
        from .gpu import prebuild_case

        run = _start_prebuild(args, [(describe(job), partial(prebuild_case, *job, job[0].N, _budget(args)))
                                     for job in jobs])
    with run or contextlib.nullcontext():  # Ctrl-C or an error: the prebuild is cancelled
        for i, (case, dtype, layout) in enumerate(progress(jobs, describe,
                                                           "benchmarking" if gpu else "CPU reference + ptxas")):
            if run is not None:
                run.wait(i)  # this case's candidates are compiled; later cases' compile meanwhile
            record = _one(case, dtype, layout, gpu, args)
            record["batch"] = args.batch
            if args.n is not None:  # a forced width: the summary keeps a row a width
                record["n"] = case.N
            if args.explain:
                console.print(_explain(record))
            records.append(record)
            if args.out and gpu:  # partial results survive an interrupted run
                write_json(args.out, records, summarize(records), {"mode": "gpu", "partial": True})
        prebuilt = _finish_prebuild(args, run) if gpu else {}
    summary = summarize(records) if gpu else []
    _print(console, records, summary, gpu)
    if args.out:
        write_json(args.out, records, summary, {"mode": "gpu" if gpu else "cpu", **prebuilt})
        console.print(f"wrote {args.out}")
    if args.plot:  # without a GPU: what CPU mode measured, each plan's predicted traffic
        (plot if gpu else plot_plans)(args.plot, records)
        console.print(f"wrote {args.plot}")
    if not gpu:
        console.print("[yellow]No GPU here: plans were checked on the CPU reference and the PTX assembled with "
                      "ptxas. Timings need an NVIDIA GPU (sm_80+).[/]")
    return 0 if all(r.get("error_ok", True) for r in records) else 1


def run_conv_bench(args) -> int:
    """`bench conv:...`: every convolution case against cuDNN on the GPU, or its plan checked on the CPU."""
    from rich.table import Table

    from ..console import console
    from ..suite.conv import discover_conv
    from .report import plot, summarize, write_json

    _check_numbers(args)
    if args.layout in ("nk", "both") or args.n is not None or args.tokens is not None:
        raise ValueError("--layout kn/nk/both, --n and --tokens do not apply to convolution cases (--layout nchw or "
                         "nhwc; N = output pixels); --batch sets their batch")
    layout = "nchw" if args.layout == "kn" else args.layout
    cases = discover_conv(args.path, batch=args.batch)[: args.limit]
    dtypes = [DTYPES[name] for name in _dtypes(args.dtype)]
    gpu = _gpu_present() and not args.cpu
    records = []
    jobs = [(c, d) for c in cases for d in dtypes]
    describe = lambda job: f"{job[0].name} {job[1]}"  # noqa: E731
    run = None
    if gpu:
        from .conv import prebuild_conv_case

        run = _start_prebuild(args, [(describe(job), partial(prebuild_conv_case, *job, _budget(args), layout=layout))
                                     for job in jobs])
    with run or contextlib.nullcontext():  # Ctrl-C or an error: the prebuild is cancelled
        records = _conv_records(args, jobs, describe, gpu, layout, run)
        prebuilt = _finish_prebuild(args, run) if gpu else {}
    summary = summarize(records) if gpu else []
    table = Table(title="sparseforge bench (convolutions)" + ("" if gpu else " (CPU mode)"))
    cols = ["case", "dtype", "input", "kernel", "stride", "nnz", "config"]
    cols += ["sf us", "cuDNN us", "x cuDNN", "rel err"] if gpu else ["ref rel err", "predicted us"]
    for col in cols:
        table.add_column(col)
    for r in records:
        row = [r["case"], r["dtype"], "x".join(map(str, r["input_shape"])), "x".join(map(str, r["kernel"])),
               "x".join(map(str, r["stride"])), str(r["nnz"]), r["config"]]
        row += ([f"{r['sparseforge_us']:.2f}", f"{r['cudnn_us']:.2f} ({r['cudnn_layout']})",
                 f"{r['speedup_vs_cudnn']:.2f}", f"{r['rel_error']:.1e}" + ("" if r["error_ok"] else " FAIL")]
                if gpu else [f"{r['reference_rel_error']:.1e}", f"{r['predicted_us']:.1f}"])
        table.add_row(*row)
    console.print(table)
    for row in summary:
        console.print(f"{row['model']} {row['sparsity']} {row['dtype']} batch {row['batch']}: {row['cases']} cases, "
                      f"geomean x cuDNN {row['geomean_speedup_vs_cudnn']:.2f}, all correct {row['all_correct']}")
    if args.out:
        write_json(args.out, records, summary, {"mode": "gpu" if gpu else "cpu", **prebuilt})
        console.print(f"wrote {args.out}")
    if args.plot and gpu:
        plot(args.plot, [{**r, "cublas_us": r["cudnn_us"]} for r in records])
        console.print(f"wrote {args.plot} (speedup against cuDNN)")
    elif args.plot:
        console.print("[yellow]--plot: CPU mode has no timings to plot for convolutions; run on a GPU[/]")
    if not gpu:
        console.print("[yellow]No GPU here: plans were checked on the CPU reference and the PTX assembled with "
                      "ptxas. Timings need an NVIDIA GPU (sm_80+).[/]")
    return 0 if all(r.get("error_ok", True) for r in records) else 1


def _conv_records(args, jobs, describe, gpu: bool, layout: str, run) -> list[dict]:
    """Each convolution case measured (GPU) or checked (CPU) in turn, the partial results written after each;
    with a prebuild run, case i waits for its own prebuild only."""
    from ..console import console, progress
    from .report import summarize, write_json

    records = []
    for i, (case, dtype) in enumerate(progress(jobs, describe, "benchmarking" if gpu else "CPU reference + ptxas")):
        if gpu:
            from .conv import run_conv_case

            if run is not None:
                run.wait(i)  # this case's candidates are compiled; later cases' compile meanwhile
            record = run_conv_case(case, dtype, _budget(args), layout=layout)
        else:
            from .conv import run_conv_case_cpu

            record = run_conv_case_cpu(case, dtype, layout=layout)
        if args.explain and isinstance(record.get("choice"), dict):
            console.print(_explain(record))
        records.append(record)
        if args.out and gpu:
            write_json(args.out, records, summarize(records), {"mode": "gpu", "partial": True})
    return records


def _budget(args) -> float | None:
    """The tune_budget every case is compiled (and prebuilt) with: --tune-budget 0 is the cost model's pick."""
    return tuning_budget(args.tune_budget, "--tune-budget")


def _gpu_arch() -> int:
    """The compute capability compile_spmm / compile_conv2d (device "cuda") compile for: the current GPU's."""
    import torch

    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return 10 * major + minor


def _start_prebuild(args, jobs: list[tuple[str, Callable[..., int]]]):
    """Start compiling every case's candidates into the disk cache side by side on all cores (runtime.prebuild),
    each case measured as soon as its own are compiled while the later ones compile: one case's short list
    keeps a few cores busy, so compiling case after case left most of a 16-core host idle (ResNet-50's 17
    convolutions at --tune-budget 0.5: 5-14 measured in 60 s), and a run cut short still has what it measured.
    jobs: (label, prebuild call taking arch=) per case, with the arguments its measuring call takes. With
    --tune-budget 0 each case has its one predicted kernel compiled here. None where nothing is prebuilt."""
    from ..console import console
    from ..runtime.prebuild import PrebuildRun, prebuild_useful

    if args.no_prebuild or not prebuild_useful():
        if not args.no_prebuild:
            console.print(f"[yellow]no prebuild: {NO_PREBUILD}[/]")
        return None
    arch = _gpu_arch()
    return PrebuildRun([(label, partial(job, arch=arch)) for label, job in jobs], what="cases")


NO_PREBUILD = "the disk cache is off or the CUDA toolkit's ptxas is missing: nothing compiled now would carry over"


def _finish_prebuild(args, run) -> dict:
    """What the results JSON records of the prebuild (prebuild_seconds None where nothing was prebuilt, and
    why), once every job is done; a line saying what it did."""
    from ..console import console

    if run is None:
        return {"prebuild_seconds": None, "prebuild_skipped": "--no-prebuild" if args.no_prebuild else NO_PREBUILD}
    done = run.finish()
    failed = f"; {len(done.failures)} failed (compiled when measured)" if done.failures else ""
    console.print(f"prebuilt {done.built} kernels for {done.jobs} cases in {done.seconds:.1f} s on {done.workers} "
                  f"threads{failed}")
    return {"prebuild_seconds": done.seconds, "prebuilt_kernels": done.built, "prebuild_failures": list(done.failures)}


def _check_outputs(args) -> None:
    from ..console import check_output_path

    for option, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            check_output_path(path, option)


def _one(case, dtype, layout, gpu: bool, args) -> dict:
    if gpu:
        from .gpu import run_case

        from ..suite.llm import LLMCase

        rotate = isinstance(case, LLMCase) if args.rotate_weights is None else args.rotate_weights
        return run_case(case, dtype, layout, case.N, _budget(args), rotate_weights=rotate)
    from .cpu import run_case_cpu

    return run_case_cpu(case, dtype, layout, case.N, assemble=True)


def _explain(record: dict) -> str:
    from ..tune.choose import Choice

    head = f"{record['case']} {record['dtype']} {record['layout']} N={record['N']}: {record.get('mapping')}"
    if "choice" not in record:
        return head + " (fixed config)"
    choice = record["choice"]
    if isinstance(choice, list):  # CPU mode: predictions only
        choice = {"records": choice, "winner": min(range(len(choice)), key=lambda i: choice[i]["predicted_us"])}
    return head + "\n" + Choice.from_dict(choice).explain()


def _print(console, records, summary, gpu: bool) -> None:
    from rich.table import Table

    table = Table(title="sparseforge bench" + ("" if gpu else " (CPU mode)"))
    cols = ["case", "dtype", "layout", "M", "K", "N", "nnz", "mapping", "config"]
    cols += ["sf us", "cuBLAS us", "x cuBLAS", "x TF32", "cuSPARSE us", "x cuSPARSE", "rel err", "compile s"] if gpu \
        else ["ref rel err", "assemble s"]
    rotating = gpu and any("speedup_vs_cublas_rotating" in r for r in records)
    if rotating:  # weights streamed from HBM: time, rate and ratio beside cuBLAS's
        cols += ["HBM sf us (TB/s)", "HBM cuBLAS us (TB/s)", "x cuBLAS HBM"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("case", "config") else "right")
    for r in records:
        row = [r["case"], r["dtype"], r["layout"], str(r["M"]), str(r["K"]), str(r["N"]), str(r["nnz"]),
               r.get("mapping", "-"), r["config"]]
        if gpu:
            row += [f"{r['sparseforge_us']:.2f}", f"{r['cublas_us']:.2f}", f"{r['speedup_vs_cublas']:.2f}",
                    f"{r.get('speedup_vs_cublas_tf32', float('nan')):.2f}",
                    f"{r['cusparse_us']:.1f}" if r.get("cusparse_us") else "-",
                    f"{r['speedup_vs_cusparse']:.1f}" if r.get("speedup_vs_cusparse") else "-",
                    f"{r['rel_error']:.1e}" + ("" if r["error_ok"] else " FAIL"), f"{r['compile_seconds']:.2f}"]
            if rotating:
                row += ([f"{r['sparseforge_rotating_us']:.2f} ({r['sparseforge_rotating_tbs']:.2f})",
                         f"{r['cublas_rotating_us']:.2f} ({r['cublas_rotating_tbs']:.2f})",
                         f"{r['speedup_vs_cublas_rotating']:.2f}"] if "speedup_vs_cublas_rotating" in r else ["-"] * 3)
        else:
            row += [f"{r['reference_rel_error']:.1e}", f"{r.get('assemble_seconds', float('nan')):.2f}"]
        table.add_row(*row)
    console.print(table)
    if summary:
        s = Table(title="geomean speedups")
        for col in ("model", "sparsity", "dtype", "layout", "batch", "cases", "x cuBLAS", "x cuBLAS TF32",
                    "x cuSPARSE", "of floor (median)", "fetch TB/s (median)", "correct"):
            s.add_column(col)
        for row in summary:
            s.add_row(row["model"], str(row["sparsity"]), row["dtype"], row["layout"], str(row["batch"]),
                      str(row["cases"]), f"{row['geomean_speedup_vs_cublas']:.2f}",
                      f"{row['geomean_speedup_vs_cublas_tf32']:.2f}", f"{row['geomean_speedup_vs_cusparse']:.1f}",
                      _fmt(row.get("median_floor_fraction"), "{:.0%}"), _fmt(row.get("median_fetched_tbs"), "{:.2f}"),
                      str(row["all_correct"]))
        console.print(s)
        for row in summary:
            if row.get("geomean_speedup_vs_cublas_rotating") is not None:
                console.print(f"{row['model']} {row['sparsity']} {row['dtype']}: x cuBLAS with weights rotated "
                              f"through HBM (geomean) {row['geomean_speedup_vs_cublas_rotating']:.2f}")
        console.print("of floor: the byte/FLOP floor (B and C moved once) over the measured time; fetch TB/s: the B "
                      "rows the plan re-reads per row group (plan.operand_bytes) over the measured time")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def add_bench24_parser(sub) -> None:
    from .semi import SHAPES, WIDTHS

    bench = sub.add_parser("bench24", help="2:4 on Sparse Tensor Cores vs cuBLAS vs torch's semi-structured path",
                           description="Time 2:4 matrix products on Sparse Tensor Cores (cuSPARSELt) against cuBLAS "
                                       "and torch's semi-structured path; needs an NVIDIA GPU (sm_80+).")
    bench.add_argument("--shapes", default="bert,llama",
                       help=f"comma-separated groups ({', '.join(SHAPES)}) or MxK shapes (out x in), e.g. 4096x4096")
    bench.add_argument("--n", default=",".join(map(str, WIDTHS)), help="comma-separated input widths (tokens)")
    bench.add_argument("--dtype", choices=["fp16", "bf16", "all"], default="all")
    bench.add_argument("--no-torch", action="store_true", help="skip torch's semi-structured baseline")
    bench.add_argument("--out", type=Path, default=None, help="write results JSON here")
    bench.add_argument("--plot", type=Path, default=None, help="write a speedup plot (PNG) here")
    bench.set_defaults(run=run_bench24)


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """'bert,4096x11008' -> [(group, out, in), ...]."""
    from .semi import SHAPES

    shapes = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in SHAPES:
            shapes += [(item, m, k) for m, k in SHAPES[item]]
            continue
        try:
            m, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r}: give a group ({', '.join(SHAPES)}) or OUTxIN such as 4096x11008") from None
        if m < 1 or k < 1:
            raise ValueError(f"shape {item!r}: OUT and IN must be >= 1, e.g. 4096x11008")
        if max(m, k) >= INDEX_LIMIT:  # the kernels index with 32-bit integers; a larger one failed allocating
            raise ValueError(f"shape {item!r}: OUT and IN must be < 2**31 = {INDEX_LIMIT}, e.g. 4096x11008")
        shapes.append(("custom", m, k))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def parse_widths(spec: str) -> list[int]:
    """'1,16,2048' -> [1, 16, 2048]; anything else is an error naming what was given."""
    try:
        widths = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise ValueError(f"--n needs comma-separated positive widths such as 1,16,2048; got {spec!r}")
    if max(widths) >= INDEX_LIMIT:  # as for bench: 32-bit indices; a larger N failed allocating (a MemoryError)
        raise ValueError(f"--n {max(widths)}: N must be < 2**31 = {INDEX_LIMIT}, as M and K are (the kernels "
                         "index with 32-bit integers); give smaller widths such as 1,16,2048")
    return widths


def run_bench24(args) -> int:
    from ..console import console, progress
    from .report import write_json
    from .semi import host_overhead_us, run_case24
    from .semi_report import plot24, print24, summarize24

    shapes, widths = parse_shapes(args.shapes), parse_widths(args.n)
    _check_outputs(args)  # before the work: a bad --out or --plot path was found only after every case ran
    if not _gpu_present():
        raise RuntimeError("bench24 times Sparse Tensor Cores and needs an NVIDIA GPU (sm_80+); none is visible")
    dtypes = ["float16", "bfloat16"] if args.dtype == "all" else [DTYPES[args.dtype]]
    jobs = [(g, m, k, n, d) for d in dtypes for g, m, k in shapes for n in widths]
    records = []
    describe = lambda job: f"{job[0]} {job[1]}x{job[2]} N={job[3]} {job[4]}"  # noqa: E731
    for group, m, k, n, dtype in progress(jobs, describe, "2:4 benchmark"):
        records.append({"group": group, **run_case24(m, k, n, dtype, with_torch=not args.no_torch)})
        if args.out:  # partial results survive an interrupted run
            write_json(args.out, records, summarize24(records), {"mode": "gpu", "partial": True})
    overhead = host_overhead_us()
    summary = summarize24(records)
    print24(console, records, summary, overhead)
    if args.out:
        write_json(args.out, records, summary, {"mode": "gpu", "host_overhead_us": overhead})
        console.print(f"wrote {args.out}")
    if args.plot:
        plot24(args.plot, records)
        console.print(f"wrote {args.plot}")
    return 0 if all(r["error_ok"] and r.get("gemv24_error_ok", True) for r in records) else 1
