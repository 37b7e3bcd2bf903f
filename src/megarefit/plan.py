"""Plans as data: frozen copy ops, exact-cover validation, JSON round trip.

A :class:`Plan` is a list of :class:`CopyOp` s, each ``(source tensor, source
box) -> (target tensor, target box)``, plus the shapes of every tensor it
touches. It is computed from shapes alone (no tensor is read) and checked by
:func:`validate_plan` before any byte moves.

Offsets are kept in **elements**; ``*_byte_offset`` / ``nbytes`` give the same in
**bytes** for the plan's dtype.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from megarefit.dims import ModelDims
from megarefit.errors import PlanValidationError
from megarefit.layout import Box, RankCoord, SourceLayout

if TYPE_CHECKING:
    from megarefit.plan_columns import PlanColumns

Direction = Literal["megatron_to_hf", "hf_to_megatron", "megatron_to_vllm"]
OpKind = Literal["contiguous", "scratch"]

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise PlanValidationError(f"unsupported dtype {dtype!r}; known: {sorted(ITEMSIZE)}") from None


class TensorRef(NamedTuple):
    """A tensor by name; ``rank`` is the Megatron rank, or ``None`` for an HF tensor."""

    rank: RankCoord | None
    name: str

    def __str__(self) -> str:
        return self.name if self.rank is None else f"{self.name} @ rank {self.rank}"


@dataclass(frozen=True)
class TensorMeta:
    """Shape (elements) and dtype of a tensor a plan touches.

    ``zero_fill`` lists boxes of a *target* that no op writes and that must be
    zero: Megatron's vocab padding rows on import. ``storage_shape`` is set when
    the plan addresses the tensor through a row-major view of another shape
    (Megatron's legacy ``GroupedMLP`` ``weight1`` ``[h, E*2F]`` as ``[E, h, 2F]``).
    """

    shape: tuple[int, ...]
    dtype: str
    zero_fill: tuple[Box, ...] = ()
    storage_shape: tuple[int, ...] | None = None  # the stored tensor's shape when ``shape`` is a view of it

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``src[src_box]`` into ``dst[dst_box]`` (same box lengths, up to leading 1-dims).

    ``kind == "contiguous"``: both boxes are single runs, so one transport
    descriptor moves it (a contiguous sliced pull). ``kind == "scratch"``: one
    side is strided (on export, the target box of a row-parallel tensor); move
    the contiguous run through a scratch buffer and copy strided locally.
    No op is strided on both sides.
    """

    src: TensorRef
    src_box: Box
    dst: TensorRef
    dst_box: Box
    kind: OpKind
    src_offset: int  # flat element offset of src_box's first element
    dst_offset: int  # flat element offset of dst_box's first element
    itemsize: int  # bytes per element
    transpose: bool = False  # dst[dst_box] = src[src_box] with leading 1-dims dropped, transposed (2-D)
    src_view: tuple[int, ...] | None = None  # view the stored source as this shape first
    dst_view: tuple[int, ...] | None = None  # view the stored target as this shape first

    @property
    def numel(self) -> int:
        return self.src_box.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def src_byte_offset(self) -> int:
        return self.src_offset * self.itemsize

    @property
    def dst_byte_offset(self) -> int:
        return self.dst_offset * self.itemsize


def make_op(src: TensorRef, src_shape: tuple[int, ...], src_box: Box,
            dst: TensorRef, dst_shape: tuple[int, ...], dst_box: Box, item: int, *, transpose: bool = False,
            src_view: bool = False, dst_view: bool = False) -> CopyOp:
    """``src_view`` / ``dst_view``: the stored tensor is addressed through the view ``*_shape``."""
    both = src_box.is_contiguous_in(src_shape) and dst_box.is_contiguous_in(dst_shape) and not transpose
    kind: OpKind = "contiguous" if both else "scratch"
    return CopyOp(src, src_box, dst, dst_box, kind, src_box.flat_offset(src_shape), dst_box.flat_offset(dst_shape),
                  item, transpose, src_shape if src_view else None, dst_shape if dst_view else None)


def joined(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` as one box when ``b`` continues ``a`` along one dim (every other
    dim equal), else ``None``."""
    for d, (ao, an, bo) in enumerate(zip(a.offsets, a.lengths, b.offsets)):
        if ao + an == bo and a.offsets[:d] + a.offsets[d + 1:] == b.offsets[:d] + b.offsets[d + 1:] \
                and a.lengths[:d] + a.lengths[d + 1:] == b.lengths[:d] + b.lengths[d + 1:]:
            return Box(a.offsets, a.lengths[:d] + (an + b.lengths[d],) + a.lengths[d + 1:])
    return None


def merge_ops(ops: list[CopyOp], sources: Mapping[TensorRef, TensorMeta],
              targets: Mapping[TensorRef, TensorMeta]) -> list[CopyOp]:
    """Merge consecutive contiguous ops between the same two tensors whose source and
    target boxes continue each other and stay single runs when joined: one larger
    contiguous sliced pull (``sources`` / ``targets`` give the shapes)."""
    out: list[CopyOp] = []
    for op in ops:
        prev = out[-1] if out else None
        if prev is not None and prev.kind == op.kind == "contiguous" and prev.src == op.src and prev.dst == op.dst \
                and prev.src_offset + prev.numel == op.src_offset and prev.dst_offset + prev.numel == op.dst_offset:
            src_box, dst_box = joined(prev.src_box, op.src_box), joined(prev.dst_box, op.dst_box)
            src_shape, dst_shape = sources[op.src].shape, targets[op.dst].shape
            if src_box is not None and dst_box is not None and src_box.is_contiguous_in(src_shape) \
                    and dst_box.is_contiguous_in(dst_shape):
                out[-1] = CopyOp(prev.src, src_box, prev.dst, dst_box, "contiguous", prev.src_offset, prev.dst_offset,
                                 prev.itemsize)
                continue
        out.append(op)
    return out


def _squeeze_leading(lengths: tuple[int, ...], keep: int = 2) -> tuple[int, ...]:
    """``lengths`` without leading 1s, keeping at least ``keep`` dims (a box may carry
    leading length-1 dims the other side lacks: a FusedMoE expert slot)."""
    i = 0
    while i < len(lengths) - keep and lengths[i] == 1:
        i += 1
    return lengths[i:]


@dataclass(frozen=True)
class QuantizeStep:
    """Block-FP8 quantization on the receiver, after the pulls: ``staging`` (a target the
    ops fill, in the model dtype, never handed over) becomes ``weight`` (float8_e4m3fn,
    same shape) and ``scale`` (float32 ``[..., ceil(N/block[0]), ceil(K/block[1])]``: blocks
    over the last two dims, each leading index -- a FusedMoE expert slot -- on its own),
    two targets no op writes. ``reason`` says why the trainer could not quantize it."""

    staging: TensorRef
    weight: TensorRef
    scale: TensorRef
    block: tuple[int, int]
    ue8m0: bool
    reason: str


@dataclass(frozen=True)
class Plan:
    """A validated list of copy ops and the tensors they touch.

    ``ops`` are grouped by target, targets in ``targets`` order, so a receiver
    can finish (and hand over) one target tensor at a time. ``quantize`` lists the
    receiver-side FP8 steps (their staging targets are filled by ops and not handed
    over; their weight / scale targets are produced by the step).
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

    @cached_property
    def staging(self) -> frozenset[TensorRef]:
        """Targets filled only to be quantized on the receiver (not handed over)."""
        return frozenset(q.staging for q in self.quantize)

    @cached_property
    def produced(self) -> dict[TensorRef, QuantizeStep]:
        """Targets a quantize step writes (no op does), with their step."""
        return {ref: q for q in self.quantize for ref in (q.weight, q.scale)}

    @cached_property
    def ops_by_target(self) -> dict[TensorRef, tuple[CopyOp, ...]]:
        out: dict[TensorRef, list[CopyOp]] = {t: [] for t in self.targets}
        for op in self.ops:
            out[op.dst].append(op)
        return {t: tuple(v) for t, v in out.items()}

    @cached_property
    def columns(self) -> PlanColumns:
        """The ops as int64 columns (:mod:`megarefit.plan_columns`): kept as such by the
        columnar planner, built op by op otherwise.

        Raises:
            KeyError: an op names a tensor the plan does not declare."""
        from megarefit.plan_columns import PlanColumns
        from megarefit.plan_table import OpTable

        return self.ops.columns if isinstance(self.ops, OpTable) else PlanColumns.from_plan(self)

    @cached_property
    def nbytes(self) -> int:
        from megarefit.plan_table import OpTable

        if isinstance(self.ops, OpTable):
            return int(self.ops.nbytes().sum())
        return sum(op.nbytes for op in self.ops)

    def summary(self) -> dict[str, Any]:
        """Counts per source rank (``None`` for HF sources): ops, contiguous pulls, scratch copies, bytes."""
        from megarefit.plan_table import OpTable

        per: dict[Any, dict[str, int]] = defaultdict(lambda: {"ops": 0, "contiguous": 0, "scratch": 0, "bytes": 0})
        if isinstance(self.ops, OpTable):  # whole columns: no op objects
            import torch

            table, cols = self.ops.sources, self.ops.columns
            ranks = [g.rank for g in table.groups]
            rank_id = {r: i for i, r in enumerate(dict.fromkeys(ranks))}
            of_op = torch.tensor([rank_id[r] for r in ranks], dtype=torch.int64)[table.group[cols.src_id]]
            n = len(rank_id)
            count = torch.bincount(of_op, minlength=n).tolist()
            scratch = torch.bincount(of_op, weights=cols.kind.double(), minlength=n).long().tolist()
            nbytes = torch.zeros(n, dtype=torch.int64).index_add_(0, of_op, self.ops.nbytes()).tolist()
            for r, i in rank_id.items():
                if count[i]:
                    per[r] = {"ops": count[i], "contiguous": count[i] - scratch[i], "scratch": scratch[i],
                              "bytes": nbytes[i]}
            ops: tuple[CopyOp, ...] = ()
        else:
            ops = self.ops
        for op in ops:
            row = per[op.src.rank]
            row["ops"] += 1
            row[op.kind] += 1
            row["bytes"] += op.nbytes
        total = {k: sum(r[k] for r in per.values()) for k in ("ops", "contiguous", "scratch", "bytes")}
        return {"sources": len(self.sources), "targets": len(self.targets), "per_rank": dict(per), "total": total}

    # ---- serialization -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def ref(r: TensorRef) -> list[Any]:
            return [None if r.rank is None else list(r.rank), r.name]

        def meta(r: TensorRef, m: TensorMeta) -> list[Any]:
            return [ref(r), list(m.shape), m.dtype, [b.to_list() for b in m.zero_fill],
                    None if m.storage_shape is None else list(m.storage_shape)]

        return {
            "format": "megarefit.plan/3",  # /3: quantize steps
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
        plan = cls(data["direction"], ModelDims(**data["dims"]), SourceLayout.from_dict(data["layout"]), data["dtype"],
                   sources, targets, tuple(ops), data["digest"], steps)
        validate_plan(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def digest_of(*parts: Any) -> str:
    """Stable short digest of JSON-serializable parts (the plan-cache key)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def validate_plan(plan: Plan) -> None:
    """Prove the plan is safe to execute.

    Checks, for every op: both tensors are declared, both boxes lie in bounds,
    box lengths agree, the recorded kind and offsets match the boxes, and at
    least one side is a single contiguous run. For every target: op boxes plus
    declared ``zero_fill`` boxes are pairwise disjoint and their volume equals
    the target's element count, i.e. every element is written exactly once.

    The checks run on the plan's columns first (:mod:`megarefit.plan_columns`: whole
    arrays at once); ops and targets those cannot prove (transposed or viewed ops, boxes
    partial in two dims, zero-fill, quantize steps, anything wrong) are checked one by
    one, which is also what names a failure.

    Raises:
        PlanValidationError: naming the op / target and what is wrong.
    """
    from megarefit.plan_columns import vectorized_checks
    from megarefit.plan_table import OpTable

    table = plan.ops if isinstance(plan.ops, OpTable) else None
    try:
        cols = plan.columns
    except KeyError:  # an undeclared tensor: the per-op checks name it
        checks = [(op, plan.sources.get(op.src), plan.targets.get(op.dst)) for op in plan.ops]
        target_rows: list[tuple[TensorRef, TensorMeta, tuple[CopyOp, ...]]] | None = None
        targets: list[TensorRef] = list(plan.targets)
    else:
        bad_ops, odd = vectorized_checks(cols)
        if table is not None:  # single rows of the tables: no names formatted for the rest
            checks = [(table[i], table.sources.meta(int(cols.src_id[i])), table.targets.meta(int(cols.dst_id[i])))
                      for i in bad_ops.tolist()]
            target_rows = _odd_targets(table, odd)
            targets = []
        else:
            checks = [(op, plan.sources.get(op.src), plan.targets.get(op.dst))
                      for op in (plan.ops[i] for i in bad_ops.tolist())]
            names = list(plan.targets)
            targets, target_rows = [names[i] for i in odd.tolist()], None
    for op, src, dst in checks:
        _check_op(op, src, dst)
    produced = plan.produced
    for step in plan.quantize:
        staging, weight, scale = (plan.targets.get(r) for r in (step.staging, step.weight, step.scale))
        if staging is None or weight is None or scale is None:
            raise PlanValidationError(f"quantize step for {step.weight}: staging / weight / scale not declared")
        want_scale = tuple(staging.shape[:-2]) + tuple(-(-n // b) for n, b in zip(staging.shape[-2:], step.block))
        if len(staging.shape) < 2 or weight.shape != staging.shape or weight.dtype != "float8_e4m3fn" or (
                scale.shape != want_scale or scale.dtype != "float32"):
            raise PlanValidationError(f"quantize step for {step.weight}: staging {staging.shape} -> float8 "
                                      f"{weight.dtype} {weight.shape} and float32 scales {scale.dtype} {scale.shape} "
                                      f"(expected {want_scale})")
    if target_rows is None:
        by_target = plan.ops_by_target if targets else {}
        target_rows = [(ref, plan.targets[ref], by_target.get(ref, ())) for ref in targets]
    for ref, meta, writers in target_rows:
        if ref in produced:
            if writers:
                raise PlanValidationError(f"target {ref}: written by ops and by its quantize step")
            continue
        entries = [(op.dst_box, str(op.src)) for op in writers] + [(b, "zero fill") for b in meta.zero_fill]
        for b, who in entries:
            if not b.within(meta.shape):
                raise PlanValidationError(f"target {ref}: box {b} from {who} outside shape {meta.shape}")
        _check_disjoint(ref, entries)
        covered = sum(b.numel for b, _ in entries)
        if covered != meta.numel:
            raise PlanValidationError(
                f"target {ref}: ops cover {covered} of {meta.numel} elements (shape {meta.shape})"
            )


def _odd_targets(table: Any, odd: Any) -> list[tuple[TensorRef, TensorMeta, tuple[CopyOp, ...]]]:
    """``(ref, meta, ops writing it)`` for target rows ``odd`` of a columnar plan: single rows
    when they are few, the whole materialized plan when they are many (cheaper per op)."""
    import torch

    rows = odd.tolist()
    if not rows:
        return []
    dst = table.columns.dst_id
    mask = torch.zeros(len(table.targets), dtype=torch.bool)
    mask[odd] = True
    ops = torch.nonzero(mask[dst]).flatten()
    every = table._all if len(ops) > len(table) // 10 else table  # all at once, or one row at a time
    by: dict[int, list[CopyOp]] = {t: [] for t in rows}
    for i, t in zip(ops.tolist(), dst[ops].tolist()):
        by[t].append(every[i])
    return [(table.targets.ref(t), table.targets.meta(t), tuple(by[t])) for t in rows]


def _check_op(op: CopyOp, src: TensorMeta | None, dst: TensorMeta | None) -> None:
    if src is None or dst is None:
        raise PlanValidationError(f"op {op.src} -> {op.dst}: tensor not declared in plan")
    if not op.src_box.within(src.shape):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: source box {op.src_box} outside shape {src.shape}")
    if not op.dst_box.within(dst.shape):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: target box {op.dst_box} outside shape {dst.shape}")
    if op.transpose:
        squeezed = _squeeze_leading(op.src_box.lengths)
        if len(squeezed) != 2 or squeezed[::-1] != _squeeze_leading(op.dst_box.lengths):
            raise PlanValidationError(f"op {op.src} -> {op.dst}: transposed box lengths do not match: "
                                      f"{op.src_box.lengths} vs {op.dst_box.lengths}")
    elif _squeeze_leading(op.src_box.lengths, 1) != _squeeze_leading(op.dst_box.lengths, 1):
        raise PlanValidationError(
            f"op {op.src} -> {op.dst}: box lengths differ: {op.src_box.lengths} vs {op.dst_box.lengths}"
        )
    src_run, dst_run = op.src_box.is_contiguous_in(src.shape), op.dst_box.is_contiguous_in(dst.shape)
    if not (src_run or dst_run):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: both boxes are strided ({op.src_box}, {op.dst_box})")
    want = "contiguous" if src_run and dst_run and not op.transpose else "scratch"
    if op.kind != want or op.src_offset != op.src_box.flat_offset(src.shape) or (
        op.dst_offset != op.dst_box.flat_offset(dst.shape)
    ):
        raise PlanValidationError(f"op {op.src} -> {op.dst}: kind/offsets inconsistent with its boxes")


def _check_disjoint(ref: TensorRef, entries: list[tuple[Box, str]]) -> None:
    active: list[tuple[Box, str]] = []
    for box, who in sorted(entries, key=lambda e: e[0].offsets):
        start = box.offsets[0] if box.offsets else 0
        active = [(b, w) for b, w in active if not b.offsets or b.offsets[0] + b.lengths[0] > start]
        for other, other_who in active:
            if box.overlaps(other):
                raise PlanValidationError(
                    f"target {ref}: box {box} from {who} overlaps box {other} from {other_who}"
                )
        active.append((box, who))
