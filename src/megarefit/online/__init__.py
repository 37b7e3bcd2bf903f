"""Online refit: trainer ranks publish, receivers pull live shards between RL steps.

Four subpackages, one way (``pyproject.toml``'s import-linter contracts):

* :mod:`~megarefit.online.trainer`: :class:`Publisher`, the trainer side
  (``Publisher.from_megatron(model, ...)`` on every Megatron rank), what it serves and checks;
* :mod:`~megarefit.online.receiver`: :class:`RefitReceiver` and its parts (version fence, plan
  cache, memory, staged and streamed cycles), and :class:`ReplicaReceiver`, fan-out from it;
* :mod:`~megarefit.online.delta`: delta refits, the trainer's change records and the receiver's patch;
* :mod:`~megarefit.online.store`: :class:`Rendezvous` and its key-value store, below all of them.
"""

from megarefit.online.delta.log import RepublishError
from megarefit.online.receiver.receiver import CycleStats, RefitReceiver, StaleVersionError, VersionMismatchError
from megarefit.online.receiver.replica import ReplicaReceiver
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.online.trainer.publisher import Publisher, PublisherGroup, VersionOrderError

__all__ = ["CycleStats", "Publisher", "PublisherGroup", "RefitReceiver", "Rendezvous", "ReplicaReceiver",
           "RepublishError", "StaleVersionError", "VersionMismatchError", "VersionOrderError"]
