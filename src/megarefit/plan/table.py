"""A plan held as columns: tensor tables named on demand, ops as int64 rows.

A 671B MoE export plan has ~640k source tensors and ~360k ops; one Python object
per tensor and per op costs seconds before a byte moves. Here a plan is kept as
data the planner can emit with a few whole-array operations:

* :class:`TensorGroup`: the tensors one spec-table row (one HF name template, for
  targets) gives on one rank. They share a shape and dtype and differ only in
  layer and expert.
* :class:`TensorTable`: one row per tensor -- ``(group, layer, expert)``, ``-1``
  for "none" -- and a :class:`~collections.abc.Mapping` ``TensorRef -> TensorMeta``
  built the first time someone asks for names::

      row t   group[t]  layer[t]  expert[t]     name (on demand)
      0       0         -1        -1            embedding.word_embeddings.weight
      1       3         0         -1            decoder.layers.0.self_attention.linear_qkv.weight
      2       7         5         17            decoder.layers.5.mlp.experts.local_experts.17.linear_fc1.weight

  Source tables hold Megatron's local layer and expert indices (as
  ``named_parameters()`` spells them on that rank), target tables HF's global ones.
* :class:`OpTable`: the ops as :class:`~megarefit.plan.columns.PlanColumns` (ids into
  the two tables, boxes padded to ``D`` dims), a :class:`~collections.abc.Sequence`
  of :class:`~megarefit.plan.CopyOp` whose items are built one at a time on demand.

Validation, byte counts and per-rank summaries read the columns; only code that
walks every op by name (the JSON form, the in-process translator) materializes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from megarefit.layout.parallel import Box, RankCoord
from megarefit.plan.columns import PlanColumns
from megarefit.plan.ops import CopyOp, TensorMeta, TensorRef
from megarefit.specs.table import ParamSpec


@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one table row on one rank (``rank is None``: HF tensors, the row's
    ``hf_index``-th HF name). Every instance has ``meta``'s shape and dtype."""

    rank: RankCoord | None
    spec: ParamSpec
    hf_index: int | None  # None: Megatron names; k: the row's k-th HF name template
    meta: TensorMeta
    suffix: str = ""  # appended to every name (FP8 ``_scale_inv``, receiver ``:staging``)

    def name(self, layer: int, expert: int) -> str:
        """The instance's name (``-1``: no layer / expert index in the name)."""
        lay, exp = (None if layer < 0 else layer), (None if expert < 0 else expert)
        if self.hf_index is None:
            return self.spec.megatron_name(lay, exp) + self.suffix
        return self.spec.hf[self.hf_index].format(layer=lay, expert=exp) + self.suffix


class TensorTable(Mapping["TensorRef", "TensorMeta"]):
    """Tensors as rows ``(group, layer, expert)`` (int64 columns of equal length), in
    plan order. Reading it as a mapping formats every name once (seconds for ~10^6
    tensors): use :meth:`ref` / :meth:`meta` for single rows."""

    def __init__(self, groups: Sequence[TensorGroup], group: torch.Tensor, layer: torch.Tensor,
                 expert: torch.Tensor):
        self.groups = tuple(groups)
        self.group, self.layer, self.expert = group, layer, expert

    def __len__(self) -> int:
        return int(self.group.shape[0])

    def ref(self, i: int) -> TensorRef:
        g = self.groups[int(self.group[i])]
        return TensorRef(g.rank, g.name(int(self.layer[i]), int(self.expert[i])))

    def meta(self, i: int) -> TensorMeta:
        return self.groups[int(self.group[i])].meta

    @cached_property
    def _dict(self) -> dict[TensorRef, TensorMeta]:
        out: dict[TensorRef, TensorMeta] = {}
        groups = self.groups
        for g, lay, exp in zip(self.group.tolist(), self.layer.tolist(), self.expert.tolist()):
            grp = groups[g]
            out[TensorRef(grp.rank, grp.name(lay, exp))] = grp.meta
        if len(out) != len(self):
            raise ValueError(f"tensor table names {len(self) - len(out)} tensor(s) twice")
        return out

    @cached_property
    def index(self) -> dict[TensorRef, int]:
        """Row of each tensor (formats every name)."""
        return {ref: i for i, ref in enumerate(self._dict)}

    def __getitem__(self, ref: object) -> TensorMeta:
        return self._dict[ref]  # type: ignore[index]

    def __iter__(self) -> Iterator[TensorRef]:
        return iter(self._dict)

    def __contains__(self, ref: object) -> bool:
        return ref in self._dict

    def _per_group(self, value: Callable[[TensorMeta | None], object]) -> torch.Tensor:
        """``[groups, ...]`` int64 of ``value(meta)``, computed once per distinct meta (a plan
        has ~10^4 groups over a few dozen shapes)."""
        seen: dict[TensorMeta, int] = {}
        index = [seen.setdefault(g.meta, len(seen)) for g in self.groups]
        rows = [value(m) for m in seen] or [value(None)]
        return torch.tensor(rows, dtype=torch.int64)[torch.tensor(index or [0], dtype=torch.int64)]

    def shapes(self, width: int) -> torch.Tensor:
        """``[tensors, width]`` int64: every row's shape, left-padded with 1."""
        table = self._per_group(lambda m: [1] * width if m is None else [1] * (width - len(m.shape)) + list(m.shape))
        return table.reshape(-1, width)[self.group]

    def ndims(self) -> torch.Tensor:
        """``[tensors]`` int64: every row's number of dims."""
        return self._per_group(lambda m: 0 if m is None else len(m.shape))[self.group]

    def numels(self) -> torch.Tensor:
        return self._per_group(lambda m: 0 if m is None else m.numel)[self.group]

    def lookup(self, refs: Iterable[TensorRef]) -> dict[TensorRef, TensorMeta]:
        """The metas of those ``refs`` that are rows of this table, naming no other row: each
        name is matched against the name templates of its rank's groups (layer and expert
        read back), then its row is found in the columns. For a few refs in a big table (a
        plan's quantize steps) instead of formatting every name (``table[ref]``)."""
        if "_dict" in self.__dict__:
            return {r: self._dict[r] for r in refs if r in self._dict}
        out: dict[TensorRef, TensorMeta] = {}
        for ref in refs:
            for gi, g in enumerate(self.groups):
                m = _group_pattern(g).fullmatch(ref.name) if g.rank == ref.rank else None
                if m is None:
                    continue
                found = m.groupdict()
                layer, expert = (int(found[k]) if found.get(k) is not None else -1 for k in ("layer", "expert"))
                if bool(((self.group == gi) & (self.layer == layer) & (self.expert == expert)).any()):
                    out[ref] = g.meta
                    break
        return out


def _group_pattern(g: TensorGroup) -> re.Pattern[str]:
    """``g``'s names as a regex (``{layer}`` / ``{expert}`` captured), cached per group."""
    template = g.spec.megatron if g.hf_index is None else g.spec.hf[g.hf_index]
    key = (template, g.suffix)
    pattern = _PATTERNS.get(key)
    if pattern is None:
        parts = re.split(r"\{(layer|expert)\}", template)
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>0|[1-9][0-9]*)" for i, p in enumerate(parts))
        pattern = _PATTERNS[key] = re.compile(regex + re.escape(g.suffix))
    return pattern


_PATTERNS: dict[tuple[str, str], re.Pattern[str]] = {}


class OpTable(Sequence["CopyOp"]):
    """A plan's ops as columns (:class:`PlanColumns`, ids into ``sources`` / ``targets``)
    plus per-op ``itemsize`` (bytes per element) and ``transpose``; ``table[i]`` builds
    one :class:`CopyOp`, iterating builds them all once."""

    def __init__(self, columns: PlanColumns, sources: TensorTable, targets: TensorTable, itemsize: torch.Tensor,
                 transpose: torch.Tensor):
        self.columns, self.sources, self.targets = columns, sources, targets
        self.itemsize, self.transpose = itemsize, transpose

    def __len__(self) -> int:
        return int(self.columns.src_id.shape[0])

    @staticmethod
    def _op(src: TensorRef, s_meta: TensorMeta, dst: TensorRef, d_meta: TensorMeta, so: list[int], sl: list[int],
            do: list[int], dl: list[int], kind: int, src_flat: int, dst_flat: int, item: int,
            transpose: bool) -> CopyOp:
        ns, nd = len(s_meta.shape), len(d_meta.shape)
        return CopyOp(src, Box(tuple(so[len(so) - ns:]), tuple(sl[len(sl) - ns:])), dst,
                      Box(tuple(do[len(do) - nd:]), tuple(dl[len(dl) - nd:])),
                      "scratch" if kind else "contiguous", src_flat, dst_flat, item, transpose,
                      s_meta.shape if s_meta.storage_shape is not None else None,
                      d_meta.shape if d_meta.storage_shape is not None else None)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice) or "materialized" in self.__dict__:
            return self.materialized[i]
        c = self.columns
        s, t = int(c.src_id[i]), int(c.dst_id[i])
        return self._op(self.sources.ref(s), self.sources.meta(s), self.targets.ref(t), self.targets.meta(t),
                        c.src_off[i].tolist(), c.src_len[i].tolist(), c.dst_off[i].tolist(), c.dst_len[i].tolist(),
                        int(c.kind[i]), int(c.src_flat[i]), int(c.dst_flat[i]), int(self.itemsize[i]),
                        bool(self.transpose[i]))

    @cached_property
    def materialized(self) -> tuple[CopyOp, ...]:
        c = self.columns
        src_refs, dst_refs = list(self.sources._dict), list(self.targets._dict)
        s_metas, d_metas = list(self.sources._dict.values()), list(self.targets._dict.values())
        s_box = _boxes(c.src_off, c.src_len, self.sources.ndims()[c.src_id])
        d_box = _boxes(c.dst_off, c.dst_len, self.targets.ndims()[c.dst_id])
        kinds = ("contiguous", "scratch")
        out = []
        for s, t, sb, db, k, sf, df, it, tr in zip(c.src_id.tolist(), c.dst_id.tolist(), s_box, d_box, c.kind.tolist(),
                                                   c.src_flat.tolist(), c.dst_flat.tolist(), self.itemsize.tolist(),
                                                   self.transpose.tolist()):
            sm, dm = s_metas[s], d_metas[t]
            out.append(CopyOp(src_refs[s], sb, dst_refs[t], db, kinds[k], sf, df, it, tr,
                              sm.shape if sm.storage_shape is not None else None,
                              dm.shape if dm.storage_shape is not None else None))
        return tuple(out)

    def __iter__(self) -> Iterator[CopyOp]:
        return iter(self.materialized)

    # tuple-like: ``plan.ops + (op,)``, ``plan.ops == other_plan.ops``
    def __add__(self, other: Sequence[CopyOp]) -> tuple[CopyOp, ...]:
        return self.materialized + tuple(other)

    def __radd__(self, other: Sequence[CopyOp]) -> tuple[CopyOp, ...]:
        return tuple(other) + self.materialized

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and tuple(other) == self.materialized

    __hash__ = None  # type: ignore[assignment]

    def nbytes(self) -> torch.Tensor:
        """``[ops]`` int64: bytes each op moves."""
        return self.columns.src_len.prod(1) * self.itemsize


def _boxes(off: torch.Tensor, length: torch.Tensor, ndim: torch.Tensor) -> list[Box]:
    """One :class:`Box` per row of padded ``[ops, D]`` columns, cut to ``ndim`` dims; equal
    rows share one object (a plan repeats a few template boxes over layers and experts)."""
    if not len(off):
        return []
    width = off.shape[1]
    rows, inverse = torch.unique(torch.cat([off, length, ndim[:, None]], 1), dim=0, return_inverse=True)
    made = [Box(tuple(r[width - r[-1]:width]), tuple(r[2 * width - r[-1]:2 * width])) for r in rows.tolist()]
    return [made[i] for i in inverse.tolist()]


__all__ = ["OpTable", "TensorGroup", "TensorTable"]
