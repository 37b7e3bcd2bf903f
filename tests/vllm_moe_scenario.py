"""Run by test_vllm_refit.py in its own process: a Qwen3-MoE refit into vLLM (CPU) over NIXL
from two real Megatron trainer processes (EP=2). Prints one JSON line with the outcome."""

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


def main(work: Path) -> dict:
    import vllm

    import megarefit
    from conftest import real_config
    from megarefit.integrations.hf import build_hf_model, install_weights, save_checkpoint
    from megarefit.integrations.megatron import TrainerCase, serving_trainer_job, start_workers
    from megarefit.integrations.vllm import PartialUpdateError
    from megarefit.live_demo import PROMPTS, greedy
    from megarefit.rendezvous import Rendezvous

    cfg = real_config("Qwen3-30B-A3B") | {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 300, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_scaling": None,
        "head_dim": 32, "num_experts": 4, "moe_intermediate_size": 48, "intermediate_size": 96,
        "bos_token_id": 0, "eos_token_id": 1}
    rdzv = Rendezvous.serve(job="vllm-moe")
    snap = work / "snap"
    snap.mkdir(exist_ok=True)
    group = start_workers(serving_trainer_job, world_size=2,
                          args=(TrainerCase("vllm-moe", cfg, 1, 1, torch.tensor([PROMPTS[0]]), ep=2),
                                ("127.0.0.1", rdzv.port, "vllm-moe"), 1, 0.01, str(snap)))
    try:
        torch.manual_seed(0)
        save_checkpoint(work / "ckpt", cfg, dict(build_hf_model(cfg).state_dict()))
        llm = vllm.LLM(model=str(work / "ckpt"), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                       max_model_len=128, worker_extension_cls="megarefit.integrations.vllm.MegarefitWorkerExtension")
        llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, "vllm-moe", 120.0))
        try:
            llm.collective_rpc("update_weights_from_megatron", args=(1,))
        except PartialUpdateError as exc:
            return {"outcome": "partial_update_error", "message": str(exc)}
        params = vllm.SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        shards = {(0, 0, e): torch.load(snap / f"v1-tp0-pp0-ep{e}.pt") for e in range(2)}
        reference = build_hf_model(cfg)
        install_weights(reference, megarefit.megatron_to_hf(shards, cfg, ep=2).items())
        return {"outcome": "installed", "vllm": [list(o.outputs[0].token_ids) for o in outs],
                "hf": greedy(reference, 8)}
    finally:
        rdzv.mark_consumed(1)
        group.join(timeout=120)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
