"""The budget a too-small ``memory_budget`` names is one a streamed refit completes with.

A streamed receiver's ring shares its budget with the scratch its gathered (small and strided)
pulls land in. A receiver given a budget too small for the largest layer raises
``MemoryBudgetError`` naming a budget; a receiver given exactly that budget must then complete
a streamed refit, its ring and scratch within the budget, even where the gathered pulls need
more scratch than the budget's default share (a tp=2 trainer into full HF tensors or a tp=1
vLLM worker: row-parallel weights land as column halves, read through scratch).

Real parts: Publishers serving reference shards and RefitReceivers over NIXL (UCX loopback).
Oracles: the HF state the reference sharder started from and the vLLM layout built from it with
cat / chunk (tests/reference.py), never megarefit's translation; the ring and scratch tensors
as measured here.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

pytest.importorskip("nixl")

from conftest import tiny_config  # noqa: E402
from reference import reference_hf_state, reference_shards, vllm_reference  # noqa: E402

from megarefit.layout.megatron_model import source_layout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.receiver.stream import MemoryBudgetError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from megarefit.transport.nixl_requests import GatherSizes  # noqa: E402

_JOBS = itertools.count()
TOO_SMALL = 4096  # bytes: less than any layer


def _serve(cfg: dict, hf: dict[str, torch.Tensor], tp: int) -> tuple[str, Rendezvous, list[Publisher]]:
    job = f"budget-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in s.items()}, cfg, rank=r, layout=source_layout(cfg, tp=tp, pp=1),
                      rendezvous=rdzv, agent_name=f"{job}-t{r[0]}")
            for r, s in reference_shards(hf, cfg, tp=tp, pp=1).items()]
    for p in pubs:
        p.publish(1)
    return job, rdzv, pubs


def _named_budget(rdzv: Rendezvous, name: str, **options) -> int:
    """The budget the error of a too-small one names (the error must name the layer and a budget)."""
    small = RefitReceiver(rdzv, name=name, timeout=30, memory_budget=TOO_SMALL, **options)
    try:
        with pytest.raises(MemoryBudgetError, match=rf"more than the ring .*memory_budget={TOO_SMALL} .* is too "
                                                    r"small; use memory_budget >= \d+,") as err:
            next(small.run_refit_cycle(1))
    finally:
        small.close()
    return int(re.search(r"memory_budget >= (\d+),", str(err.value)).group(1))


def _expected(hf: dict[str, torch.Tensor], cfg: dict, target: VllmTarget | None) -> dict[str, torch.Tensor]:
    return hf if target is None else vllm_reference(hf, cfg, target.tp, target.rank)


@pytest.mark.parametrize("target, scratch_budget", [
    (None, None),  # full HF tensors: o_proj / down_proj land as column halves of each trainer rank
    (VllmTarget(1, 0), None),  # a tp=1 vLLM worker: the same halves, fused qkv / gate_up
    (VllmTarget(2, 1), None),  # a tp=2 vLLM worker: shards as the trainer's
    (None, 1024),  # a scratch budget smaller than one strided piece
], ids=["hf", "vllm-tp1", "vllm-tp2", "hf-scratch-1k"])
def test_the_budget_a_too_small_one_names_completes_a_streamed_refit(target, scratch_budget):
    cfg = tiny_config("Llama-3.1-8B", num_hidden_layers=8)
    hf = reference_hf_state(cfg, "llama")
    job, rdzv, _pubs = _serve(cfg, hf, tp=2)
    budget = _named_budget(rdzv, f"{job}-small", target=target, scratch_budget=scratch_budget)
    receiver = RefitReceiver(rdzv, name=f"{job}-named", timeout=30, target=target, memory_budget=budget,
                             scratch_budget=scratch_budget)
    want = _expected(hf, cfg, target)
    try:
        for cycle in range(2):  # cold, then warm (the ring and READs prepared once)
            got = {name: t.clone() for name, t in receiver.run_refit_cycle(1)}
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), (cycle, name)
            stats = receiver.stats
            assert stats.install == "streamed" and stats.groups > 1 and stats.cold == (cycle == 0)
            measured = receiver._stream.ring.numel() + receiver.transport.scratch_allocated
            assert stats.peak_extra_bytes == measured <= budget
        # the scratch the receiver allowed for bounds what the transport allocated
        assert receiver.transport.scratch_allocated <= receiver._memory.scratch_bound(
            GatherSizes.of(receiver.plan, receiver._stream.direct), budget)
    finally:
        receiver.close()


@pytest.mark.parametrize("factor", [1.25, 2, 3])
def test_a_budget_above_the_named_one_completes_too(factor):
    """The error says ``memory_budget >= N``: larger budgets (a larger scratch share, a larger
    direct-READ threshold, other groups) complete as well."""
    cfg = tiny_config("Llama-3.1-8B", num_hidden_layers=8)
    hf = reference_hf_state(cfg, "llama")
    job, rdzv, _pubs = _serve(cfg, hf, tp=2)
    budget = int(factor * _named_budget(rdzv, f"{job}-small"))
    receiver = RefitReceiver(rdzv, name=f"{job}-above", timeout=30, memory_budget=budget)
    try:
        got = {name: t.clone() for name, t in receiver.run_refit_cycle(1)}
        assert got.keys() == hf.keys() and all(torch.equal(got[n], t) for n, t in hf.items())
        assert receiver.stats.groups > 1 and receiver.stats.peak_extra_bytes <= budget
    finally:
        receiver.close()
