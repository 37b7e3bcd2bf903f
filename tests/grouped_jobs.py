"""Worker body for test_megatron_grouped.py (module level so spawn can import it)."""

from __future__ import annotations

import dataclasses

import torch


def inspect_grouped(rank: int, world_size: int, port: int, cfg: dict, hf: dict, tp: int) -> dict:
    from megarefit.demo.megatron_cpu import build_gpt_model, fake_grouped_gemm, gpt_arch_from_hf, init_parallel
    from megarefit.translate import hf_to_megatron

    fake_grouped_gemm()
    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=tp, pp=1)
    arch = dataclasses.replace(gpt_arch_from_hf(cfg, tp=tp), moe_grouped_gemm=True)
    model = build_gpt_model(arch)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {"names": names, "expert_class": type(model.decoder.layers[0].mlp.experts).__name__}
    # Load our legacy-layout shards into the real GroupedMLP and run its own forward.
    shards = hf_to_megatron(hf, cfg, tp=tp, expert_layout="legacy_grouped")[(rank, 0, 0)]
    experts = model.decoder.layers[0].mlp.experts
    with torch.no_grad():
        experts.weight1.copy_(shards["decoder.layers.0.mlp.experts.weight1"])
        experts.weight2.copy_(shards["decoder.layers.0.mlp.experts.weight2"])
        g = torch.Generator().manual_seed(1)
        tokens_per_expert = torch.tensor([3, 0, 5, 2])
        x = torch.randn(int(tokens_per_expert.sum()), cfg["hidden_size"], generator=g)
        probs = torch.ones(int(tokens_per_expert.sum()))
        experts.config.bf16 = True  # GroupedMLP.forward asserts bf16; params stay fp32
        y, _ = experts(x, tokens_per_expert, probs)
    out.update(x=x, y=y, tokens_per_expert=tokens_per_expert)
    return out
