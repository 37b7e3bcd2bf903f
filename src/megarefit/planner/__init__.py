"""Planners: spec table + dims + a Megatron layout -> validated :class:`~megarefit.plan.Plan` s.

* :mod:`~megarefit.planner.megatron_to_hf`: export, Megatron shards -> full HF tensors (on columns);
* :mod:`~megarefit.planner.hf_to_megatron`: import, full HF tensors -> every rank's shards;
* :mod:`~megarefit.planner.namemap`: global Megatron -> HF name maps and their comparison.

The geometry they share (which rows of which shard land where) is
:mod:`megarefit.layout.geometry`; plans for one vLLM worker's own shards are
:mod:`megarefit.targets`.
"""

from megarefit.planner.hf_to_megatron import plan_hf_to_megatron
from megarefit.planner.megatron_to_hf import plan_megatron_to_hf

__all__ = ["plan_hf_to_megatron", "plan_megatron_to_hf"]
