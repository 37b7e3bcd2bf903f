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

A Transformer-Engine grouped linear (``TEGroupedMLP``: ``<linear>.to_wrap.weight{e}`` per local expert) has one
adapter under Bridge's default ``share_expert_adapters``: every local expert's weight takes the same product,
each merged and served under its own name (``mlp.experts.linear_fc1.weight{e}``). Bridge's per-expert and
shared-outer grouped adapters (3-D factors) are refused.

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarefit.errors import LayoutError, MissingParameterError, UnsupportedAdapterError
from megarefit.layout.dims import ModelDims
from megarefit.layout.hf_dims import load_hf_config
from megarefit.layout.lora import PartRun, adapter_local_shape, part_runs
from megarefit.layout.megatron_model import refit_tensors, unwrap
from megarefit.specs.lora import WRAPPED, AdapterRow, Factor, adapter_row, base_name, is_adapter
from megarefit.specs.table import ParallelMode, canonical_name

_WRAPPED_WEIGHT = re.compile(re.escape(WRAPPED) + r"weight[0-9]*$")  # a base (TE grouped: weight{expert})


@dataclass(frozen=True)
class _Part:
    """One adapter of a wrapped linear: its factors, the one gathered, over which group, where its rows land."""

    a: torch.Tensor
    b: torch.Tensor
    gathered: Factor
    expert: bool  # split over expert-TP (a routed expert's adapter), else over TP
    runs: tuple[PartRun, ...]
    offset: int  # of the gathered factor in its group's flat send buffer (elements)


@dataclass(frozen=True)
class _Wrapped:
    name: str  # the served (unwrapped) name
    weight: torch.Tensor  # the live base shard
    parts: tuple[_Part, ...]


@dataclass(frozen=True)
class _Group:
    """A group the adapters split over (TP, or expert-TP for routed experts): size, rank, process group, and the
    adapter rank ``r`` (Bridge's ``dim``) of the adapters split over it."""

    size: int
    rank: int
    handle: Any
    r: int


def adapter_alpha_dims(model: torch.nn.Module) -> tuple[float, int, int]:
    """``(alpha, dim, expert dim)`` of a Bridge LoRA model's adapters: routed experts' adapters (``is_expert``)
    may have their own ``dim`` (Bridge's ``normalize_moe_lora``: ``dim // moe_router_topk``); the expert dim is
    ``dim`` where no expert is adapted.

    Raises:
        LayoutError: no adapter module, adapters of one kind that disagree on ``alpha`` / ``dim``, or alphas that
            differ between the kinds."""
    kinds: dict[bool, set[tuple[float, int]]] = {False: set(), True: set()}
    for m in model.modules():
        if hasattr(m, "linear_in") and hasattr(m, "alpha"):
            kinds[bool(getattr(m, "is_expert", False))].add((float(m.alpha), int(m.dim)))
    dense, expert = kinds[False] or kinds[True], kinds[True] or kinds[False]
    if len(dense) != 1 or len(expert) != 1 or next(iter(dense))[0] != next(iter(expert))[0]:
        raise LayoutError(f"expected one (alpha, dim) over the model's dense LoRA adapters and one over its routed "
                          f"experts' (same alpha), found {kinds[False] or 'none'} and {kinds[True] or 'none'}")
    (alpha, dim), (_, expert_dim) = next(iter(dense)), next(iter(expert))
    return alpha, dim, expert_dim


def adapter_alpha_dim(model: torch.nn.Module) -> tuple[float, int]:
    """``(alpha, dim)`` of a Bridge LoRA model's adapters (``ParallelLinearAdapter`` modules: ``linear_in``,
    ``alpha``, ``dim``), ``dim`` being the adapter rank r.

    Raises:
        LayoutError: no adapter module, or adapters that disagree on ``alpha`` / ``dim`` (Bridge's
            ``normalize_moe_lora`` gives experts ``dim // moe_router_topk``: not supported)."""
    found = {(float(m.alpha), int(m.dim)) for m in model.modules() if hasattr(m, "linear_in") and hasattr(m, "alpha")}
    if len(found) != 1:
        raise LayoutError(f"expected one (alpha, dim) over the model's LoRA adapters, found {found or 'no adapter'} "
                          "(adapters of several ranks, e.g. Bridge's normalize_moe_lora=True, are not supported)")
    (alpha, dim), = found
    return alpha, dim


class MergedLoRA:
    """Served copies of one rank's LoRA-wrapped linears with the adapters merged in.

    Args:
        params: the rank's parameters by name (``named_parameters()``, ``module.`` prefixes allowed):
            wrapped bases, their adapters and every other parameter.
        dims: model dims (query groups and head_dim place CanonicalLoRA's q / k / v rows).
        alpha, rank: Bridge's ``alpha`` and ``dim``; the merge scale is ``alpha / rank``.
        expert_rank: the routed experts' adapter rank, where it differs (Bridge's ``normalize_moe_lora``:
            ``dim // moe_router_topk``, their scale ``alpha / expert_rank``); default ``rank``.
        tp, tp_rank, tp_group: the tensor-parallel group dense and shared-expert adapters are split over
            (``tp_group`` ``None`` only with ``tp == 1``).
        etp, etp_rank, etp_group: the expert-tensor-parallel group routed experts' adapters are split over
            (Megatron's ``expert_tensor_parallel_size``; ``etp_group`` ``None`` only with ``etp == 1``).
        shared_expert_overlap: the model's ``moe_shared_expert_overlap``.

    Raises:
        UnsupportedAdapterError: an adapter megarefit refuses (:func:`~megarefit.specs.lora.adapter_row`); a
            routed expert's ``linear_fc2`` adapter at ``etp > 1``, or a shared expert's under
            ``shared_expert_overlap`` at ``tp > 1`` (Bridge's forward is not the merged product there:
            Megatron-Bridge issue #5634).
        MissingParameterError: a wrapped base without its adapter factors, or an adapter without its base.
        LayoutError: a factor's local shape is not what ``rank`` and ``tp`` / ``etp`` imply.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], dims: ModelDims, *, alpha: float, rank: int, tp: int = 1,
                 tp_rank: int = 0, tp_group: Any = None, etp: int = 1, etp_rank: int = 0, etp_group: Any = None,
                 shared_expert_overlap: bool = False, expert_rank: int | None = None) -> None:
        for what, size, group in (("tp", tp, "tensor"), ("etp", etp, "expert-tensor")):
            if size > 1 and (tp_group if what == "tp" else etp_group) is None:
                raise LayoutError(f"MergedLoRA at {what}={size} needs the {group}-parallel group ({what}_group)")
        self.scale = alpha / rank
        self.alpha = alpha
        self._groups = {False: _Group(tp, tp_rank, tp_group, rank),
                        True: _Group(etp, etp_rank, etp_group, expert_rank or rank)}
        named = {canonical_name(n): p for n, p in params.items() if canonical_name(n) is not None}
        if shared_expert_overlap:
            _check_shared_overlap(named, tp)
        self._wrapped, send = self._collect(named, dims)
        device = next((w.weight.device for w in self._wrapped), torch.device("cpu"))
        self._send = {k: torch.cat([f.detach().reshape(-1) for f in v]) if v else torch.empty(0, device=device)
                      for k, v in send.items()}
        self._recv = {k: v.new_empty(self._groups[k].size * v.numel()) for k, v in self._send.items()}
        self._copies = _copies([w.weight for w in self._wrapped])
        largest = max((w.weight.numel() for w in self._wrapped), default=0)  # float32 scratch, reused per linear
        self._scratch = torch.empty(largest, dtype=torch.float32, device=device)
        self.served: dict[str, torch.Tensor] = {base_name(n): p for n, p in named.items() if not is_adapter(n)}
        self.served.update({w.name: c for w, c in zip(self._wrapped, self._copies)})
        self.refresh()

    def _adapters(self, named: Mapping[str, torch.Tensor],
                  dims: ModelDims) -> dict[str, dict[str, tuple[AdapterRow, torch.Tensor]]]:
        """Adapter factors by wrapped module, then by their name under ``.adapter.``, shapes checked."""
        groups: dict[str, dict[str, tuple[AdapterRow, torch.Tensor]]] = {}
        for name, p in named.items():
            if is_adapter(name):
                row, _ = adapter_row(name)
                g = self._groups[row.expert]
                if row.expert and g.size > 1 and row.base.role.parallel_mode is ParallelMode.ROW:
                    raise UnsupportedAdapterError(
                        f"adapter {name} at expert_tensor_parallel_size={g.size}: Bridge's adapter on a routed expert's "
                        "linear_fc2 does not compute W + (alpha / r) B A there (its linear_in leaves a partial sum the "
                        "MoE dispatcher then counts once per expert-TP rank: Megatron-Bridge issue #5634), so no merged "
                        "weight serves what the trainer computes; train with expert_tensor_parallel_size=1, or leave "
                        "the experts' linear_fc2 out of target_modules")
                if p.ndim != 2:
                    raise UnsupportedAdapterError(
                        f"adapter {name}: a {p.ndim}-D factor {tuple(p.shape)}, Bridge's GroupedExpertLinearAdapter (one "
                        "adapter per grouped expert, share_expert_adapters=False) or SharedOuterGroupedExpertAdapter "
                        "(experts_shared_outer_loras=True), not verified here; train with Bridge's default "
                        "share_expert_adapters=True (one adapter shared by an EP rank's grouped experts)")
                want = adapter_local_shape(row, dims, g.r, g.size, name=name)
                if tuple(p.shape) != want:
                    raise LayoutError(f"adapter {name} on {'etp' if row.expert else 'tp'} rank {g.rank}: local shape "
                                      f"{tuple(p.shape)}, expected {want} (r={g.r}, split over {g.size})")
                module = name.split(".adapter.")[0]
                groups.setdefault(module, {})[name.split(".adapter.")[1]] = (row, p)
        return groups

    def _collect(self, named: Mapping[str, torch.Tensor],
                 dims: ModelDims) -> tuple[tuple[_Wrapped, ...], dict[bool, list[torch.Tensor]]]:
        groups = self._adapters(named, dims)
        wrapped: list[_Wrapped] = []
        send: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        at = {False: 0, True: 0}
        built: dict[str, tuple[_Part, ...]] = {}  # by wrapped module: a grouped linear's experts share one adapter
        for name, p in named.items():
            if not _WRAPPED_WEIGHT.search(name):
                continue
            module = name.split(WRAPPED)[0]
            if module not in built:
                parts = groups.pop(module, None)
                if not parts:
                    raise MissingParameterError(f"{name} on tp rank {self._groups[False].rank} is wrapped but has no "
                                                "adapter")
                built[module] = tuple(self._part(a, b, dims, send, at) for a, b in _pairs(name, parts))
            wrapped.append(_Wrapped(base_name(name), p.detach(), built[module]))
        if groups:
            raise MissingParameterError(f"adapters on tp rank {self._groups[False].rank} without a wrapped base "
                                        f"weight: {sorted(groups)}")
        return tuple(wrapped), send

    def _part(self, a: tuple[AdapterRow, torch.Tensor], b: tuple[AdapterRow, torch.Tensor], dims: ModelDims,
              send: dict[bool, list[torch.Tensor]], at: dict[bool, int]) -> _Part:
        """One adapter's factors as a :class:`_Part`; its gathered factor appended to its group's send list."""
        gathered, expert = a[0].gathered, a[0].expert
        full = a if gathered else b
        part = _Part(a[1].detach(), b[1].detach(), Factor.A if gathered else Factor.B, expert,
                     _runs(a[0], dims, self._groups[expert].size), at[expert])
        send[expert].append(full[1])
        at[expert] += full[1].numel()
        return part

    @classmethod
    def from_megatron(cls, model: torch.nn.Module, hf_config: Any) -> MergedLoRA:
        """The served copies of this rank's Bridge LoRA model (``LoRA`` or ``CanonicalLoRA`` applied), TP and
        expert-TP read from ``megatron.core.parallel_state``, ``alpha`` / ``dim`` from the adapter modules; the
        parameters and the persistent buffers a refit serves (:func:`~megarefit.layout.megatron_model.refit_tensors`:
        the router's ``expert_bias``).

        Raises:
            LayoutError: the adapters disagree on ``alpha`` / ``dim``, or none is found.
            and what the constructor raises.
        """
        from megatron.core import parallel_state as ps

        alpha, rank, expert_rank = adapter_alpha_dims(model)
        dims = ModelDims.from_hf_config(load_hf_config(hf_config))
        overlap = bool(getattr(getattr(unwrap(model)[0], "config", None), "moe_shared_expert_overlap", False))
        return cls(refit_tensors(model), dims, alpha=alpha, rank=rank,
                   tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   tp_group=ps.get_tensor_model_parallel_group(),
                   etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
                   etp_group=ps.get_expert_tensor_parallel_group(check_initialized=False),
                   shared_expert_overlap=overlap, expert_rank=expert_rank)

    @property
    def tp(self) -> int:
        return self._groups[False].size

    @property
    def gathered_bytes(self) -> int:
        """Bytes one :meth:`refresh` receives from the other ranks of TP and expert-TP (the split factors)."""
        return sum((self._groups[k].size - 1) * v.numel() * v.element_size() for k, v in self._send.items())

    @property
    def served_copy_bytes(self) -> int:
        """Bytes of the merged copies (what a plain served copy of the same bases would also hold)."""
        return sum(c.numel() * c.element_size() for c in self._copies)

    def refresh(self) -> None:
        """Gather the split factors (one ``all_gather`` over TP, one over expert-TP where split) and rewrite every
        merged copy."""
        full = {k: self._gather(k) for k in (False, True)}
        for w, copy in zip(self._wrapped, self._copies):
            merged = self._scratch[:w.weight.numel()].view(w.weight.shape)
            merged.copy_(w.weight)  # W.float(): exact
            for part in w.parts:
                g = self._groups[part.expert]
                _merge_part(merged, part, full[part.expert], self.alpha / g.r, g.size)
            copy.copy_(merged)

    def _gather(self, expert: bool) -> torch.Tensor:
        flat, group = self._send[expert], self._groups[expert]
        for w in self._wrapped:
            for part in w.parts:
                if part.expert is expert:
                    src = part.a if part.gathered is Factor.A else part.b
                    flat[part.offset:part.offset + src.numel()].copy_(src.reshape(-1))  # this step's values
        if group.size == 1 or flat.numel() == 0:
            return flat.view(1, -1)
        chunks = list(self._recv[expert].view(group.size, -1).unbind(0))
        dist.all_gather(chunks, flat, group=group.handle)
        return self._recv[expert].view(group.size, -1)


def _check_shared_overlap(tensors: Mapping[str, torch.Tensor], tp: int) -> None:
    """Refuse shared-expert adapters under ``moe_shared_expert_overlap`` at TP > 1 (Megatron-Bridge issue #5634:
    the base drops its TP collectives there and the adapter does not follow, so the trainer's forward is not
    W + (alpha / r) B A)."""
    shared = next((n for n in tensors if is_adapter(n) and ".mlp.shared_experts." in n), None)
    if shared is not None and tp > 1:
        raise UnsupportedAdapterError(
            f"adapter {shared} with moe_shared_expert_overlap=True at tp={tp}: Bridge's shared-expert adapter does "
            "not compute W + (alpha / r) B A there (Megatron-Bridge issue #5634); train with "
            "moe_shared_expert_overlap=False, or leave the shared experts out of target_modules")


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


__all__ = ["MergedLoRA", "adapter_alpha_dim", "adapter_alpha_dims"]
