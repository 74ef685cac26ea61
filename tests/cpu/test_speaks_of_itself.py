"""The project speaks of itself only: its code, docs, benchmarks and tests say what a thing is and why, never
which work period made it ("the sixth s-ession") or which tracker entry asked for it ("i-ssue 12"). Dated
entries by commit (docs/history.md) carry the history."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "README.md", REPO / "src", REPO / "docs", REPO / "benchmarks", REPO / "tests"]
# spelled with a character class so this file does not match itself
WORDS = re.compile(r"s[e]ssion|i[s]sue #?[0-9]+", re.I)
SKIPPED_PARTS = {"__pycache__", ".hypothesis", ".pytest_cache"}


def _files():
    """The repository's files under SCANNED: git's list where this is a clone (build outputs such as
    *.egg-info are not the project's words), else every file but caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *[str(p.relative_to(REPO)) for p in SCANNED]],
                                cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = None
    if listed:
        yield from (REPO / name for name in listed if name and (REPO / name).is_file())
        return
    for top in SCANNED:
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if path.is_file() and not SKIPPED_PARTS & set(path.relative_to(REPO).parts):
                yield path


def test_no_work_period_or_tracker_numbers():
    found = []
    for path in _files():
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for match in WORDS.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(REPO)}:{line} {match.group(0)!r}")
    assert not found, f"say what a thing is and why, not when or for which ticket: {found[:20]}"


def test_the_pattern_finds_both_forms():
    period, ticket = "Ses" + "sion", "Iss" + "ue"  # split so the scan above passes over this file
    assert WORDS.search(f"as in the Sixth {period}") and WORDS.search(f"see {ticket.lower()} #31")
    assert WORDS.search(f"{ticket} 7")
    assert not WORDS.search("an issue with the layout") and not WORDS.search("tissue")
