"""Megatron -> HF name maps, and their comparison with another source of truth (Megatron-Bridge).

A name map lists every Megatron parameter of a layout under its *global* name
(global layer index; global expert id for per-expert names, Megatron-Bridge's
convention), with the ranks that hold it, megarefit's role and parallel mode,
and the HF checkpoint name(s) it becomes::

    decoder.layers.3.self_attention.linear_qkv.weight    qkv  column  (0,1,0) (1,1,0)
        -> model.layers.3.self_attn.q_proj.weight, ...k_proj.weight, ...v_proj.weight
    decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight   expert_gated_mlp   (0,1,1) (1,1,1)
        -> model.layers.3.mlp.experts.5.gate_proj.weight, ...up_proj.weight

(On its rank the expert above is ``local_experts.1`` at ep=2 with 8 experts;
``local`` keeps that name.) HF names of multi-tensor roles come in the order
``(q, k, v)`` and ``(gate, up)``, the shard ids of vLLM's ``stacked_params_mapping``.

:func:`compare` checks a map whose ``other_kind`` / ``other_hf`` were filled
from Megatron-Bridge (:mod:`megarefit.integrations.bridge`) and returns every
disagreement: unmapped names, different HF names, incompatible mapping kinds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace

from megarefit.layout import RankCoord, SourceLayout
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import source_tensors
from megarefit.specs.table import ParallelMode, ParamSpec, Role, Stage


@dataclass(frozen=True)
class NameMapEntry:
    """One Megatron parameter (global name) and what it becomes in HF.

    ``other_kind`` / ``other_hf``: the same parameter as another tool maps it
    (Megatron-Bridge: its mapping class, e.g. ``QKVMapping``, ``AutoMapping`` or,
    resolved against a real module, ``AutoMapping:row``); ``None`` = not asked,
    ``""`` kind = the other tool has no mapping for this name.
    """

    megatron: str
    local: str
    ranks: tuple[RankCoord, ...]
    role: str
    parallel: str
    hf: tuple[str, ...]
    duplicate: bool = False  # a tied output-layer copy on the last stage: not exported
    transform: str = ""  # what a 1:1 mapping does besides copying ("": nothing; GLM-5's rotated indexer heads)
    other_kind: str | None = None
    other_hf: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["ranks"] = [list(r) for r in self.ranks]
        d["hf"] = list(self.hf)
        d["other_hf"] = None if self.other_hf is None else list(self.other_hf)
        return d


@dataclass(frozen=True)
class Disagreement:
    """One parameter where megarefit and the other tool differ; ``what`` is
    ``"unmapped"`` (the other tool has no mapping), ``"hf_names"``, ``"kind"`` or
    ``"transform"`` (megarefit reorders rows where the other tool copies them)."""

    megatron: str
    what: str
    megarefit: str
    other: str

    def __str__(self) -> str:
        return f"{self.megatron}: {self.what}: megarefit {self.megarefit} vs {self.other}"


def name_map(dims: ModelDims, layout: SourceLayout) -> list[NameMapEntry]:
    """Every Megatron parameter of ``layout`` (ranks that exist in Megatron's grid), in
    rank order then table order, merged by global name. With tied embeddings and
    pp > 1 the last stage's ``output_layer.weight`` copy is listed with
    ``duplicate=True`` (megarefit never exports it). Legacy ``GroupedMLP`` tensors
    (``experts.weight1`` / ``weight2``, no expert id in the name) list the HF names of
    every expert they hold, over all ep ranks."""
    merged: dict[str, dict] = {}
    per_ep = dims.num_experts // layout.ep if dims.num_experts else 0
    for rank, tensors in source_tensors(dims, layout).items():
        for local, t in tensors.items():
            row = t.spec  # MTP layers keep their own index (0, 1, ...) in a global name
            layer = dims.spec.layer_index(local, Stage.MTP) if row.stage is Stage.MTP else t.layer
            glob = row.megatron.format(layer=layer, expert=t.expert)
            if row.role.is_grouped:
                experts = range(rank.ep * per_ep, (rank.ep + 1) * per_ep)
                hf = tuple(h.format(layer=t.layer, expert=e) for e in experts for h in row.hf)
            else:
                hf = row.hf_names(t.layer, t.expert)
            entry = merged.setdefault(glob, {"local": local, "ranks": [], "role": row.role, "hf": [],
                                             "duplicate": row.duplicate, "transform": _transform(row)})
            entry["ranks"].append(rank)
            entry["hf"].extend(h for h in hf if h not in entry["hf"])
    return [NameMapEntry(name, e["local"], tuple(sorted(set(e["ranks"]))), e["role"].value,
                         e["role"].parallel_mode.value, tuple(e["hf"]), bool(e["duplicate"]), e["transform"])
            for name, e in merged.items()]


VALUE_TRANSFORMS = {"plus_one": "values: HF = Megatron + 1 (Megatron's zero-centered norm)"}
"""How a name map spells each ``ParamSpec.value`` rule."""


PACKED = "packed: dim-0 part"


def _transform(row: ParamSpec) -> str:
    if row.value is not None:
        return VALUE_TRANSFORMS[row.value]
    if row.pack is not None:
        return f"{PACKED} {row.pack[0]} of {row.pack[1]} of the HF tensor"
    if row.head_rotate is None:
        return ""
    return f"rows rotated per head of {row.head_rotate[0]}: Megatron (nope, rope) -> HF (rope, nope)"


# Megatron-Bridge mapping class -> megarefit roles it can stand for. AutoMapping is a
# 1:1 copy whose TP split Bridge decides from the owning module ("AutoMapping:column"
# once resolved against a real model); QKV / gated mappings are the 3:1 / 2:1 ones.
_ONE_TO_ONE = {Role.REPLICATED, Role.COLUMN, Role.ROW, Role.VOCAB, Role.EXPERT_ROW, Role.EXPERT_COLUMN}
KIND_ROLES: dict[str, frozenset[Role]] = {
    "QKVMapping": frozenset({Role.QKV, Role.GATED_QKV}),  # with attention_output_gate: per group [q; gate; k; v]
    "GatedMLPMapping": frozenset({Role.GATED_MLP, Role.EXPERT_GATED_MLP}),
    "AutoMapping": frozenset(_ONE_TO_ONE),
    "ColumnParallelMapping": frozenset({Role.COLUMN, Role.VOCAB}),
    "RowParallelMapping": frozenset({Role.ROW, Role.EXPERT_ROW}),
    "ReplicatedMapping": frozenset({Role.REPLICATED}),
    # gpt-oss's fused experts: Bridge's own classes (transpose, (de-)interleave, stack the experts)
    "GPTOSSMLPGateUpProjMapping": frozenset({Role.EXPERT_GATE_UP_FUSED}),
    "GPTOSSMLPDownProjMapping": frozenset({Role.EXPERT_ROW_FUSED, Role.EXPERT_REPLICATED_FUSED}),
    # Nemotron-H's Mamba mixer: in_proj [z; x; B; C; dt] and conv1d [x; B; C], each part split over TP
    "MambaInProjMapping": frozenset({Role.SEGMENTED}),
    "MambaConv1dMapping": frozenset({Role.SEGMENTED}),
    # Qwen3.5's gated DeltaNet: in_proj [Q; K; V; Z; b; a] from in_proj_qkv / _z / _b / _a and conv1d
    # [Q; K; V], each part split over TP; the gated norm, HF w = Megatron's zero-centered w - 1 + 1
    "GDNLinearMappingSeparate": frozenset({Role.SEGMENTED}),
    "GDNLinearMapping": frozenset({Role.SEGMENTED}),  # Qwen3-Next: in_proj_qkvz / in_proj_ba packed per key head
    "GDNConv1dMapping": frozenset({Role.SEGMENTED}),
    "RMSNorm2ZeroCenteredRMSNormMapping": frozenset({Role.REPLICATED}),
    "_FullDimQKNormMapping": frozenset({Role.COLUMN}),  # MiniMax-M2's q / k norms over all heads, split by heads
    # DeepSeek-V4: compressors / indexers (present in some layers), the hyper-connection alphas packed into one
    # HF hc_*_scale (alpha_pre the primary, post / res the secondaries)
    "_ReplicatedOptional": frozenset({Role.REPLICATED}),
    "_HCAlphaMapping": frozenset({Role.REPLICATED}),
    "_HCAlphaSecondaryMapping": frozenset({Role.REPLICATED}),
}
# Bridge mapping classes that change values, and the name-map transform each one is
KIND_TRANSFORMS = {"RMSNorm2ZeroCenteredRMSNormMapping": VALUE_TRANSFORMS["plus_one"]}
# Bridge mapping classes that pack several Megatron tensors into one HF tensor (DeepSeek-V4's hyper-connection
# alphas into hc_*_scale; alpha_pre is the primary): which part is which, Bridge's classes do not say
PACKING_KINDS = frozenset({"_HCAlphaMapping", "_HCAlphaSecondaryMapping"})


def kind_agrees(kind: str, role: Role) -> bool:
    """Whether a Bridge mapping kind (``Class`` or ``Class:parallelism``) fits ``role``."""
    cls, _, mode = kind.partition(":")
    if role not in KIND_ROLES.get(cls, frozenset()):
        return False
    return not mode or ParallelMode(mode) is role.parallel_mode


def compare(entries: Iterable[NameMapEntry]) -> list[Disagreement]:
    """Every disagreement between megarefit's columns and the ``other_*`` columns."""
    out = []
    for e in entries:
        if e.other_kind is None or e.duplicate:
            continue
        if not e.other_kind:
            out.append(Disagreement(e.megatron, "unmapped", f"{e.role} -> {list(e.hf)}", "no mapping"))
            continue
        if e.other_hf is not None and tuple(e.other_hf) != e.hf:
            out.append(Disagreement(e.megatron, "hf_names", str(list(e.hf)), str(list(e.other_hf))))
        if not kind_agrees(e.other_kind, Role(e.role)):
            out.append(Disagreement(e.megatron, "kind", f"{e.role} ({e.parallel})", e.other_kind))
        elif e.transform != (theirs := _their_transform(e)):
            # a Bridge mapping copies (it never reorders rows), or changes values as KIND_TRANSFORMS says
            out.append(Disagreement(e.megatron, "transform", e.transform or "a straight copy",
                                    theirs or f"{e.other_kind} (a straight copy)"))
    return out


def _their_transform(e: NameMapEntry) -> str:
    """The transform Bridge's mapping class of ``e`` is, as a name map spells it (a packing class: any part)."""
    cls = e.other_kind.partition(":")[0]  # type: ignore[union-attr]
    if cls in PACKING_KINDS:
        return e.transform if e.transform.startswith(PACKED) else f"{PACKED} (one of several)"
    return KIND_TRANSFORMS.get(cls, "")


def with_other(entry: NameMapEntry, kind: str, hf: tuple[str, ...] | None) -> NameMapEntry:
    return replace(entry, other_kind=kind, other_hf=hf)


@dataclass
class NameMapReport:
    """What ``megarefit name-map`` prints: the map, where it came from, disagreements."""

    family: str
    layout: dict[str, object]
    entries: list[NameMapEntry]
    source: str = "megarefit"
    disagreements: list[Disagreement] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"family": self.family, "layout": self.layout, "source": self.source,
                           "entries": [e.to_dict() for e in self.entries],
                           "disagreements": [asdict(d) for d in self.disagreements]}, indent=1)


__all__ = ["Disagreement", "KIND_ROLES", "NameMapEntry", "NameMapReport", "compare", "kind_agrees", "name_map",
           "with_other"]
