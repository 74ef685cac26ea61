"""Autotuning of tile configurations."""
from .autotune import candidates, default_config, time_kernel, tune

__all__ = ["candidates", "default_config", "time_kernel", "tune"]
