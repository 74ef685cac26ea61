"""Errors raised for malformed sparse weights and files."""


class SparseFormatError(ValueError):
    """A sparse matrix or file breaks the format; the message names the problem and the fix."""
