"""`sparseforge convert IN OUT` and `sparseforge profile IN`: a whole model saved with torch.save(model), or a
state dict (what `sparseforge prune` writes) with --model naming the model it belongs to; every Linear / Conv2d
measured dense, unstructured and 2:4 on the shapes an example input feeds it (nn.convert). convert saves the
converted model (loadable in any process that imports sparseforge); profile only reports, with a per-layer table
and a PNG of per-layer times, and needs a GPU (it measures)."""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from .dtypes import SHORT_NAMES
from .tune.choose import TUNE_BUDGET_S

DTYPES = SHORT_NAMES  # the one table lives in dtypes.py


def add_model_parsers(sub) -> None:
    for name, help_text in (("convert", "convert a saved model's Linear / Conv2d layers to the fastest of dense, "
                                        "unstructured sparse and 2:4, by measurement"),
                            ("profile", "measure every Linear / Conv2d of a saved model dense and sparse, "
                                        "without converting it (needs a CUDA GPU)")):
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           epilog=MODEL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("input", type=Path, help="a model saved with torch.save(model), or with --model a state dict "
                                                "(.pt / .safetensors, e.g. what `sparseforge prune` writes)")
        if name == "convert":
            p.add_argument("output", type=Path, help="where the converted model is saved (torch.save)")
        p.add_argument("--model", metavar="NAME", default=None,
                       help="build the model INPUT's state dict belongs to: a torchvision or timm model name "
                            "(resnet50, vit_b_16), or module:factory, a function returning the model (e.g. "
                            "mypackage.models:build; the current directory is searched first)")
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
        p.add_argument("--cpu", action="store_true",
                       help="stay on the CPU (policy 'sparse' or 'dense' only)" if name == "convert" else
                       argparse.SUPPRESS)  # profile measures: refused with the reason
        p.set_defaults(run=_run)


MODEL_EPILOG = """\
a pruned model, from a state dict:
  sparseforge prune resnet50.pt resnet50_90.pt --sparsity 0.9
  sparseforge convert resnet50_90.pt resnet50_sparse.pt --model resnet50 --example-shape 1,3,224,224
(--model: a torchvision or timm name, or module:factory; without it INPUT must be a whole model saved with
torch.save(model, path))"""


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

    from .console import check_input_file, check_output_path, console, write_output
    from .nn import convert, fuse_epilogues
    from .nn.convert import ExampleInputError, one_line
    from .prune.targets import NothingSelectedError
    from .tune.choose import check_tune_budget

    if args.command == "profile" and args.cpu:
        raise ValueError("profile measures each layer's dense and sparse times on an NVIDIA GPU, so --cpu leaves it "
                         "nothing to measure; run it on a GPU (on a CPU, `sparseforge convert --cpu --policy sparse` "
                         "converts a model without measuring)")
    for option, path in (("--report", args.report), ("--plot", getattr(args, "plot", None)),
                         ("OUTPUT", getattr(args, "output", None))):
        if path is not None:
            check_output_path(path, option)
    shape = _shape(args.example_shape)
    check_tune_budget(args.tune_budget, "--tune-budget")
    for option, pattern in (("--include", args.include), ("--exclude", args.exclude)):
        _regex(pattern, option)
    device = "cpu" if args.cpu else "cuda"
    if args.cpu and args.policy == "measure":
        raise ValueError("convert --cpu: --policy measure (the default) times the kernels on a GPU; on the CPU give "
                         "--policy sparse (every layer the sparse kernels can take, unmeasured) or --policy dense")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"no CUDA GPU here: {args.command} measures on one"
                         + (". Pass --cpu with --policy sparse or dense to convert without measuring"
                            if args.command == "convert" else ""))
    check_input_file(args.input, "a model saved with torch.save(model), or a state dict with --model")
    output = getattr(args, "output", None)
    if output is not None and output.exists() and os.path.samefile(args.input, output):
        raise ValueError(f"OUTPUT {output} is the input file: converting would overwrite the original model; "
                         "give another output path")
    model = build_model(args.model, args.input) if args.model else _load_model(args.input)
    if next(model.parameters(), None) is None:  # nothing to convert, and no dtype to take the example's from
        raise ValueError(f"{args.input}: the model has no parameters, so no Linear or Conv2d layer to convert")
    # convert() replaces layers inside a model: a model that is itself one layer is converted inside a wrapper
    bare = isinstance(model, (torch.nn.Linear, torch.nn.Conv2d))
    if bare:
        model = torch.nn.Sequential(model)
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
            report = convert(model, example, dtype=dtype if args.dtype else None,
                             include=_layer_filter(args.include, bare), exclude=_layer_filter(args.exclude, bare),
                             policy=args.policy, tune_budget=args.tune_budget,
                             fold_bn=not args.no_fold_bn, time_model=device == "cuda", progress=progress)
        except ExampleInputError as err:  # convert's own trial forward: said here in the CLI's terms
            raise ValueError(f"the model fails on a random {dtype} input of shape {tuple(shape)} "
                             f"({one_line(err.__cause__)}); give --example-shape the shape of the model's one "
                             "input (a model that takes token ids or several inputs needs the Python API: "
                             "sparseforge.nn.convert(model, example_inputs))") from None
        except NothingSelectedError as err:  # in this command's words: its options, the patterns as given
            # (a bare layer's filter is a callable), the wrapper's layer "0" as the model itself
            skipped = [replace(item, name="") for item in err.skipped] if bare else err.skipped
            raise NothingSelectedError(skipped, args.include, args.exclude, err.what, err.verb, "--") from None
    if bare:  # the wrapper's layer "0" is the model itself, whose qualified name is ""
        model = model[0]
        for layer in report.layers:
            layer.name = ""
        report.skipped = [replace(item, name="") for item in report.skipped]
    table = Table(title=f"sparseforge {args.command}: {args.input.name}")
    for col in ("layer", "kind", "weight", "sparsity", "choice", "mapping", "dense us", "chosen us", "speedup"):
        table.add_column(col, justify="left" if col in ("layer", "kind", "choice", "mapping") else "right")
    for layer in report.layers:
        dense, chosen = layer.times_us.get("dense"), layer.times_us.get(layer.choice)
        table.add_row(layer.name or "(the model itself)", layer.kind, "x".join(map(str, layer.weight_shape)),
                      f"{layer.sparsity:.1%}", layer.choice, layer.mapping or "-", _fmt(dense), _fmt(chosen),
                      _fmt(layer.speedup, "{:.2f}x"))
    console.print(table)
    console.print(str(report).splitlines()[-3] if report.latency_before_us else "")
    console.print("\n".join(str(report).splitlines()[-2:]))
    if args.report:
        text = json.dumps(report.as_dict(), indent=1, default=str)
        write_output(args.report, lambda: args.report.write_text(text), "--report")
        console.print(f"wrote {args.report}")
    if getattr(args, "plot", None):
        write_output(args.plot, lambda: plot_layers(args.plot, report), "--plot")
        console.print(f"wrote {args.plot}")
    if args.command == "convert":
        if not args.no_fuse and not bare:  # one layer alone has no ReLU or shortcut add to fuse
            model, fused = fuse_epilogues(model, (example,))
            console.print(f"epilogues fused into {len(fused.fused)} sparse convolution(s)"
                          + (f"; not fused: {', '.join(f'{s.name} ({s.reason})' for s in fused.skipped)}"
                             if fused.skipped else ""))
        write_output(args.output, lambda: torch.save(model, args.output), "OUTPUT")
        console.print(f"wrote {args.output} (load it with torch.load(path, weights_only=False) in a process that "
                      "imports sparseforge)")
    return 0


def _load_model(path: Path):
    """The module torch.save(model) wrote at path; any other file is refused with what it holds or why it cannot
    be read (torch raises many types for a damaged or foreign file, some with a traceback from deep inside)."""
    import torch

    from .checkpoint import check_torch_file, read_head, torch_load

    wanted = "a model saved with torch.save(model, path)"
    if path.suffix == ".safetensors":
        raise ValueError(f"{path}: a .safetensors file holds tensors only, not a model; give --model NAME as well "
                         "to build the model they belong to (a torchvision or timm name, or module:factory)")
    check_torch_file(path, read_head(path), wanted)
    try:
        model = torch_load(path, weights_only=False)
    except Exception as err:
        what = " ".join(str(err).split())[:200]
        raise ValueError(f"{path}: not a readable model file ({type(err).__name__}: {what}); give {wanted}; a "
                         "truncated or damaged file needs copying or saving again") from None
    if isinstance(model, dict):
        raise ValueError(f"{path} holds a state dict (weights only), not a model: give --model NAME as well to "
                         "build the model it belongs to (a torchvision or timm name, or module:factory), or save "
                         "the module itself (torch.save(model, path))")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{path} holds a {type(model).__name__}, not a model: save the module itself "
                         "(torch.save(model, path))")
    return model


def build_model(spec: str, weights: Path):
    """The model `--model spec` names, with the state dict at `weights` loaded into it (every key matching)."""
    from .checkpoint import load_state
    from .prune import find_state_dict

    _, state = find_state_dict(load_state(weights))  # first: a bad weights file is found before any import
    model = _model_from_spec(spec)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes that do not match: torch lists them over many lines
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ValueError(f"{weights} does not fit --model {spec}: {' '.join(first.split())[:300]}; give the model "
                         "the weights were trained as") from None
    missing, unexpected = result.missing_keys, result.unexpected_keys
    if missing or unexpected:
        parts = [f"{len(keys)} {what} (first: {', '.join(keys[:3])})"
                 for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ValueError(f"{weights} does not fit --model {spec}: its keys differ from the model's, "
                         f"{'; '.join(parts)}; give the model the weights were trained as")
    return model


def _model_from_spec(spec: str):
    """A fresh model (random weights) from a torchvision or timm name, or from module:factory."""
    import torch

    from .nn.convert import one_line

    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"--model {spec}: give module:factory, e.g. mypackage.models:build")
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: a module beside the user
            sys.path.insert(0, os.getcwd())
        try:
            factory = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"--model {spec}: cannot import {module_name} ({one_line(err)}); give a module "
                             "importable from the current directory or PYTHONPATH") from None
        except Exception as err:  # the module's own code failed (a syntax error, an exception at import)
            raise ValueError(f"--model {spec}: importing {module_name} failed ({type(err).__name__}: "
                             f"{one_line(err)}); fix the module") from None
        try:
            for part in attribute.split("."):
                factory = getattr(factory, part)
        except AttributeError:
            raise ValueError(f"--model {spec}: {module_name} has no {attribute}") from None
        if not callable(factory):
            raise ValueError(f"--model {spec}: {attribute} is a {type(factory).__name__}, not a function that "
                             "returns the model")
        try:
            model = factory()
        except Exception as err:
            raise ValueError(f"--model {spec}: {attribute}() failed ({one_line(err)}); it must build the model "
                             "when called without arguments") from None
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"--model {spec}: {attribute}() returned a {type(model).__name__}, not a "
                             "torch.nn.Module")
        return model
    tried, missing = [], []
    try:
        import torchvision.models
    except ImportError:
        missing.append("torchvision")
        tried.append("torchvision is not installed (pip install torchvision)")
    else:
        if spec in torchvision.models.list_models():
            return torchvision.models.get_model(spec, weights=None)
        tried.append("not a torchvision model")
    try:
        import timm
    except ImportError:
        missing.append("timm")
        tried.append("timm is not installed (pip install timm)")
    else:
        if timm.is_model(spec):
            return timm.create_model(spec, pretrained=False)
        tried.append("not a timm model")
    if len(missing) == 2:  # the name may well be right: what is missing is the library that builds it
        raise ValueError(f"--model {spec}: neither torchvision nor timm is installed, and model names are built by "
                         "them: pip install torchvision (or pip install timm for a timm model), or give "
                         "module:factory (a function returning the model)")
    raise ValueError(f"--model {spec}: {', '.join(tried)}; give a torchvision or timm model name, or "
                     "module:factory (a function returning the model)")


def _regex(pattern: str | None, option: str):
    """The compiled --include / --exclude pattern (None for none); a bad one named with its option."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{option} {pattern!r} is not a valid regular expression ({err}); escape characters "
                         "such as ( [ + * ? with a backslash to match them literally") from None


def _layer_filter(pattern: str | None, bare: bool):
    """The pattern as convert() takes it; for a model that is itself one layer (wrapped, so named "0"), a filter
    that matches the pattern against the model's own qualified name ""."""
    compiled = _regex(pattern, "pattern")
    if compiled is None or not bare:
        return pattern
    return lambda name, module: compiled.search("") is not None


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
