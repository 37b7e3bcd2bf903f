"""Delta refits: what changed since a version, recorded by trainers and applied by receivers.

* :mod:`~megarefit.online.delta.track` and :mod:`~megarefit.online.delta.mark`: the trainer's
  change tracking (hooks on the optimizer step; the marking kernel);
* :mod:`~megarefit.online.delta.log`: :class:`DeltaLog`, a rank's published delta records;
* :mod:`~megarefit.online.delta.records`: the records' format (pages, epochs, keys);
* :mod:`~megarefit.online.delta.apply`: :class:`DeltaReceiver`, a receiver's delta choice and patch;
* :mod:`~megarefit.online.delta.kernel`: the patch kernel;
* :mod:`~megarefit.online.delta.held` and :mod:`~megarefit.online.delta.held_kernel`: the arena
  fingerprint that sees a consumer writing a handed-over view.

Layers, one way, top to bottom: apply; log, kernel, held; records, track; mark, held_kernel.
"""
