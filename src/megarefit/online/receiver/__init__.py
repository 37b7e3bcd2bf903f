"""The receiver: :class:`RefitReceiver` and its parts, and the replicas it serves.

* :mod:`~megarefit.online.receiver.replica`: :class:`ReplicaReceiver`, fan-out from a receiver that has a version;
* :mod:`~megarefit.online.receiver.receiver`: :class:`RefitReceiver`, a facade over its parts;
* :mod:`~megarefit.online.receiver.pipeline`: staged and streamed cycles;
* :mod:`~megarefit.online.receiver.delta_direct`: delta patches into direct (vLLM-owned) tensors;
* :mod:`~megarefit.online.receiver.fence`: the version fence, seqlock reads;
* :mod:`~megarefit.online.receiver.plan_cache`: a plan per layout and placement;
* :mod:`~megarefit.online.receiver.memory`: arena, ring, release;
* :mod:`~megarefit.online.receiver.cycle` (errors, CycleStats), :mod:`~megarefit.online.receiver.arena`
  (the arena described for replicas), :mod:`~megarefit.online.receiver.integrity` (checksums),
  :mod:`~megarefit.online.receiver.stream` (layer groups through a two-slot ring),
  :mod:`~megarefit.online.receiver.prefetch` (pulls while serving), :mod:`~megarefit.online.receiver.node`
  (node groups: the receivers that share a host), :mod:`~megarefit.online.receiver.node_copy` (byte ranges
  of a node-mate's arena, version-fenced).
"""
