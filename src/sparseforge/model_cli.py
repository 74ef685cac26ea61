"""`sparseforge convert IN OUT` and `sparseforge profile IN`: a whole model saved with torch.save(model), every
Linear / Conv2d measured dense, unstructured and 2:4 on the shapes an example input feeds it (nn.convert).
convert saves the converted model (loadable in any process that imports sparseforge); profile only reports,
with a per-layer table and a PNG of per-layer times."""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

from .dtypes import SHORT_NAMES
from .tune.choose import TUNE_BUDGET_S

DTYPES = SHORT_NAMES  # the one table lives in dtypes.py


def add_model_parsers(sub) -> None:
    for name, help_text in (("convert", "convert a saved model's Linear / Conv2d layers to the fastest of dense, "
                                        "unstructured sparse and 2:4, by measurement"),
                            ("profile", "measure every Linear / Conv2d of a saved model dense and sparse, "
                                        "without converting it")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("input", type=Path, help="a model saved with torch.save(model)")
        if name == "convert":
            p.add_argument("output", type=Path, help="where the converted model is saved (torch.save)")
        p.add_argument("--example-shape", required=True,
                       help="the shape of one example input, comma-separated, e.g. 1,3,224,224 (random values)")
        p.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast the model first")
        p.add_argument("--policy", choices=("measure", "sparse", "dense"), default="measure")
        p.add_argument("--tune-budget", type=float, default=TUNE_BUDGET_S, help="seconds of kernel timing per layer and shape (0: the cost model's pick, nothing timed)")
        p.add_argument("--include", help="regex: only layers whose qualified name matches")
        p.add_argument("--exclude", help="regex: leave layers whose name matches as they are")
        p.add_argument("--no-fold-bn", action="store_true", help="keep BatchNorm2d layers apart from the convolutions")
        if name == "convert":
            p.add_argument("--no-fuse", action="store_true",
                           help="save the model as convert() leaves it: without fusing each sparse convolution's "
                                "ReLU / shortcut add into its kernel (the fused model is a torch.fx GraphModule)")
        p.add_argument("--report", type=Path, default=None, help="write the per-layer report here (JSON)")
        if name == "profile":
            p.add_argument("--plot", type=Path, default=None, help="a PNG of per-layer times, dense against sparse")
        p.add_argument("--cpu", action="store_true", help="stay on the CPU (policy 'sparse' or 'dense' only)")
        p.set_defaults(run=_run)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(v < 1 for v in shape):
        raise ValueError(f"--example-shape {text!r}: give positive integers separated by commas, e.g. 1,3,224,224")
    return shape


def _run(args) -> int:
    import torch
    from rich.progress import Progress
    from rich.table import Table

    from .console import check_output_path, console
    from .nn import convert, fuse_epilogues
    from .nn.convert import ExampleInputError, one_line
    from .tune.choose import check_tune_budget

    for option, path in (("--report", args.report), ("--plot", getattr(args, "plot", None)),
                         ("OUTPUT", getattr(args, "output", None))):
        if path is not None:
            check_output_path(path, option)
    shape = _shape(args.example_shape)
    check_tune_budget(args.tune_budget, "--tune-budget")
    if not args.input.is_file():
        raise ValueError(f"{args.input}: no such file (a model saved with torch.save(model))")
    output = getattr(args, "output", None)
    if output is not None and output.exists() and os.path.samefile(args.input, output):
        raise ValueError(f"OUTPUT {output} is the input file: converting would overwrite the original model; "
                         "give another output path")
    model = _load_model(args.input)
    if next(model.parameters(), None) is None:  # nothing to convert, and no dtype to take the example's from
        raise ValueError(f"{args.input}: the model has no parameters, so no Linear or Conv2d layer to convert")
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here: measuring needs one. Pass --cpu with --policy sparse or dense")
    if args.command == "profile":
        model = copy.deepcopy(model)
    model.to(device)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else next(model.parameters()).dtype
    example = _example(shape, device, dtype)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("measuring layers", total=None)

        def progress(name, index, total):
            bar.update(task, total=total, completed=index, description=f"measuring {name}")

        try:
            report = convert(model, example, dtype=dtype if args.dtype else None, include=args.include,
                             exclude=args.exclude, policy=args.policy, tune_budget=args.tune_budget,
                             fold_bn=not args.no_fold_bn, time_model=device == "cuda", progress=progress)
        except ExampleInputError as err:  # convert's own trial forward: said here in the CLI's terms
            raise ValueError(f"the model fails on a random {dtype} input of shape {tuple(shape)} "
                             f"({one_line(err.__cause__)}); give --example-shape the shape of the model's one "
                             "input (a model that takes token ids or several inputs needs the Python API: "
                             "sparseforge.nn.convert(model, example_inputs))") from None
    table = Table(title=f"sparseforge {args.command}: {args.input.name}")
    for col in ("layer", "kind", "weight", "sparsity", "choice", "mapping", "dense us", "chosen us", "speedup"):
        table.add_column(col, justify="left" if col in ("layer", "kind", "choice", "mapping") else "right")
    for layer in report.layers:
        dense, chosen = layer.times_us.get("dense"), layer.times_us.get(layer.choice)
        table.add_row(layer.name, layer.kind, "x".join(map(str, layer.weight_shape)), f"{layer.sparsity:.1%}",
                      layer.choice, layer.mapping or "-", _fmt(dense), _fmt(chosen), _fmt(layer.speedup, "{:.2f}x"))
    console.print(table)
    console.print(str(report).splitlines()[-3] if report.latency_before_us else "")
    console.print("\n".join(str(report).splitlines()[-2:]))
    if args.report:
        args.report.write_text(json.dumps(report.as_dict(), indent=1, default=str))
        console.print(f"wrote {args.report}")
    if getattr(args, "plot", None):
        plot_layers(args.plot, report)
        console.print(f"wrote {args.plot}")
    if args.command == "convert":
        if not args.no_fuse:
            model, fused = fuse_epilogues(model, (example,))
            console.print(f"epilogues fused into {len(fused.fused)} sparse convolution(s)"
                          + (f"; not fused: {', '.join(f'{s.name} ({s.reason})' for s in fused.skipped)}"
                             if fused.skipped else ""))
        torch.save(model, args.output)
        console.print(f"wrote {args.output} (load it with torch.load(path, weights_only=False) in a process that "
                      "imports sparseforge)")
    return 0


def _load_model(path: Path):
    """The module torch.save(model) wrote at path; any other file is refused with what it holds or why it cannot
    be read (torch raises many types for a damaged or foreign file, some with a traceback from deep inside)."""
    import torch

    if path.suffix == ".safetensors":
        raise ValueError(f"{path}: a .safetensors file holds tensors only, not a model; save the module with "
                         "torch.save(model, path)")
    try:
        model = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as err:
        what = " ".join(str(err).split())[:200]
        raise ValueError(f"{path}: not a readable model file ({type(err).__name__}: {what}); give a model saved "
                         "with torch.save(model, path); a truncated or damaged file needs copying or saving again"
                         ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{path} holds a {type(model).__name__}, not a model: save the module itself "
                         "(torch.save(model, path)), not its state_dict")
    return model


def _example(shape: tuple[int, ...], device: str, dtype):
    """The seeded random example input; one too large to allocate is refused with its size named."""
    import torch

    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    except (RuntimeError, MemoryError):
        raise ValueError(f"--example-shape {','.join(map(str, shape))}: the example input needs {size / 2**30:.1f} "
                         "GiB; give the shape of one real input") from None


def _fmt(value, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def plot_layers(path: Path, report) -> None:
    """Per-layer bars: dense time and the chosen path's time (where measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report.layers
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(layers) + 2), 5))
    xs = range(len(layers))
    ax.bar([x - 0.2 for x in xs], [layer.times_us.get("dense") or 0 for layer in layers], width=0.4, label="dense")
    ax.bar([x + 0.2 for x in xs], [layer.times_us.get(layer.choice) or 0 for layer in layers], width=0.4,
           label="chosen")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([layer.name for layer in layers], rotation=90, fontsize=7)
    ax.set_ylabel("time per call (us, CUDA graph replay)")
    ax.set_title("per-layer time: dense against the chosen path")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
