"""Merged LoRA refit: the trainer serves ``W + (alpha / r) * B @ A`` per shard, into served copies.

A Megatron-Bridge LoRA model (:mod:`megarefit.specs.lora`) holds, per wrapped linear, the frozen base
shard ``<linear>.to_wrap.weight`` and the adapter factors A ``[r, in]`` and B ``[out, r]``, split over
TP as :mod:`megarefit.layout.lora` says. Per shard the merged weight needs one factor in full, the
one TP split along the product's inner side: A of a column base (split over r), B of a row base
(split over out)::

    column base, rank t:  W_t [out/tp, in]  +=  s * B_t [out/tp, r]  @  A [r, in]       (A gathered)
    row base,    rank t:  W_t [out, in/tp]  +=  s * B [out, r]       @  A_t [r, in/tp]  (B gathered)

:meth:`MergedLoRA.refresh` gathers exactly those factors, every one of them in one ``all_gather`` over
the TP group (adapter bytes only: ``2 * r * hidden`` elements a linear, tiny next to its base), then
writes each merged shard into its served copy, in the shard's dtype. :attr:`MergedLoRA.served` holds
Megatron names as an unwrapped model spells them (``to_wrap.`` dropped; adapters absent), so existing
plans, publishers and receivers, vLLM-sharded targets included, move merged weights unchanged.

Rounding, against Bridge 0.6.2's ``export_hf_weights(..., merge_adapter_weights=True)``: Bridge
gathers both factors whole, splits B per HF tensor and computes, per HF tensor, in float32,
``(W.float() + (alpha / r) * (B.float() @ A.float())).to(W.dtype)`` (``_merge_single_adapter_weight``
over ``LoRAMerge.merge``). This module runs the same operations in the same order on this rank's rows
/ columns of the same product: the float32 product of r terms, the scale, one add, one rounding to the
shard's dtype. Each element is a sum over the same r products; tests/bridge_lora.py measured the
merged bytes bit-equal to Bridge's export (fp32, LoRA and CanonicalLoRA, tp 1 and 2) on CPU. A BLAS
that ordered the r-term sum differently for a sub-block could differ by the last bit of a float32,
before the one rounding to the shard's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarefit.errors import LayoutError, MissingParameterError
from megarefit.layout.dims import ModelDims
from megarefit.layout.hf_dims import load_hf_config
from megarefit.layout.lora import PartRun, adapter_local_shape, part_runs
from megarefit.specs.lora import WRAPPED, AdapterRow, Factor, adapter_row, base_name, is_adapter
from megarefit.specs.table import canonical_name


@dataclass(frozen=True)
class _Part:
    """One adapter of a wrapped linear: its factors, the one gathered, where its rows land."""

    a: torch.Tensor
    b: torch.Tensor
    gathered: Factor
    runs: tuple[PartRun, ...]
    offset: int  # of the gathered factor in the flat send buffer (elements)


@dataclass(frozen=True)
class _Wrapped:
    name: str  # the served (unwrapped) name
    weight: torch.Tensor  # the live base shard
    parts: tuple[_Part, ...]


def adapter_alpha_dim(model: torch.nn.Module) -> tuple[float, int]:
    """``(alpha, dim)`` of a Bridge LoRA model's adapters (``ParallelLinearAdapter`` modules: ``linear_in``,
    ``alpha``, ``dim``), ``dim`` being the adapter rank r.

    Raises:
        LayoutError: no adapter module, or adapters that disagree on ``alpha`` / ``dim``."""
    found = {(float(m.alpha), int(m.dim)) for m in model.modules() if hasattr(m, "linear_in") and hasattr(m, "alpha")}
    if len(found) != 1:
        raise LayoutError(f"expected one (alpha, dim) over the model's LoRA adapters, found {found or 'no adapter'}")
    (alpha, dim), = found
    return alpha, dim


class MergedLoRA:
    """Served copies of one TP rank's LoRA-wrapped linears with the adapters merged in.

    Args:
        params: the rank's parameters by name (``named_parameters()``, ``module.`` prefixes allowed):
            wrapped bases, their adapters and every other parameter.
        dims: model dims (query groups and head_dim place CanonicalLoRA's q / k / v rows).
        alpha, rank: Bridge's ``alpha`` and ``dim``; the merge scale is ``alpha / rank``.
        tp, tp_rank, tp_group: the tensor-parallel group the adapters are split over (``tp_group``
            ``None`` only with ``tp == 1``).

    Raises:
        UnsupportedAdapterError: an adapter megarefit refuses (:func:`~megarefit.specs.lora.adapter_row`).
        MissingParameterError: a wrapped base without its adapter factors, or an adapter without its base.
        LayoutError: a factor's local shape is not what ``rank`` and ``tp`` imply.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], dims: ModelDims, *, alpha: float, rank: int, tp: int = 1,
                 tp_rank: int = 0, tp_group: Any = None) -> None:
        if tp > 1 and tp_group is None:
            raise LayoutError(f"MergedLoRA at tp={tp} needs the tensor-parallel group (tp_group)")
        self.scale, self.tp, self.tp_rank, self._group = alpha / rank, tp, tp_rank, tp_group
        named = {canonical_name(n): p for n, p in params.items() if canonical_name(n) is not None}
        self._wrapped, send = self._collect(named, dims, rank)
        self._send = torch.cat([f.detach().reshape(-1) for f in send]) if send else torch.empty(0)
        self._recv = self._send.new_empty(tp * self._send.numel())
        self._copies = _copies([w.weight for w in self._wrapped])
        largest = max((w.weight.numel() for w in self._wrapped), default=0)  # float32 scratch, reused per linear
        self._scratch = torch.empty(largest, dtype=torch.float32, device=self._send.device)
        self.served: dict[str, torch.Tensor] = {base_name(n): p for n, p in named.items() if not is_adapter(n)}
        self.served.update({w.name: c for w, c in zip(self._wrapped, self._copies)})
        self.refresh()

    def _collect(self, named: Mapping[str, torch.Tensor], dims: ModelDims,
                 rank: int) -> tuple[tuple[_Wrapped, ...], list[torch.Tensor]]:
        groups: dict[str, dict[str, tuple[AdapterRow, torch.Tensor]]] = {}
        for name, p in named.items():
            if is_adapter(name):
                row, _ = adapter_row(name)
                want = adapter_local_shape(row, dims, rank, self.tp, name=name)
                if tuple(p.shape) != want:
                    raise LayoutError(f"adapter {name} on tp rank {self.tp_rank}: local shape {tuple(p.shape)}, "
                                      f"expected {want} (r={rank}, tp={self.tp})")
                module = name.split(".adapter.")[0]
                groups.setdefault(module, {})[name.split(".adapter.")[1]] = (row, p)
        wrapped, send, at = [], [], 0
        for name, p in named.items():
            if WRAPPED not in name or not name.endswith(".weight"):
                continue
            module = name.split(WRAPPED)[0]
            parts = groups.pop(module, None)
            if not parts:
                raise MissingParameterError(f"{name} on tp rank {self.tp_rank} is wrapped but has no adapter")
            built = []
            for a, b in _pairs(name, parts):
                full = a if a[0].gathered else b
                built.append(_Part(a[1].detach(), b[1].detach(), Factor.A if a[0].gathered else Factor.B,
                                   _runs(a[0], dims, self.tp), at))
                send.append(full[1])
                at += full[1].numel()
            wrapped.append(_Wrapped(base_name(name), p.detach(), tuple(built)))
        if groups:
            raise MissingParameterError(f"adapters on tp rank {self.tp_rank} without a wrapped base weight: "
                                        f"{sorted(groups)}")
        return tuple(wrapped), send

    @classmethod
    def from_megatron(cls, model: torch.nn.Module, hf_config: Any) -> MergedLoRA:
        """The served copies of this rank's Bridge LoRA model (``LoRA`` or ``CanonicalLoRA`` applied), TP
        read from ``megatron.core.parallel_state``, ``alpha`` / ``dim`` from the adapter modules.

        Raises:
            LayoutError: the adapters disagree on ``alpha`` / ``dim``, or none is found.
            and what the constructor raises.
        """
        from megatron.core import parallel_state as ps

        alpha, rank = adapter_alpha_dim(model)
        dims = ModelDims.from_hf_config(load_hf_config(hf_config))
        return cls(dict(model.named_parameters()), dims, alpha=alpha, rank=rank,
                   tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   tp_group=ps.get_tensor_model_parallel_group())

    @property
    def gathered_bytes(self) -> int:
        """Bytes one :meth:`refresh` receives from the other TP ranks (the r-split / out-split factors)."""
        return (self.tp - 1) * self._send.numel() * self._send.element_size()

    @property
    def served_copy_bytes(self) -> int:
        """Bytes of the merged copies (what a plain served copy of the same bases would also hold)."""
        return sum(c.numel() * c.element_size() for c in self._copies)

    def refresh(self) -> None:
        """Gather the split factors (one ``all_gather`` over TP) and rewrite every merged copy."""
        full = self._gather()
        for w, copy in zip(self._wrapped, self._copies):
            merged = self._scratch[:w.weight.numel()].view(w.weight.shape)
            merged.copy_(w.weight)  # W.float(): exact
            for part in w.parts:
                _merge_part(merged, part, full, self.scale, self.tp)
            copy.copy_(merged)

    def _gather(self) -> torch.Tensor:
        flat = self._send
        for w in self._wrapped:
            for part in w.parts:
                src = part.a if part.gathered is Factor.A else part.b
                flat[part.offset:part.offset + src.numel()].copy_(src.reshape(-1))  # this step's values
        if self.tp == 1:
            return flat.view(1, -1)
        chunks = list(self._recv.view(self.tp, -1).unbind(0))
        dist.all_gather(chunks, flat, group=self._group)
        return self._recv.view(self.tp, -1)


def _pairs(name: str, parts: Mapping[str, tuple[AdapterRow, torch.Tensor]]) -> list[tuple[tuple, tuple]]:
    """(A, B) per adapter of one wrapped linear, in ``parts`` order (CanonicalLoRA: q, k, v / gate, up)."""
    prefixes = sorted({k.rpartition("linear_")[0] for k in parts}, key=lambda p: min(
        r.parts for r, _ in (parts[k] for k in parts if k.startswith(p))))
    out = []
    for pre in prefixes:
        a, b = parts.get(pre + "linear_in.weight"), parts.get(pre + "linear_out.weight")
        if a is None or b is None:
            raise MissingParameterError(f"{name}: adapter {pre or 'adapter'} lacks "
                                        f"{'linear_in (A)' if a is None else 'linear_out (B)'}")
        out.append((a, b))
    return out


def _runs(row: AdapterRow, dims: ModelDims, tp: int) -> tuple[PartRun, ...]:
    """The base rows adapter ``row`` covers: all of them (LoRA), or one part's runs (CanonicalLoRA)."""
    runs = part_runs(row, dims, tp)
    if len(row.parts) == len(row.base.hf):  # LoRA: B already holds the base's local rows in order
        rows = sum(r.length for r in runs)
        return (PartRun(0, 0, 0, rows),)
    return tuple(r for r in runs if r.part == row.parts[0])


def _merge_part(merged: torch.Tensor, part: _Part, full: torch.Tensor, scale: float, tp: int) -> None:
    """``merged[rows] += scale * (B @ A)`` in float32, Bridge's order: the product, the scale, one add."""
    src = part.a if part.gathered is Factor.A else part.b
    gathered = full[:, part.offset:part.offset + src.numel()].reshape(tp * src.shape[0], src.shape[1])
    a, b = (gathered, part.b) if part.gathered is Factor.A else (part.a, gathered)
    lora = b.float() @ a.float()
    lora.mul_(scale)  # = scale * (B @ A): the same float32 multiply, in place
    for run in part.runs:
        merged[run.base_start:run.base_start + run.length].add_(lora[run.part_start:run.part_start + run.length])


def _copies(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One contiguous buffer per (device, dtype), a view per weight, in order."""
    out: list[torch.Tensor | None] = [None] * len(weights)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, w in enumerate(weights):
        groups.setdefault((w.device, w.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        flat = torch.empty(sum(weights[i].numel() for i in idx), dtype=dtype, device=device)
        at = 0
        for i in idx:
            out[i] = flat[at:at + weights[i].numel()].view(weights[i].shape)
            at += weights[i].numel()
    return [t for t in out if t is not None]


__all__ = ["MergedLoRA", "adapter_alpha_dim"]
