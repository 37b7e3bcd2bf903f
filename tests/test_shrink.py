"""`megarefit demo` shrinks real configs (megarefit.demo.shrink): sizes go down, what decides
the weights' layout stays, and every change is said."""

from __future__ import annotations

import pytest
from conftest import CONFIG_DIR, real_config

from megarefit.demo.shrink import shrink_config
from megarefit.layout.dims import ModelDims

# the configs the demo shrinks generically; Qwen3.5's and Qwen3-Next's (gated DeltaNet) below
GDN = ("Qwen3.5-27B", "Qwen3.5-397B-A17B", "Qwen3-Next-80B-A3B-Thinking")
NOT_SHRUNK = ("DeepSeek-V4-Flash",)  # the demo refuses it before shrinking (no Megatron-Core release builds it)
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.json") if p.stem not in GDN + NOT_SHRUNK)


@pytest.mark.parametrize("name", NAMES)
def test_shrunk_configs_keep_the_architecture(name):
    cfg = real_config(name)
    small, notes = shrink_config(cfg)
    big, dims = ModelDims.from_hf_config(cfg), ModelDims.from_hf_config(small)
    # GLM-5.2: up to two layers that share the DSA indexer are kept (3 full, then 2 shared)
    assert dims.hidden_size <= 512 and dims.num_layers <= (5 if big.shared_indexer_layers else 3)
    assert dims.vocab_size <= 512 and bool(dims.shared_indexer_layers) == bool(big.shared_indexer_layers)
    assert notes and notes[0].startswith("shrunk to a CPU-sized model of the same architecture")
    assert small["model_type"] == cfg["model_type"] and small["architectures"] == cfg["architectures"]
    ratio = big.num_attention_heads // big.num_query_groups
    assert dims.num_attention_heads // dims.num_query_groups == (1 if ratio == 1 else min(ratio, 16))
    assert dims.num_query_groups % 2 == 0  # tp=2 splits the KV groups
    for flag in ("qkv_bias", "qk_norm", "tie_word_embeddings", "router_bias"):
        assert getattr(dims, flag) == getattr(big, flag), flag
    assert bool(dims.kv_lora_rank) == bool(big.kv_lora_rank) and bool(dims.q_lora_rank) == bool(big.q_lora_rank)
    assert bool(dims.num_experts) == bool(big.num_experts)
    assert bool(dims.shared_expert_ffn) == bool(big.shared_expert_ffn)
    assert bool(dims.dense_layers) == bool(big.dense_layers)
    if cfg.get("rope_scaling") and cfg["model_type"] == "gpt_oss":  # the CPU harness builds its YaRN
        assert small["rope_scaling"] == cfg["rope_scaling"]
    elif cfg.get("rope_scaling"):
        assert small["rope_scaling"] is None and any("RoPE scaling" in n for n in notes)
    if cfg.get("layer_types"):  # per-layer attention kinds follow the kept layers; windows below 16 tokens
        assert small["layer_types"] == cfg["layer_types"][:dims.num_layers]
        assert small["sliding_window"] <= 4 and any("layer_types cut" in n for n in notes)
    assert all(small.get(k, 0) < small["vocab_size"] for k in ("bos_token_id", "pad_token_id")
               if isinstance(small.get(k), int))


def test_a_small_config_is_left_alone(config):
    cfg = config("Qwen3-0.6B")
    assert shrink_config(cfg) == (cfg, [])


@pytest.mark.parametrize("name", GDN)
def test_gated_deltanet_configs_keep_one_layer_of_each_kind(name):
    """A gated-DeltaNet hybrid keeps a GDN layer and a full-attention layer with heads tp=2 splits; a
    vision-language checkpoint becomes its language model (text architecture, ``text_config``), said so."""
    cfg = real_config(name)
    small, notes = shrink_config(cfg)
    dims, big = ModelDims.from_hf_config(small), ModelDims.from_hf_config(cfg)
    assert dims.linear_layers == (0,) and dims.num_layers == 2 and dims.num_experts == min(big.num_experts, 4)
    assert dims.gdn_key_heads % 2 == 0 and dims.gdn_value_heads % dims.gdn_key_heads == 0
    text = cfg.get("text_config")
    assert small["architectures"] == ([cfg["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")]
                                      if text else cfg["architectures"])
    assert small["model_type"] == (text or cfg)["model_type"]
    assert bool(text) == any("its language model only" in n for n in notes)
    assert any("one gated DeltaNet layer, then one full-attention layer" in n for n in notes)
