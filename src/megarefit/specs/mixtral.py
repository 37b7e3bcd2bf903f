"""Mixtral: Llama attention, top-2 routed experts, HF ``block_sparse_moe`` with ``w1`` (gate),
``w3`` (up), ``w2`` (down) per expert; every layer is MoE."""

from megarefit.specs import gpt
from megarefit.specs.moe import moe_rows
from megarefit.specs.table import FamilySpec

MIXTRAL = FamilySpec(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    entries=gpt.EMBEDDING + gpt.ATTENTION + gpt.GATED_MLP + gpt.OUTPUT
    + moe_rows(block="block_sparse_moe", expert_proj=("w1", "w3", "w2")),
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    experts_key="num_local_experts",
    moe_ffn_key="intermediate_size",
)
