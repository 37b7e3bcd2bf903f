"""RefitReceiver's parts, each on its own, with real parts: a real Rendezvous and real
Publishers serving reference shards over NIXL (UCX loopback) in this process.

* VersionFence: passes a quiet pull, rejects one whose update sequence or version moved,
  waits out a writer and names it;
* PlanCache: plans once per layout and placement, re-plans when the layout changes and not
  otherwise, checks the manifests against the plan;
* ReceiverMemory: the arena and the ring hold exactly the targets, release returns the bytes
  it frees, a ring too small names a budget that fits, direct targets take no ring bytes;
* CyclePipeline: staged and streamed cycles over the parts, a torn streamed cycle reported.

Oracles: the HF state the reference sharder started from (tests/reference.py), tensor sizes
measured here, and the seqlock's contract (a Publisher.updating block moves a sequence by 2).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import re
import time
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, vllm_reference  # noqa: E402

from megarefit.errors import MegarefitError, MissingParameterError, ShapeMismatchError  # noqa: E402
from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online.receiver.cycle import Laps, StaleVersionError, TornUpdateError, VersionMismatchError, gc_paused  # noqa: E402
from megarefit.online.receiver.fence import VersionFence  # noqa: E402
from megarefit.online.receiver.memory import ReceiverMemory  # noqa: E402
from megarefit.online.receiver.pipeline import CyclePipeline  # noqa: E402
from megarefit.online.receiver.plan_cache import PlanCache  # noqa: E402
from megarefit.online.receiver.stream import MemoryBudgetError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from megarefit.transport.cuda_ipc import IpcSources  # noqa: E402
from megarefit.transport.nixl import NixlTransport  # noqa: E402

CPU = torch.device("cpu")
_NAMES = itertools.count()


class Served(NamedTuple):
    cfg: dict
    hf: dict[str, torch.Tensor]
    rdzv: Rendezvous
    pubs: dict[tuple[int, int, int], Publisher]  # tp=2 ranks, serving ``hf``
    single: Publisher  # one tp=1 rank of another job, serving the same model


def _serve(cfg: dict, hf: dict[str, torch.Tensor], tp: int, job: str) -> tuple[Rendezvous, dict]:
    rdzv = Rendezvous.serve(job=job)
    shards = reference_shards(hf, cfg, tp=tp, pp=1)
    return rdzv, {r: Publisher({n: t.clone() for n, t in s.items()}, cfg, rank=r, layout=source_layout(cfg, tp=tp, pp=1),
                               rendezvous=rdzv, agent_name=f"{job}-trainer-{r[0]}") for r, s in shards.items()}


@pytest.fixture(scope="module")
def served() -> Served:
    cfg = tiny_config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    rdzv, pubs = _serve(cfg, hf, 2, "parts")
    _, single = _serve(cfg, hf, 1, "parts-tp1")
    return Served(cfg, hf, rdzv, pubs, single[(0, 0, 0)])


_VERSIONS = itertools.count(10, 10)  # each test its own versions (v, v + 1, ... stay below the next)


def _publish_all(s: Served) -> int:
    v = next(_VERSIONS)
    for p in s.pubs.values():
        p.publish(v)
    return v


def _manifests(s: Served) -> dict:
    return {p.rank: p.manifest for p in s.pubs.values()}


def _metadata(s: Served) -> dict:
    return {p.rank: p.agent.metadata for p in s.pubs.values()}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _name(what: str) -> str:
    return f"parts-{what}-{next(_NAMES)}"


def _transport(what: str, **options) -> NixlTransport:
    """A receiver's transport, as RefitReceiver makes it (CUDA IPC where a rank shares the device)."""
    return NixlTransport(_name(what), ipc=IpcSources(CPU, "auto"), **options)


# ---- the fence ------------------------------------------------------------------
def test_fence_passes_a_quiet_pull_and_rejects_one_whose_update_sequence_moved(served):
    v = _publish_all(served)
    fence = VersionFence(served.rdzv, _name("fence"))
    lap = Laps()
    start = fence.start(v, 5, lap)
    assert start.version == v and start.asked == v and start.ranks == sorted(served.pubs)
    assert start.manifests.keys() == served.pubs.keys() and all(n % 2 == 0 for n in start.seq.values())
    assert list(lap.seconds) == ["discover", "version"]
    fence.end(start)  # nobody wrote
    assert fence.torn(start, 3) is None
    seq = start.seq[(1, 0, 0)]
    with served.pubs[(1, 0, 0)].updating(v):  # same version, bytes rewritten: only the sequence tells
        pass
    with pytest.raises(StaleVersionError, match=rf"wrote their weights during the pull of version {v} "
                                                rf"\(update sequence moved\): \(1, 0, 0\) {seq} -> {seq + 2}$") as err:
        fence.end(start)
    assert err.value.retryable
    torn = fence.torn(start, 3)
    assert isinstance(torn, TornUpdateError) and torn.retryable and isinstance(torn.__cause__, StaleVersionError)
    assert "3 groups were already handed over, so the consumer holds a mix of versions" in str(torn)
    fence.end(fence.start(v, 5))  # a new pull reads the new sequences: it passes


def test_fence_end_a_version_that_moved_is_retryable_only_when_none_was_asked(served):
    v = _publish_all(served)
    fence = VersionFence(served.rdzv, _name("fence"))
    asked, latest = fence.start(v, 5), fence.start(None, 5)
    assert latest.version == v and latest.asked is None
    served.pubs[(0, 0, 0)].publish(v + 1)
    for start, retryable in ((asked, False), (latest, True)):
        with pytest.raises(StaleVersionError, match=rf"moved past version {v} during the pull: \(0, 0, 0\) -> "
                                                    rf"{v + 1}$") as err:
            fence.end(start)
        assert err.value.retryable is retryable
    with pytest.raises(VersionMismatchError, match=rf"do not publish one common version after 0\.1 s: "
                                                   rf"\(0, 0, 0\): {v + 1}, \(1, 0, 0\): {v} "):
        fence.start(None, 0.1)


def test_fence_waits_out_a_writer_and_names_it_after_the_timeout(served):
    v = _publish_all(served)
    name = _name("fence")
    fence = VersionFence(served.rdzv, name)
    with pytest.raises(RuntimeError, match="step failed"):
        with served.pubs[(1, 0, 0)].updating(v + 1):
            raise RuntimeError("step failed")  # the rank stays marked writing
    t0 = time.monotonic()
    with pytest.raises(StaleVersionError, match=rf"still writing their weights after 0\.2 s .*receiver '{name}', "
                                                r"job 'parts', .*: \(1, 0, 0\)$"):
        fence.start(None, 0.2)
    assert time.monotonic() - t0 >= 0.2
    v = _publish_all(served)  # publish ends the failed update
    assert fence.start(None, 5).version == v


# ---- the plan cache --------------------------------------------------------------
def test_plan_cache_replans_on_a_layout_change_and_not_otherwise(served):
    cache = PlanCache(None)
    tp2, tp1 = _manifests(served), {served.single.rank: served.single.manifest}
    plan, new = cache.plan_for(tp2)
    assert new and cache.plan is plan and cache.plans_built == 1 and plan.layout.tp == 2
    assert {ref.name: tuple(m.shape) for ref, m in plan.targets.items()} == {
        n: tuple(t.shape) for n, t in served.hf.items()}
    again, new = cache.plan_for(_manifests(served))  # the same layout: the same plan
    assert again is plan and not new and cache.plans_built == 1
    other, new = cache.plan_for(tp1)  # re-sharded to tp=1: planned
    assert new and other.layout.tp == 1 and other.digest != plan.digest and cache.plans_built == 2
    back, new = cache.plan_for(tp2)  # seen before: new to the cycle, not planned again
    assert back is plan and new and cache.plans_built == 2
    cache.invalidate()
    assert cache.plan is None
    again, new = cache.plan_for(tp2)
    assert again is plan and new and cache.plans_built == 2


def test_plan_cache_follows_a_vllm_target_and_keeps_each_placement(served):
    cache = PlanCache(VllmTarget(2, 0))
    manifests = _manifests(served)
    first, _ = cache.plan_for(manifests)
    for rank, plan in ((0, first), (1, None)):
        if plan is None:
            assert cache.follow(VllmTarget(2, rank)) and cache.plan is None
            plan, new = cache.plan_for(manifests)
            assert new and plan is not first and cache.plans_built == 2
        want = vllm_reference(served.hf, served.cfg, 2, rank)
        assert {ref.name: tuple(m.shape) for ref, m in plan.targets.items() if ref not in plan.staging} == {
            n: tuple(t.shape) for n, t in want.items()}
    assert not cache.follow(VllmTarget(2, 1))
    assert cache.follow(VllmTarget(2, 0))
    back, new = cache.plan_for(manifests)
    assert back is first and new and cache.plans_built == 2
    with pytest.raises(MegarefitError, match="full HF tensors: it has no vLLM target"):
        PlanCache(None).follow(VllmTarget(2, 0))


def test_plan_cache_checks_the_manifests_against_the_plan(served):
    manifests = _manifests(served)
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    lacking = dict(manifests)
    lacking[(1, 0, 0)] = dataclasses.replace(manifests[(1, 0, 0)], tensors=tuple(
        t for t in manifests[(1, 0, 0)].tensors if t.name != name))
    halved = dict(manifests)  # the same served memory (digest), another dtype
    halved[(0, 0, 0)] = dataclasses.replace(manifests[(0, 0, 0)], tensors=tuple(
        dataclasses.replace(t, dtype="bfloat16") if t.name == name else t for t in manifests[(0, 0, 0)].tensors))
    cache = PlanCache(None)
    plan, _ = cache.plan_for(manifests)
    with pytest.raises(MissingParameterError, match=rf"rank \(tp=1, pp=0, ep=0\) does not publish {name} "):
        cache.check_manifests(plan, lacking)
    with pytest.raises(ShapeMismatchError, match=rf"rank \(tp=0, pp=0, ep=0\) publishes {name} as bfloat16 "
                                                 r"\(64, 48\), plan expects float32"):
        cache.check_manifests(plan, halved)
    cache.check_manifests(plan, manifests)
    cache.check_manifests(plan, halved)  # checked per served memory: a warm cycle's same digests cost no check
    with pytest.raises(ShapeMismatchError):
        PlanCache(None).check_manifests(plan, halved)


# ---- the receiver memory ---------------------------------------------------------
def test_memory_staged_arena_holds_every_target_and_release_returns_the_bytes_it_frees(served):
    manifests = _manifests(served)
    plan, _ = PlanCache(None).plan_for(manifests)
    transport = _transport("arena", scratch_budget=4096)
    memory = ReceiverMemory(transport, CPU)
    assert not memory.holds and memory.release() == 0
    memory.allocate(plan, manifests)
    share = _nbytes(served.hf.values())
    assert memory.holds and memory.stream is None and memory.sizes == (share, share)
    assert {ref.name: tuple(t.shape) for ref, t in memory.buffers.items()} == {
        n: tuple(t.shape) for n, t in served.hf.items()}
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in memory.buffers.values())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two targets share a byte
    arenas = list(memory.arenas.values())
    assert _nbytes(arenas) == share
    transport.connect(manifests, _metadata(served))
    transport.prepare(plan, manifests, memory.buffers)  # registers the arena, allocates the scratch
    scratch = transport.scratch_allocated
    assert scratch > 0 and all(transport.nixl.registered(a) for a in arenas)
    assert memory.release() == share + scratch
    assert not memory.holds and transport.scratch_allocated == 0
    assert not any(transport.nixl.registered(a) for a in arenas)
    assert memory.release() == 0


def test_transport_prepares_again_a_source_whose_metadata_changed_at_the_same_addresses(served):
    """A source re-registers (its NIXL metadata changes: here it registers one more block) while
    what it serves stays where it was (the same manifest, the same memory digest, so the same
    cache key): the transport's requests against its old metadata were released, and the next
    prepare makes that rank's again instead of returning the cached, released ones (it once did:
    a READ posted on a released handle). The pull equals the HF state; only that rank prepared twice."""
    manifests = _manifests(served)
    plan, _ = PlanCache(None).plan_for(manifests)
    transport = _transport("same-addresses")
    memory = ReceiverMemory(transport, CPU)
    memory.allocate(plan, manifests)
    transport.connect(manifests, _metadata(served))
    transport.execute(transport.prepare(plan, manifests, memory.buffers), memory.buffers)
    pub, other = served.pubs[(0, 0, 0)], served.pubs[(1, 0, 0)]
    before, extra = pub.agent.metadata, torch.zeros(1 << 16, dtype=torch.uint8)
    pub.agent.register([extra])
    try:
        assert pub.agent.metadata != before and _manifests(served)[pub.rank].memory_digest == manifests[pub.rank].memory_digest
        for t in memory.buffers.values():
            t.zero_()
        transport.connect(_manifests(served), _metadata(served))
        transport.execute(transport.prepare(plan, _manifests(served), memory.buffers), memory.buffers)
        assert [ref.name for ref, t in memory.buffers.items() if not torch.equal(t, served.hf[ref.name])] == []
        assert (transport.rank_prepares[pub.rank], transport.rank_prepares[other.rank]) == (2, 1)
    finally:
        memory.release()
        pub.agent.deregister([extra])


def _fitting_budget(served, plan) -> int:
    """The budget a ring too small names; a ring of it fits the largest layer (an error that names
    none, or a budget that does not fit, fails here)."""
    with pytest.raises(MemoryBudgetError, match=r"memory_budget=4096 .* is too small; use memory_budget >= \d+") as err:
        ReceiverMemory(NixlTransport(_name("tiny")), CPU, 4096).allocate(plan, _manifests(served))
    budget = int(re.search(r"memory_budget >= (\d+)", str(err.value)).group(1))
    transport = NixlTransport(_name("fits"))
    memory = ReceiverMemory(transport, CPU, budget)
    memory.allocate(plan, _manifests(served))
    assert memory.stream.ring.numel() + transport.scratch_budget <= budget
    return budget


def test_memory_ring_within_its_budget_and_release_returns_the_bytes_it_frees(served):
    manifests = _manifests(served)
    plan, _ = PlanCache(None).plan_for(manifests)
    budget = _fitting_budget(served, plan)  # the budget named: room for the scratch the gathered pulls need too
    transport = _transport("ring")
    memory = ReceiverMemory(transport, CPU, budget)
    memory.allocate(plan, manifests)
    stream = memory.stream
    assert stream is not None and not memory.buffers and len(stream.groups) > 2
    assert [ref.name for g in stream.groups for ref in g.plan.targets] == [ref.name for ref in plan.targets]
    assert {ref.name for ref in plan.targets} == served.hf.keys()  # every target once, in plan order
    # consecutive groups share ring bytes only where the ring cannot hold both (a ring of about one layer)
    assert all(not a.overlaps(b) or a.nbytes + b.nbytes > stream.nbytes
               for a, b in zip(stream.groups, stream.groups[1:]))
    transport.connect(manifests, _metadata(served))
    prepared = memory.prepare_stream(plan, manifests)
    assert len(prepared) == len(stream.groups) and memory.stream.budget == budget
    ring, scratch = memory.stream.ring.numel(), transport.scratch_allocated
    assert ring + scratch <= budget
    assert memory.release() == ring + scratch and memory.stream is None and memory.release() == 0


def test_memory_direct_targets_take_no_ring_bytes_and_are_checked(served):
    manifests = _manifests(served)
    plan, _ = PlanCache(None).plan_for(manifests)
    transport = _transport("direct")
    name = "model.layers.0.mlp.down_proj.weight"
    mine = torch.empty_like(served.hf[name])
    ringed, direct = ReceiverMemory(transport, CPU, "auto"), ReceiverMemory(transport, CPU, "auto", direct={name: mine})
    ringed.allocate(plan, manifests)
    direct.allocate(plan, manifests)
    assert {ref.name for ref in direct.stream.direct} == {name} and direct.direct_bytes() == mine.nbytes
    assert any(t is mine for bufs in direct.stream.buffers for t in bufs.values())
    assert ringed.stream.ring.numel() - direct.stream.ring.numel() == mine.nbytes  # 64 x 96 float32: 256-aligned
    for tensors, error, match in (
            ({name: torch.empty(96, 64)}, ShapeMismatchError,
             rf"direct tensor '{name}': expected contiguous \[64, 96\] float32 on cpu, got \[96, 64\]"),
            ({name: torch.empty(96, 64).t()}, ShapeMismatchError, "contiguous=False"),
            ({"model.layers.0.mlp.nope.weight": mine}, MissingParameterError, "'model.layers.0.mlp.nope.weight' is not a target")):
        with pytest.raises(error, match=match):
            ReceiverMemory(transport, CPU, "auto", direct=tensors).allocate(plan, manifests)


# ---- the pipeline ----------------------------------------------------------------
def _pipeline(served, what: str, **memory) -> CyclePipeline:
    transport = _transport(what)
    name = transport.nixl.name
    return CyclePipeline(VersionFence(served.rdzv, name), PlanCache(None), ReceiverMemory(transport, CPU, **memory),
                         transport, timeout=5)


def test_pipeline_staged_cycle_pulls_again_after_a_write_and_gives_up_past_its_retries(served):
    pipe = _pipeline(served, "staged")
    v = _publish_all(served)
    for cold in (True, False):
        got = {n: t.clone() for n, t in pipe.staged(v, retries=0)}
        assert got.keys() == served.hf.keys() and all(torch.equal(got[k], t) for k, t in served.hf.items())
        stats = pipe.stats
        assert (stats.version, stats.cold, stats.install, stats.retries) == (v, cold, "staged", 0)
        assert stats.bytes_moved == stats.arena_bytes == _nbytes(served.hf.values())
    assert pipe.counters["plans_built"] == 1
    execute, writes = pipe.transport.execute, iter([True])

    def execute_during_a_step(*args, **kwargs):
        execute(*args, **kwargs)
        if next(writes, False):
            with served.pubs[(1, 0, 0)].updating(v):
                pass

    pipe.transport.execute = execute_during_a_step
    assert dict(pipe.staged(v, retries=1)).keys() == served.hf.keys() and pipe.stats.retries == 1
    writes = iter([True, True])
    with pytest.raises(StaleVersionError, match=r"wrote their weights during the pull .*\(1, 0, 0\)"):
        next(pipe.staged(v, retries=1))


def test_pipeline_streamed_cycle_hands_groups_over_and_reports_a_torn_one(served):
    plan, _ = PlanCache(None).plan_for(_manifests(served))
    budget = _fitting_budget(served, plan)
    pipe = _pipeline(served, "streamed", memory_budget=budget)
    v = _publish_all(served)
    got = {n: t.clone() for n, t in pipe.streamed(v)}
    assert got.keys() == served.hf.keys() and all(torch.equal(got[k], t) for k, t in served.hf.items())
    stats = pipe.stats
    assert stats.install == "streamed" and stats.groups > 2 and stats.peak_extra_bytes <= budget
    for torn in ([], None):  # a rank writes once the first tensor was handed over
        cycle = pipe.streamed(v, torn)
        next(cycle)
        with served.pubs[(0, 0, 0)].updating(v):
            pass
        if torn is None:
            with pytest.raises(TornUpdateError, match=rf"\(0, 0, 0\) .*; {stats.groups} groups were already handed"):
                list(cycle)
        else:
            assert len(list(cycle)) == len(served.hf) - 1  # the consumer finishes its install
            assert len(torn) == 1 and torn[0].retryable and isinstance(torn[0], TornUpdateError)
        assert pipe.stats is stats  # a torn cycle reports no stats


# ---- the cycle's small parts ----------------------------------------------------
def test_laps_time_each_stage_and_gc_paused_restores_the_collector():
    lap = Laps()
    time.sleep(0.02)
    lap("a")
    lap.restart()
    lap("b")
    assert list(lap.seconds) == ["a", "b"] and lap.seconds["a"] >= 0.02 > lap.seconds["b"]
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with pytest.raises(KeyError), gc_paused():
                assert not gc.isenabled()
                raise KeyError
            assert gc.isenabled() is enabled
    finally:
        gc.enable()
