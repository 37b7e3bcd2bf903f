"""Real ``TransformerConfig`` s of the imported megatron-core release, one per family as Megatron-Bridge
configures its trainer, read by megarefit (``MegatronCore.from_config``) and checked for the model.

:func:`audit` builds each case's config (``MLATransformerConfig`` for MLA models) with the values written
here by hand (Megatron-Bridge 0.6.2's providers: ``qwen3_bridge.py``, ``gpt_oss_bridge.py``,
``qwen35_bridge.py``, ...; none taken from megarefit's tables), then copies of it with one audited flag
changed, and reports what megarefit's check says of each; test_megatron_flags.py holds what it must say.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
_MOE = {"num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
_SHARED = {"moe_shared_expert_intermediate_size": 32}
_SIGMOID = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32"}
_MLA = {"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "qk_layernorm": True}
_GDN = {"qk_layernorm": True, "layernorm_zero_centered_gamma": True, "attention_output_gate": True}
_GATED_SHARED = {**_GDN, **_MOE, **_SHARED, "moe_shared_expert_gate": True}
# HF config -> the TransformerConfig options its trainer sets beyond the common ones below
CASES: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B.json": {},
    "Qwen2.5-0.5B.json": {"add_qkv_bias": True},
    "Qwen3-0.6B.json": {"qk_layernorm": True},
    "Qwen3-30B-A3B.json": {"qk_layernorm": True, **_MOE},  # norm_topk_prob true: softmax over the top k
    "Mixtral-8x7B-v0.1.json": _MOE,
    "DeepSeek-V3.json": {**_MLA, **_MOE, **_SHARED, **_SIGMOID, "moe_router_pre_softmax": True, "mtp_num_layers": 1},
    "GLM-4.5-Air.json": {"add_qkv_bias": True, **_MOE, **_SHARED, **_SIGMOID},
    "GLM-5.json": {**_MLA, **_MOE, **_SHARED, **_SIGMOID, "moe_router_pre_softmax": True,
                   "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 2, "dsa_indexer_head_dim": 16,
                   "dsa_indexer_topk": 4},
    "gpt-oss-120b.json": {"add_bias_linear": True, "softmax_type": "learnable", "glu_linear_offset": 1.0,
                          "activation_func_clamp_value": 7.0, "activation_func": "quick_gelu", **_MOE},
    "NVIDIA-Nemotron-3-Nano-30B-A3B.json": {"gated_linear_unit": False, "activation_func": "squared_relu",
                                            **_MOE, **_SHARED, **_SIGMOID},
    "MiniMax-M2.5.json": {"qk_layernorm": True, **_MOE, **_SIGMOID},
    "Qwen3.5-27B.json": _GDN,
    "Qwen3.5-397B-A17B.json": _GATED_SHARED,
    "Qwen3-Next-80B-A3B-Thinking.json": _GATED_SHARED,
}
COMMON = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16, "ffn_hidden_size": 128,
          "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "silu", "add_bias_linear": False,
          "use_cpu_initialization": True}
# a value no case's trainer uses, per flag that is not a bool (a bool flag gets the other bool)
OTHER: dict[str, Any] = {"normalization": "LayerNorm", "softmax_type": "off-by-one", "activation_func": "gelu",
                         "no_rope_freq": 2, "moe_latent_size": 16, "moe_mlp_glu_interleave_size": 32,
                         "moe_shared_expert_glu_interleave_size": 32, "gtp_weight_remat_size": 2,
                         "expert_gtp_weight_remat_size": 2}
FLIPS: dict[str, dict[Any, Any]] = {"glu_linear_offset": {0.0: 1.0, 1.0: 0.0},
                                    "activation_func_clamp_value": {None: 7.0, 7.0: None},
                                    "moe_router_score_function": {"softmax": "sigmoid", "sigmoid": "softmax"}}


def _function(name: str) -> Any:
    """Megatron-Core's activation of that name (as a trainer passes it)."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return {"silu": F.silu, "gelu": F.gelu, "quick_gelu": quick_gelu, "squared_relu": squared_relu}[name]


def build(case: str) -> Any:
    """The case's real config on the imported release (its 0.19+ DSA indexer ropes interleaved pairs,
    as Megatron-Bridge sets for GLM-5)."""
    import megatron.core
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kwargs = COMMON | CASES[case]
    kwargs["activation_func"] = _function(kwargs["activation_func"])
    cls = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    if "dsa_indexer_rope_interleaved" in {f.name for f in dataclasses.fields(cls)} and kwargs.get(
            "experimental_attention_variant") == "dsa":
        kwargs["dsa_indexer_rope_interleaved"] = True
    assert megatron.core.__version__
    return cls(**kwargs)


def other(flag: str, value: Any) -> Any:
    """A value of ``flag`` other than ``value`` (the config's)."""
    if flag in FLIPS:
        return FLIPS[flag][value]
    if flag == "activation_func":
        return _function(OTHER[flag])
    return (not value) if isinstance(value, bool) else OTHER[flag]


def _verdict(config: Any, dims: Any) -> str | None:
    """None where megarefit's check passes the config for ``dims``, else its error."""
    import megatron.core

    from megarefit.errors import UnverifiedMegatronError
    from megarefit.specs.megatron_core import MegatronCore

    try:
        MegatronCore.from_config(megatron.core.__version__, config).check(
            dims.megatron_needs(config.mtp_num_layers or 0), model=dims.family)
    except UnverifiedMegatronError as exc:
        return str(exc)
    return None


def audit() -> dict[str, Any]:
    """``{"version", "fields": the config classes' fields, "flags": the release's flag table,
    "cases": {case: {"right": verdict, "changed": {flag: [value, verdict]}}}}``, every flag of the
    release's table changed in turn (verdict: None, or the refusal)."""
    import megatron.core
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megarefit.layout.dims import ModelDims
    from megarefit.specs.megatron_core import MegatronCore
    from megarefit.specs.megatron_flags import plain

    flags = [f.name for f in MegatronCore.verified(megatron.core.__version__).release.flags]
    out: dict[str, Any] = {"version": megatron.core.__version__, "flags": flags,
                           "fields": sorted(f.name for f in dataclasses.fields(MLATransformerConfig)), "cases": {}}
    for case in CASES:
        dims = ModelDims.from_hf_config(json.loads((CONFIGS / case).read_text()))
        config = build(case)
        changed = {}
        for flag in (f for f in flags if hasattr(config, f)):  # MLA's own flags: MLATransformerConfig only
            bad = copy.copy(config)
            setattr(bad, flag, other(flag, getattr(config, flag)))  # past __post_init__: megarefit reads attributes
            changed[flag] = [plain(getattr(bad, flag)), _verdict(bad, dims)]
        out["cases"][case] = {"right": _verdict(config, dims), "changed": changed}
    return out

