"""Demos and the CPU Megatron-Core harness behind them, the tests and the benchmarks.

* :mod:`~megarefit.demo.megatron_cpu`: real Megatron-Core ``GPTModel`` s on CPU (gloo
  worker processes, CPU patches, trainer jobs);
* :mod:`~megarefit.demo.offline`: ``megarefit demo``, Megatron -> HF through a validated plan;
* :mod:`~megarefit.demo.live`: ``megarefit demo --live``, trainers publishing over NIXL;
* :mod:`~megarefit.demo.bench`: ``megarefit bench`` and the timing helpers benchmarks share.

Nothing here is imported by the library below it.
"""
