"""Node-local dedup at run time (issue 60): receivers of one node split what they all need.

Real parts: in-process Publishers serving the reference sharder's shards over NIXL (UCX), real
RefitReceivers with ``node=n`` on threads of this process (one node: one ``$MEGAREFIT_NODE``),
each with its own NIXL agent, copying from each other's arenas.

Oracles: the HF state the shards came from and vLLM's documented TP layout built from it by
cat / chunk (tests/reference.py), never the planner; the split's contract checked on drawn needs.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, unshard, vllm_reference  # noqa: E402

from megarefit.errors import MegarefitError  # noqa: E402
from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.receiver.node_split import NodePiece, node_pieces, split_node  # noqa: E402
from megarefit.online.receiver.plan_cache import PlanCache  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402

CFG = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)
_JOBS = itertools.count()


# ---- the split, as data ---------------------------------------------------------------------------
@st.composite
def _needs(draw):
    mates = [f"m{i}" for i in range(draw(st.integers(1, 5)))]
    sigs = {f"{i:016x}": draw(st.integers(1, 1 << 20)) for i in range(draw(st.integers(0, 30)))}
    needs = {}
    for m in mates:
        mine = draw(st.sets(st.sampled_from(sorted(sigs)), max_size=len(sigs))) if sigs else set()
        needs[m] = [NodePiece(f"{m}.{s}", "bfloat16", sigs[s], s) for s in sorted(mine)]
    return mates, needs


@settings(max_examples=200, deadline=None)
@given(_needs(), st.randoms())
def test_the_split_gives_each_shared_piece_one_needer_and_is_the_same_on_every_mate(drawn, rnd):
    """Every piece is pulled by exactly one mate that needs it (itself, if only it needs it);
    pulls and copies of a mate are its pieces, disjoint; the split does not depend on the order
    the records were read in; replicas (every mate needs every piece) pull within one piece of each other."""
    mates, needs = drawn
    split = split_node(needs, mates)
    shuffled = list(needs.items())
    rnd.shuffle(shuffled)
    assert split_node(dict(shuffled), mates) == split
    pulled_by: dict[str, set[str]] = {}
    for m in mates:
        pulls, copies = split.pulls(m, needs[m]), split.copies(m, needs[m])
        copied = [p.name for ps in copies.values() for p in ps]
        assert sorted(pulls + copied) == sorted(p.name for p in needs[m]) and not set(pulls) & set(copied)
        for p in needs[m]:
            if p.name in pulls:
                pulled_by.setdefault(p.signature, set()).add(m)
        for owner, ps in copies.items():
            assert all(owner in {x for x in mates if p.signature in {q.signature for q in needs[x]}} for p in ps)
    for sig, owners in pulled_by.items():
        needers = [m for m in mates if sig in {p.signature for p in needs[m]}]
        assert len(owners) == 1 and owners <= set(needers), (sig, owners, needers)
    load = {m: sum(p.nbytes for p in needs[m] if split.owners.get(p.signature) == m) for m in mates}
    biggest = max((p.nbytes for ps in needs.values() for p in ps), default=0)
    if len(mates) > 1 and len({frozenset(p.signature for p in needs[m]) for m in mates}) == 1:  # replicas
        assert max(load.values()) - min(load.values()) <= biggest, load


def test_one_signature_with_two_sizes_is_refused():
    a = [NodePiece("x", "bfloat16", 8, "s")]
    with pytest.raises(MegarefitError, match="not one piece"):
        split_node({"a": a, "b": [NodePiece("y", "bfloat16", 16, "s")]}, ["a", "b"])
    with pytest.raises(MegarefitError, match=r"no pieces from node-mates \['b'\]"):
        split_node({"a": a}, ["a", "b"])


def test_pieces_of_two_vllm_tp_ranks_share_exactly_the_tensors_both_hold_whole():
    """vLLM tp 2, ranks 0 and 1: a target of one rank has the signature of a target of the other
    exactly where their reference tensors (vLLM's layout by cat / chunk, random weights) are
    equal: the replicated ones (norms), and only those."""
    hf = reference_hf_state(CFG, "qwen3")
    manifests = _manifests(hf)
    pieces, want = {}, {}
    for rank in (0, 1):
        cache = PlanCache(VllmTarget(2, rank))
        cache.plan_for(manifests)
        pieces[rank] = {p.name: p for p in node_pieces(cache.base)}
        want[rank] = vllm_reference(hf, CFG, 2, rank)
    same = {n for n in pieces[0] if n in pieces[1] and pieces[0][n].signature == pieces[1][n].signature}
    equal = {n for n in want[0] if n in want[1] and want[0][n].shape == want[1][n].shape
             and torch.equal(want[0][n], want[1][n])}
    assert same == equal and same and all("norm" in n for n in same), sorted(same ^ equal)
    sigs0 = {p.signature for p in pieces[0].values()}
    assert {n for n, p in pieces[1].items() if p.signature in sigs0} == same  # no two names for one piece here


# ---- at run time -------------------------------------------------------------------------------------
def _manifests(hf: dict) -> dict:
    """Manifests of tp 2 publishers of ``hf`` (not serving: planning reads only shapes)."""
    job = f"node-plan-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = _publishers(rdzv, job, hf)
    try:
        return {p.rank: p.manifest for p in pubs}
    finally:
        rdzv.store.close()


def _publishers(rdzv: Rendezvous, job: str, hf: dict, **kw) -> list[Publisher]:
    shards = reference_shards(hf, CFG, tp=2, pp=1)
    return [Publisher({n: t.clone() for n, t in s.items()}, CFG, rank=r, layout=source_layout(CFG, tp=2, pp=1),
                      rendezvous=rdzv, agent_name=f"{job}-t{r[0]}", **kw) for r, s in shards.items()]


def cycles_on_threads(receivers, version: int, timeout: float = 60.0) -> list:
    """Each receiver's cycle of ``version`` on a thread of its own: ``{name: tensor}`` or the error."""
    out: list = [None] * len(receivers)

    def run(i):
        try:
            out[i] = {n: t.clone() for n, t in receivers[i].run_refit_cycle(version)}
        except Exception as exc:  # noqa: BLE001 (handed to the test)
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(receivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a receiver's cycle did not end"
    return out


@pytest.fixture(params=[False, True], ids=["full", "delta"])
def node(monkeypatch, request):
    """A rendezvous with tp 2 publishers of random HF weights (publishing deltas or not), and a node name."""
    job = f"node-share-{next(_JOBS)}"
    monkeypatch.setenv("MEGAREFIT_NODE", job)
    rdzv = Rendezvous.serve(job=job)
    hf = reference_hf_state(CFG, "qwen3")
    pubs = _publishers(rdzv, job, hf, delta=request.param)
    yield {"rdzv": rdzv, "job": job, "hf": hf, "pubs": pubs}
    rdzv.store.close()


def _publish(node, v: int) -> dict:
    """Publish version ``v`` (1.0 added to every 13th element of every shard: a delta the trainers
    keep); the HF state it is, by the reference sharder's unsharding of the trainers' shards."""
    for p in node["pubs"]:
        for t in p.params.values():
            t.view(-1)[v % 13::13].add_(1.0)
        p.publish(v)
    shards = {tuple(p.rank)[:3]: p.params for p in node["pubs"]}
    return unshard(shards, node["hf"], lambda hf: reference_shards(hf, CFG, tp=2, pp=1))


def test_two_full_hf_receivers_of_one_node_pull_half_each_and_both_get_every_byte(node):
    """Two receivers that both pull full HF tensors: every piece is shared, each pulls about half
    from the trainers (within one tensor) and copies the other half from its mate; both get
    every byte of versions 1 and 2, warm the second time (nothing planned or prepared again).
    Trainers publishing deltas: from version 2 on each mate pulls its own delta of every target
    (no split: deltas are small) and still serves its arena; every byte still exact."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-rx{i}", timeout=30, node=2) for i in range(2)]
    for r in rx:  # fixed rates: a delta whenever the trainers keep one (this machine's speed aside)
        r.delta_model.rates.update(wire=8e9, delta_wire=8e9, scatter=1e9, full=8e9)
        r.delta_model.learn = False
    deltas = node["pubs"][0].delta is not None
    total = sum(t.numel() * t.element_size() for t in node["hf"].values())
    biggest = max(t.numel() * t.element_size() for t in node["hf"].values())
    for v in (1, 2, 3):
        want = _publish(node, v)
        got = cycles_on_threads(rx, v)
        for g in got:
            assert not isinstance(g, Exception), g
            assert g.keys() == want.keys() and [n for n in want if not torch.equal(g[n], want[n])] == []
        stats = [r.stats for r in rx]
        if deltas and v > 1:
            assert [s.refit for s in stats] == ["delta", "delta"] and [s.node_bytes for s in stats] == [0, 0], \
                [s.delta_reason for s in stats]
            continue
        assert [s.refit for s in stats] == ["full", "full"], [s.delta_reason for s in stats]
        assert sum(s.node_bytes for s in stats) == total and all(s.node_fallbacks == () for s in stats)
        assert all(s.bytes_moved == total and s.node_bytes + s.wire_bytes >= total for s in stats)
        assert abs(stats[0].node_bytes - stats[1].node_bytes) <= biggest
    assert [r.stats.cold for r in rx] == [False, False]
    for r in rx:
        r.close()


@pytest.mark.parametrize("node", [True], indirect=True, ids=["delta"])
def test_node_mates_time_their_warm_pulls_so_that_deltas_can_follow(node):
    """With the cost model learning (its default), a node-mate's warm grouped pull is timed, the baseline a
    delta needs (without it every cycle stays full: "no warm full pull timed yet")."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-rx{i}", timeout=30, node=2) for i in range(2)]
    for v in (1, 2):  # cold, then warm
        want = _publish(node, v)
        for g in cycles_on_threads(rx, v):
            assert not isinstance(g, Exception), g
            assert [n for n in want if not torch.equal(g[n], want[n])] == []
    assert all(r.stats.node_bytes > 0 for r in rx)  # the grouped pull, copies beside it
    assert all(r.delta_model.rates["full"] > 0 and r.delta_model.rates["wire"] > 0 for r in rx), \
        [r.delta_model.rates for r in rx]
    for r in rx:
        r.close()


@pytest.mark.parametrize("node", [False], indirect=True, ids=["full"])
def test_a_mate_that_rewrote_its_arena_during_the_read_is_read_again(node, monkeypatch):
    """The first same-host READ of the cycle ends as if its mate had rewritten its arena meanwhile (the mate began
    another cycle of the same version: a torn cycle pulled again, a version pulled twice): the READ is done again
    once the mate serves, not given up: no fallback, every shared byte copied, every byte exact."""
    from megarefit.online.receiver.cycle import StaleVersionError
    from megarefit.online.receiver.node_copy import MateReader

    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-rx{i}", timeout=30, node=2) for i in range(2)]
    want = _publish(node, 1)
    read, calls = MateReader.read_targets, []

    def rewritten_once(self, wanted, *args, **kwargs):
        got = read(self, wanted, *args, **kwargs)
        calls.append((self.mate, tuple(w[0] for w in wanted)))
        if len(calls) == 1:
            raise StaleVersionError(f"node-mate {self.mate!r} rewrote its arena during the READ", retryable=True)
        return got

    monkeypatch.setattr(MateReader, "read_targets", rewritten_once)
    got = cycles_on_threads(rx, 1)
    total = sum(t.numel() * t.element_size() for t in node["hf"].values())
    for g in got:
        assert not isinstance(g, Exception), g
        assert [n for n in want if not torch.equal(g[n], want[n])] == []
    assert calls.count(calls[0]) == 2 and len(set(calls)) == len(calls) - 1  # the first READ twice, the rest once
    assert all(r.stats.node_fallbacks == () for r in rx)
    assert sum(r.stats.node_bytes for r in rx) == total  # every piece copied once, none pulled instead
    for r in rx:
        r.close()


def test_vllm_tp_ranks_of_one_node_copy_only_the_replicated_tensors(node):
    """vLLM tp 2's two workers on one node: each gets exactly vLLM's layout of its rank; what they
    copy from each other are the tensors both hold whole, nothing else."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-w{i}", timeout=30, node=2, target=VllmTarget(2, i),
                        delta=False) for i in range(2)]
    want_hf = _publish(node, 1)
    got = cycles_on_threads(rx, 1)
    for i, g in enumerate(got):
        assert not isinstance(g, Exception), g
        want = vllm_reference(want_hf, CFG, 2, i)
        assert g.keys() == want.keys() and [n for n in want if not torch.equal(g[n], want[n])] == []
    ref0, ref1 = (vllm_reference(want_hf, CFG, 2, i) for i in (0, 1))
    replicated = sum(t.numel() * t.element_size() for n, t in ref0.items()
                     if n in ref1 and t.shape == ref1[n].shape and torch.equal(t, ref1[n]))
    assert sum(r.stats.node_bytes for r in rx) == replicated > 0
    for r in rx:
        r.close()


def test_a_mate_that_stops_serving_is_pulled_around_then_left_out(node):
    """Three receivers of one node refit version 1; then one closes (its heartbeat stops) and no
    longer pulls. The other two wait out its lease, pull its share themselves in the same cycle
    (named in ``stats.node_fallbacks``), and get every byte; the next version splits between the
    two alone (no fallback, no wait)."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-r{i}", timeout=30, heartbeat_s=0.2, node=3, delta=False)
          for i in range(3)]
    want = _publish(node, 1)
    assert all(not isinstance(g, Exception) for g in cycles_on_threads(rx, 1))
    gone = rx.pop(1)
    gone.close()
    for v in (2, 3):
        want = _publish(node, v)
        t0 = time.monotonic()
        got = cycles_on_threads(rx, v)
        for g in got:
            assert not isinstance(g, Exception), g
            assert [n for n in want if not torch.equal(g[n], want[n])] == []
        fallbacks = [r.stats.node_fallbacks for r in rx]
        if v == 2:
            assert any(fallbacks) and all(m == gone.name and "stopped beating" in why for f in fallbacks for m, why in f)
        else:
            assert fallbacks == [(), ()] and time.monotonic() - t0 < 10
            assert sum(r.stats.node_bytes for r in rx) == sum(t.numel() * t.element_size() for t in want.values())
    for r in rx:
        r.close()


def test_node_mates_serve_their_replica_groups_the_whole_arena(node):
    """Two staged node-mates, each the first tier of a replica group: once a mate's copies from the other are
    in, its arena is served to its group, and each group's replica mirrors every byte of versions 1 and 2
    (of which about half came to its parent from the node-mate, not the trainers)."""
    from megarefit.online.receiver.replica import ReplicaReceiver

    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-lead{i}", timeout=30, node=2, delta=False,
                        replica_group=f"{node['job']}-g{i}") for i in range(2)]
    replicas = [ReplicaReceiver(node["rdzv"], group=f"{node['job']}-g{i}", parent=f"{node['job']}-lead{i}",
                                name=f"{node['job']}-rep{i}", timeout=30) for i in range(2)]
    for v in (1, 2):
        want = _publish(node, v)
        for g in cycles_on_threads(rx, v):
            assert not isinstance(g, Exception), g
            assert [n for n in want if not torch.equal(g[n], want[n])] == []
        assert all(r.stats.node_bytes > 0 for r in rx)
        for rep in replicas:
            mirrored = {n: t.clone() for n, t in rep.run_refit_cycle()}
            assert rep.version == v and mirrored.keys() == want.keys()
            assert [n for n in want if not torch.equal(mirrored[n], want[n])] == []
    for r in rx:
        r.close()


# ---- streamed receivers (memory_budget): a node arena each, copies by layer group -----------------
STREAM_BUDGET = 720_000  # bytes (model: 819,456): half the model (the node arena), a ring of two layers, scratch


@pytest.mark.parametrize("node", [False], indirect=True, ids=["full"])
def test_streamed_receivers_of_one_node_pull_half_each_within_their_budget(node):
    """Two streamed receivers (memory_budget below the model's size) of one node: each serves a
    node arena of its half of the shared targets and copies the other half, group by group, from
    its mate's; both get every byte of versions 1 and 2 (the second warm), each pulls about half
    from the trainers (within one tensor), and ring + scratch + node arena stay within the budget."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-s{i}", timeout=30, node=2, memory_budget=STREAM_BUDGET)
          for i in range(2)]
    total = sum(t.numel() * t.element_size() for t in node["hf"].values())
    biggest = max(t.numel() * t.element_size() for t in node["hf"].values())
    assert total > STREAM_BUDGET
    for v in (1, 2):
        want = _publish(node, v)
        for g in cycles_on_threads(rx, v):
            assert not isinstance(g, Exception), g
            assert g.keys() == want.keys() and [n for n in want if not torch.equal(g[n], want[n])] == []
        stats = [r.stats for r in rx]
        assert all(s.install == "streamed" and s.groups > 1 and s.node_fallbacks == () for s in stats)
        assert sum(s.node_bytes for s in stats) == total and abs(stats[0].node_bytes - stats[1].node_bytes) <= biggest
        assert all(s.node_bytes + s.wire_bytes == total and s.peak_extra_bytes <= STREAM_BUDGET for s in stats), \
            [(s.node_bytes, s.wire_bytes, s.peak_extra_bytes) for s in stats]
    assert [r.stats.cold for r in rx] == [False, False]
    for r in rx:
        r.close()


@pytest.mark.parametrize("node", [False], indirect=True, ids=["full"])
def test_streamed_mates_write_direct_targets_their_mate_pulled_straight_into_the_consumers_tensors(node):
    """Two streamed mates, each with direct writes (``direct=``: the consumer's own tensors) for every MLP weight
    and the embedding: those READ from the trainers or from the mate's node arena land in the consumer's tensors,
    never in the ring, and are not handed over; every byte of versions 1 and 2 is exact, across what is handed
    over and what was written directly, and each mate copies about half of the model from the other."""
    names = [n for n in node["hf"] if ".mlp." in n or "embed_tokens" in n]
    consumers = [{n: torch.zeros_like(node["hf"][n]) for n in names} for _ in range(2)]
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-d{i}", timeout=30, node=2, memory_budget=STREAM_BUDGET,
                        direct=consumers[i]) for i in range(2)]
    total = sum(t.numel() * t.element_size() for t in node["hf"].values())
    for v in (1, 2):
        want = _publish(node, v)
        for g, consumer in zip(cycles_on_threads(rx, v), consumers):
            assert not isinstance(g, Exception), g
            assert sorted(g) == sorted(set(want) - set(names))
            assert [n for n in g if not torch.equal(g[n], want[n])] == []
            assert [n for n in names if not torch.equal(consumer[n], want[n])] == []
        stats = [r.stats for r in rx]
        assert all(s.direct_bytes > 0 and s.node_fallbacks == () for s in stats)
        assert sum(s.node_bytes for s in stats) == total and all(s.node_bytes + s.wire_bytes == total for s in stats)
    for r in rx:
        r.close()


@pytest.mark.parametrize("node", [False], indirect=True, ids=["full"])
def test_a_streamed_mate_that_stops_serving_is_pulled_around_mid_stream(node):
    """Three streamed receivers refit version 1; one closes. In version 2 the other two find its
    node arena unserved at the first group holding its targets, pull those and (the later groups
    prepared again, the one in flight pulled again) the rest of its share from the trainers,
    naming it in ``stats.node_fallbacks``; every byte exact, and still within the budget;
    version 3 splits between the two alone."""
    rx = [RefitReceiver(node["rdzv"], name=f"{node['job']}-f{i}", timeout=30, heartbeat_s=0.2, node=3,
                        memory_budget=STREAM_BUDGET) for i in range(3)]
    _publish(node, 1)
    assert all(not isinstance(g, Exception) for g in cycles_on_threads(rx, 1))
    gone = rx.pop(1)
    gone.close()
    total = sum(t.numel() * t.element_size() for t in node["hf"].values())
    for v in (2, 3):
        want = _publish(node, v)
        for g in cycles_on_threads(rx, v):
            assert not isinstance(g, Exception), g
            assert [n for n in want if not torch.equal(g[n], want[n])] == []
        stats = [r.stats for r in rx]
        assert all(s.peak_extra_bytes <= STREAM_BUDGET for s in stats)
        if v == 2:  # (the group in flight when the mate failed is pulled again: more than W - node bytes)
            assert all(f and all(m == gone.name for m, _ in f) for f in (s.node_fallbacks for s in stats))
            assert all(s.node_bytes + s.wire_bytes >= total for s in stats)
        else:
            assert [s.node_fallbacks for s in stats] == [(), ()] and sum(s.node_bytes for s in stats) == total
            assert all(s.node_bytes + s.wire_bytes == total for s in stats)
    for r in rx:
        r.close()


def test_node_options_that_cannot_hold_are_refused(node):
    rx = RefitReceiver(node["rdzv"], name=f"{node['job']}-keeps", node=1)
    with pytest.raises(MegarefitError, match="node-mates READ it"):
        rx.release_memory()
    rx.close()
    direct = {"model.norm.weight": torch.empty(CFG["hidden_size"], dtype=torch.bfloat16)}
    for kw, match in (({"node": 0}, "node=0"), ({"node": 2, "direct": direct}, "direct writes need a streamed"),
                      ({"node": 2, "replica_group": "g", "memory_budget": 1 << 20}, "replica group")):
        with pytest.raises(MegarefitError, match=match):
            RefitReceiver(node["rdzv"], name=f"{node['job']}-bad", **kw)
