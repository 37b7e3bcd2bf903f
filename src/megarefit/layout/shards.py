"""Checks of a set of Megatron shard names against a :class:`SourceLayout`.

:func:`check_ranks` checks the rank coordinates; :func:`resolve_layer_spec` checks every
name on every rank against the spec table and returns the layout with the layer-spec
spelling (local or Transformer-Engine fused norms) and expert layout the names use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from megarefit.errors import LayoutError, MissingParameterError, UnexpectedParameterError, UnknownParameterError
from megarefit.layout.dims import ModelDims
from megarefit.layout.geometry import source_tensors
from megarefit.layout.parallel import RankCoord, SourceLayout
from megarefit.specs import FamilySpec
from megarefit.specs.table import LAYER_SPECS, Condition, LayerSpec


def check_ranks(layout: SourceLayout, ranks: Iterable[tuple[int, int, int]]) -> None:
    """Raise :class:`LayoutError` unless ``ranks`` holds every coordinate of ``layout``'s
    process grid (:meth:`SourceLayout.ranks`). Coordinates of the full ``tp x pp x ep``
    grid that Megatron does not form (``etp == 1 < tp``) are tolerated: callers drop them."""
    expected = set(layout.ranks())
    grid = {RankCoord(t, p, e) for t in range(layout.tp) for p in range(layout.pp) for e in range(layout.ep)}
    given = {RankCoord(*r) for r in ranks}
    missing, extra = sorted(expected - given), sorted(given - grid)
    if missing or extra:
        raise LayoutError(
            f"shards for tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.etp} must hold ranks "
            f"{[tuple(r) for r in sorted(expected)]}; "
            + (f"missing {[tuple(r) for r in missing]}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {[tuple(r) for r in extra]} (wrong tp/pp/ep?)" if extra else "")
        )


def resolve_layer_spec(dims: ModelDims, layout: SourceLayout,
                       names: Mapping[RankCoord, Iterable[str]]) -> SourceLayout:
    """Check provided Megatron names against the layout; return it with the detected layer
    spec (norm spelling) and expert layout.

    ``names`` must hold every rank of ``layout`` and, on each, exactly the
    parameters the spec table implies (either fused-norm spelling, not both).

    Raises:
        LayoutError: a rank is missing or not part of the layout.
        UnknownParameterError / AmbiguousParameterError: a name matches no / two rows.
        MissingParameterError / UnexpectedParameterError: names differ from the layout's,
            naming the tensor and rank.
    """
    check_ranks(layout, names)
    expected_ranks = set(layout.ranks())
    given = {RankCoord(*r): list(v) for r, v in names.items() if RankCoord(*r) in expected_ranks}
    spec, conds = dims.spec, dims.conditions(layout.pp, layout.megatron)
    names_all = [(rank, n) for rank, ns in given.items() for n in ns]
    chosen = _layer_spec_of(spec, conds, names_all, layout.layer_spec)
    resolved = layout.with_layer_spec(chosen)
    expert_layout = _expert_layout_of(spec, conds, names_all, chosen)
    if expert_layout is not None:
        resolved = resolved.with_expert_layout(expert_layout)
    _check_names_per_rank(layout, source_tensors(dims, resolved), given)
    return resolved


def _layer_spec_of(spec: FamilySpec, conds: frozenset[Condition], names_all: list[tuple[RankCoord, str]],
                   preferred: LayerSpec) -> LayerSpec:
    """The layer spec whose spelling explains every name (``preferred`` when both do).

    Raises:
        UnknownParameterError: a name no spelling explains.
        UnexpectedParameterError: the names mix the two spellings.
    """
    def fits(spelling: LayerSpec) -> bool:
        try:
            for rank, n in names_all:
                spec.match(n, conds, spelling, rank=rank)
        except UnknownParameterError:
            return False
        return True

    # The same name can mean different roles in the two layer specs (MLA down-projections:
    # column-parallel in the local spec, replicated in the TE spec): decide the spelling first.
    candidates = [s for s in LAYER_SPECS if fits(s)]
    if not candidates:
        for rank, n in names_all:
            spec.match(n, conds, rank=rank)  # raises UnknownParameterError for a truly unknown name
        examples = []
        for s in LAYER_SPECS:  # a name that only the *other* spelling explains
            for rank, n in names_all:
                try:
                    spec.match(n, conds, s, rank=rank)
                except UnknownParameterError:
                    other = "te" if s == "local" else "local"
                    examples.append(f"{n!r} on rank {rank} is {other}-spec")
                    break
        raise UnexpectedParameterError("shards mix local-spec and Transformer-Engine-spec names: "
                                       + "; ".join(examples))
    return preferred if preferred in candidates else candidates[0]


def _expert_layout_of(spec: FamilySpec, conds: frozenset[Condition], names_all: list[tuple[RankCoord, str]],
                      chosen: LayerSpec) -> str | None:
    """The one expert layout the names use (None without experts).

    Raises:
        UnexpectedParameterError: the names mix expert layouts.
    """
    expert_layouts: dict[str, str] = {}
    for rank, n in names_all:
        row = spec.match(n, conds, chosen, rank=rank).spec
        if row.expert_layout is not None:
            expert_layouts.setdefault(row.expert_layout, f"{n!r} on rank {rank}")
    if len(expert_layouts) > 1:
        raise UnexpectedParameterError("shards mix expert layouts: "
                                       + "; ".join(f"{where} is {lay}" for lay, where in sorted(expert_layouts.items())))
    return next(iter(expert_layouts), None)


def _check_names_per_rank(layout: SourceLayout, expected: Mapping[RankCoord, Iterable[str]],
                          given: Mapping[RankCoord, list[str]]) -> None:
    """Raise unless each rank of ``layout`` holds exactly its ``expected`` names.

    Raises:
        MissingParameterError / UnexpectedParameterError: naming the tensor and rank.
    """
    for rank in sorted(layout.ranks()):
        want, have = set(expected[rank]), set(given[rank])
        if want - have:
            first = sorted(want - have)
            raise MissingParameterError(
                f"rank {rank} lacks {len(first)} expected parameter(s), e.g. {first[:3]} "
                f"(layout tp={layout.tp} pp={layout.pp}: stage {rank.pp} holds layers "
                f"{layout.layer_offset(rank.pp)}..{layout.layer_offset(rank.pp) + layout.stage_layers[rank.pp] - 1})"
            )
        if have - want:
            first = sorted(have - want)
            raise UnexpectedParameterError(
                f"rank {rank} holds {len(first)} parameter(s) the layout does not place there, e.g. {first[:3]} "
                f"(stage {rank.pp} of pp={layout.pp} has {layout.stage_layers[rank.pp]} local layers)"
            )


__all__ = ["check_ranks", "resolve_layer_spec"]
