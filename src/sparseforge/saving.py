"""save(model, directory) / load(directory): a converted model on disk, loaded in a fresh process without
measuring anything again.

A directory holds:
  model.safetensors      every tensor of the model: its state_dict, each tensor shared under several names
                         (tied embeddings) once, and the buffers state_dict leaves out (rotary tables) under
                         "nonpersistent/<name>"
  config.json            (a transformers model) its config as save_pretrained writes it; generation_config.json
                         beside it where the model has one
  sparseforge.json       written last, so a directory without it is an unfinished save: the format, the package
                         version, the model's class and how to rebuild it ("transformers": from config.json;
                         "module": the caller passes a model of the same architecture), the names shared tensors
                         go by, and per converted module its class, constructor arguments and decisions (the
                         decode widths a DecodeLinear runs on its kernels: loaded as made, not measured again),
                         and the MLPs that ran their gate and up projections as one gated kernel (wrapped again
                         on load, fused once their kernels are prepared).

load builds the model on the meta device (no memory, no random init), puts the converted modules back where
they were, and assigns the saved tensors; the kernels come from the kernel cache at the first call, or at once
loading onto a CUDA device (DecodeLinear.prepare). The cache holds each measured choice with its times, so
nothing is timed again where it holds them (on another machine, or with the cache cleared, the first layer of
each shape is measured again and the kernels compiled: the decode widths themselves stay as saved).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ._version import __version__

FORMAT = 1
MANIFEST, TENSORS, CONFIG = "sparseforge.json", "model.safetensors", "config.json"
NONPERSISTENT = "nonpersistent/"


class SavedModelError(ValueError):
    """A directory that is not a complete, readable sparseforge.save: what is wrong and the fix."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _record(module: nn.Module) -> dict | None:
    """How to rebuild `module` empty (its tensors come from the state dict), or None for a module the model's
    own code builds."""
    from .nn import DecodeLinear, SparseConv2d, SparseLinear, SparseLinear24
    from .tune.pipeline import config_record

    if isinstance(module, DecodeLinear):
        return {"class": "DecodeLinear", "kernel_widths": sorted(module.kernel_widths), "inner": _record(module.inner)}
    if isinstance(module, SparseLinear):
        return {"class": "SparseLinear", "in_features": module.in_features, "out_features": module.out_features,
                "bias": module.bias is not None, "dtype": _dtype_name(module.weight_values.dtype), "nnz": module.nnz,
                "policy": module.policy, "tune_budget": module.tune_budget,
                "pinned": {str(n): config_record(c) for n, c in sorted(module.pinned.items())},
                "decisions": [d.as_dict() for d in module.decisions]}
    if isinstance(module, SparseLinear24):
        return {"class": "SparseLinear24", "in_features": module.in_features, "out_features": module.out_features,
                "bias": module.bias is not None, "dtype": _dtype_name(module.weight.dtype), "policy": module.policy,
                "min_speedup": module.min_speedup, "decisions": [d.as_dict() for d in module.decisions],
                # the paths it runs (measured or pinned), so that loading times nothing again
                "pinned": {str(n): list(paths) for n, paths in sorted({**module.chosen_paths(),
                                                                       **module.pinned}.items())}}
    if isinstance(module, SparseConv2d):
        return {"class": "SparseConv2d", "in_channels": module.in_channels, "out_channels": module.out_channels,
                "kernel_size": list(module.kernel_size), "stride": list(module.stride),
                "padding": list(module.padding), "dilation": list(module.dilation), "groups": module.groups,
                "bias": module.bias is not None, "dtype": _dtype_name(module.weight_values.dtype), "nnz": module.nnz,
                "policy": module.policy, "tune_budget": module.tune_budget, "relu": module.relu,
                "residual": module.residual, "decisions": [d.as_dict() for d in module.decisions]}
    return None


def _build(record: dict, device) -> nn.Module:
    """An empty module from its record (the tensors are assigned afterwards)."""
    from .nn import DecodeLinear, SparseConv2d, SparseLinear, SparseLinear24
    from .tune.pipeline import config_from_record

    kind = record["class"]
    if kind == "DecodeLinear":
        # its decode widths were decided at conversion; the inner layer keeps its policy: the first layer of a
        # shape was measured ("measure": the kernel cache holds that choice with its times, so it is looked up,
        # not timed again), the others run its kernel configs (pinned: compiled, never timed)
        return DecodeLinear(_build(record["inner"], device), record["kernel_widths"])
    dtype = getattr(torch, record["dtype"])
    if kind == "SparseLinear":
        layer = SparseLinear(record["in_features"], record["out_features"], record["bias"], record["nnz"], device,
                             dtype, record["policy"], record["tune_budget"])
        pinned = {int(n): config_from_record(c) for n, c in record.get("pinned", {}).items()}
        if None in pinned.values():
            raise SavedModelError("a saved kernel config is not one this sparseforge version can rebuild: load with "
                                  "the version that saved it")
        layer.pin(pinned)
        return layer
    if kind == "SparseLinear24":
        layer = SparseLinear24(record["in_features"], record["out_features"], record["bias"], device, dtype,
                               record["policy"], record["min_speedup"])
        try:
            layer.pin({int(n): tuple(paths) for n, paths in record.get("pinned", {}).items()})
        except (AttributeError, TypeError, ValueError) as exc:
            raise SavedModelError(f"a saved 2:4 layer's pinned paths are not readable ({exc}): save the model "
                                  "again") from exc
        return layer
    if kind == "SparseConv2d":
        return SparseConv2d(record["in_channels"], record["out_channels"], tuple(record["kernel_size"]),
                            tuple(record["stride"]), tuple(record["padding"]), tuple(record["dilation"]),
                            record["groups"], record["bias"], record["nnz"], device, dtype, record["policy"],
                            record["tune_budget"], relu=record["relu"], residual=record["residual"])
    raise SavedModelError(f"the saved module class {kind!r} is not one this sparseforge {__version__} knows: load "
                          "with the version that saved it")


def _load_device(device) -> str:
    """The device load puts the tensors on, checked before anything is read: safetensors asked for a CUDA device
    that is not there fails inside torch (pin_memory needs a CUDA device)."""
    if device is None:
        return "cpu"
    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}, but there is no CUDA GPU here: load with device='cpu'")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA GPU(s): "
                             f"give cuda:0 to cuda:{torch.cuda.device_count() - 1}, or device='cpu'")
    return str(target)


def _mismatch_fix(source: str, directory: Path) -> str:
    """What to do where the saved modules or tensors do not fit the model they are loaded into."""
    if source == "transformers":  # the model came from the directory's own config.json: the files disagree
        return f"{directory / TENSORS} or {MANIFEST} is damaged, or not of the model {CONFIG} describes; save the " \
               "model again"
    return "pass a model of the architecture that was saved"


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding tensor `name`, its attribute name there)."""
    parent_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), leaf


def save(model: nn.Module, directory) -> Path:
    """Write `model` (converted or not) to `directory` (made if missing; its parent must exist): the layout is
    in the module docstring. A transformers model is rebuilt by load from its config; any other model needs a
    model of the same architecture passed to load. Returns the directory."""
    from safetensors.torch import save_file

    from .nn.llm import is_transformers_model

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file; give a directory to save the model in")
    if not directory.parent.is_dir():
        raise FileNotFoundError(f"{directory.parent} does not exist; create it first (mkdir -p) or save elsewhere")
    parametrized = [name for name, m in model.named_modules() if getattr(m, "parametrizations", None)]
    if parametrized:
        raise ValueError(f"{parametrized[0]} (and {len(parametrized) - 1} more) still carry pruning masks as "
                         "parametrizations; bake them in first: sparseforge.prune.remove_masks(model)")
    from .nn.llm import GatedDecodeMLP

    records: dict[str, dict] = {}
    gated: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(done + ".") for done in records):
            continue  # inside a recorded module: its record rebuilds it
        if isinstance(module, GatedDecodeMLP):  # the MLP's own state under its names: wrapped again on load
            gated.append(name)
            continue
        record = _record(module)
        if record is not None:
            records[name] = record
        elif type(module).__module__.split(".")[0] == "sparseforge" and name:
            raise ValueError(f"{name} is a {type(module).__name__}, which save does not handle yet; convert it back "
                             "with .to_dense() or leave it out of the conversion")
    tensors, aliases, seen = {}, {}, {}
    state = model.state_dict()
    for key, tensor in state.items():
        tensor = tensor.detach()
        where = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tensor.stride(), tensor.dtype)
        if tensor.numel() and where in seen:
            aliases[key] = seen[where]  # tied: stored once
            continue
        seen[where] = key
        tensors[key] = tensor.to("cpu").contiguous()
    for name, buffer in model.named_buffers():
        if name not in state and not name.endswith("_device_anchor"):  # an anchor follows the loaded tensors
            tensors[NONPERSISTENT + name] = buffer.detach().to("cpu").contiguous()
    directory.mkdir(exist_ok=True)
    manifest_path = directory / MANIFEST
    if manifest_path.exists():
        manifest_path.unlink()  # no stale manifest vouches for a directory half rewritten
    temp = directory / (TENSORS + ".tmp")
    save_file(tensors, str(temp))
    os.replace(temp, directory / TENSORS)
    transformers_model = is_transformers_model(model) and hasattr(model, "config")
    if transformers_model:
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
    manifest = {"format": FORMAT, "sparseforge": __version__, "class": type(model).__name__,
                "source": "transformers" if transformers_model else "module", "aliases": aliases,
                "modules": records, "gated_mlps": gated}
    temp = directory / (MANIFEST + ".tmp")
    temp.write_text(json.dumps(manifest, indent=1))
    os.replace(temp, manifest_path)  # last: the "complete" marker
    return directory


def load(directory, model: nn.Module | None = None, device=None) -> nn.Module:
    """The model sparseforge.save wrote to `directory`, in eval mode, on `device` (default: the CPU). A
    transformers model is rebuilt from config.json (needs the llm extra); any other model is restored into
    `model`, a module of the same architecture (its converted layers replaced by the saved ones). Nothing is
    measured: a DecodeLinear runs its kernels on the widths decided at conversion. Raises FileNotFoundError for
    a missing directory or manifest, SavedModelError for a corrupt or mismatched one, ValueError for a CUDA
    device this machine does not have."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .nn.llm import require_transformers

    directory = Path(directory)
    target = _load_device(device)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; give the directory sparseforge.save(model, "
                                "directory) wrote")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        if (directory / CONFIG).is_file() and not (directory / (MANIFEST + ".tmp")).exists():
            # config.json beside the weights and no manifest: what save_pretrained writes
            raise FileNotFoundError(f"{directory} has no {MANIFEST}: it is not a sparseforge-saved model (a "
                                    "save_pretrained directory?): load it with transformers, convert it first "
                                    "(sparseforge.convert(model)) and save it with sparseforge.save(model, "
                                    "directory); if sparseforge.save wrote it, that save did not finish: save the "
                                    "model again")
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: not a directory sparseforge.save wrote, or a save "
                                "that did not finish; save the model again")
    try:
        manifest = json.loads(manifest_path.read_text())
        source, records, aliases = manifest["source"], manifest["modules"], manifest["aliases"]
    except (ValueError, KeyError, TypeError) as err:
        raise SavedModelError(f"{manifest_path} is corrupt ({type(err).__name__}: {err}); save the model again") \
            from err
    if manifest.get("format") != FORMAT:
        raise SavedModelError(f"{manifest_path} is format {manifest.get('format')!r}; this sparseforge "
                              f"{__version__} reads format {FORMAT}: load with the version that saved it")
    try:  # straight onto the device: an 8B model need not pass through host memory
        tensors = load_file(str(directory / TENSORS), device=target)
    except (SafetensorError, OSError, ValueError) as err:
        raise SavedModelError(f"{directory / TENSORS} is missing or corrupt ({type(err).__name__}: {err}); save the "
                              "model again") from err
    if source == "transformers":
        if model is not None:
            raise TypeError(f"{directory} holds a transformers model, rebuilt from its config.json: call "
                            "load(directory) without model")
        transformers = require_transformers()
        cls = getattr(transformers, manifest["class"], None)
        if cls is None:
            raise SavedModelError(f"transformers {transformers.__version__} has no class {manifest['class']!r}; "
                                  "install the version the model was saved with")
        if not (directory / CONFIG).is_file():
            raise SavedModelError(f"{directory} has no {CONFIG}, which a saved transformers model is rebuilt from; "
                                  "save the model again")
        config = transformers.AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            model = cls(config)
        if (directory / "generation_config.json").is_file():
            model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    elif model is None:
        raise TypeError(f"{directory} holds a {manifest['class']}, which load cannot build on its own: pass "
                        f"model=<a {manifest['class']} of the same architecture>")
    elif not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, record in records.items():
        new = _build(record, "meta")
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except AttributeError as err:
            raise SavedModelError(f"the saved module {name} has no place in this {type(model).__name__}: "
                                  + _mismatch_fix(source, directory)) from err
        setattr(parent, child, new)
    extra = {key[len(NONPERSISTENT):]: tensors.pop(key) for key in list(tensors) if key.startswith(NONPERSISTENT)}
    for alias, canonical in aliases.items():
        if canonical not in tensors:
            raise SavedModelError(f"{manifest_path} names {alias} a copy of {canonical}, which is not saved; save the "
                                  "model again")
        tensors[alias] = tensors[canonical]
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as err:
        raise SavedModelError(f"the saved tensors do not fit the model ({' '.join(str(err).split())[:400]}): "
                              + _mismatch_fix(source, directory)) from err
    for name, buffer in extra.items():
        owner, leaf = _owner(model, name)
        owner._buffers[leaf] = buffer
    for alias, canonical in aliases.items():  # assign made a Parameter per name: one object again, as saved
        (owner, leaf), (source, source_leaf) = _owner(model, alias), _owner(model, canonical)
        for table in ("_parameters", "_buffers"):
            if leaf in getattr(owner, table) and source_leaf in getattr(source, table):
                getattr(owner, table)[leaf] = getattr(source, table)[source_leaf]
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise SavedModelError(f"{left[0]} (and {len(left) - 1} more) were not saved; save the model again with this "
                              "version")
    if device is not None:
        model.to(device)
    model.eval()
    from .nn.llm import DecodeLinear, GatedDecodeMLP

    wrapped = []
    for name in manifest.get("gated_mlps", ()):
        owner, leaf = _owner(model, name)
        wrapped.append(GatedDecodeMLP(getattr(owner, leaf)).train(model.training))
        setattr(owner, leaf, wrapped[-1])
    if any(p.is_cuda for p in model.parameters()) or any(b.is_cuda for b in model.buffers()):
        for module in model.modules():
            if isinstance(module, DecodeLinear):
                module.prepare()
        for mlp in wrapped:  # from the kernels just prepared
            mlp.fuse()
    return model
