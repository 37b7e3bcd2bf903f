"""Trainers that move their parameters between steps (issue 59): a declared move
(``Publisher.moving`` / ``params_moved``) re-registers only the moved buffers and republishes
only the moved ranks' manifests; receivers keep their plans and caches and refit the next
version bit-exactly. A move nobody declared is still refused, naming the tensor and the fix.

Real Megatron-Core GPT shards (tp 2, gloo, CPU) behind Megatron-Core DDP in two processes, real
NIXL (UCX on loopback), their parameter buffers moved the way verl's Megatron offload moves them
(``storage().resize_(0)``, re-allocated elsewhere, refilled) and the way torch_memory_saver does
(fresh pages mapped at the same addresses; :mod:`megarefit.demo.offload`). The oracle of every
pulled HF tensor is the trainers' own parameters of that version put back through the
independent reference sharder (tests/reference.py). Which tensors and ranks move: drawn
(hypothesis) against in-process publishers.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from conftest import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_hf_state, reference_shards, unshard

from megarefit.demo.workers import start_workers
from megarefit.errors import MegarefitError, ShapeMismatchError
from megarefit.layout import RankCoord
from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver
from megarefit.online.store.copy_fence import rank_key
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout
from megarefit.online.trainer.publisher import Publisher

pytestmark = pytest.mark.megatron

CFG = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
STEPS = ["none", "offload", "remap", "undeclared", "offload-rank0"]  # the move before versions 2 .. 6
V = {how: v for v, how in enumerate(STEPS, start=2)}


def _oracle(shards: dict, like: dict[str, torch.Tensor], cfg: dict = CFG) -> dict[str, torch.Tensor]:
    """The HF tensors the trainers' shards ``{rank: {megatron name: tensor}}`` are (reference sharder)."""
    return unshard(shards, like, lambda hf: reference_shards(hf, cfg, tp=2, pp=1))


@pytest.fixture(scope="module")
def run():
    """Both trainers' results, every version's pull and the receiver's counters after it."""
    from moved_jobs import moved_trainer_job

    job = "moved-megatron"
    rdzv = Rendezvous.serve(job=job)
    group = start_workers(moved_trainer_job, world_size=2, args=(rdzv.port, job, CFG, STEPS))
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=10)
    pulls, counters, plans, records = {}, {}, {}, {}
    ranks = [RankCoord(0, 0, 0), RankCoord(1, 0, 0)]
    try:
        for v in range(1, len(STEPS) + 2):
            for _ in range(30):
                try:
                    pulls[v] = {n: t.clone() for n, t in receiver.run_refit_cycle(v)}
                    break
                except RendezvousTimeout:
                    group.check()  # a trainer that failed is named at once
            counters[v] = dict(receiver.counters)
            plans[v] = (id(receiver.plan), tuple(t.data_ptr() for t in receiver._memory.arenas.values()))
            records[v] = {r: (rdzv.generations([r])[r], rdzv.fetch("nixl/" + rank_key(r))) for r in ranks}
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
    finally:
        for v in range(1, len(STEPS) + 2):  # trainers waiting on a failed run exit
            rdzv.store.set(f"{rdzv.prefix}pulled/{v}", "1")
        per_rank = group.join(300)
        receiver.close()
    return per_rank, pulls, counters, plans, records


def _exact(run, v: int) -> None:
    per_rank, pulls, *_ = run
    want = _oracle({r["rank"]: r["params"][v] for r in per_rank}, pulls[v])
    differ = [n for n in want if not torch.equal(pulls[v][n], want[n])]
    assert differ == [], f"version {v}: {len(differ)} tensors differ from the trainers' weights, e.g. {differ[:3]}"


def test_every_version_refits_bit_exact_on_one_plan(run):
    """Versions 1 .. 6 (cold, warm, and after each kind of move): every pulled HF tensor equals
    the trainers' weights of that version through the reference sharder; the receiver built one
    plan and kept it (the same plan object) and its arenas (same addresses) through every move;
    each version differs from the last."""
    _, pulls, counters, plans, _ = run
    for v in pulls:
        _exact(run, v)
    assert [counters[v]["plans_built"] for v in pulls] == [1] * len(pulls)
    assert len(set(plans.values())) == 1
    for v in list(pulls)[1:]:
        assert all(not torch.equal(pulls[v][n], pulls[v - 1][n]) for n in pulls[v]), v


def test_verl_offload_declared_moves_every_buffer_and_reloads_both_ranks(run):
    """verl's offload (storage resized to 0, re-allocated elsewhere, refilled) declared with
    ``pub.moving()``: every parameter buffer came back at a new address, each rank re-registered
    every tensor it serves (what it dropped is what it registered again) and republished; the
    receiver re-loaded the NIXL metadata of exactly the two ranks and nothing else was set up
    again on its side (no registration, no plan)."""
    per_rank, _, counters, _, records = run
    v = V["offload"]
    for r in per_rank:
        moves = r["addresses"][0]
        assert moves and all(old != new for old, new in moves), moves
        stats = r["moves"][0]
        assert stats["republished"] and stats["moved"] == stats["served"], stats
        assert stats["dropped"] == stats["registered"] > 0, stats
    assert all(records[v][r] != records[v - 1][r] for r in records[v])  # new generation and metadata
    assert counters[v]["remote_agents"] - counters[v - 1]["remote_agents"] == 2
    assert counters[v]["registrations"] == counters[v - 1]["registrations"]


def test_memory_saver_remap_declared_reregisters_at_the_same_addresses(run):
    """torch_memory_saver's pause / resume (fresh pages at the same addresses; the offload
    helper checks the old values were gone) declared with ``moving(remapped=True)``: addresses
    unchanged, every served tensor re-registered and both ranks republished (new generations).
    The receiver re-loads a rank's NIXL metadata exactly where the record changed: on CPU, UCX's
    memory keys for host memory carry no registration-specific key, so the re-registration at the
    same addresses leaves the record byte-identical and nothing is re-loaded (with RDMA the
    memory keys change, and so does the record)."""
    per_rank, _, counters, _, records = run
    v = V["remap"]
    for r in per_rank:
        moves = r["addresses"][1]
        assert moves and all(old == new for old, new in moves), moves
        stats = r["moves"][1]
        assert stats["republished"] and stats["moved"] == stats["served"], stats
        assert stats["dropped"] == stats["registered"] > 0, stats
    assert all(records[v][r][0] != records[v - 1][r][0] for r in records[v])  # both republished
    changed = sum(records[v][r][1] != records[v - 1][r][1] for r in records[v])
    assert counters[v]["remote_agents"] - counters[v - 1]["remote_agents"] == changed


def test_undeclared_move_is_refused_naming_the_tensor_and_the_fix(run):
    """verl's offload with no declaration: ``publish`` refuses, naming a moved tensor, the rank,
    both addresses and the fix (``pub.moving()`` / ``pub.params_moved()``); declared after the
    fact, the version refits bit-exactly (test_every_version_...)."""
    per_rank, *_ = run
    for r in per_rank:
        msg = r["refused"]
        assert msg is not None, "the undeclared move was published"
        assert "moved since registration" in msg and "no move was declared" in msg, msg
        assert "decoder.layers." in msg or "embedding." in msg or "output_layer." in msg, msg
        tp, pp, ep = r["rank"][:3]
        assert "pub.moving()" in msg and "pub.params_moved()" in msg and f"rank (tp={tp}, pp={pp}, ep={ep})" in msg, msg
        assert all(old != new for old, new in r["addresses"][2])


def test_only_the_moved_rank_is_reloaded(run):
    """Only rank 0 offloads before version 6: only it republishes; the receiver re-loads one
    rank's metadata."""
    per_rank, _, counters, _, records = run
    v = V["offload-rank0"]
    r0, r1 = sorted(records[v])
    assert records[v][r0][0] != records[v - 1][r0][0] and records[v][r1] == records[v - 1][r1]
    assert counters[v]["remote_agents"] - counters[v - 1]["remote_agents"] == 1
    r0 = next(r for r in per_rank if r["rank"][0] == 0)
    assert len(r0["moves"]) == 3 and len(next(r for r in per_rank if r["rank"][0] == 1)["moves"]) == 2


def test_a_warm_cycle_sets_nothing_up_again(run):
    """Version 2 (no move): no metadata re-loaded, no registration, no plan."""
    _, _, counters, _, _ = run
    v = V["none"]
    for key in ("remote_agents", "registrations", "plans_built", "xfers"):
        assert counters[v][key] == counters[v - 1][key], key


# ---- which tensors move: drawn, against in-process publishers -----------------------------------

QWEN = tiny_config("Qwen3-0.6B", tie_word_embeddings=False)
_JOBS = itertools.count()


@pytest.fixture(scope="module")
def served():
    """Two in-process publishers (tp 2, the reference sharder's shards of random HF weights), a
    receiver that pulled version 1, and the version counter."""
    job = f"moved-drawn-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    shards = reference_shards(reference_hf_state(QWEN, "qwen3"), QWEN, tp=2, pp=1)
    pubs = [Publisher({n: t.clone() for n, t in s.items()}, QWEN, rank=r, layout=source_layout(QWEN, tp=2, pp=1),
                      rendezvous=rdzv, agent_name=f"{job}-t{r[0]}") for r, s in shards.items()]
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-rx", timeout=10)
    dict(receiver.run_refit_cycle(1))
    state = {"version": 1, "rdzv": rdzv, "pubs": pubs, "receiver": receiver}
    yield state
    receiver.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drawn_moves_refit_exact_and_reload_only_moved_ranks(served, data):
    """A drawn subset of each rank's tensors moves (``p.data`` re-allocated elsewhere) and another
    is declared re-mapped in place; then a step and the next version. The receiver's pull equals
    the trainers' tensors through the reference sharder; exactly the ranks that moved anything
    republished (new generation); the receiver re-loads the NIXL metadata of exactly the ranks
    whose record changed and keeps its one plan; each manifest names every tensor where it is now."""
    rdzv, pubs, receiver = served["rdzv"], served["pubs"], served["receiver"]
    moved_ranks, hold = set(), []
    before = {p.rank: (rdzv.generations([p.rank])[p.rank], rdzv.fetch("nixl/" + rank_key(p.rank))) for p in pubs}
    for pub in pubs:
        names = sorted(pub.params)
        move = data.draw(st.sets(st.sampled_from(names), max_size=len(names)), label=f"move {pub.rank.tp}")
        remap = data.draw(st.sets(st.sampled_from(names), max_size=3), label=f"remap {pub.rank.tp}")
        for n in move:
            hold.append(pub.params[n].data)  # the old memory stays taken: the copy lands elsewhere
            pub.params[n].data = pub.params[n].data.clone()
        stats = pub.params_moved(remapped=remap)
        assert set(move) | set(remap) <= set(stats.moved) and stats.republished == bool(move or remap)
        if move or remap:
            moved_ranks.add(pub.rank)
    agents = receiver.counters["remote_agents"]
    served["version"] += 1
    v = served["version"]
    for pub in pubs:
        for t in pub.params.values():
            t.add_(float(v))
        pub.publish(v)
    got = {n: t.clone() for n, t in receiver.run_refit_cycle(v)}
    want = _oracle({tuple(p.rank)[:3]: p.params for p in pubs}, got, QWEN)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    after = {p.rank: (rdzv.generations([p.rank])[p.rank], rdzv.fetch("nixl/" + rank_key(p.rank))) for p in pubs}
    assert {r for r in after if after[r][0] != before[r][0]} == moved_ranks  # only they republished
    reloaded = sum(after[r][1] != before[r][1] for r in after)  # (host memory re-registered in place: same record)
    assert receiver.counters["remote_agents"] - agents == reloaded
    assert receiver.counters["plans_built"] == 1
    for pub in pubs:
        assert all(e.addr == pub.params[e.name].data_ptr() for e in pub.manifest.tensors)
    del hold


def test_moves_a_publisher_cannot_follow_are_refused(served):
    """A ``remapped`` name the publisher does not serve, ``params=`` lacking a served tensor or
    changing a shape: refused before anything is re-registered, naming the tensor."""
    pub = served["pubs"][0]
    with pytest.raises(MegarefitError, match="not live parameters"):
        pub.params_moved(remapped=["decoder.layers.0.no_such.weight"])
    name = min(pub.params)
    with pytest.raises(MegarefitError, match=name):
        pub.params_moved(params={n: t for n, t in pub.params.items() if n != name})
    with pytest.raises(ShapeMismatchError, match=name):
        pub.params_moved(params={**pub.params, name: torch.zeros(3)})
    served["version"] += 1
    pub.publish(served["version"])  # the rank was marked writing by the refused calls: publishing ends it
    served["pubs"][1].publish(served["version"])


def test_a_tensor_moved_out_of_a_shared_buffer_leaves_its_neighbours_registered():
    """Parameters that are views of one flat buffer per rank (registered as one region, as
    Megatron's DDP buffer is): one moves out of it (``p.data`` re-allocated elsewhere). The
    buffer's region is dropped, so its neighbours, which stayed, are registered again with it:
    every manifest entry lies in a registered region of the agent, and the refit is exact."""
    job = f"moved-flat-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    shards = reference_shards(reference_hf_state(QWEN, "qwen3", seed=1), QWEN, tp=2, pp=1)
    pubs = []
    for r, s in shards.items():
        flat = torch.cat([t.reshape(-1) for t in s.values()])
        views, at = {}, 0
        for n, t in s.items():
            views[n], at = flat[at:at + t.numel()].view(t.shape), at + t.numel()
        pubs.append(Publisher(views, QWEN, rank=r, layout=source_layout(QWEN, tp=2, pp=1), rendezvous=rdzv,
                              agent_name=f"{job}-t{r[0]}"))
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-rx", timeout=10)
    try:
        dict(receiver.run_refit_cycle(1))
        pub = pubs[0]
        name = sorted(pub.params)[len(pub.params) // 2]
        pub.params[name].data = pub.params[name].data.clone()
        stats = pub.params_moved()
        assert name in stats.moved and len(stats.moved) == len(pub.params)  # its neighbours lost the region too
        for p in pubs:
            p.publish(2)
            assert all(e.region >= 0 and p.agent.region(e.addr, e.nbytes) is not None for e in p.manifest.tensors)
        got = {n: t.clone() for n, t in receiver.run_refit_cycle(2)}
        want = _oracle({tuple(p.rank)[:3]: p.params for p in pubs}, got, QWEN)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []
    finally:
        receiver.close()
