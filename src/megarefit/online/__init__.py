"""Online refit: trainer ranks publish, receivers pull live shards between RL steps.

* :mod:`~megarefit.online.rendezvous`: the store where ranks publish manifests and versions
  (its parts: :mod:`~megarefit.online.rendezvous_records`, signed records and the job secret;
  :mod:`~megarefit.online.rendezvous_receivers`, receiver registration, heartbeats, acknowledgements);
* :mod:`~megarefit.online.publisher`: :class:`Publisher`, the trainer side (``Publisher.from_megatron(model, ...)``
  on every Megatron rank);
* :mod:`~megarefit.online.served`: the buffers a Publisher serves besides the live parameters (FP8, snapshot, checksums);
* :mod:`~megarefit.online.param_sync`: checks that a rank's published tensors are its live parameters;
* :mod:`~megarefit.online.receiver`: :class:`RefitReceiver`, a facade over its parts:
  :mod:`~megarefit.online.fence` (version fence, seqlock), :mod:`~megarefit.online.plan_cache`
  (a plan per layout and placement), :mod:`~megarefit.online.receiver_memory` (arena, ring, release),
  :mod:`~megarefit.online.pipeline` (staged and streamed cycles), :mod:`~megarefit.online.cycle`
  (errors, CycleStats);
* :mod:`~megarefit.online.stream`: streamed refits (``memory_budget``): layer groups through a two-slot ring;
* :mod:`~megarefit.online.arena`: a receiver's arena described for its replicas;
* :mod:`~megarefit.online.replica`: :class:`ReplicaReceiver`, fan-out from a receiver that has a version.
"""

from megarefit.online.delta_log import RepublishError
from megarefit.online.publisher import Publisher, PublisherGroup, VersionOrderError
from megarefit.online.receiver import CycleStats, RefitReceiver, StaleVersionError, VersionMismatchError
from megarefit.online.rendezvous import Rendezvous
from megarefit.online.replica import ReplicaReceiver

__all__ = ["CycleStats", "Publisher", "PublisherGroup", "RefitReceiver", "Rendezvous", "ReplicaReceiver",
           "RepublishError", "StaleVersionError", "VersionMismatchError", "VersionOrderError"]
