"""Shrink a real HF config to a CPU-sized model of the same architecture (``megarefit demo``).

The demo builds the model in fp32 on CPU with real Megatron-Core, so a 671B config must
become a model of a few MB first. :func:`shrink_config` keeps what decides how weights are
laid out and translated, and reduces only sizes:

============================  =================================================================
kept                          family, GQA ratio (query heads per KV head, up to 16), head_dim
                              given explicitly or not, QKV bias, QK norm, tied embeddings,
                              partial RoPE, MLA (with or without ``q_lora_rank``), the DSA indexer (and
                              its sharing schedule: layers kept up to two shared ones), dense-first
                              layers, shared experts, expert-score bias, top-k normalisation
reduced                       layers (the dense-first ones, at most one, plus two), hidden size,
                              heads (2 KV groups), FFN sizes, experts (4, top-2), MLA ranks,
                              indexer heads (4 x 16, top-8 of the 16 demo tokens), vocabulary (512),
                              sliding windows (to 4 tokens, so the demo's 16 cross them; per-layer
                              ``layer_types`` cut to the layers kept), gated DeltaNet heads (2 key
                              heads of 8, 4 value heads of 16; one GDN layer, then one full-attention
                              layer), ``rotary_dim`` with ``head_dim``
dropped, and said so          a vision-language checkpoint's vision tower (its ``text_config`` becomes the
                              config, under the text architecture),
                              RoPE scaling (the CPU harness builds plain RoPE; gpt-oss's YaRN is kept), group-limited
                              routing (``n_group``), MTP layers (not part of the HF model), a
                              checkpoint's ``quantization_config``
============================  =================================================================

None of the dropped features changes a weight's layout; each one dropped is listed in the
returned notes, which the CLI prints.
"""

from __future__ import annotations

from typing import Any

from megarefit.layout.hf_dims import indexer_schedule

SMALL_VOCAB = 512
SLIDING_WINDOW = 4  # tokens a sliding-window layer of the shrunk model attends to
KEEPS_ROPE_SCALING = ("gpt_oss",)  # model types whose RoPE scaling the CPU harness builds (YaRN)
HEAD_DIM = 16  # head_dim of the shrunk model
KV_GROUPS = 2  # KV heads of the shrunk model (tp=2 splits them)
FFN = 96
MOE_FFN = 32
EXPERTS = 4
TOPK = 2
MAX_GQA = 16


def _experts_key(cfg: dict[str, Any]) -> str | None:
    return next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(k)), None)


def _small_enough(cfg: dict[str, Any]) -> bool:
    """Already CPU-sized: nothing to shrink."""
    return (cfg.get("hidden_size", 0) <= 256 and cfg.get("num_hidden_layers", 0) <= 4
            and cfg.get("vocab_size", 0) <= 4096 and (cfg.get(_experts_key(cfg) or "", 0) or 0) <= 8)


def _attention(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """Heads, KV groups, head_dim, hidden size (and MLA ranks) of the shrunk model."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    ratio = min(heads // kv, MAX_GQA) if heads % kv == 0 else 1
    mla = bool(cfg.get("kv_lora_rank"))
    out["num_attention_heads"] = 4 if mla or ratio == 1 else KV_GROUPS * ratio
    out["num_key_value_heads"] = out["num_attention_heads"] if mla or ratio == 1 else KV_GROUPS
    if mla:
        out.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        if cfg.get("q_lora_rank"):
            out["q_lora_rank"] = 48
        if cfg.get("qk_head_dim"):  # GLM-5 spells qk_nope + qk_rope out
            out["qk_head_dim"] = 24
        if cfg.get("index_n_heads"):  # GLM-5's DSA indexer; its top-k below the demo's sequence length
            out.update(index_n_heads=4, index_head_dim=16, index_topk=min(cfg.get("index_topk") or 8, 8))
        out["hidden_size"] = 64
    elif cfg.get("head_dim"):
        out["head_dim"] = HEAD_DIM
        out["hidden_size"] = 64
        if cfg.get("rotary_dim"):  # MiniMax-M2: RoPE on the same share of each (smaller) head
            out["rotary_dim"] = max(2, HEAD_DIM * int(cfg["rotary_dim"]) // int(cfg["head_dim"]) // 2 * 2)
    else:  # head_dim = hidden_size / heads
        out["hidden_size"] = out["num_attention_heads"] * HEAD_DIM


def _moe(cfg: dict[str, Any], out: dict[str, Any], notes: list[str]) -> int:
    """Experts, FFN sizes and dense-first layers; returns how many dense layers come first."""
    out["intermediate_size"] = FFN
    key = _experts_key(cfg)
    if key is None:
        return 0
    out[key] = EXPERTS
    out["num_experts_per_tok"] = min(cfg.get("num_experts_per_tok") or TOPK, TOPK)
    if cfg.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = MOE_FFN
    if cfg.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = MOE_FFN
    if cfg.get("n_shared_experts"):
        out["n_shared_experts"] = 1
    if (cfg.get("n_group") or 1) > 1:
        notes.append(f"group-limited routing off (n_group {cfg['n_group']} -> 1, topk_group -> 1): routing only, "
                     "no weight changes layout")
    if "n_group" in cfg:
        out["n_group"], out["topk_group"] = 1, 1
    dense = min(cfg.get("first_k_dense_replace") or 0, 1)
    if "first_k_dense_replace" in cfg:
        out["first_k_dense_replace"] = dense
    if cfg.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]
        dense = 1
    return dense


def _hybrid(cfg: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """A hybrid Mamba2 config (Nemotron-H): its pattern cut to one layer of each kind, in order of
    first appearance; Mamba dims reduced (8 heads of 16, 2 groups of state 8)."""
    pattern = cfg.get("hybrid_override_pattern")
    if not pattern:
        return
    out["hybrid_override_pattern"] = "".join(dict.fromkeys(pattern))
    out["num_hidden_layers"] = len(out["hybrid_override_pattern"])
    out.update(mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8)
    if cfg.get("moe_shared_expert_intermediate_size"):
        out["moe_shared_expert_intermediate_size"] = MOE_FFN
    if (cfg.get("time_step_min") or 0) > 1e-9:  # HF clamps dt there, Megatron-Core and vLLM do not
        out["time_step_min"] = 1e-9
        notes.append(f"time_step_min {cfg['time_step_min']} -> 1e-9: HF clamps the Mamba step dt at it, "
                     "Megatron-Core and vLLM do not (a model-math difference, not a layout one)")


def _gdn(cfg: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """A gated-DeltaNet hybrid (Qwen3.5, Qwen3-Next): two layers, a GDN one, then full attention; GDN
    dims reduced (2 key heads of 8, 4 value heads of 16: tp=2 splits them)."""
    if not cfg.get("linear_num_key_heads"):
        return
    out.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
               num_hidden_layers=2)
    if cfg.get("layer_types"):
        out["layer_types"] = ["linear_attention", "full_attention"]
    else:
        out["full_attention_interval"] = 2
    notes.append("layers: one gated DeltaNet layer, then one full-attention layer")


_TEXT_MODELS = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}


def _language_model(cfg: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """A vision-language checkpoint's language model as a text-only config (``text_config`` under the
    text architecture); other configs unchanged."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in _TEXT_MODELS or not isinstance(cfg.get("text_config"), dict):
        return cfg
    notes.append(f"{arch}: its language model only ({_TEXT_MODELS[arch]}, text_config); megarefit does not move "
                 "the vision tower")
    text = dict(cfg["text_config"], architectures=[_TEXT_MODELS[arch]])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return text


def _shared_indexers(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """GLM-5.2's shared DSA indexers: enough layers to keep two that share (they reuse the last
    full layer's top-k), the schedule's prefix kept (its freq / offset still describe it)."""
    if not cfg.get("index_n_heads"):
        return
    kinds = indexer_schedule(str(cfg.get("model_type")), cfg.get, int(cfg["num_hidden_layers"]))
    if "shared" in kinds:
        out["num_hidden_layers"] = max(out["num_hidden_layers"], min(kinds.index("shared") + 2, len(kinds)))


def _windows(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """Per-layer ``layer_types`` / ``indexer_types`` cut to the kept layers; a sliding window shrunk
    below the demo's sequence length."""
    for key in ("layer_types", "indexer_types", "index_topk_pattern"):  # GLM-5.2: each layer's indexer
        if isinstance(cfg.get(key), (list, str)) and key not in out:
            out[key] = cfg[key][:out["num_hidden_layers"]]
    if cfg.get("sliding_window"):
        out["sliding_window"] = min(cfg["sliding_window"], SLIDING_WINDOW)


def shrink_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A CPU-sized copy of ``cfg`` (an HF ``config.json`` dict) with the same architecture, and
    one line per change (empty when ``cfg`` is already small). See the module docstring."""
    notes: list[str] = []
    cfg = _language_model(cfg, notes)
    if _small_enough(cfg):
        return dict(cfg), notes
    out: dict[str, Any] = {}
    _attention(cfg, out)
    dense = _moe(cfg, out, notes)
    out["num_hidden_layers"] = dense + 2
    _shared_indexers(cfg, out)
    if isinstance(cfg.get("mlp_layer_types"), list):  # GLM-5.2: the dense-first layers, spelled out
        out["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (out["num_hidden_layers"] - dense)
    _hybrid(cfg, out, notes)
    _gdn(cfg, out, notes)
    out["vocab_size"] = min(cfg.get("vocab_size") or SMALL_VOCAB, SMALL_VOCAB)
    out["max_position_embeddings"] = 256
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids must exist in the small vocabulary
        value = cfg.get(key)
        if isinstance(value, int) and value >= out["vocab_size"]:
            out[key] = min(2 + ("bos_token_id", "eos_token_id", "pad_token_id").index(key), out["vocab_size"] - 1)
        elif isinstance(value, list):
            out[key] = [v if v < out["vocab_size"] else 1 for v in value]
    _windows(cfg, out)
    scaling = cfg.get("rope_scaling") or {}
    if scaling and cfg.get("model_type") not in KEEPS_ROPE_SCALING:
        notes.append(f"RoPE scaling ({scaling.get('rope_type', scaling.get('type'))}) dropped: the CPU harness builds "
                     "plain RoPE; no weight changes layout")
        out["rope_scaling"] = None
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"MTP layers dropped ({cfg['num_nextn_predict_layers']} -> 0): not part of the HF model; "
                     "`megarefit plan --mtp-layers` plans them")
        out["num_nextn_predict_layers"] = 0
    if cfg.get("quantization_config"):
        notes.append("the checkpoint's quantization_config dropped: the demo's weights are random fp32 "
                     "(--quantization fp8 quantizes the refit)")
    small = {k: v for k, v in cfg.items() if k != "quantization_config"} | out
    changed = [f"{k} {cfg.get(k)} -> {v}" for k, v in out.items()
               if cfg.get(k) != v and k not in ("rope_scaling", "layer_types", "indexer_types", "mlp_layer_types")]
    for key in ("layer_types", "indexer_types", "mlp_layer_types"):
        if out.get(key) is not None and out[key] != (cfg.get(key) or [])[:len(out[key])]:
            changed.append(f"{key} -> {out[key]}")
        elif out.get(key) is not None and out[key] != cfg.get(key):
            changed.append(f"{key} cut to the first {len(out[key])}")
    notes.insert(0, "shrunk to a CPU-sized model of the same architecture: " + ", ".join(changed))
    return small, notes


__all__ = ["shrink_config"]
