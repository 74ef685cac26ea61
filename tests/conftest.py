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
