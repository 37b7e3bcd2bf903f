"""Declared moves: trainers whose parameter memory is freed and re-allocated (or re-mapped) between steps.

Two ways trainers move their parameters, and what each leaves of a Publisher's registration::

    verl's Megatron offload      buffer.param_data.storage().resize_(0)    new addresses: the manifest's
    (and NeMo-RL colocated)      ... resize_(n); param_data.copy_(cpu)      are freed memory
    torch_memory_saver           physical pages released, new pages         same addresses: the NIXL
                                 mapped at the same virtual addresses       registrations are stale

The trainer declares the move (:meth:`Publisher.moving <megarefit.online.trainer.publisher.Publisher.moving>`
around the offload and reload, or :meth:`~megarefit.online.trainer.publisher.Publisher.params_moved`
after it) and :func:`reregister` then, on that rank only:

1. finds the served tensors whose memory moved: their address changed, or the trainer names them
   as re-mapped at the same address (``remapped``);
2. deregisters only the NIXL regions that held them (:meth:`NixlAgent.drop
   <megarefit.transport.nixl_agent.NixlAgent.drop>`; other regions of the same registration are
   registered again by address) and registers the moved tensors where they are now;
3. re-points what reads addresses (the FP8 quantizer, the checksum fill, CUDA IPC exports, and a
   delta log's served tensors and the tracker's index of their parameters, :func:`follow_delta`:
   its mirrors, slots, records and base version hold no address and stay, so the next version's
   delta is recorded against the version before the move);
4. republishes the rank's manifest and NIXL metadata, signed, under a new generation.

Ranks that did not move publish nothing. Receivers see the new generation in their fence (the
copy's fence record no longer holds: its write marker moved), re-read that rank's manifest and
re-load its NIXL metadata only, keep their plans, arenas and scratch (the plan key has no
addresses) and prepare the moved ranks' READ requests again against the new addresses, the other
ranks' kept (:meth:`RequestBuilder.rebuild <megarefit.transport.nixl_requests.RequestBuilder.rebuild>`). Buffers a Publisher owns
(FP8 weights and scales, snapshot copies, checksums) never move: with ``snapshot=True`` or FP8
shards only, nothing is republished.

The rank is marked writing (its update sequence odd) from the start of the move until the next
``publish`` / ``updating``: no receiver accepts bytes read from memory that was freed meanwhile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megarefit.errors import MegarefitError, MissingParameterError, ShapeMismatchError
from megarefit.online.trainer.served import checksum_buffer, export_ipc
from megarefit.quant.kernel import Fp8Quantizer
from megarefit.quant.planning import SCALE_SUFFIX
from megarefit.specs.table import canonical_name
from megarefit.transport.nixl_agent import mem_type

Publisher = Any  # megarefit.online.trainer.publisher.Publisher (above this module: no import)


@dataclasses.dataclass(frozen=True)
class MoveStats:
    """What one declared move did on a rank.

    ``moved``: canonical names of the served tensors registered again (moved, re-mapped, or in a
    dropped region); ``dropped_bytes`` / ``registered_bytes``: NIXL registrations dropped and made;
    ``republished``: whether the rank published a new manifest (``False``: nothing served moved);
    ``seconds``: wall time of the re-registration and republication."""

    moved: tuple[str, ...]
    dropped_bytes: int
    registered_bytes: int
    republished: bool
    seconds: float


def served_tensors(pub: Publisher) -> list[torch.Tensor]:
    """The tensor behind each of ``pub``'s manifest entries, in manifest order (FP8 weight and
    scale, snapshot copy, or live parameter)."""
    out = []
    for e in pub.manifest.tensors:
        base = e.name.removesuffix(SCALE_SUFFIX)
        if base in pub.fp8:
            out.append(pub.fp8[base][1] if e.name != base else pub.fp8[base][0])
        else:
            out.append(pub.snapshot.get(e.name, pub.params[e.name]))
    return out


def rebind(pub: Publisher, params: Mapping[str, torch.Tensor]) -> None:
    """Serve ``params`` (Megatron's names, e.g. ``refit_tensors(model)`` again after
    ``model.to(...)`` replaced buffer objects) instead of the tensors ``pub`` holds.

    Raises:
        MissingParameterError: a tensor ``pub`` serves is not in ``params`` (names it, the rank).
        ShapeMismatchError: one has another shape or dtype, or is not contiguous."""
    new = {c: p for n, p in params.items() if (c := canonical_name(n)) is not None}
    for name, old in pub.params.items():
        p = new.get(name)
        if p is None:
            raise MissingParameterError(f"params_moved(params=...) on rank {pub.rank} lacks {name}, which the "
                                        "Publisher serves: pass every tensor refit_tensors(model) returns")
        if p.shape != old.shape or p.dtype != old.dtype or not p.is_contiguous():
            raise ShapeMismatchError(f"parameter {name} on rank {pub.rank}: expected contiguous {old.dtype} "
                                     f"{tuple(old.shape)} as registered, got {p.dtype} {tuple(p.shape)} "
                                     f"contiguous={p.is_contiguous()}")
    pub.params = {name: new[name] for name in pub.params}


def _named(pub: Publisher, remapped: bool | Iterable[str], live: Iterable[str]) -> set[str]:
    """The live served names ``remapped`` declares re-mapped in place (``True``: all).

    Raises:
        MegarefitError: a name that is not a live parameter the Publisher serves (names it)."""
    live = set(live)
    if remapped is True:
        return live
    if not remapped:
        return set()
    names = {canonical_name(n) or n for n in remapped}
    unknown = sorted(names - live)
    if unknown:
        raise MegarefitError(f"rank {pub.rank}: remapped names {unknown[:3]} are not live parameters this Publisher "
                             "serves from their own memory (FP8 and snapshot buffers never move)")
    return names


def follow_delta(pub: Publisher) -> None:
    """Point ``pub``'s delta log (``delta=``) at the tensors it serves where they are now: the
    tracker's index first (:meth:`~megarefit.online.delta.track.ChangeTracker.rekey`), then the
    log's served tensors and tracked sources (:meth:`~megarefit.online.delta.log.DeltaLog.follow`).

    Raises:
        MegarefitError: as ``DeltaLog.follow`` (a tracked tensor the tracker no longer covers)."""
    if pub.delta is None:
        return
    if pub.delta.tracker is not None:
        pub.delta.tracker.rekey()
    sources = [None if e.name.removesuffix(SCALE_SUFFIX) in pub.fp8 else pub.params[e.name]
               for e in pub.manifest.tensors]
    pub.delta.follow(served_tensors(pub), sources)


def reregister(pub: Publisher, remapped: bool | Iterable[str] = False,
               params: Mapping[str, torch.Tensor] | None = None) -> MoveStats:
    """Follow a declared move on ``pub``'s rank (see the module docstring); the caller marked the
    rank writing first.

    Raises:
        MegarefitError: ``remapped`` names a tensor it does not serve live; or ``pub``'s delta log
            cannot follow the move (:func:`follow_delta`; nothing is re-registered then).
        MissingParameterError / ShapeMismatchError: as :func:`rebind`."""
    t0 = time.perf_counter()
    before = pub.params
    if params is not None:
        rebind(pub, params)
    try:
        follow_delta(pub)
    except MegarefitError:
        pub.params = before  # (nothing else was changed: the rank stays marked writing)
        raise
    if pub.fp8:  # the quantizer reads the live parameters by address
        pub._quantize = Fp8Quantizer([(pub.params[n].detach(), w, sc) for n, (w, sc) in pub.fp8.items()],
                                     pub.quantization)
    live = {e.name: e for e in pub.manifest.tensors if e.name in pub.params and e.name not in pub.fp8
            and e.name not in pub.snapshot}
    # a CUDA tensor back at its old address may hold new physical pages (cudaMalloc after a free, a
    # re-mapping allocator): on a declared move every CUDA tensor is registered and exported again
    moved = ({n for n, e in live.items() if pub.params[n].data_ptr() != e.addr or pub.params[n].is_cuda}
             | _named(pub, remapped, live))
    if not moved:
        return MoveStats((), 0, 0, False, time.perf_counter() - t0)
    stale = sorted({live[n].region for n in moved if live[n].region >= 0})
    moved |= {n for n, e in live.items() if e.region in stale}  # they lose their registration too
    before = pub.agent.counters["registered_bytes"]
    dropped = pub.agent.drop(stale)
    pub.agent.register([pub.params[n] for n in sorted(moved)])
    entries = [dataclasses.replace(e, addr=pub.params[e.name].data_ptr(), **dict(zip(("mem", "dev"),
                                   mem_type(pub.params[e.name])))) if e.name in moved else e
               for e in pub.manifest.tensors]
    served = served_tensors(pub)
    if pub.checksums is not None:  # same registered buffer, its fill re-pointed at the new addresses
        experts = pub.dims.num_experts // pub.layout.ep if pub.dims.num_experts else 1
        pub.checksums = checksum_buffer(served, entries, experts, out=pub.checksums[0])
    if pub.ipc or any(t.is_cuda for t in served) and pub.ipc_enabled:
        pub.ipc = export_ipc(served + ([pub.checksums[0]] if pub.checksums is not None else []), f"rank {pub.rank}")
    pub.manifest = pub._build_manifest(pub.manifest.agent, entries)
    pub.rendezvous.publish_manifest(pub.manifest, pub.agent.metadata)
    return MoveStats(tuple(sorted(moved)), dropped, pub.agent.counters["registered_bytes"] - before, True,
                     time.perf_counter() - t0)


__all__ = ["MoveStats", "follow_delta", "rebind", "reregister", "served_tensors"]
