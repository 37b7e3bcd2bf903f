"""Demos and the CPU Megatron-Core harness behind them, the tests and the benchmarks.

* :mod:`~megarefit.demo.megatron_cpu`: real Megatron-Core ``GPTModel`` s on CPU (gloo
  worker processes, CPU patches, trainer jobs);
* :mod:`~megarefit.demo.offline`: ``megarefit demo``, Megatron -> HF through a validated plan;
* :mod:`~megarefit.demo.live`: ``megarefit demo --live``, trainers publishing over NIXL;
* :mod:`~megarefit.demo.bench`: ``megarefit bench`` and the timing helpers benchmarks share.

Nothing here is imported by the library below it.
"""

# megarefit 0.1's ``megarefit.demo`` module is ``megarefit.demo.offline`` now: its names stay
# importable from here for one release, with a DeprecationWarning (CHANGELOG.md).
_OFFLINE = ("FP8_COSINE", "FP8_TOLERANCE", "TOLERANCE", "check_memory", "default_config", "run_demo")


def __getattr__(name: str) -> object:
    if name not in _OFFLINE:
        raise AttributeError(f"module 'megarefit.demo' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"megarefit.demo.{name} moved to megarefit.demo.offline.{name}; the old path is removed in "
                  "megarefit 0.3", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("megarefit.demo.offline"), name)
