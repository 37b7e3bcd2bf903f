"""Worker jobs (megarefit.demo.workers) that live in nodes of an emulated cluster (tests/cluster.py).

Each job first enters its node's network namespace (:meth:`cluster.NodeSpec.enter`: ``setns``
plus ``UCX_TLS=tcp``, ``UCX_NET_DEVICES=nic0``, ``GLOO_SOCKET_IFNAME=nic0``), then runs
megarefit's own code:

* :func:`store_job`: the rendezvous store, bound to its node's address; it marks a version
  consumed once every registered receiver acknowledged it;
* :func:`trainer_job`: one Megatron-Core rank (gloo across nodes) running
  :func:`~megarefit.demo.trainer_jobs.serving_trainer_job`;
* :func:`receiver_job`: a :class:`~megarefit.online.RefitReceiver` pulling every version.

Ports are fixed (:data:`STORE_PORT`, the gloo master's): each node is a namespace this run
made, with nothing else listening in it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from cluster import NodeSpec

STORE_PORT = 29400
GLOO_PORT = 29500


def store_job(_rank: int, _world: int, _port: int, node: NodeSpec, job: str, receivers: int, versions: int,
              stop_file: str, timeout: float) -> dict[str, Any]:
    """Serve the rendezvous at ``node.ip:STORE_PORT``; for v = 1..versions wait until all
    ``receivers`` acknowledged v, then mark it consumed; serve until ``stop_file`` exists (``stop_file.ready`` says it serves)."""
    node.enter()
    from megarefit.online.store.rendezvous import Rendezvous

    rdzv = Rendezvous.serve(host=node.ip, port=STORE_PORT, job=job)
    open(stop_file + ".ready", "w").close()
    deadline = time.monotonic() + timeout
    while len(rdzv.receivers()) < receivers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{receivers} receivers did not register within {timeout}s: {rdzv.receivers()}")
        time.sleep(0.05)
    acked = {}
    for v in range(1, versions + 1):
        acked[v] = rdzv.wait_receivers(v, timeout=timeout)
        rdzv.mark_consumed(v)
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"acked": acked}


def trainer_job(rank: int, world: int, _port: int, nodes: list[NodeSpec], case: Any, store: tuple[str, str],
                versions: int, every_copy: bool, snapshot_dir: str | None = None) -> dict[str, Any]:
    """Trainer rank ``rank`` in ``nodes[rank]``: gloo rendezvous at ``nodes[0]``, then
    :func:`~megarefit.demo.trainer_jobs.serving_trainer_job` (``store``: host, job; every
    data-parallel copy serving, or only the first; each version's shards saved in ``snapshot_dir``)."""
    nodes[rank].enter()
    import torch.distributed as dist

    from megarefit.demo.trainer_jobs import serving_trainer_job

    dist.init_process_group("gloo", init_method=f"tcp://{nodes[0].ip}:{GLOO_PORT}", rank=rank, world_size=world)
    host, job = store
    return serving_trainer_job(rank, world, GLOO_PORT, case, (host, STORE_PORT, job), versions,
                               snapshot_dir=snapshot_dir, serve_copies=every_copy)


def receiver_job(rank: int, world: int, _port: int, nodes: list[NodeSpec], store: tuple[str, str], versions: int,
                 timeout: float, transfer_timeout: float | None = None, per_node: int = 1,
                 dedup: bool = True, memory_budget: int | None = None) -> dict[str, Any]:
    """Receiver ``rank`` in ``nodes[rank]``: pull versions 1..versions, acknowledge each
    (``timeout``, ``transfer_timeout``: the receiver's). ``per_node`` > 1: the receivers sharing a
    node are a node group (``RefitReceiver(node=per_node)``; found by the kernel's identity of the
    namespace; ``dedup=False``: placed so, without node groups), and ``"node_bytes"`` / ``"wire"`` / ``"node_fallbacks"`` / ``"node_s"`` / ``"node_read_s"`` / ``"span_s"`` (pull, fence
    and same-host copies) are kept per version. ``memory_budget``: streamed receivers
    (``"peak_extra"`` per version: ring + scratch + node arena).

    Each is reader ``rank`` of ``world`` (:class:`~megarefit.planner.holders.Reader`). Returns
    ``{"received": {v: {hf name: tensor}}, "done": {v: wall time the cycle ended}, "pull_s": {v:
    seconds pulling}, "bytes": {v: bytes moved}, "failovers": {v: stats.failovers}, "quarantined": {v:
    (counters["quarantined_bytes"], stats.quarantined_bytes)}, "registered": {v: (bytes registered so
    far, stats.arena_bytes)}}``."""
    nodes[rank].enter()
    from megarefit.online import RefitReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.planner.holders import Reader

    host, job = store
    receiver = RefitReceiver(Rendezvous.connect(host, STORE_PORT, job=job), name=f"receiver-{rank}",
                             timeout=timeout, reader=Reader(rank, world), transfer_timeout=transfer_timeout,
                             node=per_node if per_node > 1 and dedup else None, heartbeat_s=0.5,
                             memory_budget=memory_budget)
    out: dict[str, Any] = {"received": {}, "done": {}, "pull_s": {}, "bytes": {}, "failovers": {}, "quarantined": {},
                           "registered": {}, "node_bytes": {}, "wire": {}, "node_fallbacks": {}, "node_s": {},
                           "node_read_s": {}, "span_s": {}, "peak_extra": {}}
    for v in range(1, versions + 1):
        out["received"][v] = {name: t.clone() for name, t in receiver.run_refit_cycle(v)}
        out["done"][v] = time.time()
        out["pull_s"][v] = receiver.stats.seconds["pull"]
        out["bytes"][v] = receiver.stats.bytes_moved
        out["failovers"][v] = receiver.stats.failovers
        out["quarantined"][v] = (receiver.counters.get("quarantined_bytes", 0), receiver.stats.quarantined_bytes)
        out["registered"][v] = (receiver.counters["registered_bytes"], receiver.stats.arena_bytes)
        stats = receiver.stats
        out["node_bytes"][v], out["wire"][v], out["node_fallbacks"][v] = stats.node_bytes, stats.wire_bytes, \
            stats.node_fallbacks
        out["node_s"][v] = stats.seconds.get("node", 0.0)
        out["node_read_s"][v] = stats.seconds.get("node.read", 0.0)  # the same-host READs alone (no waiting)
        out["span_s"][v] = sum(stats.seconds.get(k, 0.0) for k in ("pull", "fence", "node", "node.arena"))  # READs
        out["peak_extra"][v] = stats.peak_extra_bytes  # to copies done; streamed: the node arena's pull first
        receiver.acknowledge(v)
    return out


__all__ = ["GLOO_PORT", "STORE_PORT", "receiver_job", "store_job", "trainer_job"]
