"""The ``TransformerConfig`` flags whose value changes what a stored parameter means, per release, as data.

A flag (:class:`ConfigFlag`) names the values megarefit translates exactly for a model that needs no
other; a family whose tables are written for another value says so in
:attr:`~megarefit.specs.table.FamilySpec.megatron_config`, and values that follow the HF config (biases,
q / k norms, the router) come from :meth:`~megarefit.layout.dims.ModelDims.megatron_needs`. Both reach
:meth:`~megarefit.specs.megatron_core.MegatronCore.check` as one :class:`ModelNeeds`. Every other value
is refused, naming the flag, the value, the release and the value to set::

    flag (0.16+)                              default         other values (family)
    normalization                             RMSNorm
    layernorm_zero_centered_gamma             False           True (Qwen3.5, Qwen3-Next)
    attention_output_gate                     False           True (Qwen3.5, Qwen3-Next)
    softmax_type                              vanilla         learnable (gpt-oss)
    gated_linear_unit / activation_func       True / silu     False / squared_relu (Nemotron-H); quick_gelu (gpt-oss)
    glu_linear_offset / ..._clamp_value       0.0 / None      1.0 / 7.0 (gpt-oss)
    add_qkv_bias, add_bias_linear, qk_layernorm,              the HF config's biases and q / k norms
    moe_router_score_function, moe_router_pre_softmax,        the family's router and norm_topk_prob
    moe_router_enable_expert_bias, moe_shared_expert_gate     (DeepSeek-V3's e_score_correction_bias)

``docs/megatron-versions.md`` tabulates every flag with its releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Feature = Literal["any", "moe", "mla", "dsa", "mtp", "shared_experts", "gdn"]
"""Which models a :class:`ConfigFlag` matters for: every model, or those with routed experts,
multi-latent attention, a DSA indexer, multi-token prediction, shared experts or gated DeltaNet layers."""


@dataclass(frozen=True)
class ConfigFlag:
    """A ``TransformerConfig`` attribute whose value changes what megarefit must do.

    Attributes:
        name: the attribute (``dsa_indexer_rope_interleaved``); a callable value (``activation_func``)
            is recorded by its ``__name__``.
        verified: the values megarefit translates exactly for a model whose :class:`ModelNeeds` names
            no others (proved by forward equivalence).
        feature: the models it matters for (:data:`Feature`).
        why: what another value changes, for the error message.
    """

    name: str
    verified: tuple[Any, ...]
    feature: Feature
    why: str


@dataclass(frozen=True)
class ModelNeeds:
    """What one model needs of its trainer's ``TransformerConfig``.

    Attributes:
        features: the model's :data:`Feature` s (``"any"`` included): which flags matter.
        values: ``(flag, values megarefit translates for this model)`` where they are not the
            flag's :attr:`ConfigFlag.verified` (an empty tuple: no value is translated exactly).
    """

    features: frozenset[str]
    values: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    def verified(self, flag: ConfigFlag) -> tuple[Any, ...]:
        """The values of ``flag`` megarefit translates for this model."""
        return dict(self.values).get(flag.name, flag.verified)

    def wanted(self, flags: tuple[ConfigFlag, ...]) -> tuple[ConfigFlag, ...]:
        """Those of ``flags`` that matter for this model."""
        return tuple(f for f in flags if f.feature in self.features | {"any"})


def plain(value: Any) -> Any:
    """A config value as a record holds it: a callable by its ``__name__``, anything else as is."""
    return getattr(value, "__name__", repr(value)) if callable(value) else value


_F = ConfigFlag
FLAGS_016: tuple[ConfigFlag, ...] = (
    _F("normalization", ("RMSNorm",), "any",
       "selects the norm: every family megarefit translates is RMSNorm (LayerNorm subtracts the mean and holds "
       "a bias no HF checkpoint has)"),
    _F("layernorm_zero_centered_gamma", (False,), "any",
       "decides what a norm weight stores (Megatron-LM's --apply-layernorm-1p): True stores w - 1 and the norm "
       "computes (1 + w). HF's Qwen3.5 / Qwen3-Next norms compute 1 + w, every other family's w: read with the "
       "other convention every norm is served 1 off"),
    _F("apply_residual_connection_post_layernorm", (False,), "any",
       "takes the residual after the norm, which no HF family megarefit translates does"),
    _F("qk_layernorm", (False,), "any",
       "builds the q / k norms (HF q_norm / k_norm, MLA's q_a / kv_a layernorms): it must be what the HF config has"),
    _F("qk_l2_norm", (False,), "any", "L2-normalises queries and keys (no weight), which no HF family here does"),
    _F("add_qkv_bias", (False,), "any",
       "builds linear_qkv's bias (add_bias_linear does too): it must be what the HF config has"),
    _F("add_bias_linear", (False,), "any",
       "builds a bias on every linear (o_proj, the MLP, the experts): it must be what the HF config has"),
    _F("rotary_interleaved", (False,), "any",
       "ropes interleaved pairs of each head; the HF families rotate halves (rotate_half; MLA de-interleaves as "
       "HF does with this False): q / k rows would need a permutation megarefit does not apply"),
    _F("no_rope_freq", (None,), "any", "skips RoPE in some layers (NoPE), which no HF family here does"),
    _F("attention_output_gate", (False,), "any",
       "adds per-head output-gate rows to linear_qkv (Qwen3.5 / Qwen3-Next gated attention, HF q_proj's gate half)"),
    _F("softmax_type", ("vanilla",), "any",
       "changes the attention softmax: 'learnable' holds gpt-oss's sinks (HF self_attn.sinks), 'off-by-one' adds "
       "1 to every denominator (no HF family here)"),
    _F("gated_linear_unit", (True,), "any",
       "decides whether linear_fc1 stores [gate; up] (a GLU) or one up projection (Nemotron-H's squared ReLU)"),
    _F("activation_func", ("silu",), "any",
       "is the MLP's activation (by name): silu for the SwiGLU families, quick_gelu for gpt-oss, squared_relu "
       "for Nemotron-H"),
    _F("glu_linear_offset", (0.0,), "any",
       "adds a constant to the GLU's linear half (gpt-oss computes act(gate) * (up + 1)): with another offset "
       "the served up_proj is off by the difference"),
    _F("activation_func_clamp_value", (None,), "any", "clamps the GLU's inputs (gpt-oss's swiglu_limit 7.0)"),
    _F("fp8_param", (False,), "any",
       "keeps the parameters as Transformer Engine FP8 tensors (data + scales), which megarefit does not read: "
       "publish from a model whose parameters are bf16 / fp32"),
    _F("fp4_param", (False,), "any", "keeps the parameters as FP4 tensors, which megarefit does not read"),
    _F("moe_router_score_function", ("softmax",), "moe",
       "is the router's score function: softmax for Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5 and Qwen3-Next, "
       "sigmoid for DeepSeek-V3, GLM, MiniMax-M2 and Nemotron-H"),
    _F("moe_router_pre_softmax", (False,), "moe",
       "decides whether a softmax router's top-k probabilities are renormalised (False: softmax over the top k, "
       "HF norm_topk_prob=True, Mixtral, gpt-oss; True: softmax over every expert, norm_topk_prob=False); a "
       "sigmoid router always renormalises (top-k > 1), so norm_topk_prob=False has no Megatron-Core setting"),
    _F("moe_router_enable_expert_bias", (False,), "moe",
       "adds the router's score-correction bias (HF e_score_correction_bias): it must be what the HF config has"),
    _F("moe_apply_probs_on_input", (False,), "moe",
       "scales the experts' input by the router probability instead of their output (no HF family here)"),
    _F("moe_latent_size", (None,), "moe", "projects the experts into a latent space, which no spec table reads"),
    _F("moe_shared_expert_gate", (False,), "shared_experts",
       "gates the shared expert with a sigmoid (HF shared_expert_gate: Qwen3.5-MoE and Qwen3-Next only)"),
)
FLAGS_017 = FLAGS_016 + (
    _F("mla_down_proj_fusion", (False,), "mla",
       "fuses linear_q_down_proj and linear_kv_down_proj into one weight, which no spec row reads"),
    _F("mtp_use_repeated_layer", (False,), "mtp", "shares one MTP layer across depths"),
    _F("use_mup", (False,), "any", "scales embeddings, attention and logits (muP): not the HF model's function"),
)
FLAGS_018 = FLAGS_017 + (
    _F("moe_single_grouped_weight", (False,), "moe", "stacks every local expert into one weight"),
    _F("moe_single_grouped_bias", (False,), "moe", "stacks every local expert's bias into one tensor"),
    _F("moe_mlp_glu_interleave_size", (None,), "moe",
       "interleaves gate and up rows in blocks inside expert linear_fc1 (same names and shapes: translating it "
       "as [gate; up] would be silently wrong)"),
    _F("use_grouped_gemm_for_dense_mlp", (False,), "any",
       "builds the dense MLP as a grouped GEMM, whose parameters megarefit has not verified"),
)
FLAGS_019 = FLAGS_018 + (
    _F("dsa_indexer_rope_interleaved", (True,), "dsa",
       "False ropes the indexer's half-split pairs, GLM-5 (HF rope_interleave) interleaved pairs: set it True, as "
       "Megatron-Bridge does for GLM-5"),
    # the rotation multiplies the indexer's q and k by one orthogonal matrix: their products, the model, unchanged
    # (HF GLM-5 has none, Megatron-Bridge sets False; the CPU demo's True matches HF's logits)
    _F("dsa_indexer_rotate_activation", (True, False), "dsa", "rotates the indexer's queries and keys"),
    _F("dsa_indexer_scoring_relu", (True,), "dsa", "drops the ReLU on the indexer's scores"),
    _F("moe_shared_expert_glu_interleave_size", (None,), "shared_experts",
       "interleaves gate and up rows in blocks inside the shared expert's linear_fc1"),
    _F("use_grouped_gemm_for_shared_expert", (False,), "shared_experts", "builds the shared expert as a grouped GEMM"),
    _F("gtp_weight_remat_size", (1,), "any",
       "shards every weight further along out_features (generalized tensor parallelism): a rank holds part of "
       "its TP shard, which from_megatron does not describe"),
    _F("expert_gtp_weight_remat_size", (1,), "moe",
       "shards every expert weight further (generalized expert tensor parallelism): a rank holds part of its "
       "expert-TP shard"),
)

__all__ = ["FLAGS_016", "FLAGS_017", "FLAGS_018", "FLAGS_019", "ConfigFlag", "Feature", "ModelNeeds", "plain"]
