"""Safe handover between training steps and refits (issue 13): trainer ranks in their own
processes rewrite their weights continuously while a receiver refits over real NIXL (UCX
on loopback). Every parameter of version v holds the value v, so a torn pull -- bytes of
two versions under one version number -- is visible in the received tensors."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402

from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.online import RefitReceiver, StaleVersionError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402

CFG = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)


def _stress(mode: str, cycles: int, job: str) -> dict[str, int]:
    """``cycles`` refits with version=None against two lockstep writers; counts of accepted
    intact / accepted torn / rejected cycles and retries."""
    from handover_jobs import writer_job

    rdzv = Rendezvous.serve(job=job)
    group = start_workers(writer_job, world_size=2, args=(rdzv.port, job, CFG, mode, 0.01, 0.01))
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=30, retries=5)
    counts = {"intact": 0, "torn": 0, "rejected": 0, "retries": 0}
    try:
        for _ in range(cycles):
            try:
                got = dict(receiver.run_refit_cycle())
            except StaleVersionError:
                counts["rejected"] += 1
                continue
            counts["retries"] += receiver.stats.retries
            values = {v for t in got.values() for v in torch.unique(t).tolist()}
            counts["intact" if values == {float(receiver.stats.version)} else "torn"] += 1
    finally:
        rdzv.store.set(rdzv.prefix + "stop", "1")
        rdzv.store.set(rdzv.prefix + "done", "1")
        receiver.close()
        group.join(timeout=120)
    return counts


def test_seqlock_accepts_no_torn_pull():
    """200 refits while both trainer ranks rewrite every parameter through
    ``Publisher.updating``: every accepted pull is exactly one version (all bytes equal
    that version's value); overlapping pulls were rejected and pulled again."""
    counts = _stress("seqlock", 200, "handover-seqlock")
    print("seqlock:", counts)
    assert counts["torn"] == 0, counts
    assert counts["intact"] >= 150, counts
    assert counts["retries"] + counts["rejected"] > 0, counts  # the writers really overlapped the pulls


def test_plain_publish_lets_torn_pulls_through():
    """The same stress with plain ``publish`` (the version moves only after the step) lets
    torn pulls through: what the seqlock protocol exists for."""
    counts = _stress("plain", 100, "handover-plain")
    print("plain:", counts)
    assert counts["torn"] > 0, counts


def test_snapshot_publisher_serves_whole_versions_while_training_writes():
    """``Publisher(snapshot=True)``: receivers read the registered copy that ``publish``
    refreshes (inside the seqlock), so the trainers rewrite their live parameters with no
    protocol around the step and still no pull is torn."""
    counts = _stress("snapshot", 100, "handover-snapshot")
    print("snapshot:", counts)
    assert counts["torn"] == 0, counts
    assert counts["intact"] >= 75, counts


def test_killed_receiver_is_named_then_dropped_after_its_lease():
    """A receiver process that acknowledged version 1 is killed (SIGKILL): a trainer waiting
    for version 2 gets a RendezvousTimeout naming it while its lease runs, and once the
    lease expired ``wait_receivers`` returns with the dead receiver dropped."""
    import time

    from handover_jobs import receiver_job
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.store.rendezvous import RendezvousTimeout
    from megarefit.online.trainer.publisher import Publisher

    job = "handover-kill"
    rdzv = Rendezvous.serve(job=job)
    hf = reference_hf_state(CFG, "qwen3")
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in reference_shards(hf, CFG, tp=2, pp=1).items()}
    pubs = [Publisher(s, CFG, rank=r, layout=source_layout(CFG, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r[0]}")
            for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    group = start_workers(receiver_job, world_size=1, args=(rdzv.port, job))
    rdzv.store.wait([rdzv.prefix + "receiver-ready"], timedelta(seconds=120))
    assert pubs[0].wait_receivers(1, timeout=5) == {f"{job}-receiver-proc": "acked"}
    for p in pubs:
        p.publish(2)
    group.kill(0)
    with pytest.raises(RendezvousTimeout, match=f"version 2 .*{job}-receiver-proc \\(last acknowledged 1\\)"):
        pubs[0].wait_receivers(2, timeout=0.2, lease=30)
    t0 = time.monotonic()
    assert pubs[0].wait_receivers(2, timeout=10, lease=0.5) == {f"{job}-receiver-proc": "dropped"}
    assert time.monotonic() - t0 >= 0.5


@pytest.mark.megatron
def test_deferred_param_gather_is_finished_before_publishing():
    """Megatron-Core DDP with the distributed optimizer's sharded buffer and
    ``overlap_param_gather`` (2 data-parallel processes, gloo): after the step each rank's
    parameters are whole only after the next all-gather. A Publisher given ``ddp=``
    refuses to publish then, naming the pending buckets; after ``finish_param_sync`` on
    both ranks it publishes, and the bytes it serves are the new ones on every shard."""
    pytest.importorskip("megatron.core")
    from megatron_jobs import deferred_param_gather_job

    job = "handover-ddp"
    rdzv = Rendezvous.serve(job=job)
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
    results = start_workers(deferred_param_gather_job, world_size=2, args=(rdzv.port, job, cfg)).join(timeout=300)
    first = next(r for r in results if r["rank"] == 0)
    assert first["stale_before"], "the other rank's shard must be stale right after the step"
    assert first["refused"] and "has not all-gathered" in first["refused"] and "rank (tp=0" in first["refused"]
    assert all(r["whole_after"] for r in results)
    assert first["served_is_buffer"]


@pytest.mark.megatron
def test_a_data_parallel_copy_serves_whole_parameters_after_the_gather():
    """The same two data-parallel processes, both serving (``serve_copies=True``): rank 1 is copy 1.
    Each refuses to publish while the all-gather is pending (naming its own coordinate, copy 1's
    too); after ``finish_param_sync`` the bytes at every address each manifest names (raw memory,
    what a receiver READs) equal the whole new parameters, every shard's update included -- the
    buffers computed apart from Megatron's gather, each shard plus its rank's step."""
    pytest.importorskip("megatron.core")
    from megatron_jobs import deferred_param_gather_job

    job = "handover-ddp-copies"
    rdzv = Rendezvous.serve(job=job)
    cfg = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
    results = start_workers(deferred_param_gather_job, world_size=2,
                            args=(rdzv.port, job, cfg, True)).join(timeout=300)
    by_rank = {r["rank"]: r for r in results}
    assert [by_rank[r]["coord"] for r in (0, 1)] == [(0, 0, 0), (0, 0, 0, 1)]
    for r in (0, 1):
        got = by_rank[r]
        assert got["stale_before"]
        assert got["refused"] and "has not all-gathered" in got["refused"], (r, got["refused"])
        assert ("copy=1" in got["refused"]) == (r == 1), got["refused"]
        served = got["served_bytes"]
        assert served["entries"] > 0 and served["inside"] == served["entries"], served  # all live parameters
        assert served["differ"] == [], (r, served["differ"])


def test_trainer_killed_mid_pull_then_restarted():
    """A trainer process is SIGKILLed: the next pull raises TransferError naming that
    trainer and hands nothing over (what the consumer installed before is untouched). The
    trainer restarts (a new process: new memory, new NIXL metadata, same agent name) with
    new weights, and the next cycle pulls them whole."""
    from handover_jobs import static_trainer_job

    from megarefit.transport.nixl_agent import TransferError

    job = "handover-restart"
    rdzv = Rendezvous.serve(job=job)
    trainers = start_workers(static_trainer_job, world_size=2, args=(rdzv.port, job, CFG, None, 1.0, 1))
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=120)  # the trainers' start-up: seconds
    installed = {k: t.clone() for k, t in receiver.run_refit_cycle(1)}  # what a consumer keeps
    assert {v for t in installed.values() for v in torch.unique(t).tolist()} == {1.0}
    trainers.kill(1)
    receiver.timeout = 3
    cycle = receiver.run_refit_cycle(1)
    with pytest.raises(TransferError, match=f"peer '{job}-trainer-1'"):
        next(cycle)
    assert {v for t in installed.values() for v in torch.unique(t).tolist()} == {1.0}
    restarted = start_workers(static_trainer_job, world_size=1, args=(rdzv.port, job, CFG, 1, 2.0, 2))
    trainers.kill(0)  # rank 0 moves to version 2 as well (a restarted job)
    rank0 = start_workers(static_trainer_job, world_size=1, args=(rdzv.port, job, CFG, 0, 2.0, 2))
    receiver.timeout = 60
    got = dict(receiver.run_refit_cycle(2))
    assert got.keys() == installed.keys()
    assert {v for t in got.values() for v in torch.unique(t).tolist()} == {2.0}
    rdzv.store.set(rdzv.prefix + "stop", "1")
    receiver.close()
    restarted.join(timeout=60)
    rank0.join(timeout=60)
