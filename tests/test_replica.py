"""Fan-out (issue 13): replicas mirror a receiver's arena instead of reading the trainers.
Real NIXL agents (UCX loopback) in one process; Publishers serve reference shards."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("nixl")

from reference import reference_hf_state, reference_shards  # noqa: E402

from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402


@pytest.fixture
def trainers(config):
    cfg = config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    rdzv = Rendezvous.serve(job="replica")
    pubs = [Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                      agent_name=f"replica-trainer-{r[0]}")
            for r, s in shards.items()]
    return hf, shards, rdzv, pubs


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replicas_mirror_the_first_tier(trainers, replicas):
    """One receiver reads the trainers; ``replicas`` more join a tree of fan-out 2
    (``tree_parent``), each reading its parent's arena in one READ per dtype: every
    replica equals the HF state bit for bit, for two versions, and only the first tier
    reads trainer memory (the others' bytes come from receivers)."""
    from megarefit.online.receiver.replica import ReplicaReceiver, tree_parent

    hf, shards, rdzv, pubs = trainers
    root = RefitReceiver(rdzv, name="tier1", timeout=5, replica_group="g")
    assert tree_parent(rdzv, "g", "tier1", 2) is None
    others = [ReplicaReceiver(rdzv, group="g", parent=tree_parent(rdzv, "g", f"r{i}", 2), name=f"r{i}", timeout=5,
                              serve=True) for i in range(replicas)]
    assert [o.parent for o in others] == ["tier1", "tier1", "r0", "r0"][:replicas]
    for version, sign in ((1, 1), (2, -1)):
        if version == 2:
            for s in shards.values():
                for t in s.values():
                    t.mul_(-1)
        for p in pubs:
            p.publish(version)
        got = dict(root.run_refit_cycle(version))
        assert all(torch.equal(got[k], sign * v) for k, v in hf.items())
        for o in others:  # in tree order: a parent before its children
            mirrored = dict(o.run_refit_cycle())
            assert o.version == version and mirrored.keys() == got.keys()
            assert all(torch.equal(mirrored[k], sign * v) for k, v in hf.items())
            assert o.bytes_read == sum(a.numel() * a.element_size() for a in o.arenas.values())
    # replicas never connected to a trainer: their only remote agent is their parent
    for o in others:
        assert o._loaded is not None and o.fell_back is False
    for o in others:
        o.close()
    root.close()


def test_replica_falls_back_to_the_trainers_when_its_parent_dies(trainers, caplog):
    """The first-tier receiver (its own process) is killed with SIGKILL: its replica logs a
    line naming it and pulls the same version from the trainers through its fallback
    receiver -- bit-identical, nothing torn."""
    from datetime import timedelta

    from handover_jobs import replica_parent_job

    from megarefit.demo.workers import start_workers
    from megarefit.online.receiver.replica import ReplicaReceiver

    hf, _, rdzv, pubs = trainers
    for p in pubs:
        p.publish(1)
    group = start_workers(replica_parent_job, world_size=1, args=(rdzv.port, "replica", "h"))
    rdzv.store.wait([rdzv.prefix + "tier1-ready"], timedelta(seconds=120))
    fallback = RefitReceiver(rdzv, name="r-direct", timeout=5)
    child = ReplicaReceiver(rdzv, group="h", parent="replica-tier1", name="r-child", timeout=2, fallback=fallback)
    got = dict(child.run_refit_cycle())
    assert not child.fell_back and all(torch.equal(got[k], v) for k, v in hf.items())
    group.kill(0)
    with caplog.at_level(logging.WARNING, logger="megarefit.online.receiver.replica"):
        got = dict(child.run_refit_cycle())
    assert child.fell_back and "parent 'replica-tier1' failed" in caplog.text
    assert all(torch.equal(got[k], v) for k, v in hf.items())
    child.close()
    fallback.close()
