"""Where LoRA adapter shards sit: local shapes per TP rank, and the base rows each adapter part adapts.

An adapter's global shape is its row's shape symbols with ``"r"`` the adapter rank
(:class:`~megarefit.specs.lora.AdapterRow`); TP splits dim 0 for ``column`` / ``qkv`` /
``gated_mlp`` roles and dim 1 for ``row``. On TP rank t of a column base, the rows of one adapter
part land in the base's local rows as :class:`PartRun` segments (CanonicalLoRA's q / k / v into
``linear_qkv``, gate / up into ``linear_fc1``)::

    linear_qkv, rank t (G/tp local query groups, n = heads/groups, d = head_dim)
      group 0: [q rows 0 .. n*d)  [k rows 0 .. d)  [v rows 0 .. d)   group 1: [q n*d .. 2n*d) ...
               part 0 (q)         part 1 (k)       part 2 (v)         (rows of the rank's own q / k / v)
    linear_fc1, rank t:   [gate_t (ffn/tp rows); up_t (ffn/tp rows)]

Rows of a part are counted in that part's local shard (``q_proj`` rows ``[t*q/tp, (t+1)*q/tp)`` as
rows 0 .. q/tp): exactly the rows Bridge's ``ColumnParallelLinear`` B of that part holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarefit.errors import LayoutError
from megarefit.layout.dims import ModelDims
from megarefit.specs.lora import AdapterRow
from megarefit.specs.table import ParallelMode, Role


@dataclass(frozen=True)
class PartRun:
    """``length`` rows of adapter part ``part`` (its local rows from ``part_start``) at base local row
    ``base_start``."""

    part: int
    part_start: int
    base_start: int
    length: int


def adapter_global_shape(row: AdapterRow, dims: ModelDims, rank: int) -> tuple[int, int]:
    """``row``'s shape at TP=1 for adapter rank ``rank`` (``"r"``)."""
    a, b = (rank if s == "r" else dims.size(s) for s in row.shape)
    return a, b


def adapter_split_dim(row: AdapterRow) -> int:
    """The dim TP splits: 1 for a ``row`` role (A of a row base), else 0."""
    return 1 if row.role.parallel_mode is ParallelMode.ROW else 0


def adapter_local_shape(row: AdapterRow, dims: ModelDims, rank: int, tp: int, *, name: str = "") -> tuple[int, int]:
    """Local shape on every TP rank (the split is even).

    Raises:
        LayoutError: the split dim does not divide by ``tp`` (A of a column base needs ``r % tp == 0``:
            Bridge builds it as ``ColumnParallelLinear(in, r)``).
    """
    shape = list(adapter_global_shape(row, dims, rank))
    dim = adapter_split_dim(row)
    if shape[dim] % tp:
        what = "the adapter rank r" if row.shape[dim] == "r" else f"{row.shape[dim]!r}"
        raise LayoutError(f"adapter {name or row.megatron}: {what} = {shape[dim]} does not split over tp={tp}")
    shape[dim] //= tp
    return shape[0], shape[1]


def split_size(row: AdapterRow, tp: int, etp: int) -> int:
    """The size of the group ``row`` splits over: ``etp`` (expert-TP) for a routed expert's adapter, else ``tp``.

    Callers pass it as the ``tp`` of :func:`adapter_local_shape` and :func:`part_runs`."""
    return etp if row.expert else tp


def part_runs(row: AdapterRow, dims: ModelDims, tp: int) -> tuple[PartRun, ...]:
    """Where the rows of each base part (``row.parts``) sit in the base's local rows on any TP rank.

    ``qkv`` base: per local query group, q then k then v rows; ``gated_mlp`` / ``expert_gated_mlp``
    (dense, shared or routed experts' ``linear_fc1``): gate then up; other bases: one part, every row.
    ``tp`` is the split group's size (:func:`split_size`).
    """
    base = row.base.role
    if base is Role.QKV:
        groups, d = dims.num_query_groups // tp, dims.head_dim
        n = dims.num_attention_heads // dims.num_query_groups
        runs, at = [], 0
        for g in range(groups):
            for part, size in ((0, n * d), (1, d), (2, d)):
                runs.append(PartRun(part, g * size, at, size))
                at += size
        return tuple(runs)
    if base in (Role.GATED_MLP, Role.EXPERT_GATED_MLP):  # dense, shared or routed experts' [gate_t; up_t]
        f = dims.size(row.base.shape[0]) // 2 // tp
        return PartRun(0, 0, 0, f), PartRun(1, 0, f, f)
    return (PartRun(0, 0, 0, dims.size(row.base.shape[0]) // (tp if base.parallel_mode is ParallelMode.COLUMN else 1)),)


__all__ = ["PartRun", "adapter_global_shape", "adapter_local_shape", "adapter_split_dim", "part_runs", "split_size"]
