"""Streamed cycles fail over (``RefitReceiver(memory_budget=...)``), as staged ones do: four real
Megatron-Core trainer processes (gloo, TP=2 x DP=2) serve their live shards over real NIXL; a
streamed receiver reading data-parallel copy 1 is handed a first tensor, then copy 1 of tp rank 0
(global rank 2) is SIGKILLed mid-stream. The cycle completes from the other holders: every tensor
handed over equals the independent reference sharder's unsharding (tests/reference.py) of copy 0's
own snapshots (saved by the trainers before publishing), ``stats.failovers`` names the dead rank
and its replacement, and the ring is not allocated again (ring + scratch within the budget).
With copy 0 alone serving, killing tp rank 0 mid-stream fails the cycle naming that rank, within
the timeout; what was handed over before is exact.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config
from reference import reference_hf_state, reference_shards, unshard

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job
from megarefit.demo.workers import start_workers
from megarefit.online import RefitReceiver
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.planner.holders import Reader, read_ranks
from megarefit.transport.nixl_agent import TransferError

pytestmark = pytest.mark.megatron

TOKENS = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(3))
LAYERS = 8
BUDGET = 600_000  # bytes: a ring of a few of the tiny model's layers: many groups


def _oracle(case: TrainerCase, snapshots: Path) -> dict[str, torch.Tensor]:
    """Version 1's HF tensors from copy 0's snapshots on disk, by the reference sharder."""
    snaps = {(tp, 0, 0): torch.load(snapshots / f"v1-tp{tp}-pp0-ep0.pt") for tp in (0, 1)}
    dtype = next(iter(snaps[(0, 0, 0)].values())).dtype
    shard = functools.partial(reference_shards, cfg=case.hf_config, tp=2, pp=1)
    return unshard(snaps, reference_hf_state(case.hf_config, "qwen3", dtype=dtype), shard)


def _serve(job: str, tmp_path: Path, serve_copies: bool):
    rdzv = Rendezvous.serve(job=job)
    case = TrainerCase(job, tiny_config("Qwen3-0.6B", num_hidden_layers=LAYERS), 2, 1, TOKENS)
    group = start_workers(serving_trainer_job, world_size=4,
                          args=(case, ("127.0.0.1", rdzv.port, job), 1, 0.01, str(tmp_path), serve_copies))
    return rdzv, case, group


def _pull_killing(receiver: RefitReceiver, group, rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every tensor handed over (copied before the next is asked for), worker ``rank`` SIGKILLed
    (and gone) once the first was: the READs of the groups after fail; and the ring then."""
    got: dict[str, torch.Tensor] = {}
    ring = None
    for name, t in receiver.run_refit_cycle(1):
        if not got:
            ring = receiver._stream.ring
            group.kill(rank)
        got[name] = t.clone()
    return got, ring


def test_a_copy_killed_mid_stream_fails_over_and_the_cycle_completes(tmp_path):
    rdzv, case, group = _serve("stream-failover", tmp_path, True)
    try:
        receiver = RefitReceiver(rdzv, name="stream-failover-r", timeout=20, reader=Reader(1, 2),
                                 memory_budget=BUDGET)
        dead = (0, 0, 0, 1)  # copy 1 of tp rank 0: global rank 2
        got, ring = _pull_killing(receiver, group, 2)
        stats = receiver.stats
        want = _oracle(case, tmp_path)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        assert stats.groups > 3, stats.groups
        (rank, replaced), = stats.failovers
        live = {(0, 0, 0), (1, 0, 0), (1, 0, 0, 1)}
        assert rank == dead and (0, 0, 0) in replaced and set(replaced) <= live, stats.failovers  # tp 0: one left
        assert dead not in [tuple(r) for r in read_ranks(receiver.plan)]
        assert stats.peak_extra_bytes <= BUDGET, (stats.peak_extra_bytes, BUDGET)
        assert receiver._stream.ring is ring  # the failover pulled through the same ring: no second one
        again = {n: t.clone() for n, t in receiver.run_refit_cycle(1)}  # warm: the failed-over plan, same ring
        assert receiver._stream.ring is ring and receiver.stats.failovers == ()
        assert all(torch.equal(again[n], want[n]) for n in want)
        rdzv.mark_consumed(1)
    finally:
        with pytest.raises(RuntimeError, match="worker"):
            group.join(timeout=60)


def test_with_no_other_holder_a_streamed_cycle_fails_naming_the_rank(tmp_path):
    rdzv, case, group = _serve("stream-no-holder", tmp_path, False)
    try:
        receiver = RefitReceiver(rdzv, name="stream-no-holder-r", timeout=10, memory_budget=BUDGET)
        got: dict[str, torch.Tensor] = {}
        t0 = None
        with pytest.raises(TransferError, match=r"trainer rank 0\.0\.0 as tp\.pp\.ep.*no other trainer rank serves"
                                                r".*must not serve until a refit completes") as info:
            for name, t in receiver.run_refit_cycle(1):
                got[name] = t.clone()
                if t0 is None:
                    group.kill(0)  # (0, 0, 0): tp rank 0's only holder
                    t0 = time.monotonic()
        assert info.value.rank == (0, 0, 0) and receiver.stats is None  # no cycle completed
        assert time.monotonic() - t0 < 10 + 20  # within the timeout (and the store's), never a hang
        want = _oracle(case, tmp_path)
        assert got and len(got) < len(want)  # some groups were handed over, not all
        for name, tensor in got.items():
            assert torch.equal(tensor, want[name]), name  # nothing wrong was handed over
        rdzv.mark_consumed(1)
    finally:
        with pytest.raises(RuntimeError, match="worker"):
            group.join(timeout=60)


def test_the_failover_fence_drops_the_failed_rank_only_if_it_wrote_nothing():
    """VersionFence.failed_over on a real store: the failed rank leaves the fence while its
    sequence and version are as at the start; once it wrote (its sequence moved), failing over
    is refused naming it (bytes read from it may be torn)."""
    from megarefit.layout import RankCoord
    from megarefit.online.receiver.cycle import StaleVersionError
    from megarefit.online.receiver.fence import FenceStart, VersionFence

    rdzv = Rendezvous.serve(job="fence-failover")
    r0, r1 = RankCoord(0, 0, 0), RankCoord(1, 0, 0)
    for r in (r0, r1):
        rdzv.publish_version(r, 1)
    seq, _ = rdzv.state([r0, r1])
    start = FenceStart({}, {}, [r0, r1], seq, 1, None)
    fence = VersionFence(rdzv, "fence-failover-r")
    after = fence.failed_over(start, r1, [r0], timeout=5)
    assert after.ranks == [r0] and after.seq == {r0: seq[r0]} and after.version == 1
    rdzv.begin_update(r1)
    rdzv.end_update(r1, 1)  # r1 rewrote its weights (same version number) after the start
    with pytest.raises(StaleVersionError, match=r"failing over from trainer rank \(1, 0, 0\).*\(1, 0, 0\) \(failed\)"):
        fence.failed_over(start, r1, [r0], timeout=5)
