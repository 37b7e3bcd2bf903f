"""Which trainer rank serves each source tensor a plan reads: every copy serves, reads spread.

A plan names each source tensor at its coordinate's first holder (``RankCoord(tp, pp, ep)``,
copy 0). The same bytes are on other ranks too (Megatron's layouts, default rank order):

======================= ================================================================
source row              held whole, the same bytes, by
======================= ================================================================
TP shard (dense roles)  every rank of its pipeline stage with that dense tp rank: each
                        data-parallel copy, and under EP each ep rank paired with that tp
expert shard            its expert-data-parallel copies (same tp, pp, ep); with ``etp == 1``
                        also every TP rank paired with its ep rank (whole experts)
replicated (norms, ..)  every rank of its pipeline stage
======================= ================================================================

:func:`assign_holders` rewrites a columnar plan so that each source tensor is read from one
of its holders, chosen by a rule every receiver applies alone (no coordinator, all agree)::

    turn   = key(group) + layer + expert * L
    copy   = replica mod copies                        (the copies divide the engines evenly)
    holder = copy's block of holders [(turn + reader.index div copies) mod holders per copy]
    holder = holders[(turn + reader.index) mod len(holders)]           (else)

``key(group)`` a CRC-32 of the source row and rank, ``L`` the layers plus one; readers are
numbered ``replica + replicas * worker`` (:class:`Reader`). Where the copies divide the engines
(replicas) evenly, each engine reads one data-parallel copy (each receiver connects to and fences
one copy's ranks, however many copies serve): a whole engine reads every tensor, so each copy
serves the same bytes. Within a copy, or over every holder otherwise, the readers of one tensor,
and the tensors of a row (layer after layer, expert after expert), take consecutive holders:
bytes per trainer GPU come out even over every receiver of every replica.
The choice is data: the rewritten plan's sources name ``RankCoord(tp, pp, ep, copy)``, its
digest changes with the reader, and :func:`served_bytes` sums what each trainer GPU serves.

Source: Megatron-Core's process groups (``tp-cp-ep-dp-pp``, expert grid ``etp-ep-edp-pp``),
:func:`~megarefit.layout.parallel.stage_pair`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch

from megarefit.errors import NoHolderError, PlanValidationError
from megarefit.layout.parallel import RankCoord, SourceLayout
from megarefit.plan import Plan, digest_of
from megarefit.plan.table import OpTable, TensorGroup, TensorTable
from megarefit.specs.table import ParamSpec, Role


@dataclass(frozen=True)
class Reader:
    """A receiver among all that read one trainer: ``index`` in ``[0, count)``, of ``replicas``
    identical engines (0: as many as readers, each reader an engine of its own).

    :meth:`of` numbers worker ``worker`` (of ``workers`` in one vLLM engine) of replica
    ``replica`` (of ``replicas`` identical engines) as ``replica + replicas * worker``.

    Raises:
        PlanValidationError: ``index`` outside ``[0, count)``, or ``count`` not a multiple of ``replicas``."""

    index: int = 0
    count: int = 1
    replicas: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise PlanValidationError(f"reader index {self.index!r} of {self.count!r}: need 0 <= index < count")
        if self.replicas == 0:
            object.__setattr__(self, "replicas", self.count)
        if not (isinstance(self.replicas, int) and self.replicas > 0 and self.count % self.replicas == 0):
            raise PlanValidationError(f"{self.count} readers cannot be {self.replicas!r} identical engines")

    @classmethod
    def of(cls, replica: int, replicas: int, worker: int = 0, workers: int = 1) -> Reader:
        if not (0 <= replica < replicas and 0 <= worker < workers):
            raise PlanValidationError(f"replica {replica} of {replicas}, worker {worker} of {workers}: out of range")
        return cls(replica + replicas * worker, replicas * workers, replicas)


def holders(layout: SourceLayout, row: ParamSpec, rank: RankCoord) -> tuple[RankCoord, ...]:
    """Every rank that holds source row ``row``'s tensors of coordinate ``rank`` byte for byte
    (see the module table), copy by copy: ``layout.copies`` blocks of equal length."""
    role = row.role
    kind = "replicated" if role is Role.REPLICATED else (
        ("expert_whole" if layout.etp == 1 or role is Role.EXPERT_REPLICATED_FUSED else "expert") if role.is_expert
        else "dense")
    return _holders(layout.tp, layout.ep, layout.etp, layout.copies, kind, rank.first)


@lru_cache(maxsize=65536)
def _holders(tp: int, ep: int, etp: int, copies: int, kind: str, rank: RankCoord) -> tuple[RankCoord, ...]:
    pairs = _pairs(tp, ep, etp)
    if kind == "replicated":
        same = pairs
    elif kind.startswith("expert"):
        same = tuple((t, e) for t, e in pairs if e == rank.ep and (kind == "expert_whole" or t == rank.tp))
    else:
        same = tuple((t, e) for t, e in pairs if t == rank.tp)
    return tuple(RankCoord(t, rank.pp, e, c) for c in range(copies) for t, e in same)  # copy-major


def _pairs(tp: int, ep: int, etp: int) -> tuple[tuple[int, int], ...]:
    return SourceLayout(tp, 1, ep, tp, (0,), etp=etp).tp_ep_pairs()


def _group_holders(table: TensorTable, layout: SourceLayout) -> list[tuple[RankCoord, ...]]:
    return [holders(layout, g.spec, g.rank) if g.rank is not None else (None,) for g in table.groups]


def _group_key(g: TensorGroup) -> int:
    return zlib.crc32(f"{g.spec.megatron}{g.suffix}@{tuple(g.rank or ())}".encode())


class _Choice:
    """A source table's holder sets, prepared once; :meth:`index` per reader is one vector op."""

    def __init__(self, table: TensorTable, layout: SourceLayout):
        self.table = table
        self.sets = _group_holders(table, layout)
        size = torch.tensor([len(s) for s in self.sets] or [1], dtype=torch.int64)
        key = torch.tensor([_group_key(g) for g in table.groups] or [0], dtype=torch.int64)
        span = layout.num_layers + layout.mtp_layers + 1
        g = table.group
        self.size = size[g]
        self.base = key[g] + table.layer + 1 + (table.expert + 1) * span
        self.width = max((len(s) for s in self.sets), default=1)
        self.copies = layout.copies

    def index(self, reader: Reader, exclude: frozenset[RankCoord] = frozenset()) -> torch.Tensor:
        """``[sources]`` int64: which of its holders each source row is read from. A row whose
        holder is in ``exclude`` (failed ranks) takes one of its remaining holders, by the same
        rule over those; every other row keeps its holder.

        Raises:
            NoHolderError: every holder of a row is excluded (names the tensor and the ranks)."""
        if reader.replicas % self.copies == 0:  # one copy per engine, the engines spread evenly over the copies
            block = (self.size // self.copies).clamp(min=1)  # (a group of one holder: block 1, copy 0)
            copy = torch.where(self.size >= self.copies, (reader.index % reader.replicas) % self.copies, 0)
            idx = copy * block + (self.base + reader.index // self.copies) % block
        else:
            idx = (self.base + reader.index) % self.size
        if not exclude:
            return idx
        for g, s in enumerate(self.sets):
            gone = [k for k, r in enumerate(s) if r in exclude]
            if not gone:
                continue
            rows = (self.table.group == g) & torch.isin(idx, torch.tensor(gone))
            if not bool(rows.any()):
                continue
            left = torch.tensor([k for k, r in enumerate(s) if r not in exclude], dtype=torch.int64)
            if not len(left):
                grp = self.table.groups[g]
                raise NoHolderError(f"no trainer rank left to serve {grp.spec.megatron}{grp.suffix} (coordinate "
                                    f"{grp.rank}): its holders {[str(r) for r in s]} all failed this cycle")
            idx[rows] = left[(self.base[rows] + reader.index) % len(left)]
        return idx


def holder_index(table: TensorTable, layout: SourceLayout, reader: Reader) -> torch.Tensor:
    """``[sources]`` int64: which of its holders (:func:`holders` order) each source row of
    ``table`` is read from by ``reader``."""
    return _Choice(table, layout).index(reader)


def _columnar(plan: Plan) -> OpTable:
    if not isinstance(plan.ops, OpTable):
        raise PlanValidationError("holder choice needs a columnar plan (plan_megatron_to_hf / plan_megatron_to_vllm); "
                                  "this one was built op by op (from JSON, or import direction)")
    return plan.ops


def assign_holders(plan: Plan, reader: Reader = Reader(), exclude: frozenset[RankCoord] = frozenset()) -> Plan:
    """``plan`` with each source tensor read from the holder :class:`Reader` ``reader`` takes
    (module docstring). With one copy and no other holder (``layout.dp`` one copy, no EP, tp 1)
    the plan comes back as is. ``exclude``: failed ranks; what they served goes to other holders
    of the same tensors (:meth:`_Choice.index`).

    Raises:
        NoHolderError: a source tensor has no holder outside ``exclude``.
        PlanValidationError: ``plan`` is not columnar (built by ``plan_megatron_to_hf`` /
            ``plan_megatron_to_vllm``, with or without FP8): its source rows' spec rows are unknown."""
    ops = _columnar(plan)
    choice = _Choice(ops.sources, plan.layout)
    if choice.width == 1 and not exclude:
        return plan
    table, sets, width = ops.sources, choice.sets, choice.width
    used, pair_of_row = torch.unique(table.group * width + choice.index(reader, exclude), return_inverse=True)
    groups, canon = _canonical([_on(table.groups[p // width], sets[p // width][p % width]) for p in used.tolist()])
    # two rows may now name one tensor (the planner read a replicated tensor from tp ranks in turn):
    # one row per tensor, the ops re-pointed
    rows = torch.stack([canon[pair_of_row], table.layer, table.expert], 1)
    unique, row_of = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((len(unique),), len(table), dtype=torch.int64).scatter_reduce_(
        0, row_of, torch.arange(len(table)), "amin")
    sources = TensorTable(groups, unique[:, 0], unique[:, 1], unique[:, 2])
    cols = dataclasses.replace(ops.columns, src_id=row_of[ops.columns.src_id], src_shape=ops.columns.src_shape[first])
    out = OpTable(cols, sources, ops.targets, ops.itemsize, ops.transpose)
    return Plan(plan.direction, plan.dims, plan.layout, plan.dtype, sources, plan.targets, out,  # type: ignore[arg-type]
                digest_of("holders", plan.digest, reader.index, reader.count), plan.quantize, plan.transforms)


def _canonical(groups: list[TensorGroup]) -> tuple[list[TensorGroup], torch.Tensor]:
    """Equal groups (one rank, row, HF index, suffix and meta) once, and each group's index among them."""
    index: dict[tuple, int] = {}
    out: list[TensorGroup] = []
    of = []
    for g in groups:
        key = (g.rank, id(g.spec), g.hf_index, g.suffix, g.meta)
        if key not in index:
            index[key] = len(out)
            out.append(g)
        of.append(index[key])
    return out, torch.tensor(of or [0], dtype=torch.int64)


def _on(g: TensorGroup, rank: RankCoord) -> TensorGroup:
    return g if g.rank == rank else TensorGroup(rank, g.spec, g.hf_index, g.meta, g.suffix)


def read_ranks(plan: Plan) -> list[RankCoord]:
    """The trainer ranks ``plan``'s ops read from, sorted (a receiver fences only these)."""
    if isinstance(plan.ops, OpTable):
        table = plan.ops.sources
        groups = torch.unique(table.group[plan.ops.columns.src_id]).tolist()
        return sorted({r for g in groups if (r := table.groups[g].rank) is not None})
    return sorted({op.src.rank for op in plan.ops if op.src.rank is not None})


def replacements(plan: Plan, reader: Reader, exclude: frozenset[RankCoord],
                 failed: RankCoord) -> list[RankCoord]:
    """The ranks that serve, once ``failed`` joins ``exclude``, what ``failed`` served to
    ``reader`` of ``plan`` (a plan before :func:`assign_holders`), sorted.

    Raises:
        NoHolderError: as :func:`assign_holders`."""
    ops = _columnar(plan)
    choice = _Choice(ops.sources, plan.layout)
    read = torch.zeros(len(ops.sources), dtype=torch.bool)
    read[ops.columns.src_id] = True
    before, after = choice.index(reader, exclude), choice.index(reader, exclude | {failed})
    out = set()
    for row in torch.nonzero(read).flatten().tolist():
        group = int(ops.sources.group[row])
        if choice.sets[group][int(before[row])] == failed:
            out.add(choice.sets[group][int(after[row])])
    return sorted(out)


def served_by_readers(plan: Plan, readers: Iterable[Reader]) -> dict[RankCoord, int]:
    """Bytes each trainer rank serves when every reader of ``readers`` runs ``plan`` (one
    receiver's plan, before :func:`assign_holders`): the same sums as
    ``served_bytes(assign_holders(plan, r) for r in readers)``, from the columns alone.

    Raises:
        PlanValidationError: as :func:`assign_holders`."""
    ops = _columnar(plan)
    choice = _Choice(ops.sources, plan.layout)
    ranks = sorted({r for s in choice.sets for r in s if r is not None})
    rid = {r: i for i, r in enumerate(ranks)}
    flat = torch.zeros((len(choice.sets), choice.width), dtype=torch.int64)
    for g, s in enumerate(choice.sets):
        flat[g, :len(s)] = torch.tensor([rid[r] for r in s])
    table = ops.sources
    per_row = torch.zeros(len(table), dtype=torch.int64).index_add_(0, ops.columns.src_id, ops.nbytes())
    read = per_row > 0
    group, per_row = table.group[read], per_row[read]
    total = torch.zeros(len(ranks), dtype=torch.int64)
    for reader in readers:
        total.index_add_(0, flat[group, choice.index(reader)[read]], per_row)
    return {r: int(b) for r, b in zip(ranks, total.tolist()) if b}


def served_bytes(plans: Iterable[Plan]) -> dict[RankCoord, int]:
    """Bytes each trainer rank serves to the readers of ``plans`` (each plan: one receiver's,
    after :func:`assign_holders`), summed over every op."""
    out: dict[RankCoord, int] = {}
    for plan in plans:
        for rank, row in plan.summary()["per_rank"].items():
            out[rank] = out.get(rank, 0) + row["bytes"]
    return out


__all__ = ["Reader", "assign_holders", "holder_index", "holders", "read_ranks", "replacements", "served_bytes",
           "served_by_readers"]
