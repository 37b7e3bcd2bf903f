"""Qwen2 / Qwen2.5 (q/k/v bias always on), Qwen3 (q/k RMSNorm, head_dim from the config)
and Qwen3-MoE (Qwen3 attention, routed experts; dense layers from ``mlp_only_layers`` /
``decoder_sparse_step``)."""

from megarefit.specs import gpt
from megarefit.specs.moe import moe_rows
from megarefit.specs.table import FamilySpec

QWEN2 = FamilySpec(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + gpt.GATED_MLP + gpt.OUTPUT,
    qkv_bias=True,
)

QWEN3 = FamilySpec(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + gpt.QK_NORM + gpt.GATED_MLP + gpt.OUTPUT,
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    qk_norm=True,
)

QWEN3_MOE = FamilySpec(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + gpt.QK_NORM + gpt.GATED_MLP + gpt.OUTPUT + moe_rows(),
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    qk_norm=True,
    experts_key="num_experts",
    moe_ffn_key="moe_intermediate_size",
    mlp_only_key="mlp_only_layers",
    sparse_step_key="decoder_sparse_step",
    router_renorm=("norm_topk_prob", False),  # transformers' Qwen3MoeConfig default
)
