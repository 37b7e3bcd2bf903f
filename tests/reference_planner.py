"""The export planner as it was before it moved to columns: one Python object per
source tensor and per op, straight from ``source_tensors`` and ``pieces``. Kept as an
independent implementation for tests/test_plan_columns.py to compare the columnar
planner (:mod:`megarefit.plan_export`) against, op for op."""

from __future__ import annotations

from collections import defaultdict

from megarefit.dims import ModelDims
from megarefit.layout import RankCoord, SourceLayout
from megarefit.plan import CopyOp, Plan, TensorMeta, TensorRef, digest_of, itemsize, make_op, merge_ops, validate_plan
from megarefit.planner import _boxes, grouped_pieces, hf_shapes, pieces, source_tensors, view_shape
from megarefit.specs.table import Role


def reference_megatron_to_hf(dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                             experts: frozenset[int] | None = None) -> Plan:
    """The export plan, one object per op (the pre-columns planner; targets in first-seen order).

    ``experts``: the global routed experts this receiver owns (vLLM expert
    parallelism); expert tensors of other experts get no target and no op.
    ``None``: all experts.

    Each HF element is read from exactly one rank. Replicated tensors are read
    from TP ranks in turn (``k % tp`` for the k-th replicated tensor of a stage)
    to spread the load; tied-embedding copies on the last stage are not read.

    Raises:
        LayoutError: tp/pp/ep do not fit the model.
        PlanValidationError: internal inconsistency (a bug): the plan does not cover exactly.
    """
    tensors = source_tensors(dims, layout)
    sources = {TensorRef(r, n): TensorMeta(t.shape, t.spec.dtype or dtype)
               for r, ts in tensors.items() for n, t in ts.items()}
    targets: dict[TensorRef, TensorMeta] = {}
    by_target: dict[TensorRef, list[CopyOp]] = defaultdict(list)
    replicated_count: dict[int, int] = defaultdict(int)
    for rank, ts in tensors.items():
        for name, t in ts.items():
            if t.spec.duplicate:
                continue
            if not t.spec.role.is_expert and rank.ep != layout.dense_ep(rank.tp):
                continue  # non-expert tensors are replicated over ep: read one existing copy
            if experts is not None and t.expert is not None and t.expert not in experts:
                continue  # an expert this receiver does not own
            if t.spec.role.is_grouped:
                if layout.etp == 1 and rank.tp != layout.expert_tps(rank.ep)[0]:
                    continue  # whole experts on every TP rank: read them from one
                view = view_shape(t.spec, dims, layout)
                sources[TensorRef(rank, name)] = TensorMeta(view, t.spec.dtype or dtype, storage_shape=t.shape)
                item = itemsize(t.spec.dtype or dtype)
                hf_shape = hf_shapes(t.spec, dims, layout)[0]
                per_ep = dims.num_experts // layout.ep
                for hf_name, sbox, dbox in grouped_pieces(t.spec, dims, layout, rank.tp, rank.ep, t.layer):
                    if experts is not None and rank.ep * per_ep + sbox.offsets[0] not in experts:
                        continue  # an expert this receiver does not own
                    dst = TensorRef(None, hf_name)
                    targets.setdefault(dst, TensorMeta(hf_shape, t.spec.dtype or dtype))
                    by_target[dst].append(make_op(TensorRef(rank, name), view, sbox, dst, hf_shape, dbox, item,
                                                  transpose=True, src_view=True))
                continue
            names = t.spec.hf_names(t.layer, t.expert)
            shapes = hf_shapes(t.spec, dims, layout)
            tdtype = t.spec.dtype or dtype
            item = itemsize(tdtype)
            for hf_name, shape in zip(names, shapes):
                targets.setdefault(TensorRef(None, hf_name), TensorMeta(shape, tdtype))
            reader = rank
            if t.spec.role is Role.REPLICATED:
                if rank.tp != 0:
                    continue  # one replica is enough; chosen below from the tp=0 visit
                k = replicated_count[rank.pp] % layout.tp
                replicated_count[rank.pp] += 1
                reader = RankCoord(k, rank.pp, layout.dense_ep(k))
            elif t.spec.role.is_expert and layout.etp == 1 and layout.tp > 1:
                tps = layout.expert_tps(rank.ep)
                if rank.tp != tps[0]:
                    continue  # whole experts on every TP rank: spread experts over the TP ranks that exist
                reader = RankCoord(tps[t.expert % len(tps)], rank.pp, rank.ep)  # same name on every TP rank
            shape_of = dict(zip(names, shapes))
            for p in pieces(t.spec, names, dims, layout, reader.tp):
                sbox, dbox = _boxes(p, t.shape, shape_of[p.hf_name])
                dst = TensorRef(None, p.hf_name)
                by_target[dst].append(make_op(TensorRef(reader, name), t.shape, sbox, dst, shape_of[p.hf_name], dbox,
                                              item))
    # targets in first-seen order: embedding, layers in order, final norm, head
    ops = [op for ref in targets for op in merge_ops(by_target[ref], sources, targets)]
    plan = Plan("megatron_to_hf", dims, layout, dtype, sources, targets, tuple(ops),
                digest_of("megatron_to_hf", dims.to_dict(), layout.to_dict(), dtype,
                          None if experts is None else sorted(experts)))
    validate_plan(plan)
    return plan


