"""Megatron's deferred parameter all-gather, seen from a Publisher.

With the distributed optimizer and ``overlap_param_gather``, each data-parallel rank's
optimizer step updates only its shard of Megatron DDP's parameter buffer; the all-gather
that makes every rank's parameters whole again is dispatched by the *next forward's*
pre-hooks. A refit right after ``optimizer.step()`` would read the previous version on
every shard but the rank's own -- silently (NeMo-RL hit exactly this)::

    backward -> finish_grad_sync          bucket groups: param_gather_dispatched = False
    optimizer.step()                      own shard of the buffer updated, others stale
    <- a refit here reads stale bytes ->
    next forward: pre-hooks all-gather    every rank whole again

:func:`finish_param_sync` (a collective: call it on every rank of the data-parallel group,
e.g. right after the step) gathers now; :func:`check_param_sync` (what a Publisher given
``ddp=`` runs before it publishes) waits for gathers already in flight and refuses, naming
the buckets, when one was never dispatched. Duck-typed on Megatron-Core's
``DistributedDataParallel`` (``ddp_config``, ``bucket_groups``,
``expert_parallel_bucket_groups``, ``start_param_sync``); megatron is not imported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megarefit.errors import MegarefitError


class ParamSyncPendingError(MegarefitError):
    """Megatron DDP has not all-gathered the parameters the last optimizer step updated."""


def _deferred(chunk: Any) -> bool:
    cfg = getattr(chunk, "ddp_config", None)
    return bool(cfg is not None and cfg.use_distributed_optimizer and cfg.overlap_param_gather)


def _groups(chunk: Any) -> list[Any]:
    return list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))


def finish_param_sync(model_chunks: Iterable[Any]) -> None:
    """All-gather every deferred parameter bucket now (``start_param_sync(force_sync=True)``,
    Megatron DDP's own call). A collective: every data-parallel rank must call it."""
    for chunk in model_chunks:
        if _deferred(chunk):
            chunk.start_param_sync(force_sync=True)


def check_param_sync(model_chunks: Iterable[Any], rank: Any) -> None:
    """Make sure the parameters hold the last step's values on every shard: wait for
    all-gathers already dispatched (a local wait), refuse if one never was.

    Raises:
        ParamSyncPendingError: naming the rank and the first buckets whose all-gather was
            not dispatched since the last gradient sync.
    """
    pending = []
    for c, chunk in enumerate(model_chunks):
        if not _deferred(chunk):
            continue
        for g, group in enumerate(_groups(chunk)):
            if not group.param_gather_dispatched:
                pending.append(f"model chunk {c} bucket group {g}")
            elif group.param_gather_handle is not None:  # dispatched by every rank: waiting is local
                group.param_gather_handle.wait()
                group.param_gather_handle = None
    if pending:
        raise ParamSyncPendingError(
            f"rank {rank}: Megatron DDP has not all-gathered the parameters of the last optimizer step "
            f"(distributed optimizer with overlap_param_gather defers it to the next forward): {pending[:3]}"
            f"{' ...' if len(pending) > 3 else ''}. Call megarefit.online.trainer.param_sync.finish_param_sync(model_chunks) "
            "on every data-parallel rank after the step, before publishing")


__all__ = ["ParamSyncPendingError", "check_param_sync", "finish_param_sync"]
