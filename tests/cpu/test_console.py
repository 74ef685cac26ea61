import pytest

from sparseforge.console import check_output_path, progress


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
