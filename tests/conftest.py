import pytest


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (sm_80+); run tests/gpu on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cli_error(capsys):
    """Run `sparseforge ARGS...` in-process and check it failed the way every CLI error must: exit code 2 and
    one line `error: ...` on stderr, no traceback. Returns that line."""
    from sparseforge.cli import main

    def run(*argv) -> str:
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
        return lines[0]

    return run
