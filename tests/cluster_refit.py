"""A refit across nodes of an emulated cluster (tests/cluster.py), for tests and benchmarks/bench_cluster.py.

Nodes: ``t0 .. t{dp*tp-1}`` (one Megatron-Core trainer rank each, gloo across nodes), ``r0 ..``
(one :class:`~megarefit.online.RefitReceiver` each) and ``store`` (the rendezvous, bound to its
node's address, no rate limit). Every trainer and receiver NIC is limited to ``rate_mbit``
(``rates`` overrides per node: a straggler).

:func:`refit_on_cluster` returns a :class:`ClusterRefit`: the trainers' snapshots of every
version (the oracle's input), what each receiver got, and the bytes through every NIC while the
receivers ran. ``every_copy``: every data-parallel copy serves (the default), or only copy 0;
the receivers spread their reads over what serves (each a different reader).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cluster import Cluster, cluster
from cluster_jobs import receiver_job, store_job, trainer_job

from megarefit.demo.trainer_jobs import TrainerCase
from megarefit.demo.workers import WorkerGroup, start_workers

TOKENS = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(3))


def cluster_config() -> dict:
    """Qwen3 shrunk to about 8.6 MB of fp32 weights: a few MB per trainer NIC per cycle."""
    from conftest import tiny_config

    return tiny_config("Qwen3-0.6B", hidden_size=256, intermediate_size=768, num_hidden_layers=2, vocab_size=1000,
                       head_dim=64)


@dataclass
class ClusterRefit:
    """One run: ``trainers[rank]`` and ``receivers[i]`` are the jobs' results
    (tests/cluster_jobs.py); ``moved[node]``: ``{"tx_bytes", "rx_bytes"}`` while the receivers ran."""

    case: TrainerCase
    dp: int
    versions: int
    trainers: list[dict]
    receivers: list[dict]
    moved: dict[str, dict[str, int]]
    rates: dict[str, float | None] = field(default_factory=dict)
    snapshots: dict[int, dict[tuple[int, ...], dict[str, torch.Tensor]]] = field(default_factory=dict)

    def trainer_tx(self) -> dict[str, int]:
        """Bytes each trainer node sent while the receivers ran."""
        return {n: m["tx_bytes"] for n, m in self.moved.items() if n.startswith("t")}

    def cycle_s(self, v: int) -> float:
        """Version ``v``'s cycle: from the first receiver starting to pull to the last one done
        (wall clock; the receivers share this machine's clock)."""
        starts = [r["done"][v] - r["pull_s"][v] for r in self.receivers]
        return max(r["done"][v] for r in self.receivers) - min(starts)

    def warm_cycles(self) -> list[float]:
        return [self.cycle_s(v) for v in range(2, self.versions + 1)]

    def median_warm_s(self) -> float:
        return statistics.median(self.warm_cycles())


def _wait_ready(store: WorkerGroup, ready: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        store.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rendezvous store did not start within {timeout}s")
        time.sleep(0.05)


def _wait_first_version(trainers: WorkerGroup, d: Path, files: int, timeout: float) -> None:
    """Until the trainer ranks saved ``files`` snapshots of version 1 (right before publishing it): the receivers'
    timeout then bounds the pull, not the trainers' start on a loaded machine."""
    deadline = time.monotonic() + timeout
    while len(list(d.glob("v1-tp*.pt"))) < files:
        trainers.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer ranks did not save {files} snapshots of version 1 within {timeout}s")
        time.sleep(0.05)


def refit_on_cluster(*, dp: int = 2, tp: int = 2, receivers: int = 4, versions: int = 3, every_copy: bool = True,
                     trainers_may_die: bool = False,
                     rate_mbit: float = 300.0, rates: Mapping[str, float | None] | None = None,
                     timeout: float = 120.0, receiver_timeout: float = 60.0, transfer_timeout: float | None = None,
                     during: Callable[[Cluster, dict[str, WorkerGroup]], None] | None = None,
                     config: dict | None = None, per_node: int = 1, killed: tuple[int, ...] = (),
                     dedup: bool = True, memory_budget: int | None = None) -> ClusterRefit:
    """Make the cluster, run store, trainers and receivers in it, remove it all; ``during(c,
    groups)`` runs while the receivers pull (fault injection; ``groups``: "store", "trainers",
    "receivers"). ``receiver_timeout`` / ``transfer_timeout``: the receivers' ``timeout`` /
    ``transfer_timeout``. ``per_node``: receivers per receiver node (``r0`` holds receivers 0 ..
    per_node - 1, ...), a node group each (``dedup=False``: no groups); ``killed``: receivers ``during`` kills (``None`` results).
    ``memory_budget``: the receivers stream within it (bytes).

    Raises:
        RuntimeError / TimeoutError: a job failed (its traceback) or did not end within ``timeout``."""
    cfg = config or cluster_config()
    case = TrainerCase("cluster", cfg, tp, 1, TOKENS)
    world = dp * tp
    names = [f"t{i}" for i in range(world)] + [f"r{i}" for i in range(-(-receivers // per_node))] + ["store"]
    rates = {"store": None, **(rates or {})}
    with cluster(names, rate_mbit=rate_mbit, rates=rates) as c, tempfile.TemporaryDirectory() as d:
        stop = str(Path(d) / "stop")
        store = (c["store"].ip, "cluster")
        groups = {"store": start_workers(store_job, world_size=1, args=(c["store"].spec, store[1], receivers,
                                                                        versions, stop, timeout))}
        _wait_ready(groups["store"], Path(stop + ".ready"), timeout)
        groups["trainers"] = start_workers(trainer_job, world_size=world, args=(
            [c[f"t{i}"].spec for i in range(world)], case, store, versions, every_copy, d))
        _wait_first_version(groups["trainers"], Path(d), world if every_copy else tp, timeout)  # copies: one file
        before = c.counters()
        groups["receivers"] = start_workers(receiver_job, world_size=receivers, args=(
            [c[f"r{i // per_node}"].spec for i in range(receivers)], store, versions, receiver_timeout,
            transfer_timeout, per_node, dedup, memory_budget))
        try:
            if during is not None:
                during(c, groups)
            got = groups["receivers"].join(timeout, killed=killed)
            after = c.counters()
            try:  # the store serves until the trainers end (a slowed one may still wait for it)
                trained = groups["trainers"].join(timeout)
            except RuntimeError:  # a trainer the fault killed
                if not trainers_may_die:
                    raise
                trained = []
            Path(stop).touch()
            groups["store"].join(timeout)
        finally:
            Path(stop).touch()
        moved = {n: {k: after[n][k] - before[n][k] for k in ("tx_bytes", "rx_bytes")} for n in after}
        return ClusterRefit(case, dp, versions, trained, got, moved,
                            {n: node.rate_mbit for n, node in c.nodes.items()}, _snapshots(Path(d)))


def _snapshots(d: Path) -> dict[int, dict[tuple[int, ...], dict[str, torch.Tensor]]]:
    """``{version: {rank coordinate: shards}}`` the trainers saved before publishing each version."""
    import re

    out: dict[int, dict[tuple[int, ...], dict[str, torch.Tensor]]] = {}
    for f in d.glob("v*-tp*.pt"):
        m = re.fullmatch(r"v(\d+)-tp(\d+)-pp(\d+)-ep(\d+)(?:-copy(\d+))?\.pt", f.name)
        if m:
            v, *coord = (int(x) for x in m.groups() if x is not None)
            out.setdefault(v, {})[tuple(coord)] = torch.load(f)
    return out


__all__ = ["ClusterRefit", "cluster_config", "refit_on_cluster"]
