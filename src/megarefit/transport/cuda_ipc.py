"""CUDA IPC: trainer ranks on the receiver's own GPU are read by device copies, not NIXL.

Colocated RL keeps trainer and vLLM processes on the same GPUs. Between two processes on
one GPU NIXL/UCX goes through the host (0.8 GB/s measured on an H200), while a copy from
another process's tensor through CUDA IPC runs at a device copy's speed. So:

* **Trainer** (:func:`export_storages`): every CUDA storage a :class:`~megarefit.online.trainer.publisher.Publisher`
  serves (parameters, or Megatron's contiguous parameter buffer they are views of; FP8 and
  snapshot buffers; the checksum block) is exported once with PyTorch's CUDA IPC reduction
  (``torch.multiprocessing.reductions.reduce_tensor``: the caching allocator's block handle
  plus the storage's offset in it, a shared reference counter, a producer event) into the
  rank's manifest as :class:`~megarefit.transport.manifest.IpcStorage` records, beside the
  GPU's UUID.
* **Receiver** (:class:`IpcSources`): a rank whose records name the GPU the receiver lands on
  (same UUID, whatever ``CUDA_VISIBLE_DEVICES`` numbers it) is opened once
  (``rebuild_cuda_tensor``) and its tensors become views of the opened storages. The plan's
  ops from those ranks compile once into :class:`DeviceCopies`: contiguous runs coalesced
  across neighbouring tensors and copied with ``copy_`` (``cudaMemcpyAsync``), small runs and
  strided boxes in one batched launch (:class:`~megarefit.transport.boxcopy.BoxCopies`). A warm
  cycle re-launches them; nothing is opened or compiled again until a manifest changes (a
  restarted or re-registered trainer exports new records: detected by the manifest's memory
  digest, the old mappings are dropped and the new ones opened).

Same plan, same arena, same seqlock fence and version checks as NIXL pulls: only the bytes'
path differs. A mixed job (some ranks on this GPU, some elsewhere) uses both in one cycle
(:class:`~megarefit.transport.nixl.NixlTransport` routes per rank).

Limits: a handle cannot be opened by the process that exported it (a rank in the receiver's
own process is read over NIXL); processes in different containers may be refused by the
driver (then ``auto`` falls back to NIXL with a warning). PyTorch's reference counter counts
one consumer per export: a trainer that frees a served storage while several receivers hold
it frees it at once (which it may anyway: re-create the Publisher after re-allocating).
Anyone who can read the manifest on this host can map the trainer's memory: see issue 27's
authenticated rendezvous.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord
from megarefit.plan import CopyOp, Plan, TensorRef
from megarefit.transport.boxcopy import BoxCopies
from megarefit.transport.local import op_views
from megarefit.transport.manifest import IpcStorage, Manifest, TensorEntry

IpcMode = Literal["auto", "nixl", "ipc"]
"""How a receiver reads trainer ranks: ``"auto"`` CUDA IPC for ranks on its own GPU (NIXL for
the rest, and where opening fails), ``"nixl"`` never IPC, ``"ipc"`` every rank through CUDA IPC
(an error names each rank that cannot be)."""

RUN_MIN_BYTES = 64 << 20
"""A coalesced contiguous run at least this long is one ``copy_`` (``cudaMemcpyAsync``); shorter
runs and strided boxes go through one batched :class:`~megarefit.transport.boxcopy.BoxCopies` launch.
Measured on an H200 (Qwen3-8B, tp=2 trainers into full HF tensors, 16.4 GB): with 1 MiB, 1013
``copy_`` calls per cycle left the GPU waiting on their launches (0.69x of one plain copy of the
same bytes); BoxCopies moves row-parallel boxes at 0.93x of a contiguous copy
(benchmarks/bench_box_copies.py)."""

_REF_COUNTER = re.compile(r"^/[A-Za-z0-9_.-]{1,200}$")  # PyTorch's shared-memory counter name, e.g. /torch_123_45_0


class IpcError(MegarefitError):
    """A CUDA IPC record is malformed, or cannot be opened here (names the rank and why)."""


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a visible CUDA device (``torch.cuda.get_device_properties(d).uuid``), as text."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_storages(tensors: Iterable[torch.Tensor]) -> tuple[IpcStorage, ...]:
    """CUDA IPC records of the distinct CUDA storages holding ``tensors`` (CPU tensors are
    skipped), each exported once through ``torch.multiprocessing.reductions.reduce_tensor``.

    Raises:
        RuntimeError: PyTorch could not export a storage (its message)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out, seen = [], set()
    for t in tensors:
        if not t.is_cuda:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))
        _fn, args = reduce_tensor(whole)
        dev, handle, size, offset, ref, ref_offset, event, event_sync = args[6:10] + args[11:]
        out.append(IpcStorage(device_uuid(t.device), int(dev), storage.data_ptr(), int(size), bytes(handle).hex(),
                              int(offset), bytes(ref).hex(), int(ref_offset), bytes(event or b"").hex(),
                              bool(event_sync), os.getpid()))
    return tuple(out)


def _checked(rec: IpcStorage, rank: RankCoord) -> tuple[bytes, bytes, bytes | None]:
    """(handle, ref counter name, event handle) of a record, after checking its fields.

    Raises:
        IpcError: a field is malformed (names the rank and the field)."""
    try:
        handle, ref = bytes.fromhex(rec.handle), bytes.fromhex(rec.ref_counter)
        event = bytes.fromhex(rec.event) if rec.event else None
    except (TypeError, ValueError) as exc:
        raise IpcError(f"rank {rank}: CUDA IPC record of storage at {rec.base:#x} has a non-hex field: {exc}") from None
    if not 0 < len(handle) <= 1024 or (event is not None and len(event) > 1024):
        raise IpcError(f"rank {rank}: CUDA IPC handle of {len(handle)} bytes is not a PyTorch handle")
    if not _REF_COUNTER.match(ref.decode("ascii", "replace")) or ".." in ref.decode("ascii", "replace"):
        raise IpcError(f"rank {rank}: CUDA IPC reference counter {ref!r} is not a shared-memory name")
    if rec.nbytes <= 0 or rec.offset < 0 or rec.ref_offset < 0 or rec.base <= 0:
        raise IpcError(f"rank {rank}: CUDA IPC record sizes or offsets out of range: {rec}")
    return handle, ref, event


def open_storage(rec: IpcStorage, local_device: int, rank: RankCoord) -> torch.Tensor:
    """The exported storage as a flat ``uint8`` tensor ``[rec.nbytes]`` mapped into this process
    on ``local_device`` (this process's index of the record's GPU).

    Raises:
        IpcError: a malformed record, or the driver refused the handle (e.g. the exporting
            process is this one, has exited, or lives in another IPC namespace)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handle, ref, event = _checked(rec, rank)
    if rec.pid == os.getpid():
        raise IpcError(f"rank {rank}: exported by this very process (pid {rec.pid}); CUDA IPC handles open "
                       "only in other processes")
    try:
        return rebuild_cuda_tensor(torch.Tensor, (rec.nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8,
                                   local_device, handle, rec.nbytes, rec.offset, False, ref, rec.ref_offset,
                                   event, rec.event_sync)
    except Exception as exc:  # the driver's or PyTorch's error, whatever its type
        raise IpcError(f"rank {rank}: cannot open the CUDA IPC handle of storage at {rec.base:#x} "
                       f"({rec.nbytes} bytes) on cuda:{local_device}: {exc}") from exc


def _entry_view(flat: torch.Tensor, at: int, entry: TensorEntry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    return flat[at:at + entry.nbytes].view(dtype).view(entry.shape)


@dataclass
class _Opened:
    records: tuple[IpcStorage, ...]
    storages: list[torch.Tensor]  # flat uint8, one per record
    tensors: dict[str, torch.Tensor]  # served name -> view of an opened storage


class IpcSources:
    """The trainer ranks this receiver reads through CUDA IPC, opened once per manifest.

    ``device``: the receiver's CUDA device (where its buffers live); ``mode``: see :data:`IpcMode`.
    """

    def __init__(self, device: torch.device, mode: IpcMode = "auto"):
        if mode not in ("auto", "nixl", "ipc"):
            raise MegarefitError(f"transport must be 'auto', 'nixl' or 'ipc', got {mode!r}")
        if mode == "ipc" and device.type != "cuda":
            raise MegarefitError(f"transport='ipc' needs a CUDA receiver device, got {device}")
        self.device, self.mode = device, mode
        self._uuid = device_uuid(device) if device.type == "cuda" and mode != "nixl" else None
        self._opened: dict[RankCoord, _Opened] = {}
        self.opened_storages = 0  # storages mapped so far (counts re-opens after a trainer restart)
        self.open_seconds = 0.0

    @property
    def ranks(self) -> frozenset[RankCoord]:
        """Ranks currently read through CUDA IPC."""
        return frozenset(self._opened)

    def connect(self, manifests: Mapping[RankCoord, Manifest]) -> bool:
        """Open (or keep) each rank's storages; returns whether any rank's mapping changed (a
        prepared plan against the old ones must be dropped).

        Raises:
            IpcError: ``mode="ipc"`` and a rank cannot be read through CUDA IPC (says why)."""
        import time

        changed = False
        for rank, manifest in sorted(manifests.items()):
            old = self._opened.get(rank)
            if old is not None and old.records == manifest.ipc:
                continue
            changed |= self._opened.pop(rank, None) is not None
            t0 = time.perf_counter()
            why = self._refusal(manifest)
            if why is None:
                try:
                    self._opened[rank] = self._open(manifest)
                    changed = True
                except IpcError as exc:
                    why = str(exc)
                    if self.mode == "auto":
                        warnings.warn(f"{why}; reading rank {rank} over NIXL instead", stacklevel=4)
            self.open_seconds += time.perf_counter() - t0
            if why is not None and self.mode == "ipc":
                raise IpcError(f"transport='ipc': rank {rank} cannot be read through CUDA IPC: {why}; use "
                               "transport='auto' to read such ranks over NIXL")
        return changed

    def _refusal(self, manifest: Manifest) -> str | None:
        """Why ``manifest``'s rank is not read through CUDA IPC here, or ``None``."""
        if self._uuid is None:
            return "the receiver is not on a CUDA device" if self.mode != "nixl" else "transport='nixl'"
        if not manifest.ipc:
            return "its manifest exports no CUDA IPC handles (tensors on the host, or Publisher(ipc=False))"
        if manifest.ipc[0].pid == os.getpid():
            return "its tensors were exported by this process (CUDA IPC handles open only in other processes)"
        if any(e.mem != "VRAM" for e in manifest.tensors):
            return "it serves some tensors from host memory"
        uuids = {r.uuid for r in manifest.ipc}
        if uuids != {self._uuid}:
            return f"its tensors are on GPU(s) {sorted(uuids)}, this receiver on {self._uuid} ({self.device})"
        return None

    def _open(self, manifest: Manifest) -> _Opened:
        local = self.device.index if self.device.index is not None else torch.cuda.current_device()
        records = sorted(manifest.ipc, key=lambda r: r.base)
        storages = [open_storage(r, local, manifest.rank) for r in records]
        self.opened_storages += len(storages)
        tensors = {}
        extra = [(manifest.checksums[0], manifest.checksums[1], "__checksums__")] if manifest.checksums else []
        spans = [(e.addr, e.nbytes, e) for e in manifest.tensors] + extra
        for addr, nbytes, what in spans:
            i = next((i for i, r in enumerate(records) if r.base <= addr and addr + nbytes <= r.base + r.nbytes), None)
            if i is None:
                name = what if isinstance(what, str) else what.name
                raise IpcError(f"rank {manifest.rank}: tensor {name} at {addr:#x} ({nbytes} bytes) lies in no "
                               "exported CUDA storage")
            at = addr - records[i].base
            if isinstance(what, str):
                tensors[what] = storages[i][at:at + nbytes]
            else:
                tensors[what.name] = _entry_view(storages[i], at, what)
        return _Opened(manifest.ipc, storages, tensors)

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """The opened source tensor of ``ref`` (a rank read through CUDA IPC)."""
        assert ref.rank is not None
        return self._opened[ref.rank].tensors[ref.name]

    def checksum_block(self, rank: RankCoord) -> torch.Tensor:
        """The rank's opened checksum block (flat ``uint8``)."""
        return self._opened[rank].tensors["__checksums__"]


@dataclass
class DeviceCopies:
    """One plan's ops from CUDA-IPC sources as device copies, compiled once.

    ``runs``: coalesced contiguous ``(dst, src)`` ``uint8`` runs of at least ``RUN_MIN_BYTES``,
    one ``copy_`` each; ``boxes``: every other op in one :class:`~megarefit.transport.boxcopy.BoxCopies`.
    ``nbytes``: bytes copied per launch; ``copies``: ``copy_`` calls plus batched launches."""

    runs: list[tuple[torch.Tensor, torch.Tensor]]
    boxes: BoxCopies | None
    nbytes: int

    @property
    def copies(self) -> int:
        return len(self.runs) + (1 if self.boxes is not None else 0)

    @property
    def device(self) -> torch.device:
        """The destinations' device."""
        return self.runs[0][0].device if self.runs else (self.boxes.device if self.boxes else torch.device("cpu"))

    @classmethod
    def build(cls, plan: Plan, ops: Sequence[CopyOp], source: Callable[[TensorRef], torch.Tensor],
              buffers: Mapping[TensorRef, torch.Tensor], *, run_min_bytes: int = RUN_MIN_BYTES,
              fused: bool | None = None) -> DeviceCopies:
        """Compile ``ops`` (all from ranks ``source`` opens) into copies into ``buffers``."""
        flat: dict[int, torch.Tensor] = {}

        def storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
            s = t.untyped_storage()
            whole = flat.get(s.data_ptr())
            if whole is None:
                whole = flat[s.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),))
            return whole, t.storage_offset() * t.element_size()

        items, pairs = [], []
        for op in ops:
            src, out = source(op.src), buffers[op.dst]
            if op.kind == "contiguous" and src.is_contiguous() and out.is_contiguous():
                s_flat, s_at = storage_bytes(src)
                d_flat, d_at = storage_bytes(out)
                items.append((s_flat, s_at + op.src_byte_offset, d_flat, d_at + op.dst_byte_offset, op.nbytes))
            else:
                pairs.append(op_views(op, src, out))
        runs = []
        for s_flat, s_at, d_flat, d_at, n in _coalesced(items):
            pair = (d_flat[d_at:d_at + n], s_flat[s_at:s_at + n])
            (runs if n >= run_min_bytes else pairs).append(pair)
        nbytes = sum(d.numel() * d.element_size() for d, _ in pairs + runs)
        return cls(runs, BoxCopies(pairs, fused=fused) if pairs else None, nbytes)

    def __call__(self) -> None:
        """Launch every copy on the current stream of the destination's device (asynchronous on a GPU)."""
        for d, s in self.runs:
            d.copy_(s, non_blocking=True)
        if self.boxes is not None:
            self.boxes()


def _coalesced(items: list[tuple[torch.Tensor, int, torch.Tensor, int, int]]
               ) -> list[tuple[torch.Tensor, int, torch.Tensor, int, int]]:
    """Join runs that continue each other on both sides (same source and destination storage)."""
    out: list[tuple[torch.Tensor, int, torch.Tensor, int, int]] = []
    for s, sa, d, da, n in sorted(items, key=lambda i: (i[0].data_ptr(), i[1])):
        if out:
            ps, psa, pd, pda, pn = out[-1]
            if ps is s and pd is d and psa + pn == sa and pda + pn == da:
                out[-1] = (ps, psa, pd, pda, pn + n)
                continue
        out.append((s, sa, d, da, n))
    return out


__all__ = ["RUN_MIN_BYTES", "DeviceCopies", "IpcError", "IpcMode", "IpcSources", "device_uuid", "export_storages",
           "open_storage"]
