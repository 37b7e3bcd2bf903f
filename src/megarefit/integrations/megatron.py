"""What a trainer calls with its own Megatron-Core model: the tensors a refit reads.

On every Megatron rank::

    from megarefit.integrations.megatron import refit_tensors
    pub = Publisher(refit_tensors(model), hf_config, rank=(tp_rank, pp_rank, ep_rank), tp=tp, pp=pp, ...)

:func:`refit_tensors` returns the rank's live parameters (Megatron's local names, as
``named_parameters()`` spells them) plus the persistent buffers the spec tables name as
weights. The CPU harness that builds real Megatron-Core models for the tests, benchmarks
and demos is :mod:`megarefit.demo.megatron_cpu`.
"""

from __future__ import annotations

import torch

from megarefit.specs import FAMILIES
from megarefit.specs.megatron_core import MegatronCore
from megarefit.specs.table import canonical_name


def refit_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a refit reads from one rank: ``named_parameters()`` plus the persistent
    buffers a spec table names as weights (the MoE router's ``expert_bias``, HF
    ``e_score_correction_bias``). Live tensors, not copies."""
    rows = [row for fam in FAMILIES for row in fam.entries]
    out = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        canon = canonical_name(name)
        if canon is not None and any(row.matches(canon) for row in rows):
            out[name] = buf
    return out


def local_named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU clones of :func:`refit_tensors` (this rank's shards, Megatron names)."""
    return {name: p.detach().cpu().clone() for name, p in refit_tensors(model).items()}


def megatron_core_of(model: torch.nn.Module, *, assume: str | None = None) -> MegatronCore:
    """The Megatron-Core record of ``model`` (a ``GPTModel`` / ``MambaModel``, possibly wrapped): the
    imported ``megatron.core.__version__`` and the layout flags of its ``config``, for
    ``Publisher(..., megatron=...)``. ``assume``: a verified version to read an unverified one as.

    Raises:
        UnverifiedMegatronError: the version is not verified (and no ``assume``).
    """
    import megatron.core

    config = getattr(model, "config", None)
    while config is None and hasattr(model, "module"):
        model = model.module
        config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no Megatron config (.config): pass a Megatron-Core model")
    return MegatronCore.from_config(megatron.core.__version__, config, assume=assume)


__all__ = ["local_named_parameters", "megatron_core_of", "refit_tensors"]
