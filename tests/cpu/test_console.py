import os
from pathlib import Path

import pytest

from sparseforge.console import check_input_file, check_output_path, progress, write_output


def test_output_path_needs_an_existing_directory(tmp_path):
    check_output_path(tmp_path / "r.json", "--out")
    with pytest.raises(ValueError, match=r"--out .*missing.* does not exist; create it first"):
        check_output_path(tmp_path / "missing" / "r.json", "--out")
    with pytest.raises(ValueError, match="is a directory"):
        check_output_path(tmp_path, "output")
    assert not (tmp_path / "missing").exists()


def test_progress_off_a_terminal_prints_one_line_per_job(capsys):
    assert list(progress(["a", "b"], str.upper, "checking")) == ["a", "b"]
    assert capsys.readouterr().out.splitlines() == ["checking [1/2] A", "checking [2/2] B"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="uses /dev/full and /proc")
def test_output_path_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    for path, words in (("/dev/full", "is a character device, not a file"), ("/proc/o.pt", "cannot be written")):
        with pytest.raises(ValueError, match=words):
            check_output_path(Path(path), "--out")
    check_output_path(tmp_path / "new.json", "--out")
    assert not (tmp_path / "new.json").exists()  # the probe leaves nothing behind
    (tmp_path / "old.json").write_text("kept")
    check_output_path(tmp_path / "old.json", "--out")
    assert (tmp_path / "old.json").read_text() == "kept"  # nor truncates what is there


def test_input_file_is_named_for_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for path, words in ((tmp_path / "nope", "does not exist"), (tmp_path, "is a directory, not a file"),
                        (tmp_path / "fifo", r"is a FIFO \(named pipe\), not a file")):
        with pytest.raises((ValueError, FileNotFoundError), match=f"{words}; give a state dict"):
            check_input_file(path, "a state dict")


def test_a_failed_write_is_one_line_naming_the_path_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "o.pt"

    def half_written():
        target.write_bytes(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:747] . unexpected pos 64 vs 0")

    with pytest.raises(ValueError, match=r"OUTPUT .*o\.pt could not be written \(RuntimeError: \[enforce fail"):
        write_output(target, half_written, "OUTPUT")
    assert not target.exists()
