"""Streamed refits (``RefitReceiver(memory_budget=...)``), with real NIXL agents (UCX loopback).

A streamed receiver pulls groups of whole layers through one bounded ring and hands each group
over as it lands. Its tensors must equal, bit for bit, what a staged receiver hands over and,
for a whole-model receiver, the HF tensors the reference sharder sharded (block-FP8: as vLLM's
own quantizer makes them), with a budget under 10% of the share; the receiver's extra memory (ring + scratch, as
it counts it and as its ring and scratch tensors measure) stays within the budget.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl")

from moe_cases import moe_config  # noqa: E402
from reference import (  # noqa: E402
    moe_hf_state,
    moe_reference_shards,
    reference_hf_state,
    reference_shards,
    vllm_fp8_checkpoint,  # noqa: E402
)

from megarefit.layout.megatron_model import source_layout
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.receiver.receiver import TornUpdateError  # noqa: E402
from megarefit.online.receiver.stream import MemoryBudgetError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402

_JOBS = iter(range(10**6))
LAYERS = 32  # a layer is ~3% of the share: a budget under 10% holds a ring of two layers


def _serve(cfg, shards, tp, ep=1, quantization=None):
    job = f"stream-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in s.items()}, cfg, rank=r, layout=source_layout(cfg, tp=tp, pp=1, ep=ep),
                      rendezvous=rdzv, agent_name=f"{job}-t{'.'.join(map(str, r))}", quantization=quantization)
            for r, s in shards.items()]
    return job, rdzv, pubs


def _pull(receiver, version):
    """Every handed-over tensor, copied before the next is asked for (the streamed contract)."""
    return [(name, t.clone()) for name, t in receiver.run_refit_cycle(version)]


def _share(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def _cases(config):
    dense = config("Llama-3.1-8B", num_hidden_layers=LAYERS)
    hf = reference_hf_state(dense, "llama")
    moe = moe_config("Qwen3-30B-A3B", num_hidden_layers=LAYERS, mlp_only_layers=[])
    moe_hf = moe_hf_state(moe, "qwen3_moe")
    return {
        "dense-hf": (dense, hf, 2, 1, None, None),
        "dense-vllm-tp2": (dense, hf, 2, 1, VllmTarget(2, 1), None),
        "moe-ep2": (moe, moe_hf, 1, 2, None, None),
        "dense-fp8": (config("Llama-3.1-8B", num_hidden_layers=2 * LAYERS, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64), None, 2, 1, None, "fp8"),
    }


@pytest.mark.parametrize("case", ["dense-hf", "dense-vllm-tp2", "moe-ep2", "dense-fp8"])
def test_streamed_equals_staged_and_the_offline_translation(config, case):
    cfg, hf, tp, ep, target, quantization = _cases(config)[case]
    if hf is None:  # FP8: 128x128 blocks need larger dims
        hf = reference_hf_state(cfg, "llama")
    shards = (moe_reference_shards(hf, cfg, "qwen3_moe", tp=tp, pp=1, ep=ep, etp=1) if ep > 1
              else reference_shards(hf, cfg, tp=tp, pp=1))
    job, rdzv, pubs = _serve(cfg, shards, tp, ep, quantization)
    staged = RefitReceiver(rdzv, name=f"{job}-staged", timeout=60, target=target)
    for p in pubs:
        p.publish(1)
    want = _pull(staged, 1)
    share = _share(want)
    budget = int(0.09 * share)
    streamed = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=60, target=target, memory_budget=budget)
    for cycle in range(2):  # cold, then warm (groups, ring and READs prepared once)
        got = _pull(streamed, 1)
        assert [n for n, _ in got] == [n for n, _ in want]  # same names, same order
        for (name, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        stats = streamed.stats
        assert stats.install == "streamed" and stats.groups > 4 and stats.cold == (cycle == 0)
        ring = streamed._stream
        measured = ring.ring.numel() + streamed.transport.scratch_allocated
        assert stats.peak_extra_bytes == measured <= budget < 0.1 * share
    if target is None:  # the model the shards were made from: no NIXL, no ring, no megarefit layout code
        offline = hf if quantization is None else vllm_fp8_checkpoint(
            hf, {n for n in hf if n.endswith("_proj.weight")})  # every attention / MLP projection, 128x128 blocks
        assert {n for n, _ in got} == set(offline)
        for name, t in got:
            assert torch.equal(t.view(torch.uint8), offline[name].view(torch.uint8)), name
    staged.close()
    streamed.close()


def test_the_next_group_is_pulled_while_a_group_is_installed(config):
    """While the consumer installs group k, group k + 1's READs are already posted (their ring
    bytes are at the other end), and group k + 2's are not (they would land on group k)."""
    cfg = config("Llama-3.1-8B", num_hidden_layers=LAYERS)
    job, rdzv, pubs = _serve(cfg, reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1), 2)
    for p in pubs:
        p.publish(1)
    staged = RefitReceiver(rdzv, name=f"{job}-staged", timeout=60)
    want = _pull(staged, 1)
    receiver = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=60, memory_budget=int(0.09 * _share(want)))
    started = []
    start = receiver.transport.start
    receiver.transport.start = lambda prepared, **kw: (started.append(prepared), start(prepared, **kw))[1]
    for cycle in range(2):
        started.clear()
        seen = [(name, len(started), t.clone()) for name, t in receiver.run_refit_cycle(1)]
        groups = receiver._stream.groups
        assert len(groups) > 4 and not any(a.overlaps(b) for a, b in zip(groups, groups[1:]))
        group_of = {ref.name: k for k, g in enumerate(groups) for ref in g.plan.targets}
        for name, posted, _ in seen:
            k = group_of[name]
            assert posted == min(k + 2, len(groups)), (cycle, name, k, posted)
        assert [n for n, _, _ in seen] == [n for n, _ in want]
        for (name, _, a), (_, b) in zip(seen, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    receiver.close()
    staged.close()


def test_direct_writes_land_in_the_consumers_tensors(config):
    """``direct``: every MLP weight is READ straight into the consumer's own tensors (no ring
    bytes, never handed over); the rest streams through the ring and is copied. The consumer
    ends equal to a staged receiver's tensors, for two versions; bad direct tensors are named."""
    from megarefit.errors import MegarefitError, MissingParameterError, ShapeMismatchError

    cfg = config("Llama-3.1-8B", num_hidden_layers=8)
    hf = reference_hf_state(cfg, "llama")
    job, rdzv, pubs = _serve(cfg, reference_shards(hf, cfg, tp=2, pp=1), 2)
    for p in pubs:
        p.publish(1)
    staged = RefitReceiver(rdzv, name=f"{job}-staged", timeout=60)
    want = dict(_pull(staged, 1))
    model = {n: torch.zeros_like(t) for n, t in want.items()}
    direct = {n: t for n, t in model.items() if ".mlp." in n}
    budget = int(0.3 * _share(want.items()))
    with pytest.raises(MegarefitError, match="need a streamed refit"):
        RefitReceiver(rdzv, name=f"{job}-bad", direct=direct)
    rx = RefitReceiver(rdzv, name=f"{job}-direct", timeout=60, memory_budget=budget, direct=direct)
    plain = RefitReceiver(rdzv, name=f"{job}-plain", timeout=60, memory_budget=budget)
    plain.refit(lambda w: [None for _ in w], 1)
    for version in (1, 2):
        if version == 2:
            for p, (r, s) in zip(pubs, reference_shards({n: t * 2 for n, t in hf.items()}, cfg, tp=2, pp=1).items()):
                with p.updating(2):
                    for n, t in s.items():
                        p.params[n].copy_(t)
            want = dict(_pull(staged, 2))
        handed = []

        def install(weights):
            for name, t in weights:
                handed.append(name)
                model[name].copy_(t)

        stats = rx.refit(install, version)
        assert not set(handed) & set(direct) and set(handed) | set(direct) == set(want)
        assert all(torch.equal(model[n], want[n]) for n in want)
        assert stats.direct_bytes == sum(t.numel() * t.element_size() for t in direct.values()) > 0
        assert stats.groups < plain.stats.groups  # the ring holds no MLP weight: fewer, fuller groups
        assert stats.peak_extra_bytes <= budget
    rx.set_direct({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ShapeMismatchError, match="up_proj"):
        rx.refit(install, 2)
    rx.set_direct({"model.layers.0.mlp.nope.weight": torch.zeros(3, 3)})
    with pytest.raises(MissingParameterError, match="nope"):
        rx.refit(install, 2)
    for r in (rx, plain, staged):
        r.close()


def test_a_write_during_a_streamed_cycle_is_reported_as_torn(config):
    cfg = config("Llama-3.1-8B", num_hidden_layers=LAYERS)
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    job, rdzv, pubs = _serve(cfg, shards, 2)
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=10, memory_budget="auto")
    cycle = receiver.run_refit_cycle(1)
    next(cycle)  # the consumer installed a first tensor of version 1
    with pubs[1].updating(2):  # then trainer rank 1 steps, mid-cycle
        pass
    with pytest.raises(TornUpdateError, match="mix of versions"):
        for _ in cycle:
            pass
    receiver.close()


def _step(pub, version: int) -> None:
    """Trainer rank ``pub`` steps to ``version``: every element of its shards becomes ``version``."""
    with pub.updating(version):
        for t in pub.params.values():
            t.fill_(version)


def _versions_held(model: dict[str, torch.Tensor]) -> set[float]:
    return {float(v) for t in model.values() for v in t.unique().tolist()}


def test_a_torn_streamed_cycle_is_pulled_again_whole(config):
    """A rank steps while groups are being installed: ``refit`` installs the whole cycle again
    (``stats.retries``), so the consumer ends on one version, all of it; with ``retries=0``
    the same write raises TornUpdateError, and the consumer really holds a mix."""
    cfg = config("Llama-3.1-8B", num_hidden_layers=8)
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    job, rdzv, pubs = _serve(cfg, shards, 2)
    for p in pubs:
        _step(p, 1)
    receiver = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=10, memory_budget=300_000)
    model: dict[str, torch.Tensor] = {}
    steps = iter([2])

    def install(weights):
        for i, (name, t) in enumerate(weights):
            model[name] = t.clone()
            if i == 0 and (v := next(steps, None)) is not None:  # both ranks step after the first tensor
                for p in pubs:
                    _step(p, v)

    stats = receiver.refit(install)
    assert stats.retries == 1 and stats.version == 2 and stats.groups > 2
    assert _versions_held(model) == {2.0} and len(model) == len(receiver.plan.targets)
    receiver.retries, steps = 0, iter([3])
    with pytest.raises(TornUpdateError, match="mix of versions"):
        receiver.refit(install)
    assert _versions_held(model) == {2.0, 3.0}  # what the error says: a mix
    assert receiver.refit(install).version == 3 and _versions_held(model) == {3.0}
    receiver.close()


def test_writers_stepping_during_streamed_cycles_never_leave_a_mix(config):
    """Two trainer ranks step continually (every element = the version) while a streamed
    receiver refits into a model: every refit that returns leaves one version, whole; a torn
    one that runs out of retries says so (and the next one mends it)."""
    import random
    import threading

    cfg = config("Llama-3.1-8B", num_hidden_layers=8)
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    job, rdzv, pubs = _serve(cfg, shards, 2)
    for p in pubs:
        _step(p, 1)
    receiver = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=30, memory_budget=300_000)
    model: dict[str, torch.Tensor] = {}
    stop, rng = threading.Event(), random.Random(0)

    def trainer():
        version = 1
        while not stop.is_set() and version < 200:
            version += 1
            for p in pubs:
                _step(p, version)
            time.sleep(rng.uniform(0.0, 0.03))

    def install(weights):
        for name, t in weights:
            model[name] = t.clone()
            time.sleep(0.0005)  # installing takes time: writes land mid-cycle

    writer = threading.Thread(target=trainer, daemon=True)
    writer.start()
    done, torn, retried = 0, 0, 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline or done < 3:
        try:
            stats = receiver.refit(install)
        except TornUpdateError:
            torn += 1
            continue
        done += 1
        retried += stats.retries
        assert _versions_held(model) == {float(stats.version)}, "a refit returned with a mix of versions"
    stop.set()
    writer.join(10)
    assert done >= 3 and retried + torn > 0  # writes did land mid-cycle, and were caught
    receiver.close()


def test_a_budget_below_one_layer_names_the_layer_and_the_budget_that_fits(config):
    cfg = config("Llama-3.1-8B", num_hidden_layers=4)
    shards = reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1)
    job, rdzv, pubs = _serve(cfg, shards, 2)
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-streamed", timeout=10, memory_budget=4096)
    with pytest.raises(MemoryBudgetError, match=r"layer \d+ \(model\.layers\.\d+\..*\): \d+ bytes, more than the "
                       r"ring .*memory_budget=4096 .* use memory_budget >= \d+") as err:
        next(receiver.run_refit_cycle(1))
    for attempt in range(3):  # the advice counts the scratch seen so far: at most one more step
        fits = int(str(err.value).split("memory_budget >= ")[1].split(",")[0])
        again = RefitReceiver(rdzv, name=f"{job}-fits{attempt}", timeout=10, memory_budget=fits)
        try:
            assert len(list(again.run_refit_cycle(1))) > 0
            break
        except MemoryBudgetError as exc:
            err = pytest.ExceptionInfo.from_exc_info((type(exc), exc, exc.__traceback__))
        finally:
            again.close()
    else:
        pytest.fail(f"the advised budgets did not fit: {err.value}")
    assert again.stats.peak_extra_bytes <= fits and attempt <= 1
    receiver.close()


def test_bad_budgets_are_refused():
    rdzv = Rendezvous.serve(job=f"stream-{next(_JOBS)}")
    with pytest.raises(Exception, match="positive number of bytes"):
        RefitReceiver(rdzv, name="bad", memory_budget=0)
    with pytest.raises(Exception, match="replica group"):
        RefitReceiver(rdzv, name="bad2", memory_budget=1 << 20, replica_group="g")
