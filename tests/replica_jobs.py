"""Replicas that stop mid-mirror on cue (tests/test_replica_cut_through.py).

A :class:`PausingReplica` is a real serving :class:`ReplicaReceiver` that, the first time the
bytes landed in its arena reach ``pause_at``, sets ``paused`` and waits for ``resume``: it has
published that progress, its children may read those bytes, the rest of its arena is not there
yet. :func:`pausing_replica_job` runs one in its own process and never resumes it (the test
kills it there)."""

from __future__ import annotations

import threading
import time

from megarefit.online.receiver.replica import ReplicaReceiver


class PausingReplica(ReplicaReceiver):
    def __init__(self, *args, pause_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.pause_at, self.paused, self.resume = pause_at, threading.Event(), threading.Event()

    def _landed(self, nbytes: int) -> None:
        super()._landed(nbytes)
        if nbytes >= self.pause_at > 0 and not self.paused.is_set():
            self.paused.set()
            self.resume.wait(60)


def pausing_replica_job(index: int, world_size: int, master_port: int, rdzv_port: int, job: str, group: str,
                        parent: str, chunk_bytes: int, pause_at: int) -> dict:
    """Replica ``p`` of ``parent`` mirroring version 1 that stops once ``pause_at`` bytes landed,
    says so (``p-paused``), and stays there (beating, serving what landed) until killed."""
    from megarefit.online.store.rendezvous import Rendezvous

    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=job)
    replica = PausingReplica(rdzv, group=group, parent=parent, name="p", timeout=30, serve=True,
                             chunk_bytes=chunk_bytes, heartbeat_s=0.1, pause_at=pause_at)
    threading.Thread(target=lambda: dict(replica.run_refit_cycle(1)), daemon=True).start()
    replica.paused.wait(60)
    rdzv.store.set(rdzv.prefix + "p-paused", "1")
    time.sleep(600)
    return {}
