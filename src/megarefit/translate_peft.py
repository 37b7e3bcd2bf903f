"""Bridge LoRA adapter shards <-> HF PEFT adapter tensors, both directions, exact inverses.

PEFT names are the base HF module with ``lora_A`` / ``lora_B`` under PEFT's ``base_model.model.``
prefix, as Megatron-Bridge 0.6.2's ``save_hf_adapter`` writes them and ``peft`` loads them::

    decoder.layers.L.self_attention.linear_qkv.adapter.linear_in.weight   [r, hidden] (r split over TP)
        -> base_model.model.model.layers.L.self_attn.{q,k,v}_proj.lora_A.weight     (A duplicated)
    decoder.layers.L.self_attention.linear_qkv.adapter.linear_out.weight  [qkv, r]  (QKV groups per rank)
        -> base_model.model.model.layers.L.self_attn.q_proj.lora_B.weight [q, r], k_proj [kv, r], v_proj
    decoder.layers.L.mlp.linear_fc1.adapter.linear_out.weight             [2ffn, r] ([gate_t; up_t] per rank)
        -> ...mlp.gate_proj.lora_B.weight [ffn, r], ...mlp.up_proj.lora_B.weight [ffn, r]
    CanonicalLoRA ``adapter_q`` / ``_k`` / ``_v`` / ``_gate`` / ``_up``: one PEFT module each, as is.

Bridge's own ``export_adapter_weights`` duplicates A the same way (tests/bridge_lora.py compares the
tensors). Going back, LoRA's fused ``linear_qkv`` / ``linear_fc1`` hold one A: q / k / v (gate / up)
``lora_A`` must be equal, else they are refused (such an adapter is a CanonicalLoRA one).

Shards are ``{tp_rank: {megatron_name: local_tensor}}`` of one pipeline stage holding every layer
(pp = 1: layer numbers are global).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megarefit.errors import MissingParameterError, ShapeMismatchError
from megarefit.layout.dims import ModelDims
from megarefit.layout.hf_dims import load_hf_config
from megarefit.layout.lora import adapter_global_shape, adapter_local_shape, part_runs
from megarefit.planner.lora_to_peft import PEFT_PREFIX, peft_config, peft_names
from megarefit.specs.lora import ADAPTER_ROWS, CANONICAL_ROWS, LORA_ROWS, AdapterRow, Factor, Wrapper, peft_row
from megarefit.specs.table import Role


def _assemble(row: AdapterRow, locals_: list[torch.Tensor], dims: ModelDims) -> list[torch.Tensor]:
    """Global tensors, one per base part, from the TP shards of one adapter tensor."""
    tp = len(locals_)
    if row.role is Role.ROW:
        return [torch.cat(locals_, dim=1)]
    if row.role in (Role.QKV, Role.GATED_MLP):
        runs = part_runs(row, dims, tp)
        return [torch.cat([t[r.base_start:r.base_start + r.length] for t in locals_
                           for r in sorted((r for r in runs if r.part == part), key=lambda r: r.part_start)])
                for part in row.parts]
    full = torch.cat(locals_, dim=0)
    return [full] * len(row.parts) if row.factor is Factor.A else [full]


def lora_to_peft(shards: Mapping[int, Mapping[str, torch.Tensor]], hf_config: Any, *,
                 alpha: float) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT tensors and a ``peft_config`` (``r``, ``lora_alpha``, ``target_modules``) from adapter shards.

    Raises:
        MissingParameterError: a TP rank lacks an adapter tensor another rank has.
        UnsupportedAdapterError / UnknownParameterError: as :func:`~megarefit.specs.lora.peft_row`.
    """
    dims = ModelDims.from_hf_config(load_hf_config(hf_config))
    tp = len(shards)
    names = list(shards[0])
    out: dict[str, torch.Tensor] = {}
    ranks_of_r: set[int] = set()
    for name in names:
        row, layer = peft_row(name)
        missing = [t for t in range(tp) if name not in shards[t]]
        if missing:
            raise MissingParameterError(f"adapter {name}: missing on tp ranks {missing}")
        parts = _assemble(row, [shards[t][name] for t in range(tp)], dims)
        ranks_of_r.add(parts[0].shape[0 if row.factor is Factor.A else 1])
        out.update(zip(peft_names(row, layer), parts, strict=True))
    if len(ranks_of_r) != 1:
        raise ShapeMismatchError(f"adapters of more than one rank r: {sorted(ranks_of_r)}")
    return out, peft_config(out, ranks_of_r.pop(), alpha)


def peft_to_lora(state: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any], hf_config: Any, *, tp: int = 1,
                 wrapper: Wrapper = "lora") -> dict[int, dict[str, torch.Tensor]]:
    """Adapter shards of ``wrapper`` at ``tp`` from PEFT tensors (:func:`lora_to_peft`'s inverse).

    Raises:
        ShapeMismatchError: a tensor's shape differs from ``peft_config["r"]`` and the dims; LoRA's
            fused q / k / v (gate / up) ``lora_A`` differ (the adapter is CanonicalLoRA's: pass
            ``wrapper="canonical_lora"``).
        MissingParameterError: a PEFT tensor a row needs is absent, or ``state`` holds one no row reads.
    """
    dims = ModelDims.from_hf_config(load_hf_config(hf_config))
    r = int(peft_config["r"])
    rows = LORA_ROWS if wrapper == "lora" else CANONICAL_ROWS
    layers = sorted({int(n.split("layers.")[1].split(".")[0]) for n in state})
    out: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(tp)}
    used: set[str] = set()
    for layer in layers:
        for row in rows:
            names = peft_names(row, layer)
            if not any(n in state for n in names):
                continue  # this linear carries no adapter
            lacking = [n for n in names if n not in state]
            if lacking:
                raise MissingParameterError(f"PEFT tensors {lacking} are absent (needed by {row.megatron})")
            used.update(names)
            full = _fuse(row, [state[n] for n in names], names, dims, r)
            name = row.megatron.format(layer=layer)
            for t, local in enumerate(_split(row, full, dims, tp)):
                out[t][name] = local
                want = adapter_local_shape(row, dims, r, tp, name=name)
                if tuple(local.shape) != want:
                    raise ShapeMismatchError(f"{name} on tp rank {t}: {tuple(local.shape)}, expected {want}")
    extra = sorted(set(state) - used)
    if extra:
        raise MissingParameterError(f"PEFT tensors no {wrapper} row reads: {extra[:5]}")
    halves = {n.replace(f".{f.value}.", f".{g.value}.") for n in out[0] for f, g in ((Factor.A, Factor.B),
                                                                                     (Factor.B, Factor.A))
              if f".{f.value}." in n} - set(out[0])
    if halves:
        raise MissingParameterError(f"adapters with one factor only: the PEFT tensors of {sorted(halves)[:3]} are absent")
    return out


def _fuse(row: AdapterRow, parts: list[torch.Tensor], names: tuple[str, ...], dims: ModelDims,
          r: int) -> torch.Tensor | list[torch.Tensor]:
    """One global tensor for A (parts must agree) or row / column roles; per-part globals for fused B."""
    if row.factor is Factor.A:
        for n, p in zip(names[1:], parts[1:]):
            if not torch.equal(p, parts[0]):
                raise ShapeMismatchError(f"{n} differs from {names[0]}: {row.megatron} holds one A for "
                                         f"{len(parts)} projections (a CanonicalLoRA adapter: wrapper='canonical_lora')")
        if tuple(parts[0].shape) != adapter_global_shape(row, dims, r):
            raise ShapeMismatchError(f"{names[0]}: {tuple(parts[0].shape)}, expected "
                                     f"{adapter_global_shape(row, dims, r)} (r={r})")
        return parts[0]
    return parts if row.role in (Role.QKV, Role.GATED_MLP) else parts[0]


def _split(row: AdapterRow, full: torch.Tensor | list[torch.Tensor], dims: ModelDims, tp: int) -> list[torch.Tensor]:
    if isinstance(full, list):  # fused B: rank t's local rows, part by part, in the base's order
        runs = part_runs(row, dims, tp)
        chunks = [p.chunk(tp, dim=0) for p in full]
        return [torch.cat([chunks[run.part][t][run.part_start:run.part_start + run.length] for run in runs])
                for t in range(tp)]
    return [c.clone() for c in full.chunk(tp, dim=1 if row.role is Role.ROW else 0)]


__all__ = ["ADAPTER_ROWS", "PEFT_PREFIX", "lora_to_peft", "peft_names", "peft_to_lora"]
