"""Online receiver faults, with real NIXL agents (UCX loopback) in one process.

Publishers serve reference shards (tensors in this process); a RefitReceiver
pulls them. Each bad input must raise a clear error before any tensor is yielded.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import pytest
import torch

pytest.importorskip("nixl")

from reference import reference_hf_state, reference_shards, unshard  # noqa: E402

from megarefit.errors import MegarefitError, MissingParameterError, ShapeMismatchError  # noqa: E402
from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver, StaleVersionError, VersionMismatchError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402

_JOBS = iter(range(10**6))


def _republish(rdzv, pubs, rank, edit) -> None:
    """Publish ``rank``'s manifest with each tensor entry passed through ``edit`` (``None``
    drops it) -- a trainer that lies about its tensors -- then version 1 on every rank."""
    pub = pubs[rank]
    entries = tuple(e for t in pub.manifest.tensors if (e := edit(t)) is not None)
    rdzv.publish_manifest(dataclasses.replace(pub.manifest, tensors=entries), pub.agent.metadata)
    for p in pubs.values():
        p.publish(1)


@pytest.fixture
def served(config):
    cfg = config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    shards = reference_shards(hf, cfg, tp=2, pp=1)
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in shards.items()}  # own, contiguous memory
    job = f"faults-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = {r: Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                         agent_name=f"{job}-trainer-{r[0]}")
            for r, s in shards.items()}
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=2)
    yield cfg, hf, shards, rdzv, pubs, receiver
    receiver.close()


def test_in_process_refit_matches(served):
    cfg, hf, shards, rdzv, pubs, receiver = served
    for p in pubs.values():
        p.publish(7)
    got = dict(receiver.run_refit_cycle())
    assert receiver.stats.version == 7
    assert got.keys() == hf.keys() and all(torch.equal(got[k], v) for k, v in hf.items())


def test_mixed_versions_are_refused(served):
    *_, pubs, receiver = served
    pubs[(0, 0, 0)].publish(3)
    pubs[(1, 0, 0)].publish(4)
    with pytest.raises(VersionMismatchError, match=r"\(0, 0, 0\): 3, \(1, 0, 0\): 4"):
        next(receiver.run_refit_cycle(3))
    with pytest.raises(VersionMismatchError, match="one common version"):
        next(receiver.run_refit_cycle())


def test_a_version_the_trainers_passed_fails_at_once(served):
    """Versions only move forward: a version older than one a rank already publishes can never
    be common, so the receiver says so at once, not after its whole timeout."""
    *_, pubs, receiver = served
    receiver.timeout = 60
    pubs[(0, 0, 0)].publish(4)
    pubs[(1, 0, 0)].publish(5)
    for asked, past in ((3, r"\(0, 0, 0\), \(1, 0, 0\)"), (4, r"\(1, 0, 0\)")):
        t0 = time.perf_counter()
        with pytest.raises(VersionMismatchError, match=rf"ranks {past} already publish a version newer than the "
                                                       rf"asked version {asked}.*\(0, 0, 0\): 4, \(1, 0, 0\): 5"):
            next(receiver.run_refit_cycle(asked))
        assert time.perf_counter() - t0 < 5


def test_version_moving_during_the_pull_is_caught(served):
    *_, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    execute = receiver.transport.execute

    def execute_then_step(*args, **kwargs):
        execute(*args, **kwargs)
        pubs[(1, 0, 0)].publish(2)  # the trainer stepped while we were reading

    receiver.transport.execute = execute_then_step
    with pytest.raises(StaleVersionError, match=r"\(1, 0, 0\) -> 2"):
        next(receiver.run_refit_cycle(1))


def test_a_version_waited_for_is_pulled_once(served):
    """A receiver asking for a version the trainers have not published yet waits, then pulls it
    once: the update sequences it checks after the pull are those read once the version was
    there, not those of the wait's start (each publish moves them)."""
    *_, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    receiver.timeout = 60

    def publish_2():
        time.sleep(0.3)
        for p in pubs.values():
            with p.updating(2):
                pass

    threading.Thread(target=publish_2, daemon=True).start()
    dict(receiver.run_refit_cycle(2))
    assert (receiver.stats.version, receiver.stats.retries) == (2, 0)


def test_manifest_missing_a_tensor(served):
    _, _, _, rdzv, pubs, receiver = served
    _republish(rdzv, pubs, (1, 0, 0), lambda t: None if t.name == "decoder.layers.2.mlp.linear_fc1.weight" else t)
    with pytest.raises(MissingParameterError, match=r"rank \(tp=1, pp=0, ep=0\) does not publish "
                                                    r"decoder\.layers\.2\.mlp\.linear_fc1\.weight"):
        next(receiver.run_refit_cycle(1))


def test_dtype_mismatch(served):
    _, _, _, rdzv, pubs, receiver = served
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    _republish(rdzv, pubs, (0, 0, 0),  # a consistent entry (bytes match): the plan check must catch it
               lambda t: dataclasses.replace(t, dtype="bfloat16", nbytes=t.nbytes // 2) if t.name == name else t)
    with pytest.raises(ShapeMismatchError, match=rf"rank \(tp=0, pp=0, ep=0\) publishes {name} as bfloat16 .*"
                                                 r"plan expects float32"):
        next(receiver.run_refit_cycle(1))


def test_missing_rank_times_out_naming_it(config):
    cfg = config("Llama-3.1-8B")
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    rdzv = Rendezvous.serve(job="lonely")
    Publisher({n: t.clone() for n, t in shards[(0, 0, 0)].items()}, cfg, rank=(0, 0, 0),
              layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv, agent_name="lonely-0")
    with pytest.raises(RendezvousTimeout, match=r"no manifest .*ranks \[.1\.0\.0.\]"):
        next(RefitReceiver(rdzv, name="lonely-receiver", timeout=1).run_refit_cycle())


def test_publisher_rejects_wrong_parameters(config):
    cfg = config("Llama-3.1-8B")
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    params = {n: t.clone() for n, t in shards[(1, 0, 0)].items()}
    rdzv = Rendezvous.serve(job="wrong")
    with pytest.raises(MissingParameterError, match=r"rank \(tp=1, pp=0, ep=0\) lacks .*output_layer"):
        Publisher({k: v for k, v in params.items() if k != "output_layer.weight"}, cfg, rank=(1, 0, 0),
                  layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv)
    bad = dict(params, **{"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(64, 96)})
    with pytest.raises(ShapeMismatchError, match=r"linear_fc2\.weight on rank \(tp=1, pp=0, ep=0\): expected "
                                                 r"contiguous \(64, 48\)"):
        Publisher(bad, cfg, rank=(1, 0, 0), layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv)


def test_publisher_rejects_a_rank_megatron_does_not_form():
    from megarefit.errors import LayoutError

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 8,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 20,
           "num_local_experts": 4, "intermediate_size": 4, "tie_word_embeddings": False}
    with pytest.raises(LayoutError, match=r"rank \(tp=1, pp=0, ep=0\) is not a coordinate.*\[\(0, 0, 0\), \(1, 0, 1\)\]"):
        Publisher({}, cfg, rank=(1, 0, 0), layout=source_layout(cfg, tp=2, pp=1, ep=2, etp=1), rendezvous=None)


def test_layout_change_invalidates_the_cache(served, config):
    cfg, hf, _, rdzv, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    assert all(torch.equal(t, hf[n]) for n, t in receiver.run_refit_cycle(1))
    before = dict(receiver.counters)
    # the trainer re-shards to tp=1 under the same job: rank (0, 0, 0) republishes
    hf2 = reference_hf_state(cfg, "llama", seed=5)
    single = {n: t.clone() for n, t in reference_shards(hf2, cfg, tp=1, pp=1)[(0, 0, 0)].items()}
    pub = Publisher(single, cfg, rank=(0, 0, 0), layout=source_layout(cfg, tp=1, pp=1), rendezvous=rdzv,
                    agent_name=f"{rdzv.prefix}tp1")
    pub.publish(2)
    got = dict(receiver.run_refit_cycle(2))
    assert got.keys() == hf2.keys() and all(torch.equal(got[k], v) for k, v in hf2.items())
    after = receiver.counters
    assert after["plans_built"] == before["plans_built"] + 1 and after["xfers"] == before["xfers"] + 1
    assert receiver.stats.cold


def test_restarted_trainer_with_the_same_agent_name(served):
    cfg, hf, shards, rdzv, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    list(receiver.run_refit_cycle(1))
    # rank 1 restarts: new memory, new NIXL agent under the same name, new weights
    old = pubs[(1, 0, 0)]
    # its TP-split shards change; what every TP rank holds whole (norms) stays in sync with rank 0, as in training
    fresh = {n: t.clone() if torch.equal(t, shards[(0, 0, 0)][n]) else (t * 2).contiguous()
             for n, t in shards[(1, 0, 0)].items()}
    pubs[(1, 0, 0)] = Publisher(fresh, cfg, rank=(1, 0, 0), layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                                agent_name=old.agent.name)
    for p in pubs.values():
        p.publish(2)
    got = dict(receiver.run_refit_cycle(2))
    want = unshard({(0, 0, 0): shards[(0, 0, 0)], (1, 0, 0): fresh}, hf, functools.partial(reference_shards, cfg=cfg,
                                                                                              tp=2, pp=1))
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert not torch.equal(got["model.layers.0.mlp.down_proj.weight"], hf["model.layers.0.mlp.down_proj.weight"])
    assert receiver.counters["remote_agents"] == 3 and receiver.counters["plans_built"] == 1


def _moe_served(layout: str):
    """Mixtral-like HF state and four Publishers of it (tp=2 ep=2 etp=2, ``layout`` experts)."""
    from reference import moe_hf_state, moe_reference_shards

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 8,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 20,
           "num_local_experts": 4, "intermediate_size": 4, "tie_word_embeddings": False}
    hf = moe_hf_state(cfg, "mixtral", 3)
    shards = moe_reference_shards(hf, cfg, "mixtral", tp=2, pp=1, ep=2, etp=2, layout=layout)
    job = f"faults-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in s.items()}, cfg, rank=r,
                      layout=source_layout(cfg, tp=2, pp=1, ep=2, expert_layout=layout), rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r[0]}-{r[2]}") for r, s in shards.items()]
    return hf, rdzv, pubs, job


@pytest.mark.parametrize("layout", ["sequential", "te_grouped", "legacy_grouped"])
@pytest.mark.parametrize("experts", [None, frozenset({0, 3})])
def test_expert_layouts_over_nixl(layout, experts):
    """Every expert layout pulls over NIXL from TP=2 x EP=2 publishers (expert-TP 2), and
    a receiver for vLLM expert parallelism (experts {0, 3} of 4) pulls only those
    experts plus every dense tensor. Compared with the HF state the reference sharder
    started from. Legacy GroupedMLP ``weight1`` / ``weight2`` hold per-expert
    transposed blocks: each block crosses the wire once (gate and up both cut from the
    same scratch bytes)."""
    hf, rdzv, pubs, job = _moe_served(layout)
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=5, experts=experts)
    got = dict(receiver.run_refit_cycle(1))
    owned = "0123" if experts is None else "03"
    want = {k: v for k, v in hf.items() if ".experts." not in k or k.split(".experts.")[1].split(".")[0] in owned}
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert receiver.stats.bytes_moved == sum(v.numel() * v.element_size() for v in want.values())
    # each trainer byte crosses the wire at most once: a rank's READ descriptors never overlap
    # (legacy weight1 / weight2 blocks serve gate and up from the same bytes) and stay inside
    # what the rank publishes
    prepared = receiver.transport.prepared[0]
    for pulls, pub in zip(sorted(prepared.per_source, key=lambda p: p.rank),
                          sorted(pubs, key=lambda p: p.rank)):
        spans = sorted(pulls.remote)
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), pulls.rank
        assert pulls.wire_bytes <= sum(e.nbytes for e in pub.manifest.tensors)


@pytest.mark.parametrize("layout", ["sequential", "legacy_grouped"])
@pytest.mark.parametrize(("budget", "direct_min"), [(None, 0), (None, None), (1024, None), (1024, 64)])
def test_gathered_waves_over_nixl(layout, budget, direct_min):
    """Small and strided pulls gathered into runs of trainer memory and placed by batched
    copies, in one wave or in many through two reused scratch halves (a 1 KiB budget), next
    to direct pulls (``direct_min_bytes``: 0 reads every contiguous piece straight into its
    target, 64 a mix): every layout lands bit-identical to the HF state, two cycles in a
    row, and the scratch stays within the budget (or the largest single run)."""
    hf, rdzv, pubs, job = _moe_served(layout)
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=5, scratch_budget=budget)
    if direct_min is not None:
        receiver.transport.direct_min_bytes = direct_min
    for version in (1, 2):
        for p in pubs:
            for t in p.params.values():
                t.mul_(-1)  # new weights each version (the same bytes negated)
            p.publish(version)
        got = dict(receiver.run_refit_cycle(version))
        sign = -1 if version == 1 else 1
        assert got.keys() == hf.keys() and all(torch.equal(got[k], sign * v) for k, v in hf.items())
    prepared = receiver.transport.prepared[0]
    waves = max(len(p.waves) for p in prepared.per_source)
    assert (waves > 2) == (budget is not None)
    if direct_min == 0:
        assert any(p.handle is not None for p in prepared.per_source)
    if budget is not None:
        biggest = max(n for p in prepared.per_source for w in p.waves for n in [w.nbytes])
        assert receiver.stats.scratch_bytes <= 4 * max(budget // 4, biggest) + 256 * 8
    assert receiver.stats.descriptors == sum(len(p.remote) for p in prepared.per_source)


def test_vllm_sharded_receivers_over_nixl(served):
    """Two receivers standing for vLLM tp=2 workers pull only their own parameter shards
    (vLLM names: qkv_proj, gate_up_proj, ...) over NIXL from the TP=2 publishers; each
    equals an independent cat/chunk reference of vLLM's TP layout applied to the HF
    state (tests/reference.py), and together they move about the model's bytes once."""
    from reference import vllm_reference

    from megarefit.targets import VllmTarget

    cfg, hf, shards, rdzv, pubs, _ = served
    for p in pubs.values():
        p.publish(1)
    moved = 0
    for rank in range(2):
        receiver = RefitReceiver(rdzv, name=f"{rdzv.prefix}-vllm-{rank}", timeout=5, target=VllmTarget(2, rank))
        got = {n: t.clone() for n, t in receiver.run_refit_cycle(1)}
        want = vllm_reference(hf, cfg, 2, rank)
        assert got.keys() == want.keys() and "model.layers.0.self_attn.qkv_proj.weight" in got
        assert all(torch.equal(got[k], v) for k, v in want.items())
        moved += receiver.stats.bytes_moved
    full = sum(t.numel() * t.element_size() for t in hf.values())
    assert full <= moved < 1.1 * full  # norms are pulled by both workers


def test_interleaved_pipeline_chunks_publish_as_virtual_stages(config):
    """pp=2 ranks with two model chunks each (vpp=2) publish four Publishers
    (``vp_stage=c``); a receiver pulls the whole model over NIXL, equal to the HF state the
    reference sharder started from (sharded as the pp=4 pipeline the chunks form)."""
    from megarefit.layout import virtual_stage

    cfg = config("Llama-3.1-8B", num_hidden_layers=8)
    hf = reference_hf_state(cfg, "llama")
    shards = reference_shards(hf, cfg, tp=1, pp=4)
    job = f"faults-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = []
    for pp_rank in range(2):
        for chunk in range(2):
            params = {n: t.clone() for n, t in shards[(0, virtual_stage(pp_rank, chunk, 2), 0)].items()}
            pubs.append(Publisher(params, cfg, rank=(0, virtual_stage(pp_rank, chunk, 2), 0),
                                  layout=source_layout(cfg, tp=1, pp=2, vpp=2), rendezvous=rdzv,
                                  agent_name=f"{job}-{pp_rank}-{chunk}"))
    assert sorted(p.rank.pp for p in pubs) == [0, 1, 2, 3]
    for p in pubs:
        p.publish(1)
    got = dict(RefitReceiver(rdzv, name=f"{job}-receiver", timeout=5).run_refit_cycle(1))
    assert got.keys() == hf.keys() and all(torch.equal(got[k], v) for k, v in hf.items())


def test_update_that_raised_keeps_receivers_out_until_published(served):
    """``updating`` marks the rank writing before the block; a block that raises leaves it
    so (its bytes may be half-written): a receiver refuses to pull, naming the rank, and
    the model it feeds stays untouched; the next ``publish`` (or ``updating``) ends it."""
    _, hf, _, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    assert dict(receiver.run_refit_cycle(1)).keys() == hf.keys()
    receiver.timeout = 0.3
    with pytest.raises(RuntimeError, match="optimizer blew up"):
        with pubs[(1, 0, 0)].updating(2):
            raise RuntimeError("optimizer blew up")
    with pytest.raises(StaleVersionError, match=r"still writing .*\(1, 0, 0\)"):
        next(receiver.run_refit_cycle())
    for p in pubs.values():
        p.publish(2)
    got = dict(receiver.run_refit_cycle(2))
    assert receiver.stats.version == 2 and got.keys() == hf.keys()


def _one_write_during_the_next_pull(receiver, pub):
    """The receiver's next full pull meets one write of ``pub``'s rank (the same version, its
    bytes rewritten meanwhile); returns a function that arms it again."""
    execute, armed = receiver.transport.execute, [True]

    def execute_during_a_step(*args, **kwargs):
        execute(*args, **kwargs)
        if armed[0]:
            armed[0] = False
            with pub.updating(1):
                pass

    receiver.transport.execute = execute_during_a_step
    return lambda: armed.__setitem__(0, True)


def test_overlapping_write_is_retried_then_accepted(served):
    """A rank that writes during the pull (its update sequence moves) is caught at the
    fence; the cycle pulls again and succeeds (``stats.retries`` counts it); with
    ``retries=0`` the same overlap raises StaleVersionError naming the rank."""
    _, hf, _, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    arm = _one_write_during_the_next_pull(receiver, pubs[(0, 0, 0)])
    got = dict(receiver.run_refit_cycle(1))
    assert got.keys() == hf.keys() and receiver.stats.retries == 1
    receiver.retries = 0
    arm()
    with pytest.raises(StaleVersionError, match=r"wrote their weights during the pull .*\(0, 0, 0\)"):
        next(receiver.run_refit_cycle(1))


def test_wait_receivers_waits_for_every_live_receiver(served):
    """Every registered receiver must acknowledge: with two, ``wait_receivers`` names the
    one that has not; once both installed and acknowledged it returns. A receiver whose
    heartbeat stops (a killed process) is dropped after its lease; a restarted one
    (same name) is listed once."""
    from megarefit.online.store.rendezvous import RendezvousTimeout

    _, hf, _, rdzv, pubs, first = served
    second = RefitReceiver(rdzv, name=first.name + "-b", timeout=2, heartbeat_s=0.05)
    pub = pubs[(0, 0, 0)]
    for p in pubs.values():
        p.publish(1)
    assert dict(first.run_refit_cycle(1)).keys() == hf.keys()
    first.acknowledge()
    with pytest.raises(RendezvousTimeout, match=rf"version 1 .*{second.name} \(last acknowledged None\)"):
        pub.wait_receivers(1, timeout=0.3)
    dict(second.run_refit_cycle(1))
    second.acknowledge()
    assert pub.wait_receivers(1, timeout=5) == {first.name: "acked", second.name: "acked"}
    for p in pubs.values():
        p.publish(2)
    dict(first.run_refit_cycle(2))
    first.acknowledge()
    second.close()  # dies before pulling version 2: dropped once its lease expires
    t0 = time.monotonic()
    assert pub.wait_receivers(2, timeout=10, lease=0.5) == {first.name: "acked", second.name: "dropped"}
    assert time.monotonic() - t0 >= 0.5
    again = RefitReceiver(rdzv, name=second.name, timeout=2)  # restarted under its old name
    assert rdzv.receivers() == [first.name, second.name]
    again.close()


def test_snapshot_publisher_serves_the_published_copy(config):
    """``Publisher(snapshot=True)`` serves a registered copy, not the live parameters:
    training may rewrite them after ``publish(v)`` and a refit still gets version v's
    bytes; the next ``publish`` refreshes the copy (the live tensors are never registered)."""
    cfg = config("Llama-3.1-8B")
    hf = reference_hf_state(cfg, "llama")
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    job = f"faults-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = {r: Publisher(s, cfg, rank=r, layout=source_layout(cfg, tp=2, pp=1), rendezvous=rdzv,
                         agent_name=f"{job}-trainer-{r[0]}", snapshot=True) for r, s in shards.items()}
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=2)
    for p in pubs.values():
        assert not {e.addr for e in p.manifest.tensors} & {t.data_ptr() for t in p.params.values()}
        p.publish(1)
    for s in shards.values():
        for t in s.values():
            t.mul_(-1)  # training goes on: version 2 in the live parameters, not yet published
    got = dict(receiver.run_refit_cycle(1))
    assert all(torch.equal(got[k], v) for k, v in hf.items())
    for p in pubs.values():
        p.publish(2)
    got = dict(receiver.run_refit_cycle(2))
    assert all(torch.equal(got[k], -v) for k, v in hf.items())
    receiver.close()


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_release_memory_frees_the_buffers_and_the_next_cycle_allocates_again(served, budget):
    """Between refits a colocated receiver gives its arena / ring and scratch back; the next
    cycle allocates and prepares again (cold), without planning again, and pulls the same bytes."""
    cfg, hf, shards, rdzv, pubs, _ = served
    receiver = RefitReceiver(rdzv, name=f"{rdzv.job}-release-{budget}", timeout=5, memory_budget=budget)
    try:
        for p in pubs.values():
            p.publish(3)
        first = {k: t.clone() for k, t in receiver.run_refit_cycle(3)}
        held = receiver.stats.peak_extra_bytes
        registrations = receiver.counters["registrations"]
        assert receiver.release_memory() == held > 0
        assert receiver.release_memory() == 0  # nothing left to free
        again = {k: t.clone() for k, t in receiver.run_refit_cycle(3)}
        assert receiver.stats.cold and receiver.plans_built == 1
        assert receiver.counters["registrations"] > registrations  # registered anew
        assert again.keys() == first.keys() == hf.keys()
        assert all(torch.equal(again[k], hf[k]) for k in hf)
    finally:
        receiver.close()


# ---- prefetch: pulled and fenced on a thread, handed over later without pulling again ----------
def _settled(receiver, timeout: float = 30.0):
    """The receiver's prefetch state once it is no longer pulling."""
    deadline = time.monotonic() + timeout
    while receiver.prefetched.phase == "pulling" and time.monotonic() < deadline:
        time.sleep(0.005)
    return receiver.prefetched


def _counting(receiver) -> list[int]:
    """Count the receiver's full pulls (``transport.execute`` calls)."""
    calls = [0]
    execute = receiver.transport.execute

    def counted(*args, **kwargs):
        calls[0] += 1
        return execute(*args, **kwargs)

    receiver.transport.execute = counted
    return calls


def test_a_prefetched_version_is_handed_over_from_the_arena(served):
    """Once fenced, the prefetch holds version 1 in the receiver's own memory: the trainers
    then overwrite their shards (version 2), and the refit of 1 still hands over exactly the
    reference weights of 1, without a new pull."""
    _, hf, shards, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    calls = _counting(receiver)
    assert receiver.prefetch(1).phase in ("pulling", "ready")
    assert receiver.prefetch(1).version == 1  # asked again: the same prefetch
    state = _settled(receiver)
    assert (state.phase, state.pulled, state.retries, calls[0]) == ("ready", 1, 0, 1), state
    for rank, pub in pubs.items():
        with pub.updating(2):
            for t in shards[rank].values():
                t.add_(1.0)
    got = dict(receiver.run_refit_cycle(1))
    assert calls[0] == 1 and receiver.prefetched is None and receiver.stats.version == 1
    assert got.keys() == hf.keys() and all(torch.equal(got[k], v) for k, v in hf.items())
    got = dict(receiver.run_refit_cycle(2))  # nothing prefetched: pulled
    assert calls[0] == 2 and all(torch.equal(got[k], v + 1.0) for k, v in hf.items())


@pytest.mark.parametrize("asked", [1, None])
def test_a_refit_of_another_version_never_takes_the_prefetch(served, asked):
    """A prefetch holding version 1 (asked as 1, or as the latest) is not handed over by a refit
    of version 2: that refit drops it and pulls version 2 (the trainers' new bytes)."""
    _, hf, shards, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    calls = _counting(receiver)
    receiver.prefetch(asked)
    assert _settled(receiver).pulled == 1 and calls[0] == 1
    for rank, pub in pubs.items():
        with pub.updating(2):
            for t in shards[rank].values():
                t.add_(1.0)
    got = dict(receiver.run_refit_cycle(2))
    assert receiver.stats.version == 2 and not receiver.stats.prefetched and calls[0] == 2
    assert receiver.prefetched is None
    assert got.keys() == hf.keys() and all(torch.equal(got[k], v + 1.0) for k, v in hf.items())


def test_a_write_during_the_prefetch_is_pulled_again_before_the_handover(served):
    """A rank writing during the prefetch's pull is caught by the fence on the thread and
    pulled again there (``retries``); the handed-over tensors are whole."""
    _, hf, _, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    _one_write_during_the_next_pull(receiver, pubs[(0, 0, 0)])
    receiver.prefetch(1)
    state = _settled(receiver)
    assert (state.phase, state.retries) == ("ready", 1), state
    got = dict(receiver.run_refit_cycle(1))
    assert receiver.stats.retries == 1 and all(torch.equal(got[k], v) for k, v in hf.items())


def test_a_prefetch_returns_at_once_and_waits_for_its_version(served):
    """``prefetch`` returns while the version is not published; the thread waits for it.
    A prefetch that fails (never published) is dropped: the refit pulls afresh (and fails the same way);
    a prefetch of another version is dropped and the asked one pulled."""
    _, hf, _, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    receiver.timeout = 30
    t0 = time.perf_counter()
    assert receiver.prefetch(2).phase == "pulling"
    assert time.perf_counter() - t0 < 1.0
    for p in pubs.values():
        p.publish(2)
    assert _settled(receiver).pulled == 2
    assert dict(receiver.run_refit_cycle(2)).keys() == hf.keys()
    receiver.timeout = 0.3
    receiver.prefetch(3)
    assert _settled(receiver).phase == "failed"
    assert "3" in receiver.prefetched.error
    with pytest.raises(VersionMismatchError, match="version 3"):
        next(receiver.run_refit_cycle(3))
    receiver.prefetch(5)  # dropped by the refit of 2
    _settled(receiver)
    calls = _counting(receiver)
    assert dict(receiver.run_refit_cycle(2)).keys() == hf.keys() and calls[0] == 1


def test_a_prefetch_prepares_the_whole_fenced_version_for_the_refit_that_takes_it(served):
    """``prepare`` runs on the thread once the version is fenced, with every (name, arena view):
    what it returns is the receiver's ``prepared`` during the refit that takes the prefetch,
    whose tensors are those very views; a refit that pulls afresh has none. A ``prepare`` that
    raises fails the prefetch (its error said), and the refit pulls afresh."""
    _, hf, _, _, pubs, receiver = served
    for p in pubs.values():
        p.publish(1)
    seen = []

    def prepare(views):
        seen.append([(n, t.data_ptr(), t.clone()) for n, t in views])
        return "prepared-1"

    receiver.prefetch(1, prepare)
    assert _settled(receiver).phase == "ready" and receiver.prepared is None  # not taken yet
    assert sorted(n for n, _, _ in seen[0]) == sorted(hf) and all(torch.equal(t, hf[n]) for n, _, t in seen[0])
    got = list(receiver.run_refit_cycle(1))
    assert receiver.prepared == "prepared-1"
    assert [(n, t.data_ptr()) for n, t in got] == [(n, p) for n, p, _ in seen[0]]  # the views prepared
    calls = _counting(receiver)
    assert dict(receiver.run_refit_cycle(1)).keys() == hf.keys() and calls[0] == 1 and receiver.prepared is None

    def fails(views):
        raise RuntimeError("cannot prepare")

    receiver.prefetch(1, fails)
    assert "RuntimeError: cannot prepare" in _settled(receiver).error
    got = dict(receiver.run_refit_cycle(1))
    assert calls[0] == 3 and receiver.prepared is None and all(torch.equal(got[k], v) for k, v in hf.items())


def test_a_streamed_receiver_refuses_to_prefetch(served):
    *_, rdzv, _, receiver = served
    streamed = RefitReceiver(rdzv, name=receiver.name + "-streamed", timeout=2, memory_budget=1 << 26)
    with pytest.raises(MegarefitError, match="streamed .* prefetch needs a staged receiver"):
        streamed.prefetch(1)
    streamed.close()
