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

from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.online import RefitReceiver  # noqa: E402
from megarefit.publisher import Publisher  # noqa: E402
from megarefit.rendezvous import Rendezvous  # noqa: E402
from megarefit.targets import VllmTarget  # noqa: E402
from moe_cases import megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state, vllm_moe_reference  # noqa: E402

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
    pubs = [Publisher({n: t.clone() for n, t in shards[tuple(r)].items()}, cfg, rank=tuple(r), tp=tp, pp=1, ep=ep,
                      etp=etp, layer_spec=layer_spec, expert_layout=expert_layout, rendezvous=rdzv,
                      agent_name=f"{job}-trainer-{r.tp}-{r.ep}") for r in layout.ranks()]
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
