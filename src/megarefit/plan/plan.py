"""The :class:`Plan`: copy ops and the tensors they touch, with their JSON round trip.

A :class:`Plan` is a list of :class:`~megarefit.plan.ops.CopyOp` s, each ``(source
tensor, source box) -> (target tensor, target box)``, plus the shapes of every tensor it
touches. It is computed from shapes alone (no tensor is read) and checked by
:func:`~megarefit.plan.validate.validate_plan` before any byte moves.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from megarefit.errors import PlanValidationError
from megarefit.layout.dims import ModelDims
from megarefit.layout.parallel import Box, RankCoord, SourceLayout
from megarefit.plan.columns import PlanColumns
from megarefit.plan.ops import CopyOp, Direction, QuantizeStep, TensorMeta, TensorRef, ValueStep, itemsize, make_op
from megarefit.plan.table import OpTable
from megarefit.plan.validate import validate_plan


@dataclass(frozen=True)
class Plan:
    """A validated list of copy ops and the tensors they touch.

    ``ops`` are grouped by target, targets in ``targets`` order, so a receiver
    can finish (and hand over) one target tensor at a time. ``quantize`` lists the
    receiver-side FP8 steps (their staging targets are filled by ops and not handed
    over; their weight / scale targets are produced by the step); ``transforms`` the
    receiver-side value transforms (:class:`ValueStep`: a staging target filled by ops,
    a target produced from it, float32 or the staging's dtype, see ``VALUE_DTYPES``).
    """

    direction: Direction
    dims: ModelDims
    layout: SourceLayout
    dtype: str  # the model's dtype; a tensor's own is in its TensorMeta
    sources: Mapping[TensorRef, TensorMeta]
    targets: Mapping[TensorRef, TensorMeta]
    ops: tuple[CopyOp, ...]
    digest: str = field(default="")
    quantize: tuple[QuantizeStep, ...] = ()
    transforms: tuple[ValueStep, ...] = ()

    @cached_property
    def staging(self) -> frozenset[TensorRef]:
        """Targets filled only to be quantized or transformed on the receiver (not handed over)."""
        return frozenset([q.staging for q in self.quantize] + [t.staging for t in self.transforms])

    @cached_property
    def produced(self) -> dict[TensorRef, QuantizeStep | ValueStep]:
        """Targets a quantize or value step writes (no op does), with their step."""
        out: dict[TensorRef, QuantizeStep | ValueStep] = {ref: q for q in self.quantize for ref in (q.weight, q.scale)}
        out.update((t.target, t) for t in self.transforms)
        return out

    @cached_property
    def ops_by_target(self) -> dict[TensorRef, tuple[CopyOp, ...]]:
        out: dict[TensorRef, list[CopyOp]] = {t: [] for t in self.targets}
        for op in self.ops:
            out[op.dst].append(op)
        return {t: tuple(v) for t, v in out.items()}

    @cached_property
    def columns(self) -> PlanColumns:
        """The ops as int64 columns (:mod:`megarefit.plan.columns`): kept as such by the
        columnar planner, built op by op otherwise.

        Raises:
            KeyError: an op names a tensor the plan does not declare."""
        return self.ops.columns if isinstance(self.ops, OpTable) else PlanColumns.from_ops(self.sources, self.targets, self.ops)

    @cached_property
    def nbytes(self) -> int:
        if isinstance(self.ops, OpTable):
            return int(self.ops.nbytes().sum())
        return sum(op.nbytes for op in self.ops)

    def summary(self) -> dict[str, Any]:
        """Counts per source rank (``None`` for HF sources): ops, contiguous pulls, scratch copies, bytes
        (``scratch_bytes``: of which strided, through scratch)."""
        per: dict[Any, dict[str, int]] = defaultdict(lambda: {"ops": 0, "contiguous": 0, "scratch": 0, "bytes": 0,
                                                              "scratch_bytes": 0})
        if isinstance(self.ops, OpTable):  # whole columns: no op objects
            table, cols = self.ops.sources, self.ops.columns
            ranks = [g.rank for g in table.groups]
            rank_id = {r: i for i, r in enumerate(dict.fromkeys(ranks))}
            of_op = torch.tensor([rank_id[r] for r in ranks], dtype=torch.int64)[table.group[cols.src_id]]
            n = len(rank_id)
            count = torch.bincount(of_op, minlength=n).tolist()
            scratch = torch.bincount(of_op, weights=cols.kind.double(), minlength=n).long().tolist()
            op_bytes = self.ops.nbytes()
            nbytes = torch.zeros(n, dtype=torch.int64).index_add_(0, of_op, op_bytes).tolist()
            strided = torch.zeros(n, dtype=torch.int64).index_add_(0, of_op, op_bytes * cols.kind).tolist()
            for r, i in rank_id.items():
                if count[i]:
                    per[r] = {"ops": count[i], "contiguous": count[i] - scratch[i], "scratch": scratch[i],
                              "bytes": nbytes[i], "scratch_bytes": strided[i]}
            ops: tuple[CopyOp, ...] = ()
        else:
            ops = self.ops
        for op in ops:
            row = per[op.src.rank]
            row["ops"] += 1
            row[op.kind] += 1
            row["bytes"] += op.nbytes
            if op.kind == "scratch":
                row["scratch_bytes"] += op.nbytes
        total = {k: sum(r[k] for r in per.values()) for k in ("ops", "contiguous", "scratch", "bytes", "scratch_bytes")}
        return {"sources": len(self.sources), "targets": len(self.targets), "per_rank": dict(per), "total": total}

    # ---- serialization -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def ref(r: TensorRef) -> list[Any]:
            return [None if r.rank is None else list(r.rank), r.name]

        def meta(r: TensorRef, m: TensorMeta) -> list[Any]:
            return [ref(r), list(m.shape), m.dtype, [b.to_list() for b in m.zero_fill],
                    None if m.storage_shape is None else list(m.storage_shape)]

        return {
            "format": "megarefit.plan/3",  # /3: quantize steps (and value transforms, where a plan has them)
            "direction": self.direction,
            "dims": self.dims.to_dict(),
            "layout": self.layout.to_dict(),
            "dtype": self.dtype,
            "digest": self.digest,
            "sources": [meta(r, m) for r, m in self.sources.items()],
            "targets": [meta(r, m) for r, m in self.targets.items()],
            "ops": [[ref(o.src), o.src_box.to_list(), ref(o.dst), o.dst_box.to_list(), o.transpose] for o in self.ops],
            "quantize": [[ref(q.staging), ref(q.weight), ref(q.scale), list(q.block), q.ue8m0, q.reason]
                         for q in self.quantize],
            **({"transforms": [[ref(t.staging), ref(t.target), t.fn] for t in self.transforms]}
               if self.transforms else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if data.get("format") not in ("megarefit.plan/2", "megarefit.plan/3"):
            raise PlanValidationError(f"not a megarefit plan (format={data.get('format')!r})")

        def ref(x: list[Any]) -> TensorRef:
            return TensorRef(None if x[0] is None else RankCoord(*x[0]), x[1])

        def metas(rows: list[Any]) -> dict[TensorRef, TensorMeta]:
            return {ref(r): TensorMeta(tuple(s), d, tuple(Box.from_list(b) for b in z), None if v is None else tuple(v))
                    for r, s, d, z, v in rows}

        sources, targets = metas(data["sources"]), metas(data["targets"])
        ops = []
        for s, sb, d, db, tr in data["ops"]:
            sr, dr = ref(s), ref(d)
            if sr not in sources or dr not in targets:
                raise PlanValidationError(f"op refers to unknown tensor {sr if sr not in sources else dr}")
            ops.append(make_op(sr, sources[sr].shape, Box.from_list(sb), dr, targets[dr].shape, Box.from_list(db),
                               itemsize(sources[sr].dtype), transpose=tr,
                               src_view=sources[sr].storage_shape is not None,
                               dst_view=targets[dr].storage_shape is not None))
        steps = tuple(QuantizeStep(ref(st), ref(w), ref(sc), tuple(b), ue, why)  # type: ignore[arg-type]
                      for st, w, sc, b, ue, why in data.get("quantize", []))
        transforms = tuple(ValueStep(ref(st), ref(t), fn) for st, t, fn in data.get("transforms", []))
        plan = cls(data["direction"], ModelDims(**data["dims"]), SourceLayout.from_dict(data["layout"]), data["dtype"],
                   sources, targets, tuple(ops), data["digest"], steps, transforms)
        validate_plan(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


__all__ = ["Plan"]
