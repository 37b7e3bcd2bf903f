"""Manifests: what a trainer rank publishes about its live shards.

One manifest per Megatron rank ``(tp, pp, ep)``: the model dims and source
layout (so a receiver can plan from shapes alone), the NIXL agent that serves
the bytes, and per tensor its name, role, dtype, local and global shape, and
the address / byte length of its registered memory. The weight **version** is
published separately (it changes every optimizer step; the manifest does not).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from megarefit.errors import MegarefitError
from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.plan import digest_of

FORMAT = "megarefit.transport.manifest/5"  # /2: NIXL memory type; /3: quantization; /4: CUDA IPC; /5: LoRA adapters


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


class ManifestError(MegarefitError):
    """A published manifest is malformed (names the field or tensor)."""


_MAX_ADDRESS = 1 << 64
_MAX_DIMS = 8
_MAX_ELEMENTS = 1 << 48
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8,
             "int32": 4, "uint8": 1, "int8": 1, "float64": 8}


def _count(value: Any, what: str) -> int:
    """A non-negative integer below 2**64 (an element count, address or index)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_ADDRESS:
        raise ManifestError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise ManifestError(f"{what} must be a list of at most {_MAX_DIMS} sizes, got {value!r}"[:200])
    shape = tuple(_count(n, what) for n in value)
    if math.prod(shape) > _MAX_ELEMENTS:
        raise ManifestError(f"{what} {shape} holds more than 2**48 elements")
    return shape


def _region(value: Any, name: str) -> int:
    if value == -1:
        return -1
    return _count(value, f"tensor {name} region")


def _entry(row: Any) -> TensorEntry:
    """One tensor row of a manifest, checked: names and memory as text, sizes and addresses as
    non-negative integers, ``nbytes`` = elements x the dtype's size."""
    if not isinstance(row, list) or not 9 <= len(row) <= 10:
        raise ManifestError(f"tensor entry must be a list of 9 or 10 fields, got {str(row)[:200]}")
    name, role, dtype, shape, gshape, addr, nbytes, mem, dev, *rest = row
    if not all(isinstance(v, str) for v in (name, role, dtype, mem)):
        raise ManifestError(f"tensor entry {str(name)[:80]!r}: name, role, dtype and memory must be text")
    if dtype not in _ITEMSIZE:
        raise ManifestError(f"tensor {name}: unknown dtype {dtype!r}")
    local = _shape(shape, f"tensor {name} shape")
    entry = TensorEntry(name, role, dtype, local, _shape(gshape, f"tensor {name} global shape"),
                        _count(addr, f"tensor {name} address"), _count(nbytes, f"tensor {name} bytes"), mem,
                        _count(dev, f"tensor {name} device"), _region(rest[0] if rest else -1, name))
    if entry.nbytes != math.prod(local) * _ITEMSIZE[dtype]:
        raise ManifestError(f"tensor {name}: {entry.nbytes} bytes, but shape {local} of {dtype} holds "
                            f"{math.prod(local) * _ITEMSIZE[dtype]}")
    return entry


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
class LoraInfo:
    """What a LoRA adapter's manifest adds (:mod:`megarefit.online.trainer.lora_publisher`).

    Attributes:
        r: the adapter rank (LoRA's ``dim``; PEFT's ``r``).
        alpha: LoRA's ``alpha`` (PEFT's ``lora_alpha``): the adapter scales ``B @ A`` by ``alpha / r``.
        base_version: the version of the base weights the adapter trains on, as the engines got them: a full
            refit's version, or -1 for the checkpoint both sides loaded.
    """

    r: int
    alpha: float
    base_version: int = -1

    @classmethod
    def parse(cls, value: Any) -> LoraInfo:
        """Raises ManifestError: not ``[r, alpha, base_version]`` with a positive ``r`` and a finite ``alpha``."""
        if (not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, (int, float)) for v in value)
                or isinstance(value[0], bool) or not isinstance(value[0], int) or not isinstance(value[2], int)
                or value[0] < 1 or not math.isfinite(value[1]) or value[2] < -1):
            raise ManifestError(f"LoRA record {value!r}: expected [r >= 1, finite alpha, base_version >= -1]")
        return cls(value[0], float(value[1]), value[2])


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
    lora: LoraInfo | None = None  # a LoRA adapter's manifest: its tensors are adapter shards (None: model weights)

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
                         self.dtype, self.quantization, None if self.lora is None else asdict(self.lora))

    @cached_property
    def memory_digest(self) -> str:
        """Digest of the served memory (agent and addresses): changes when a trainer re-registers."""
        return digest_of(self.agent, [(t.name, t.addr, t.nbytes, t.mem, t.dev) for t in self.tensors], self.checksums,
                         [asdict(s) for s in self.ipc])

    @cached_property
    def entries_digest(self) -> str:
        """Digest of what a delta record's segments index (agent; each entry's name, role, dtype,
        shapes and bytes, in order), not addresses: unchanged by a declared parameter move."""
        return digest_of(self.agent, [(t.name, t.role, t.dtype, list(t.shape), list(t.global_shape), t.nbytes)
                                      for t in self.tensors])

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "format": self.format, "rank": list(self.rank), "dims": self.dims.to_dict(),
            "layout": self.layout.to_dict(), "agent": self.agent, "dtype": self.dtype,
            "quantization": None if self.quantization is None else [list(self.quantization[0]), self.quantization[1]],
            "checksums": None if self.checksums is None else list(self.checksums),
            "ipc": [asdict(s) for s in self.ipc],
            **({} if self.lora is None else {"lora": [self.lora.r, self.lora.alpha, self.lora.base_version]}),
            "tensors": [[t.name, t.role, t.dtype, list(t.shape), list(t.global_shape), t.addr, t.nbytes, t.mem,
                         t.dev, t.region] for t in self.tensors],
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """The manifest a trainer rank published, checked field by field (it arrives over the
        network: sizes are checked before anything is sized from them).

        Raises:
            ManifestError: not JSON, a format (version skew) mismatch, a missing or mistyped
                field, a negative or implausible size or address, or a byte count that does not
                match the tensor's shape and dtype (names the field or tensor)."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ManifestError(f"manifest format {got!r} is not {FORMAT!r} (version skew between trainer and "
                                "receiver megarefit?)")
        try:
            return cls._parse(data)
        except ManifestError:
            raise
        except (MegarefitError, KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}"[:500]) from None

    @classmethod
    def _parse(cls, data: dict[str, Any]) -> Manifest:
        tensors = tuple(_entry(row) for row in data["tensors"])
        quant = data.get("quantization")
        ipc = tuple(IpcStorage(**s) for s in data.get("ipc", ()))
        for s in ipc:
            if not all(isinstance(v, int) and 0 <= v < _MAX_ADDRESS for v in (s.base, s.nbytes, s.offset, s.dev)):
                raise ManifestError(f"CUDA IPC record sizes out of range: {s}")
        if not isinstance(data["rank"], list) or len(data["rank"]) not in (3, 4):
            raise ManifestError(f"rank {data['rank']!r}: expected [tp, pp, ep] or [tp, pp, ep, copy]")
        rank = RankCoord(*(_count(v, "rank") for v in data["rank"]))
        return cls(rank, ModelDims(**data["dims"]), SourceLayout.from_dict(data["layout"]),
                   str(data["agent"]), tensors, dtype=str(data.get("dtype", "")),
                   quantization=None if quant is None else (tuple(_count(b, "block") for b in quant[0]), bool(quant[1])),
                   checksums=None if data.get("checksums") is None else tuple(data["checksums"]),
                   ipc=ipc, lora=None if data.get("lora") is None else LoraInfo.parse(data["lora"]))

    def summary(self) -> dict[str, Any]:
        return {"rank": tuple(self.rank), "agent": self.agent, "tensors": len(self.tensors),
                "bytes": sum(t.nbytes for t in self.tensors), **asdict(self.layout)}
