"""gpt-oss (``GptOssForCausalLM``, ``gpt_oss``): GQA attention with biases and a learned
sink logit per head, every layer MoE with a biased router and biased experts whose HF
tensors hold all of a layer's experts (the ``*_fused`` roles of
:class:`~megarefit.specs.table.Role`)::

    Megatron decoder.layers.{layer}.                 HF model.layers.{layer}.      shape (HF)
    self_attention.linear_qkv.weight / .bias     ->  self_attn.{q,k,v}_proj.*      as every GQA family
    self_attention.linear_proj.weight / .bias    ->  self_attn.o_proj.*
    self_attention.core_attention.softmax_offset ->  self_attn.sinks               [heads]  (split by heads over tp)
    mlp.router.weight / .bias                    ->  mlp.router.weight / .bias     [E, hidden] / [E]
    mlp.experts.local_experts.{e}.linear_fc1.*   ->  mlp.experts.gate_up_proj      [E, hidden, 2f]  gate/up interleaved
                                                     mlp.experts.gate_up_proj_bias [E, 2f]          gate/up interleaved
    mlp.experts.local_experts.{e}.linear_fc2.*   ->  mlp.experts.down_proj         [E, f, hidden]
                                                     mlp.experts.down_proj_bias    [E, hidden]

Megatron-Core builds it with ``softmax_type="learnable"`` (the sinks), ``add_bias_linear``
and ``add_qkv_bias``, ``quick_gelu`` gated experts with ``glu_linear_offset=1`` and
``activation_func_clamp_value=swiglu_limit`` (HF ``(up + 1) * gate * sigmoid(1.702 gate)``,
both clamped), and a top-k-then-softmax router. Transformer-Engine grouped experts name
the same tensors ``mlp.experts.linear_fc1.weight{e}`` / ``bias{e}``; legacy ``GroupedMLP``
has no expert biases and is not a gpt-oss layout. Released checkpoints store the experts
as MXFP4; megarefit produces bf16 (``quantization="none"``) and refuses MXFP4.
"""

from megarefit.specs import gpt
from megarefit.specs.table import FamilySpec, ParamSpec, Role

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_X = _H + "mlp.experts."
R = Role


def _expert_rows(fc1: str, fc2: str, layout: str, weight: str = "weight", bias: str = "bias",
                 ) -> tuple[ParamSpec, ...]:
    """The four expert rows under one Megatron expert spelling (``{expert}`` placed by the caller)."""
    return (
        ParamSpec(_L + fc1 + weight, R.EXPERT_GATE_UP_FUSED, (_X + "gate_up_proj",), ("2moe_ffn", "hidden"),
                  layer_kind="moe", expert_layout=layout),  # type: ignore[arg-type]
        ParamSpec(_L + fc1 + bias, R.EXPERT_GATE_UP_FUSED, (_X + "gate_up_proj_bias",), ("2moe_ffn",),
                  layer_kind="moe", expert_layout=layout),  # type: ignore[arg-type]
        ParamSpec(_L + fc2 + weight, R.EXPERT_ROW_FUSED, (_X + "down_proj",), ("hidden", "moe_ffn"),
                  layer_kind="moe", expert_layout=layout),  # type: ignore[arg-type]
        ParamSpec(_L + fc2 + bias, R.EXPERT_REPLICATED_FUSED, (_X + "down_proj_bias",), ("hidden",),
                  layer_kind="moe", expert_layout=layout),  # type: ignore[arg-type]
    )


GPT_OSS = FamilySpec(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + (
        ParamSpec(_L + "self_attention.core_attention.softmax_offset", R.COLUMN, (_H + "self_attn.sinks",),
                  ("heads",)),
        ParamSpec(_L + "pre_mlp_layernorm.weight", R.REPLICATED, (_H + "post_attention_layernorm.weight",),
                  ("hidden",), layer_kind="moe"),
        ParamSpec(_L + "mlp.router.weight", R.REPLICATED, (_H + "mlp.router.weight",), ("experts", "hidden"),
                  layer_kind="moe"),
        ParamSpec(_L + "mlp.router.bias", R.REPLICATED, (_H + "mlp.router.bias",), ("experts",), layer_kind="moe"),
    ) + _expert_rows("mlp.experts.local_experts.{expert}.linear_fc1.", "mlp.experts.local_experts.{expert}.linear_fc2.",
                     "sequential")
    + _expert_rows("mlp.experts.linear_fc1.", "mlp.experts.linear_fc2.", "te_grouped", "weight{expert}",
                   "bias{expert}")
    + gpt.OUTPUT,
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    experts_key="num_local_experts",
    moe_ffn_key="intermediate_size",
    # learned sinks; act(gate) * (up + 1) with quick-GELU (x * sigmoid(1.702 x)), inputs clamped at swiglu_limit
    megatron_config=(("softmax_type", ("learnable",)), ("activation_func", ("quick_gelu",)),
                     ("glu_linear_offset", (1.0,)), ("activation_func_clamp_value", (7.0,))),
)

__all__ = ["GPT_OSS"]

