"""The ``megarefit`` command line: argument parsing and printing (:mod:`~megarefit.cli.main`,
``name-map`` in :mod:`~megarefit.cli.namemap`)."""

from megarefit.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
