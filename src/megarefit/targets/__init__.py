"""Refit targets other than full HF tensors: one vLLM worker's own parameter shards."""

from megarefit.targets.vllm import plan_megatron_to_vllm
from megarefit.targets.vllm_layout import VllmParam, VllmPiece, VllmTarget, vllm_params

__all__ = ["VllmParam", "VllmPiece", "VllmTarget", "plan_megatron_to_vllm", "vllm_params"]
