"""The rendezvous and its key-value store, where trainer ranks publish and receivers read.

* :mod:`~megarefit.online.store.rendezvous`: :class:`Rendezvous`, manifests, versions, seqlocks;
* :mod:`~megarefit.online.store.receivers`: receiver registration, heartbeats, acknowledgements;
* :mod:`~megarefit.online.store.records`: signed records and the job secret;
* :mod:`~megarefit.online.store.kv`: :class:`KeyValueStore`, the client (and how its server starts);
* :mod:`~megarefit.online.store.server`: the server process, standard library only.

Layers, one way, top to bottom: rendezvous, receivers, records and kv, server.
"""
