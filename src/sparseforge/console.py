"""What the command lines (cli.py, model_cli.py and bench/cli.py) share: the output console, the one-line error,
the checks that an input path is a file and that an output path can be written, writes that fail in one line,
and progress that stays visible when the output is piped."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from rich.console import Console

# Wide enough for full layer names when piped to a file or CI log (rich assumes 80 columns there).
console = Console(width=None if sys.stdout.isatty() else 200)

T = TypeVar("T")


def print_error(err: BaseException | str) -> None:
    """`error: <problem and fix>` as one line on stderr (a multi-line library message is joined)."""
    print("error: " + " ".join(str(err).split()), file=sys.stderr)


def not_a_file(path: Path) -> str:
    """What an existing path that is not a regular file is, in words ("a directory", "a character device", ...)."""
    mode = os.stat(path).st_mode
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def check_input_file(path: Path, what: str) -> None:
    """Refuse an input path that is missing, a directory, or not a regular file (a device such as /dev/null,
    a FIFO), each said as what it is; `what` names the file wanted ("a state dict (.pt or .safetensors)")."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; give {what}")
    if not path.is_file():
        raise ValueError(f"{path} is {not_a_file(path)}, not a file; give {what}")


def check_output_path(path: Path, option: str) -> None:
    """Refuse, before any work is done, an output path that cannot be written: its folder missing, the path a
    folder, a device or FIFO (/dev/full: the outputs are files that torch.save and safetensors write and
    seek in), or a place where no file can be created (/proc, /sys, a read-only folder), tried by creating
    the file and removing it again. The commands never create folders, so a typo in a path cannot scatter
    results elsewhere."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file path inside it")
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: the directory {path.parent} does not exist; create it first "
                         "(mkdir -p) or give a path in an existing directory")
    if path.exists() and not path.is_file():
        raise ValueError(f"{option} {path} is {not_a_file(path)}, not a file; give the path of a file to write")
    try:
        if path.exists():
            with open(path, "r+b"):  # opened for writing, not truncated: the file stays as it is
                pass
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(path)
    except FileExistsError:  # created meanwhile by another process: writable enough to be made
        pass
    except OSError as err:
        raise ValueError(f"{option} {path} cannot be written ({err.strerror or err}); give a path in a writable "
                         "directory") from None


def write_output(path: Path, write: Callable[[], object], option: str = "output") -> None:
    """Run write() (which writes `path`), a failure said in one line naming the path: check_output_path ran
    before the work, but a disk can fill up meanwhile, and torch.save's and safetensors' own words for it
    ("enforce fail at inline_container.cc", a SafetensorError) name neither the path nor the problem. A
    partly written file is removed."""
    try:
        write()
    except Exception as err:  # OSError, torch's RuntimeError, safetensors' SafetensorError, ...
        if Path(path).is_file():
            Path(path).unlink()
        reason = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())[:200]
        raise ValueError(f"{option} {path} could not be written ({type(err).__name__}: {reason}); check the "
                         "free space and permissions there") from None


def progress(jobs: list[T], describe: Callable[[T], str], title: str) -> Iterable[T]:
    """Yield the jobs while showing progress: a bar with the count done and the time left on a terminal; elsewhere (a pipe, a CI log), where
    rich draws nothing until the end, one plain line per job so a long run is visibly alive."""
    if console.is_terminal:
        from rich.progress import MofNCompleteColumn, Progress

        # rich's columns (description, bar, percent, time remaining) and the count done: "12/225"
        with Progress(*Progress.get_default_columns(), MofNCompleteColumn(), console=console, transient=True) as bar:
            task = bar.add_task(title, total=len(jobs))
            for job in jobs:
                bar.update(task, description=describe(job))
                yield job
                bar.advance(task)
        return
    for i, job in enumerate(jobs, 1):
        console.print(f"{title} [{i}/{len(jobs)}] {describe(job)}", markup=False, highlight=False)
        yield job
