"""A receiver's scratch that grows leaves one NIXL registration, not one per growth.

A real Publisher (tp=1, UCX loopback, this process) serves a tiny Llama; a receiver's transport
prepares three plans over one arena, each needing more scratch than the last (a third of the
targets, two thirds, all): the scratch is allocated and registered again twice, and each outgrown
one is deregistered once the requests prepared on it are released. NIXL then holds the arena and
one scratch (``NixlAgent.regions``), and the last scratch pulls the whole model: every target
equals the HF state the reference sharder started from (tests/reference.py). Late READs keep an
outgrown scratch registered until the quarantine takes it with the current one.
"""

from __future__ import annotations

import uuid

import pytest
import torch

pytest.importorskip("nixl")

from conftest import tiny_config
from reference import reference_hf_state, reference_shards

from megarefit.layout.megatron_model import source_layout
from megarefit.online.receiver.memory import ReceiverMemory
from megarefit.online.receiver.plan_cache import PlanCache
from megarefit.online.receiver.stream import sub_plan
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.online.trainer.publisher import Publisher
from megarefit.transport.nixl import NixlTransport, quarantine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def served():
    cfg = tiny_config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    job = f"scratch-{uuid.uuid4().hex[:8]}"
    rdzv = Rendezvous.serve(job=job)
    (rank, shards), = reference_shards(hf, cfg, tp=1, pp=1).items()
    pub = Publisher({n: t.clone() for n, t in shards.items()}, cfg, rank=rank, layout=source_layout(cfg, tp=1, pp=1),
                    rendezvous=rdzv, agent_name=f"{job}-trainer")
    pub.publish(1)
    yield hf, {pub.rank: pub.manifest}, {pub.rank: pub.agent.metadata}
    del pub  # serving until here


def _growing(served, name: str, late: bool = False):
    """A connected transport, its arena and three prepares of growing scratch; the scratch sizes.
    ``late``: before the last, the transport's READs timed out and may still land (a stand-in: the
    second plan's READs, which ended, recorded as late; a quarantine of them ends at its sweep)."""
    _, manifests, metadata = served
    plan, _ = PlanCache(None).plan_for(manifests)
    transport = NixlTransport(name)
    memory = ReceiverMemory(transport, CPU)
    memory.allocate(plan, manifests)
    transport.connect(manifests, metadata)
    refs = sorted(plan.targets, key=lambda r: r.name)
    plans = [sub_plan(plan, refs[: len(refs) // 3], plan.digest + "-third"),
             sub_plan(plan, refs[: 2 * len(refs) // 3], plan.digest + "-two-thirds"), plan]
    sizes, prepared = [], None
    transport.counters.subtract({"deregistrations": transport.counters["deregistrations"]})  # the prepares' only
    for i, p in enumerate(plans):
        if late and i == 2:  # the second plan's READs, pulled, stand for READs that timed out and may land
            transport.execute(prepared, memory.buffers)
            transport.late = "READs from trainer rank (0, 0, 0) are still in flight after timing out (stand-in)"
            transport._late = [h for pulls in prepared.per_source for h in [pulls.handle, *(w.handle for w in pulls.waves)]
                               if h is not None]
        prepared = transport.prepare(p, manifests, {r: memory.buffers[r] for r in p.targets})
        sizes.append(transport.scratch_allocated)
    return transport, memory, prepared, sizes


def test_a_scratch_grown_twice_leaves_one_registration_and_pulls_the_model(served):
    hf, _, _ = served
    transport, memory, prepared, sizes = _growing(served, f"scratch-grow-{uuid.uuid4().hex[:8]}")
    assert sizes[0] < sizes[1] < sizes[2], sizes  # it grew twice (else the test sees nothing)
    assert len(memory.arenas) == 1
    assert transport.nixl.regions == 1 + 1, transport.nixl.regions  # the arena and the last scratch
    assert transport.counters["deregistrations"] == 2
    transport.execute(prepared, memory.buffers)
    for ref, t in memory.buffers.items():
        assert torch.equal(t, hf[ref.name]), ref.name
    assert memory.release() == memory.sizes[0] + sizes[2]
    assert transport.nixl.regions == 0


def test_late_reads_keep_an_outgrown_scratch_registered_for_the_quarantine(served):
    """A growth while the transport's READs are late: the outgrown scratch stays allocated and
    registered (they may write it), and the quarantine takes it with the current scratch and the
    arena; each region is deregistered once those READs ended."""
    transport, memory, _, sizes = _growing(served, f"scratch-late-{uuid.uuid4().hex[:8]}", late=True)
    assert sizes[0] < sizes[1] < sizes[2], sizes
    assert transport.counters["deregistrations"] == 1  # the first growth, before the READs went late
    assert transport.nixl.regions == 1 + 2  # the arena, the outgrown scratch and the current one
    arena, = memory.arenas.values()
    held = quarantine(transport, [arena])
    assert held == arena.numel() * arena.element_size() + sizes[1] + sizes[2]
    assert transport.nixl.regions == 3 and transport.scratch_allocated == 0 and not transport.late
    assert transport.quarantined.sweep() == held and transport.nixl.regions == 0
    assert transport.counters["deregistrations"] == 1 + 3
