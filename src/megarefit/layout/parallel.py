"""Parallel layouts and boxes: where a shard sits, in elements.

A :class:`Box` is an axis-aligned sub-block of a row-major tensor, given as
per-dim ``offsets`` and ``lengths`` in *elements* (DCP's ``ReadItem`` and
Megatron's ``ShardedTensor`` use the same idea)::

    tensor shape (6, 4)          Box(offsets=(2, 0), lengths=(3, 4))
    row 0  . . . .
    row 1  . . . .
    row 2  # # # #   <- contiguous: full trailing dims, one run of 12 elements
    row 3  # # # #      starting at flat element 8
    row 4  # # # #
    row 5  . . . .

    Box(offsets=(0, 2), lengths=(6, 2)) is strided: six runs of 2 elements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Any

from megarefit.errors import LayoutError
from megarefit.specs.megatron_core import REFERENCE, MegatronCore
from megarefit.specs.table import ExpertLayout, LayerSpec


class RankCoord(tuple):
    """A Megatron rank's coordinates in the model-parallel grid: ``(tp, pp, ep)``, a plain tuple
    (equal to ``(tp, pp, ep)``), or ``(tp, pp, ep, copy)`` for a data-parallel copy past the first.

    ``copy``: which data-parallel copy of the ``(tp, pp, ep)`` shard (0 .. ``SourceLayout.copies``
    - 1): stage-local rank ``r = pair position + pair_period * copy`` in Megatron's default rank
    order (:func:`stage_pair`). Copy 0 is the coordinate's first holder, the one plans name; a
    receiver reads from any holder (:mod:`megarefit.planner.holders`)."""

    __slots__ = ()

    def __new__(cls, tp: Any, pp: int | None = None, ep: int = 0, copy: int = 0) -> RankCoord:
        if pp is None:  # RankCoord(iterable), as ``dataclasses.asdict`` / ``copy.deepcopy`` rebuild a tuple
            return cls(*tp)
        return tuple.__new__(cls, (tp, pp, ep) if copy == 0 else (tp, pp, ep, copy))

    def __getnewargs__(self) -> tuple[int, ...]:
        return tuple(self)

    @property
    def tp(self) -> int:
        return self[0]

    @property
    def pp(self) -> int:
        return self[1]

    @property
    def ep(self) -> int:
        return self[2]

    @property
    def copy(self) -> int:
        return self[3] if len(self) > 3 else 0

    @property
    def first(self) -> RankCoord:
        """The coordinate's first copy (``copy=0``)."""
        return RankCoord(self[0], self[1], self[2])

    def __repr__(self) -> str:
        return f"RankCoord(tp={self.tp}, pp={self.pp}, ep={self.ep}" + (f", copy={self.copy})" if self.copy else ")")

    def __str__(self) -> str:
        return f"(tp={self.tp}, pp={self.pp}, ep={self.ep}" + (f", copy={self.copy})" if self.copy else ")")


@dataclass(frozen=True, slots=True)
class Box:
    """A sub-block of a tensor: ``offsets`` and ``lengths`` per dim, in elements."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def rows(cls, shape: tuple[int, ...], start: int, length: int) -> Box:
        """Rows ``[start, start+length)`` of dim 0, all of every other dim."""
        return cls((start,) + (0,) * (len(shape) - 1), (length,) + tuple(shape[1:]))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def within(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and n > 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    def is_contiguous_in(self, shape: tuple[int, ...]) -> bool:
        """True when the box is one contiguous run of the row-major tensor ``shape``:
        after the first dim with length > 1, every dim is full."""
        lengths = self.lengths
        if len(lengths) <= 1 or lengths[1:] == shape[1:]:
            return True  # the common case: a row range
        started = False
        for o, n, s in zip(self.offsets, lengths, shape):
            if started and (o != 0 or n != s):
                return False
            if n > 1:
                started = True
        return True

    def flat_offset(self, shape: tuple[int, ...]) -> int:
        """Flat element offset of the box's first element in row-major ``shape``."""
        offset = 0
        for o, s in zip(self.offsets, shape):
            offset = offset * s + o
        return offset

    def overlaps(self, other: Box) -> bool:
        return all(
            a < b + m and b < a + n for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def to_list(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]

    @classmethod
    def from_list(cls, data: list[list[int]]) -> Box:
        return cls(tuple(data[0]), tuple(data[1]))


@dataclass(frozen=True)
class SourceLayout:
    """The trainer's Megatron layout.

    Attributes:
        tp, pp, ep: tensor / pipeline / expert parallel sizes.
        padded_vocab_size: Megatron's vocab rows across all TP ranks (HF
            ``vocab_size`` rounded up; see ``ModelDims.padded_vocab_size``).
        stage_layers: decoder layers held by each pipeline stage, in stage order
            (Megatron's even split, or uneven with
            ``num_layers_in_first/last_pipeline_stage``).
        layer_spec: which spelling of the fused norms the names use.
        etp: expert tensor parallel size (Megatron's ``expert_tensor_parallel_size``):
            ``tp`` (0 means "same as tp") or 1.
        expert_layout: how routed experts are stored (see ``ExpertLayout``).
        mtp_layers: Megatron ``mtp_num_layers`` (multi-token-prediction layers on the last stage).
        megatron: the trainer's Megatron-Core version and layout flags, which decide parameter
            names and layouts that moved between releases (default: megarefit's reference
            layout, megatron-core 0.16.1; the Publisher records the trainer's own).
        dp: Megatron's data-parallel size (with context parallel: the dp-cp group's), so that
            ``tp * dp`` ranks make one pipeline stage; every data-parallel copy of a shard serves
            it (:attr:`copies` per ``(tp, ep)`` pair). 0 (default): one copy, the fewest ranks
            Megatron's expert grid needs (``lcm(tp, etp * ep) / tp``).
    """

    tp: int
    pp: int
    ep: int
    padded_vocab_size: int
    stage_layers: tuple[int, ...]
    layer_spec: LayerSpec = "local"
    etp: int = 0
    expert_layout: ExpertLayout = "sequential"
    mtp_layers: int = 0
    megatron: MegatronCore = REFERENCE
    dp: int = 0

    def __post_init__(self) -> None:
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        if self.etp not in (1, self.tp):
            raise LayoutError(f"etp={self.etp} must be 1 or tp={self.tp}")
        if self.expert_layout not in ("sequential", "te_grouped", "legacy_grouped"):
            raise LayoutError(f"unknown expert_layout {self.expert_layout!r}")
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if len(self.stage_layers) != self.pp or any(n < 0 for n in self.stage_layers):
            raise LayoutError(f"stage_layers={self.stage_layers} must list pp={self.pp} non-negative counts")
        if self.padded_vocab_size % self.tp:
            raise LayoutError(f"padded_vocab_size={self.padded_vocab_size} is not divisible by tp={self.tp}")
        if not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise LayoutError(f"mtp_layers must be a non-negative integer, got {self.mtp_layers!r}")
        if self.layer_spec not in ("local", "te"):
            raise LayoutError(f"layer_spec must be 'local' or 'te', got {self.layer_spec!r}")
        if not isinstance(self.megatron, MegatronCore):
            raise LayoutError(f"megatron must be a MegatronCore record, got {self.megatron!r}")
        if self.dp == 0:  # one copy: the fewest data-parallel ranks the expert grid needs
            object.__setattr__(self, "dp", pair_period(self.tp, self.ep, self.etp) // self.tp)
        if not isinstance(self.dp, int) or self.dp < 1 or (self.tp * self.dp) % pair_period(self.tp, self.ep, self.etp):
            raise LayoutError(f"dp={self.dp!r}: tp * dp = {self.tp} * {self.dp} ranks per stage must be a positive "
                              f"multiple of lcm(tp, etp * ep) = {pair_period(self.tp, self.ep, self.etp)} (Megatron's "
                              "expert grid etp-ep-edp inside the stage)")

    @classmethod
    def build(cls, *, tp: int, pp: int, ep: int = 1, padded_vocab_size: int, num_layers: int,
              first_stage_layers: int | None = None, last_stage_layers: int | None = None,
              layer_spec: LayerSpec = "local", etp: int | None = None,
              expert_layout: ExpertLayout = "sequential", mtp_layers: int = 0,
              megatron: MegatronCore = REFERENCE, dp: int = 0) -> SourceLayout:
        """Split ``num_layers`` over ``pp`` stages the way Megatron-Core does.

        Without ``first_stage_layers`` / ``last_stage_layers`` (Megatron's
        ``num_layers_in_first_pipeline_stage`` / ``..._last_...``) the split is
        even; with them, the remaining layers split evenly over the middle stages.

        Raises:
            LayoutError: the layers do not split as asked (e.g. Llama-3.1-405B's
                126 layers at pp=16 need first/last stages of 7).
        """
        if not isinstance(pp, int) or pp < 1:
            raise LayoutError(f"pp must be a positive integer, got {pp!r}")
        fixed = {}
        if first_stage_layers is not None:
            fixed[0] = first_stage_layers
        if last_stage_layers is not None:
            fixed[pp - 1] = last_stage_layers
        rest = num_layers - sum(fixed.values())
        middle = pp - len(fixed)
        if middle == 0:
            ok = rest == 0
        else:
            ok = rest >= 0 and rest % middle == 0
        if not ok or (pp == 1 and len(fixed) > 0 and fixed.get(0) != num_layers):
            hint = ""
            if not fixed and pp > 2 and (num_layers + 2) % pp == 0:
                k = (num_layers + 2) // pp - 1
                hint = f"; try first_stage_layers={k}, last_stage_layers={k}"
            raise LayoutError(
                f"num_layers={num_layers} does not split over pp={pp}"
                + (f" with first/last stage layers {first_stage_layers}/{last_stage_layers}" if fixed else "")
                + hint
            )
        per = rest // middle if middle else 0
        stages = tuple(fixed.get(i, per) for i in range(pp))
        return cls(tp, pp, ep, padded_vocab_size, stages, layer_spec, tp if etp is None else etp, expert_layout,
                   mtp_layers, megatron, dp)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def layer_offset(self, pp_rank: int) -> int:
        """Global index of pipeline stage ``pp_rank``'s local layer 0."""
        return sum(self.stage_layers[:pp_rank])

    def tp_ep_pairs(self) -> tuple[tuple[int, int], ...]:
        """The ``(tp rank, ep rank)`` pairs that exist within one pipeline stage.

        Megatron-Core orders ranks tp-fastest (``"tp-cp-ep-dp-pp"``; cp = 1 here):
        stage-local rank ``r`` has tp rank ``r % tp`` in the dense grid and ep rank
        ``(r // etp) % ep`` in the expert grid (expert-TP ``etp`` fastest). With
        ``etp == tp`` every pair exists. With ``etp == 1 < tp`` they are tied::

            tp=2, ep=2, etp=1   r:   0      1      2      3     (dp=2)
                                     (0,0)  (1,1)  (0,0)  (1,1)   -> no (1,0), no (0,1)

        so a tensor is read from a rank that exists (see :meth:`dense_ep` and
        :meth:`expert_tps`); ranks repeating a pair hold copies (data parallel).
        """
        return _tp_ep_pairs(self.tp, self.ep, self.etp)

    def ranks(self) -> list[RankCoord]:
        """Every distinct ``(tp, pp, ep)`` coordinate of Megatron's process grid (their first copies)."""
        return [RankCoord(t, p, e) for p in range(self.pp) for t, e in self.tp_ep_pairs()]

    @property
    def copies(self) -> int:
        """Data-parallel copies of each ``(tp, pp, ep)`` shard: ``tp * dp / lcm(tp, etp * ep)``."""
        return self.tp * self.dp // pair_period(self.tp, self.ep, self.etp)

    def all_ranks(self) -> list[RankCoord]:
        """Every rank of the grid, each copy of each coordinate (``tp * dp * pp`` of them)."""
        return [RankCoord(t, p, e, c) for p in range(self.pp) for c in range(self.copies)
                for t, e in self.tp_ep_pairs()]

    def dense_ep(self, tp_rank: int) -> int:
        """The ep rank whose copy of TP shard ``tp_rank`` of a non-expert tensor is read
        (the lowest stage-local rank holding that shard: ``r = tp_rank``)."""
        return (tp_rank // self.etp) % self.ep

    def expert_tps(self, ep_rank: int) -> tuple[int, ...]:
        """TP ranks that exist alongside ``ep_rank`` (with ``etp == 1`` each holds whole experts)."""
        return _expert_tps(self.tp, self.ep, self.etp, ep_rank)

    def with_layer_spec(self, layer_spec: LayerSpec) -> SourceLayout:
        return dataclasses.replace(self, layer_spec=layer_spec)

    def with_expert_layout(self, expert_layout: ExpertLayout) -> SourceLayout:
        return dataclasses.replace(self, expert_layout=expert_layout)

    def with_megatron(self, megatron: MegatronCore) -> SourceLayout:
        return dataclasses.replace(self, megatron=megatron)

    def to_dict(self) -> dict[str, object]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "padded_vocab_size": self.padded_vocab_size,
                "stage_layers": list(self.stage_layers), "layer_spec": self.layer_spec, "etp": self.etp,
                "expert_layout": self.expert_layout, "mtp_layers": self.mtp_layers,
                "megatron": self.megatron.to_dict(), **({"dp": self.dp} if self.copies > 1 else {})}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> SourceLayout:
        return cls(d["tp"], d["pp"], d["ep"], d["padded_vocab_size"], tuple(d["stage_layers"]),  # type: ignore[arg-type]
                   d["layer_spec"], d.get("etp", 0), d.get("expert_layout", "sequential"),  # type: ignore[arg-type]
                   d.get("mtp_layers", 0),  # type: ignore[arg-type]
                   MegatronCore.from_dict(d["megatron"]) if "megatron" in d else REFERENCE,  # type: ignore[arg-type]
                   d.get("dp", 0))  # type: ignore[arg-type]


def virtual_stage(pp_rank: int, vp_stage: int, pp: int) -> int:
    """Megatron's interleaved (virtual) pipeline as a plain pipeline of ``pp * vpp`` stages.

    With ``virtual_pipeline_model_parallel_size = vpp``, model chunk ``vp_stage`` of
    pipeline rank ``pp_rank`` holds the layers of stage ``vp_stage * pp + pp_rank`` of a
    ``pp * vpp``-stage pipeline (checked against Megatron-Core's own ``layer_number``s)::

        pp=2, vpp=2, 8 layers    rank 0: chunk 0 = layers 0-1 (+ embedding), chunk 1 = layers 4-5
                                 rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7 (+ final norm, head)

    So plan with ``SourceLayout.build(pp=pp * vpp, ...)`` and publish each chunk as rank
    ``(tp, virtual_stage(pp_rank, vp_stage, pp), ep)``.
    """
    if not 0 <= pp_rank < pp or vp_stage < 0:
        raise LayoutError(f"pipeline rank {pp_rank} of pp={pp}, virtual stage {vp_stage}: out of range")
    return vp_stage * pp + pp_rank


def stage_pair(r: int, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """The ``(tp rank, ep rank)`` of stage-local rank ``r`` in Megatron's default rank order
    (``tp-cp-ep-dp-pp``; expert grid ``etp-ep-edp-pp``): ``(r % tp, (r // etp) % ep)``."""
    return r % tp, (r // etp) % ep


def pair_period(tp: int, ep: int, etp: int) -> int:
    """Stage-local ranks after which the ``(tp, ep)`` pairs repeat (``lcm(tp, etp * ep)``): ranks
    ``0 .. period-1`` hold each pair once, later ones are data-parallel copies."""
    return math.lcm(tp, etp * ep)


@lru_cache(maxsize=256)
def _tp_ep_pairs(tp: int, ep: int, etp: int) -> tuple[tuple[int, int], ...]:
    if ep == 1 or etp == tp:
        return tuple(product(range(tp), range(ep)))
    return tuple(sorted({stage_pair(r, tp, ep, etp) for r in range(pair_period(tp, ep, etp))}))


@lru_cache(maxsize=4096)
def _expert_tps(tp: int, ep: int, etp: int, ep_rank: int) -> tuple[int, ...]:
    return tuple(t for t, e in _tp_ep_pairs(tp, ep, etp) if e == ep_rank)



__all__ = ["Box", "ExpertLayout", "LayerSpec", "RankCoord", "SourceLayout", "pair_period", "stage_pair",
           "virtual_stage"]
