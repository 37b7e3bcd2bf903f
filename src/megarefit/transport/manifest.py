"""Manifests: what a trainer rank publishes about its live shards.

One manifest per Megatron rank ``(tp, pp, ep)``: the model dims and source
layout (so a receiver can plan from shapes alone), the NIXL agent that serves
the bytes, and per tensor its name, role, dtype, local and global shape, and
the address / byte length of its registered memory. The weight **version** is
published separately (it changes every optimizer step; the manifest does not).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.plan import digest_of

FORMAT = "megarefit.transport.manifest/4"  # /2: NIXL memory type and device; /3: quantization; /4: CUDA IPC


@dataclass(frozen=True)
class TensorEntry:
    """One published tensor. ``addr``/``nbytes`` locate its bytes in the publisher's
    registered memory (``addr`` is 0 where no address applies, e.g. the local transport)."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]  # local shape on this rank, elements
    global_shape: tuple[int, ...]  # Megatron shape at TP=1 (vocab padded), elements
    addr: int
    nbytes: int
    mem: str = "DRAM"  # NIXL memory type of the bytes: "DRAM" (host) or "VRAM" (GPU)
    dev: int = 0  # device id for VRAM (the CUDA device index)
    region: int = -1  # start address of the publisher's registered region holding the bytes (-1: unknown);
    # equal regions let a receiver pull neighbouring tensors as one descriptor


@dataclass(frozen=True)
class IpcStorage:
    """One CUDA allocation a trainer rank exports for CUDA IPC (:mod:`~megarefit.transport.cuda_ipc`):
    a PyTorch storage as ``torch.multiprocessing.reductions.reduce_tensor`` shares it.

    ``base`` and ``nbytes`` are the storage's address and size in the trainer process (bytes): a
    served tensor whose ``addr`` lies in ``[base, base + nbytes)`` is read from this storage at
    ``addr - base``. ``handle`` is the CUDA IPC handle of the caching allocator's block holding
    the storage, at byte ``offset`` in it; ``ref_counter`` / ``ref_offset`` / ``event`` /
    ``event_sync`` are PyTorch's IPC bookkeeping (shared reference counter, producer event).
    Bytes are hex strings. ``uuid`` is the GPU's UUID (``torch.cuda.get_device_properties(d).uuid``):
    the same physical GPU whatever ``CUDA_VISIBLE_DEVICES`` each process sees."""

    uuid: str
    dev: int  # the trainer's CUDA device index (its own numbering)
    base: int
    nbytes: int
    handle: str
    offset: int
    ref_counter: str
    ref_offset: int
    event: str
    event_sync: bool
    pid: int  # the exporting process (a handle cannot be opened by the process that made it)


@dataclass(frozen=True)
class Manifest:
    """What one trainer rank publishes; see the module docstring."""

    rank: RankCoord
    dims: ModelDims
    layout: SourceLayout
    agent: str  # NIXL agent name serving this rank's bytes
    tensors: tuple[TensorEntry, ...]
    format: str = FORMAT
    dtype: str = ""  # the model dtype (what the trainer trains in); quantized tensors are served as float8
    quantization: tuple[tuple[int, int], bool] | None = None  # block FP8: (block, ue8m0); None: unquantized
    checksums: tuple[int, int, str, int] | None = None  # (addr, nbytes, mem, dev) of the rank's int64 checksums
    # (:mod:`megarefit.transport.checksum`: each tensor's, in ``tensors`` order), rewritten by every publish
    ipc: tuple[IpcStorage, ...] = ()  # CUDA storages holding the served bytes (and checksums), for same-GPU receivers

    @property
    def model_dtype(self) -> str:
        """The model dtype: ``dtype`` when given, else the dtype most tensors have."""
        if self.dtype:
            return self.dtype
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
        return max(counts, key=counts.__getitem__)

    @cached_property
    def layout_digest(self) -> str:
        """Digest of what decides the plan: dims, layout, dtypes (not addresses, not version)."""
        return digest_of(self.dims.to_dict(), self.layout.to_dict(), sorted({t.dtype for t in self.tensors}),
                         self.dtype, self.quantization)

    @cached_property
    def memory_digest(self) -> str:
        """Digest of the served memory (agent and addresses): changes when a trainer re-registers."""
        return digest_of(self.agent, [(t.name, t.addr, t.nbytes, t.mem, t.dev) for t in self.tensors], self.checksums,
                         [asdict(s) for s in self.ipc])

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "format": self.format, "rank": list(self.rank), "dims": self.dims.to_dict(),
            "layout": self.layout.to_dict(), "agent": self.agent, "dtype": self.dtype,
            "quantization": None if self.quantization is None else [list(self.quantization[0]), self.quantization[1]],
            "checksums": None if self.checksums is None else list(self.checksums),
            "ipc": [asdict(s) for s in self.ipc],
            "tensors": [[t.name, t.role, t.dtype, list(t.shape), list(t.global_shape), t.addr, t.nbytes, t.mem,
                         t.dev, t.region] for t in self.tensors],
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Raises MegarefitError on a format (version skew) mismatch."""
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise MegarefitError(f"manifest format {data.get('format')!r} is not {FORMAT!r} (version skew between "
                                 "trainer and receiver megarefit?)")
        tensors = tuple(TensorEntry(n, r, d, tuple(s), tuple(g), a, b, m, v, *rest)
                        for n, r, d, s, g, a, b, m, v, *rest in data["tensors"])
        quant = data.get("quantization")
        return cls(RankCoord(*data["rank"]), ModelDims(**data["dims"]), SourceLayout.from_dict(data["layout"]),
                   data["agent"], tensors, dtype=data.get("dtype", ""),
                   quantization=None if quant is None else (tuple(quant[0]), bool(quant[1])),
                   checksums=None if data.get("checksums") is None else tuple(data["checksums"]),
                   ipc=tuple(IpcStorage(**s) for s in data.get("ipc", ())))

    def summary(self) -> dict[str, Any]:
        return {"rank": tuple(self.rank), "agent": self.agent, "tensors": len(self.tensors),
                "bytes": sum(t.nbytes for t in self.tensors), **asdict(self.layout)}
