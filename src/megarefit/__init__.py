"""megarefit: move Megatron-Core training weights into vLLM inference workers.

Public API::

    megarefit.megatron_to_hf(shards, hf_config, *, tp=1, pp=1, ep=1) -> {hf_name: tensor}
    megarefit.hf_to_megatron(hf_state, hf_config, *, tp=1, pp=1, ep=1) -> {(tp, pp, ep): {name: tensor}}
    megarefit.plan_megatron_to_hf(dims, layout, dtype) -> Plan      (pure, validated)
    megarefit.plan_megatron_to_vllm(dims, layout, dtype, VllmTarget(tp, rank)) -> Plan  (one vLLM worker's shards)
    megarefit.run_refit_cycle(plan, transport) -> iterator of (name, tensor)
    megarefit.name_map(dims, layout) -> [NameMapEntry]   (Megatron -> HF names; compare with Bridge)
"""

from megarefit.errors import MegarefitError
from megarefit.layout import Box, RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.plan import CopyOp, Plan, validate_plan
from megarefit.planner import plan_hf_to_megatron, plan_megatron_to_hf
from megarefit.planner.namemap import NameMapEntry, name_map
from megarefit.targets import VllmTarget, plan_megatron_to_vllm
from megarefit.translate import hf_to_megatron, megatron_to_hf
from megarefit.transport.execute import RefitStats, run_refit_cycle

__version__ = "0.2.0"

__all__ = [
    "Box", "CopyOp", "MegarefitError", "ModelDims", "NameMapEntry", "Plan", "RankCoord", "RefitStats",
    "SourceLayout", "VllmTarget", "hf_to_megatron", "megatron_to_hf", "name_map", "plan_hf_to_megatron",
    "plan_megatron_to_hf", "plan_megatron_to_vllm", "run_refit_cycle", "validate_plan",
]
