"""The checkpoint files the command lines read and write: state dicts (.safetensors, or what torch.save writes),
and the checks shared with whole-model files (model_cli.py). A file is refused with what it holds or why it
cannot be read, before any work; a write that fails is said in one line naming the path."""
from __future__ import annotations

import re
import warnings
import zipfile
from pathlib import Path

import torch

from .console import check_input_file, write_output
from .prune import find_state_dict

STATE_FILE = "a state dict saved with torch.save(model.state_dict(), path) or as .safetensors"
# torch.save's legacy (non-zip) format opens with its magic number, pickled (protocol 2 by default; a frame
# header comes first from protocol 4): a pickle without it was written by pickle.dump, not torch.save.
_LEGACY_MAGIC = b"\x8a\x0a" + torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")


def read_head(path: Path, size: int = 32) -> bytes:
    """The first `size` bytes of path; an unreadable file (/proc/self/mem: "[Errno 5]" and no path) named."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err})") from None


def check_torch_file(path: Path, head: bytes, wanted: str) -> None:
    """Refuse what torch.load cannot read, in words that say what the file is: torch's own ("re-run with
    weights_only=False", "Invalid magic number; corrupt file?") would send the user the wrong way."""
    if head[:2] != b"PK" and head[:1] != b"\x80":
        raise ValueError(f"{path}: not a torch checkpoint: neither the zip archive torch.save writes nor a pickle; "
                         "the file is damaged or in another format (a .safetensors file needs that suffix)")
    if head[:2] == b"PK" and not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: truncated or damaged: the zip archive torch.save writes is incomplete; "
                         "copy or save it again")
    if head[:1] == b"\x80" and _LEGACY_MAGIC not in head:
        raise ValueError(f"{path}: a plain Python pickle (pickle.dump), not a file torch.save wrote; give {wanted}")


def torch_load(path: Path, weights_only: bool):
    """torch.load onto the CPU, without the warnings torch prints for some files."""
    with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": a second stderr line, of no use here
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def load_state(path: Path) -> dict:
    """The checkpoint at path (.safetensors, or what torch.save writes), refused with the reason when it
    cannot be read or holds no state dict, before any work. Only tensors and plain containers are unpickled."""
    path = Path(path)
    check_input_file(path, STATE_FILE)
    head = read_head(path)
    state = _read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path, head)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, expected a state dict (name -> tensor); "
                         "save model.state_dict(), not the model")
    try:
        find_state_dict(state)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return state


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise ValueError(f"{path}: not a readable .safetensors file ({err}); it is truncated or damaged: "
                         "copy or save it again") from None


def _read_torch(path: Path, head: bytes) -> dict:
    check_torch_file(path, head, STATE_FILE)
    try:
        return torch_load(path, weights_only=True)
    except Exception as err:  # torch raises many types for a bad file
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if unsafe:
            raise ValueError(f"{path}: holds a Python object of class {unsafe.group(1)}; sparseforge loads only "
                             "tensors and plain containers, since unpickling other classes can run arbitrary code. "
                             "Save model.state_dict() instead, or convert the file to .safetensors") from None
        raise ValueError(f"{path}: a damaged torch checkpoint ({type(err).__name__} while reading it); "
                         "copy or save it again") from None


def save_state(state: dict, path: Path) -> None:
    """Write a state dict: .safetensors (tensors only, refused otherwise before the file is opened) or torch.save."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        others = [key for key, value in state.items() if not isinstance(value, torch.Tensor)]
        if others:
            raise ValueError(f"{path}: a .safetensors file holds only tensors, but the checkpoint also keeps "
                             f"{', '.join(map(repr, others[:4]))}; write a .pt file to keep them")
        write_output(path, lambda: save_file({k: v.contiguous() for k, v in state.items()}, str(path)))
    else:
        write_output(path, lambda: torch.save(state, path))
