"""MoE and MLA trainers -> two vLLM-sharded receivers over real NIXL (UCX loopback).

Publishers serve Megatron shards of a Qwen3-MoE (legacy GroupedMLP experts, tp=2 ep=2
etp=1) and a DeepSeek-V3 model (MLA, shared experts, TE-grouped experts, tp=2 ep=2 etp=1)
from this process; two receivers stand for the workers of a vLLM tp=2 engine (expert
parallelism on and off) and pull only their own shards. Each equals the independent
cat/chunk reference of vLLM's layout (tests/reference.py, with vLLM's own expert map),
and a worker moves only its share of the bytes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from moe_cases import megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state, vllm_moe_reference  # noqa: E402

from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.errors import LayoutError  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.online.trainer.publisher import Publisher  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402

CASES = {  # family: (config, trainer tp, ep, etp, expert layout, layer spec)
    "qwen3_moe": ("Qwen3-30B-A3B", 2, 2, 1, "legacy_grouped", "local"),
    "deepseek_v3": ("DeepSeek-V3", 2, 2, 1, "te_grouped", "te"),
}


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_two_sharded_receivers_over_nixl(family, expert_parallel, tmp_path):
    name, tp, ep, etp, expert_layout, layer_spec = CASES[family]
    cfg = moe_config(name)
    hf = hf_checkpoint_state(cfg, tmp_path, seed=5)
    shards = megatron_shards(hf, cfg, family, tp, ep, etp, expert_layout, layer_spec)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
    job = f"vllm-targets-{family}-{int(expert_parallel)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in shards[tuple(r)].items()}, cfg, rank=tuple(r),
                      layout=layout, rendezvous=rdzv, agent_name=f"{job}-trainer-{r.tp}-{r.ep}") for r in layout.ranks()]
    for p in pubs:
        p.publish(1)
    full = sum(t.numel() * t.element_size() for t in hf.values())
    moved = 0
    for rank in range(2):
        target = VllmTarget(2, rank, expert_parallel=expert_parallel)
        receiver = RefitReceiver(rdzv, name=f"{job}-vllm-{rank}", timeout=10, target=target)
        got = {n: t.clone() for n, t in receiver.run_refit_cycle(1)}
        want = vllm_moe_reference(hf, cfg, 2, rank, expert_parallel=expert_parallel)
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (key, rank)
        assert receiver.stats.bytes_moved < 0.7 * full  # this worker's share
        # on the wire: exactly that with whole experts on both sides (vLLM EP, etp=1 trainers); without vLLM EP
        # each expert is split over the workers, and a trainer's whole expert block is read as one run
        stats = receiver.stats
        assert stats.wire_bytes == stats.bytes_moved if expert_parallel else stats.wire_bytes > stats.bytes_moved
        moved += receiver.stats.bytes_moved
    assert full <= moved < 1.2 * full  # about the model once over both workers (replicated parts twice)


@pytest.mark.parametrize("head_dim", [128, 64], ids=["aligned", "straddling"])
def test_fp8_refit_over_nixl(head_dim, tmp_path):
    """Trainers publish block FP8 (quantization="fp8"): shards whose blocks lie inside the
    rank are quantized by the Publisher into buffers registered once and re-filled on every
    publish; the receiver pulls FP8 + scales, and quantizes after the pull what straddles
    ranks. Every quantized weight equals vLLM's per_block_cast_to_fp8 of the HF tensor;
    with aligned dims the wire carries about half the bf16 bytes."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from megarefit.quant import quantized_weight_names, scale_name

    cfg = moe_config("Qwen3-30B-A3B", hidden_size=256, head_dim=head_dim, moe_intermediate_size=256,
                     intermediate_size=512)
    hf = {k: v.to(torch.bfloat16) for k, v in hf_checkpoint_state(cfg, tmp_path, seed=7).items()}
    tp, ep = 2, 2
    shards = megatron_shards(hf, cfg, "qwen3_moe", tp, ep, 1, "te_grouped", "local")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=1, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, expert_layout="te_grouped")
    job = f"fp8-{head_dim}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in shards[tuple(r)].items()}, cfg, rank=tuple(r),
                      layout=layout, rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r.tp}-{r.ep}", quantization="fp8") for r in layout.ranks()]
    registrations = [p.counters["registrations"] for p in pubs]
    for p in pubs:
        p.publish(1)
    receiver = RefitReceiver(rdzv, name=f"{job}-receiver", timeout=10)
    got = {n: t.clone() for n, t in receiver.run_refit_cycle(1)}
    quantized = quantized_weight_names(dims)
    assert got.keys() == set(hf) | {scale_name(n) for n in quantized}
    for name, w in hf.items():
        if name in quantized:
            q, s = per_block_cast_to_fp8(w, [128, 128])
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                got[scale_name(name)], s), name
        else:
            assert torch.equal(got[name], w), name
    full_bf16 = sum(t.numel() * t.element_size() for t in hf.values())
    stats = receiver.stats
    descriptors = sum(p.descriptors for p in receiver.transport.prepared[0].per_source)
    if head_dim == 128:  # every block inside one shard: FP8 on the wire
        assert "pull.quantize" not in stats.seconds and stats.wire_bytes < 0.55 * full_bf16
        # the Publisher lays FP8 shards and scales out back to back and the receiver's arena follows
        # the trainer's order: neighbouring pulls (an expert's gate and up, their scales) coalesce
        assert descriptors < 0.8 * len(receiver.plan.ops)
    else:  # q/k/v rows per group straddle blocks: those are pulled in bf16 and quantized here
        assert stats.seconds["pull.quantize"] > 0 and 0.55 * full_bf16 < stats.wire_bytes < full_bf16
    # a second version: publishers re-fill the same registered buffers, the receiver re-posts its READs
    for p in pubs:
        for t in p.params.values():
            t.mul_(2)  # powers of two scale exactly: FP8 bytes stay, scales double
        p.publish(2)
    again = dict(receiver.run_refit_cycle(2))
    assert [p.counters["registrations"] for p in pubs] == registrations and not receiver.stats.cold
    some = next(iter(sorted(quantized)))
    assert torch.equal(again[some].view(torch.uint8), got[some].view(torch.uint8))
    assert torch.equal(again[scale_name(some)], 2 * got[scale_name(some)])
    # a vLLM tp=2 worker (EP) pulls its own FP8 parameters: each equals vLLM's quantizer applied to
    # the independent bf16 reference of that parameter, expert slot by slot (head_dim 64: k rows per
    # vLLM rank 64, which vLLM's FP8 layers refuse too -- megarefit says so before any byte moves)
    sharded = RefitReceiver(rdzv, name=f"{job}-vllm", timeout=10, target=VllmTarget(2, 1, expert_parallel=True))
    if head_dim == 64:
        with pytest.raises(LayoutError, match=r"k_proj.weight: rows \[64, 128\) are off the 128-element FP8 block"):
            next(sharded.run_refit_cycle(2))
        return
    mine = {n: t.clone() for n, t in sharded.run_refit_cycle(2)}
    ref = vllm_moe_reference({k: 2 * v for k, v in hf.items()}, cfg, 2, 1, expert_parallel=True)  # version 2
    assert mine.keys() == set(ref) | {n + "_scale_inv" for n in ref if n + "_scale_inv" in mine}
    for name, w in ref.items():
        if name + "_scale_inv" not in mine:
            assert torch.equal(mine[name], w), name
            continue
        for q, s, slot in zip(mine[name].reshape(-1, *w.shape[-2:]), mine[name + "_scale_inv"].reshape(
                -1, *mine[name + "_scale_inv"].shape[-2:]), w.reshape(-1, *w.shape[-2:])):
            wq, ws = per_block_cast_to_fp8(slot, [128, 128])
            assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws), name


def test_a_receiver_follows_eplb_placements_between_cycles(tmp_path):
    """vLLM's EPLB moves experts at run time: a sharded receiver given each cycle's placement
    (``set_target``; the vLLM extension reads it from the worker's EPLB state) re-plans when
    it changed, finds a placement it saw before in the plan cache, and every physical slot
    holds its logical expert's bytes (redundant experts in two slots) after each cycle."""
    name, tp, ep, etp, expert_layout, layer_spec = CASES["qwen3_moe"]
    cfg = moe_config(name)
    hf = hf_checkpoint_state(cfg, tmp_path, seed=6)
    shards = megatron_shards(hf, cfg, "qwen3_moe", tp, ep, etp, expert_layout, layer_spec)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
    job = "vllm-eplb"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.clone() for n, t in shards[tuple(r)].items()}, cfg, rank=tuple(r),
                      layout=layout, rendezvous=rdzv, agent_name=f"{job}-trainer-{r.tp}-{r.ep}") for r in layout.ranks()]
    placements = [[[0, 1, 2, 3, 0, 1]], [[3, 3, 2, 0, 1, 2]], [[0, 1, 2, 3, 0, 1]]]  # 4 logical, 2 redundant
    receiver = RefitReceiver(rdzv, name=f"{job}-vllm-1", timeout=10,
                             target=VllmTarget(2, 1, expert_parallel=True, physical_to_logical=placements[0]))
    built = []
    for version, p2l in enumerate(placements, start=1):
        for p in pubs:
            p.publish(version)
        changed = receiver.set_target(VllmTarget(2, 1, expert_parallel=True, physical_to_logical=p2l))
        got = {n: t.clone() for n, t in receiver.run_refit_cycle(version)}
        want = vllm_moe_reference(hf, cfg, 2, 1, expert_parallel=True, physical_to_logical=p2l)
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (key, version)
        built.append((changed, receiver.plans_built))
    assert built == [(False, 1), (True, 2), (True, 2)]  # the third placement is the first one again: cached


def test_eplb_placement_is_read_from_vllms_layer_state():
    """What a worker reads before a cycle: vLLM's own ``EplbLayerState`` objects (the maps
    ``MixtureOfExperts.set_eplb_state`` hands each MoE layer: logical -> physical replicas and
    replica counts), driven directly; ``eplb_placement`` turns them back into each layer's
    physical -> logical map. A slot given two experts is refused, naming it."""
    from vllm.distributed.eplb.eplb_state import EplbLayerState

    from megarefit.errors import MegarefitError
    from megarefit.integrations.vllm_install import eplb_placement

    p2l = [[0, 1, 2, 3, 0, 1], [3, 3, 2, 0, 1, 2]]  # per MoE layer, physical slot -> logical expert
    logical, replicas = 4, 3
    l2p = torch.full((len(p2l), logical, replicas), -1, dtype=torch.int64)
    counts = torch.zeros(len(p2l), logical, dtype=torch.int64)
    for m, row in enumerate(p2l):
        for physical, e in enumerate(row):
            l2p[m, e, counts[m, e]] = physical
            counts[m, e] += 1

    class MoELayer(torch.nn.Module):
        def __init__(self, m: int) -> None:
            super().__init__()
            self.eplb_state = EplbLayerState()
            self.eplb_state.set_layer_state(m, torch.zeros(len(p2l), 6), l2p, counts)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), MoELayer(0), torch.nn.Linear(2, 2), MoELayer(1))
    assert eplb_placement(model=model) == tuple(map(tuple, p2l))
    assert eplb_placement(model=torch.nn.Linear(2, 2)) is None  # no EPLB
    l2p[1, 0, 1] = 2  # logical 0 also claims slot 2, which logical 2 holds
    counts[1, 0] += 1
    with pytest.raises(MegarefitError, match="physical expert 2 holds logical experts"):
        eplb_placement(model=model)
