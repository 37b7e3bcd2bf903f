"""Every data-parallel copy serves (issue 58): four real Megatron-Core trainer processes (gloo,
TP=2 x DP=2) each publish their live shards, copies under their own keys; four receivers, each a
different reader (``Reader(i, 4)``), pull a version. Every received tensor equals the HF tensors
the independent reference sharder (tests/reference.py) gives back from copy 0's shards and from
copy 1's; each receiver reads one copy (reader i: copy i mod 2), together they read from every trainer
rank; the NIXL agent of each receiver loaded every rank it reads from (its own count, not the
plan's). With ``serve_copies=False`` only the first copies serve and the plans read them alone.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, unshard  # noqa: E402

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.planner.holders import Reader, read_ranks  # noqa: E402
from megarefit.transport.nixl_agent import TransferError  # noqa: E402

pytestmark = pytest.mark.megatron

TOKENS = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(3))
READERS = 4


def _run(job: str, serve_copies: bool):
    rdzv = Rendezvous.serve(job=job)
    case = TrainerCase(job, tiny_config("Qwen3-0.6B"), 2, 1, TOKENS)
    group = start_workers(serving_trainer_job, world_size=4,
                          args=(case, ("127.0.0.1", rdzv.port, job), 1, 0.01, None, serve_copies))
    try:
        receivers = [RefitReceiver(rdzv, name=f"{job}-{i}", timeout=120, reader=Reader(i, READERS))
                     for i in range(READERS)]
        got = [{n: t.clone() for n, t in r.run_refit_cycle(1)} for r in receivers]
        plans = [r.plan for r in receivers]
        agents = [r.counters["remote_agents"] for r in receivers]
        rdzv.mark_consumed(1)
    finally:
        trainers = group.join(timeout=180)
    return case.hf_config, got, plans, agents, trainers


@pytest.fixture(scope="module")
def every_copy():
    return _run("every-copy", True)


def test_every_copy_serves_the_same_bytes(every_copy):
    cfg, got, _, _, trainers = every_copy
    snaps = {tuple(t["coord"]): t["snapshots"][1] for t in trainers}
    assert sorted(snaps) == [(0, 0, 0), (0, 0, 0, 1), (1, 0, 0), (1, 0, 0, 1)]
    shard = functools.partial(reference_shards, cfg=cfg, tp=2, pp=1)
    dtype = next(iter(snaps[(0, 0, 0)].values())).dtype
    for copy in (0, 1):
        per = {c[:3]: s for c, s in snaps.items() if (c[3] if len(c) > 3 else 0) == copy}
        want = unshard(per, reference_hf_state(cfg, "qwen3", dtype=dtype), shard)
        for received in got:
            assert received.keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(received[name], tensor), (copy, name)


def test_reads_spread_over_every_copy(every_copy):
    """Four readers, two copies: each reads one copy (reader i: copy i mod 2), together all ranks."""
    _, _, plans, agents, _ = every_copy
    ranks = [read_ranks(p) for p in plans]
    assert [{r.copy for r in rs} for rs in ranks] == [{0}, {1}, {0}, {1}], ranks
    assert set().union(*map(set, ranks)) == {(0, 0, 0), (0, 0, 0, 1), (1, 0, 0), (1, 0, 0, 1)}
    assert agents == [len(rs) for rs in ranks]  # the transport loaded exactly the ranks the plan names
    per_rank: dict = {}
    for p in plans:
        for rank, row in p.summary()["per_rank"].items():
            per_rank[rank] = per_rank.get(rank, 0) + row["bytes"]
    mean = sum(per_rank.values()) / 4
    assert max(per_rank.values()) <= 1.25 * mean, per_rank  # a tiny model: few tensors to spread


def test_only_first_copies_serve_when_asked():
    cfg, got, plans, _, trainers = _run("first-copies", False)
    assert sorted(tuple(t["coord"]) for t in trainers if t["snapshots"]) == [(0, 0, 0), (1, 0, 0)]
    assert all(read_ranks(p) == [(0, 0, 0), (1, 0, 0)] for p in plans)
    assert all(got[0].keys() == g.keys() and all(torch.equal(got[0][n], g[n]) for n in g) for g in got)


def test_a_dead_copy_fails_over_to_the_other_holders():
    """Copy 1 of tp rank 0 (global rank 2) is SIGKILLed after version 1 was pulled; each receiver
    that read from it pulls version 1 again from the other holders: bytes equal the first pull,
    ``stats.failovers`` names the dead rank and who served its share; one that did not read from
    it is untouched. A receiver that first connects after the death (a new engine) fails over the
    same way. Killing the last holder of tp rank 0's shards then fails naming that rank."""
    job = "failover"
    rdzv = Rendezvous.serve(job=job)
    case = TrainerCase(job, tiny_config("Qwen3-0.6B"), 2, 1, TOKENS)
    group = start_workers(serving_trainer_job, world_size=4, args=(case, ("127.0.0.1", rdzv.port, job), 1))
    try:
        receivers = [RefitReceiver(rdzv, name=f"{job}-{i}", timeout=20, reader=Reader(i, READERS))
                     for i in range(READERS)]
        first = [{n: t.clone() for n, t in r.run_refit_cycle(1)} for r in receivers]
        dead = (0, 0, 0, 1)
        readers = [dead in read_ranks(r.plan) for r in receivers]
        assert any(readers)
        group.kill(2)
        for r, want in zip(receivers, first):
            got = {n: t.clone() for n, t in r.run_refit_cycle(1)}
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
            if dead in [tuple(x) for x in read_ranks(r.plan)]:
                raise AssertionError("the plan still reads the dead rank")
        for r, read in zip(receivers, readers):
            if read:
                (rank, replaced), = r.stats.failovers
                live = {(0, 0, 0), (1, 0, 0), (1, 0, 0, 1)}
                assert rank == dead and (0, 0, 0) in replaced and set(replaced) <= live  # tp 0's shards: one left
            else:
                assert r.stats.failovers == ()
        # a receiver that first connects after the death (a new engine): NIXL cannot load the dead
        # agent's metadata (no listener), a TransferError naming the rank, failed over the same way
        i = readers.index(True)
        fresh = RefitReceiver(rdzv, name=f"{job}-fresh", timeout=20, reader=Reader(i, READERS))
        got = {n: t.clone() for n, t in fresh.run_refit_cycle(1)}
        assert got.keys() == first[i].keys() and all(torch.equal(got[n], first[i][n]) for n in got)
        assert [rank for rank, _ in fresh.stats.failovers] == [dead], fresh.stats.failovers
        group.kill(0)  # (0, 0, 0): tp rank 0's last holder
        with pytest.raises(TransferError, match=r"trainer rank 0\.0\.0 as tp\.pp\.ep.*no other trainer rank serves"):
            list(next(r for r, read in zip(receivers, readers) if read).run_refit_cycle(1))
        rdzv.mark_consumed(1)
    finally:
        with pytest.raises(RuntimeError, match="worker"):
            group.join(timeout=60)
