"""The one version string: the package metadata (pyproject.toml reads it) and every cache key use it."""
__version__ = "0.1.0"
