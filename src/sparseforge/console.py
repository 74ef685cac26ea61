"""What both command lines (cli.py and bench/cli.py) share: the output console, the one-line error, the check
that an output path can be written, and progress that stays visible when the output is piped."""
from __future__ import annotations

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


def check_output_path(path: Path, option: str) -> None:
    """Refuse, before any work is done, an output path whose folder does not exist or that is a folder:
    the commands never create folders, so a typo in a path cannot scatter results elsewhere."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file path inside it")
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: the directory {path.parent} does not exist; create it first "
                         "(mkdir -p) or give a path in an existing directory")


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
