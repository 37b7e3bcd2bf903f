"""What a trainer calls with its own Megatron-Core model.

On every Megatron rank, after ``parallel_state.initialize_model_parallel`` and building the model::

    from megarefit import Publisher
    pub = Publisher.from_megatron(model, hf_config, rendezvous=rendezvous)

reads the layout from Megatron itself (:mod:`megarefit.layout.megatron_model`). The names here are
that module's, kept importable from where trainers found them: :func:`refit_tensors` (the rank's
live parameters plus the persistent buffers the spec tables name as weights) and
:func:`megatron_core_of` (the Megatron-Core version and layout flags of a model). The CPU harness
that builds real Megatron-Core models for the tests, benchmarks and demos is
:mod:`megarefit.demo.megatron_cpu`.
"""

from __future__ import annotations

import torch

from megarefit.layout.megatron_model import megatron_core_of, refit_tensors, source_layout, unwrap


def local_named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU clones of :func:`refit_tensors` (this rank's shards, Megatron names)."""
    return {name: p.detach().cpu().clone() for name, p in refit_tensors(model).items()}


__all__ = ["local_named_parameters", "megatron_core_of", "refit_tensors", "source_layout", "unwrap"]
