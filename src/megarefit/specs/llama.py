"""Llama 2 / 3.x and Mistral: GQA attention, SwiGLU MLP, optional biases from the config."""

from megarefit.specs import gpt
from megarefit.specs.table import FamilySpec

LLAMA = FamilySpec(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    entries=gpt.EMBEDDING + gpt.ATTENTION + gpt.GATED_MLP + gpt.OUTPUT,
    qkv_bias="attention_bias",
    proj_bias="attention_bias",
    mlp_bias="mlp_bias",
)
