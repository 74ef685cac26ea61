"""The `sparseforge` command line: info and prune here; bench and bench24 in bench/cli.py."""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from rich.progress import track
from rich.table import Table

from .checkpoint import load_state, save_state
from .console import check_output_path, console, print_error
from .formats import SparseFormatError
from .prune import NMError, NothingSelectedError, PruneReport, Skipped, parse_nm, prune_state_dict
from .prune.api import SCOPES
from .suite import discover


def _info(args) -> int:
    path = Path(args.path)
    wrap = (lambda files: track(files, description="reading", console=console, transient=True)) if path.is_dir() else None
    cases = discover(args.path, batch=args.batch, tokens=args.tokens, n=args.n, progress=wrap)
    table = Table(title=f"{path} ({len(cases)} matrices)")
    for col in ("matrix", "M", "K", "nnz", "density", "N", "nnz/row mean", "std", "max", "empty rows", "col reuse"):
        table.add_column(col, justify="left" if col == "matrix" else "right")
    stats_iter = track(cases, description="statistics", console=console, transient=True) if len(cases) > 1 else cases
    for case in stats_iter:
        s = case.load().stats()
        table.add_row(case.name, str(s.rows), str(s.cols), str(s.nnz), f"{s.density:.4f}",
                      "?" if case.N is None else str(case.N), f"{s.row_nnz_mean:.1f}", f"{s.row_nnz_std:.1f}",
                      str(s.row_nnz_max), str(s.empty_rows), f"{s.column_reuse:.2f}")
    console.print(table)
    return 0


def print_prune_report(report: PruneReport) -> None:
    table = Table(title=f"pruned: {report.method}")
    for col in ("layer", "shape", "nonzeros before", "after", "sparsity"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for layer in report.layers:
        table.add_row(layer.name, "x".join(map(str, layer.shape)), str(layer.nonzero_before),
                      str(layer.nonzero_after), f"{layer.sparsity:.4f}")
    console.print(table)
    print_skipped(report.skipped)
    console.print(f"{len(report.layers)} layers pruned, overall sparsity {report.sparsity:.4f}; "
                  f"{len(report.skipped)} skipped")
    if report.state_key is not None:
        console.print(f"(pruned the weights under the checkpoint's key {report.state_key!r}; its other keys are "
                      "kept as they were)", highlight=False)
    for warning in report.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)


def print_skipped(items: list[Skipped]) -> None:
    if items:
        skipped = Table(title="skipped")
        skipped.add_column("tensor")
        skipped.add_column("reason")
        for item in items:
            skipped.add_row(str(item.name), item.reason)  # a checkpoint key need not be a str
        console.print(skipped)


def _prune(args) -> int:
    source, target = Path(args.input), Path(args.output)
    check_output_path(target, "output")
    if target.exists() and source.exists() and os.path.samefile(source, target) and not args.force:
        raise ValueError(f"output {target} is the input file: pruning would overwrite the original weights; give "
                         "another output path, or --force to overwrite it")
    if args.sparsity is not None and args.sparsity == 0:
        raise ValueError(f"--sparsity {args.sparsity:g} removes no weight, so the output would be a copy of the input; "
                         "give the fraction of weights to remove, e.g. --sparsity 0.5")
    if args.nm is not None and len(set(parse_nm(args.nm))) == 1:
        raise ValueError(f"--nm {args.nm} keeps every weight (N = M), so the output would be a copy of the input; "
                         "give N < M, e.g. --nm 2:4")
    state = load_state(source)
    try:
        pruned, report = prune_state_dict(state, sparsity=args.sparsity, nm=args.nm, scope=args.scope,
                                          include=args.include, exclude=args.exclude)
    except NothingSelectedError as err:
        print_skipped(err.skipped)
        raise ValueError(f"{source}: nothing was pruned, so nothing was written: {err.as_options()}") from None
    print_prune_report(report)
    if not report.layers:
        raise ValueError(f"{source}: nothing was pruned, so nothing was written: no tensor is a 2-D or 4-D "
                         "floating-point weight that can be pruned as asked (the skipped table gives each reason)")
    save_state(pruned, target)
    console.print(f"wrote {target}")
    return 0


DESCRIPTION = """\
Make pruned neural networks run faster on NVIDIA GPUs: prune a model's weights (magnitude or 2:4), look
at sparse weight matrices, and benchmark sparseforge's sparse kernels against cuBLAS and cuSPARSE.
Without a GPU, bench checks every kernel plan on the CPU and assembles its PTX instead of timing it."""

EXAMPLES = """\
examples:
  sparseforge info dlmc/rn50/magnitude_pruning/0.9      (a .smtx file or a DLMC-style directory)
  sparseforge prune model.safetensors model_90.safetensors --sparsity 0.9
  sparseforge prune model.pt model_24.pt --nm 2:4 --exclude lm_head
  sparseforge bench dlmc/rn50/magnitude_pruning/0.9 --out results.json --plot speedup.png
  sparseforge convert model.pt model_sparse.pt --example-shape 1,3,224,224 --dtype fp16
  sparseforge convert model_90.pt model_sparse.pt --model resnet50 --example-shape 1,3,224,224
                                                        (a state dict, as prune writes, and the model it belongs to)
  sparseforge profile model.pt --example-shape 1,128,384 --plot layers.png

`sparseforge COMMAND --help` lists the options of a command."""


PRUNE_DESCRIPTION = """\
Prune the Linear (2-D) and Conv2d (4-D) floating-point weights of a saved state dict, by magnitude (--sparsity) or
to N:M (--nm), and write the pruned copy; other tensors are kept as they are. A table lists every tensor pruned
and every one skipped, with the reason."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseforge", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    info_help = "statistics of one .smtx file or a DLMC-style directory"
    info = sub.add_parser("info", help=info_help, description=info_help[0].upper() + info_help[1:] + ".")
    info.add_argument("path", help="a .smtx file, a DLMC-style directory, or llm[:sparsities[:shapes[:methods]]]")
    info.add_argument("--batch", type=int, default=1, help="ResNet-50 batch size (N = pixels x batch)")
    info.add_argument("--tokens", type=int, default=None,
                      help="N for Transformer layers (default 256) and llm layers (default 16)")
    info.add_argument("--n", type=int, default=None, help="force one N for every matrix")
    info.set_defaults(run=_info)

    prune = sub.add_parser("prune", help="prune a saved state dict (.pt/.pth) or .safetensors file",
                           description=PRUNE_DESCRIPTION)
    prune.add_argument("input", help="a state dict saved with torch.save (.pt / .pth, also a checkpoint that nests "
                                     "one) or a .safetensors file")
    prune.add_argument("output", help="where the pruned state dict is written, in the format its suffix names "
                                      "(.safetensors, else torch.save)")
    how = prune.add_mutually_exclusive_group(required=True)
    how.add_argument("--sparsity", type=float, help="magnitude pruning: fraction of weights removed")
    how.add_argument("--nm", help="N:M pruning along the input dimension, e.g. 2:4")
    prune.add_argument("--scope", choices=SCOPES, default="layer",
                       help="with --sparsity, where the fraction applies: each tensor (layer, the default), each "
                            "output row of every tensor (row: as many nonzeros in every row), or one threshold "
                            "over all tensors together (global)")
    prune.add_argument("--include", help="regex: prune only tensors whose name matches")
    prune.add_argument("--exclude", help="regex: leave tensors whose name matches dense")
    prune.add_argument("--force", action="store_true", help="allow OUTPUT to be the INPUT file (overwrites it)")
    prune.set_defaults(run=_prune)

    from .bench.cli import add_bench24_parser, add_bench_parser

    add_bench_parser(sub)
    add_bench24_parser(sub)
    from .model_cli import add_model_parsers

    add_model_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (SparseFormatError, NMError, ValueError, OSError, RuntimeError) as err:
        if os.environ.get("SPARSEFORGE_TRACEBACK"):  # where a report needs more than the one line
            traceback.print_exc()
        print_error(err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
