"""The trainer side: what a Megatron rank serves and how it keeps it true.

* :mod:`~megarefit.online.trainer.publisher`: :class:`Publisher` (``Publisher.from_megatron`` on every rank);
* :mod:`~megarefit.online.trainer.served`: buffers served besides the live parameters (FP8, snapshot, checksums);
* :mod:`~megarefit.online.trainer.param_sync`: checks that published tensors are the live parameters.
"""
