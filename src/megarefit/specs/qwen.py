"""Qwen2 / Qwen2.5 (q/k/v bias always on) and Qwen3 (q/k RMSNorm, head_dim from the config)."""

from megarefit.specs import gpt
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
)
