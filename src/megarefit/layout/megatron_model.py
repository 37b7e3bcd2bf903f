"""A Megatron-Core model's layout, read from Megatron itself (what ``Publisher.from_megatron`` uses).

Megatron already knows everything a refit needs about the trainer's side; restating it by hand
is a chance to disagree with the model actually held. For each model chunk this module reads:

    source                                   gives
    ---------------------------------------  ---------------------------------------------
    megatron.core.parallel_state             tp / pp / ep ranks and sizes, expert-TP size,
                                             virtual pipeline size
    chunk.config (TransformerConfig)         the same sizes (cross-checked), num_layers,
                                             uneven first/last stage layers, mtp_num_layers
    get_num_layers_to_build /                layers per (virtual) stage, as Megatron builds
    get_transformer_layer_offset             them (every stage, not only this rank's)
    chunk.vocab_size, chunk.vp_stage         padded vocab rows, the chunk's virtual stage
    the parameter names                      layer spec (local / Transformer-Engine fused
                                             norms) and expert layout, from the spec table
    megatron.core.__version__ + config       the ``MegatronCore`` record (verified releases)

A chunk may come wrapped: Megatron-Core ``DistributedDataParallel``, ``Float16Module`` and
``torch.nn.parallel.DistributedDataParallel`` all hold the model as ``.module``; the Megatron DDP
wrapper is kept (``MegatronChunk.ddp``) for the deferred param-gather check
(:mod:`megarefit.online.trainer.param_sync`). An interleaved pipeline (``vpp > 1``) is a plain pipeline of
``pp * vpp`` virtual stages: chunk ``v`` of pipeline rank ``p`` is stage ``v * pp + p``
(:func:`~megarefit.layout.parallel.virtual_stage`).

Megatron is imported only inside these functions (the rest of megarefit needs no Megatron).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarefit.errors import LayoutError, MegarefitError, UnknownParameterError
from megarefit.layout.dims import DEFAULT_VOCAB_DIVISOR, ModelDims, load_hf_config
from megarefit.layout.parallel import RankCoord, SourceLayout, pair_period, stage_pair, virtual_stage
from megarefit.specs import FAMILIES
from megarefit.specs.megatron_core import ASSUME_ENV, MegatronCore
from megarefit.specs.table import LAYER_SPECS, ExpertLayout, LayerSpec, canonical_name


@dataclass(frozen=True)
class MegatronChunk:
    """One model chunk of one Megatron rank, as a Publisher serves it.

    Attributes:
        rank: ``(tp rank, stage, ep rank)``; ``stage`` is the virtual stage with ``vpp > 1``.
        layout: the whole trainer's layout (``layout.pp`` counts virtual stages).
        params: :func:`refit_tensors` of the unwrapped chunk (live tensors, Megatron's names).
        ddp: the Megatron-Core ``DistributedDataParallel`` wrapper, or ``None``.
        vp_stage: the chunk's virtual pipeline stage (``None`` without an interleaved pipeline).
        replica: this process repeats another's shard (a data-parallel copy, :attr:`ParallelState.replica`),
            which serves it; one process per coordinate serves.
    """

    rank: RankCoord
    layout: SourceLayout
    params: Mapping[str, torch.Tensor] = dataclasses.field(repr=False)
    ddp: Any = dataclasses.field(default=None, repr=False)
    vp_stage: int | None = None
    replica: bool = False
    fits: frozenset[str] = frozenset(LAYER_SPECS)  # layer specs the names fit (before agree())
    experts: str | None = None  # the expert layout the names show, if any (before agree())


def refit_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a refit reads from one rank: ``named_parameters()`` plus the persistent
    buffers a spec table names as weights (the MoE router's ``expert_bias``, HF
    ``e_score_correction_bias``). Live tensors, not copies."""
    rows = [row for fam in FAMILIES for row in fam.entries]
    out = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        canon = canonical_name(name)
        if canon is not None and any(row.matches(canon) for row in rows):
            out[name] = buf
    return out


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """(the Megatron model inside ``model``'s wrappers, the Megatron-Core DDP wrapper or ``None``).

    Follows ``.module`` through Megatron-Core ``DistributedDataParallel``, ``Float16Module`` and
    torch's DDP until a module that wraps nothing.

    Raises:
        LayoutError: a fully sharded wrapper (Megatron FSDP, torch FSDP): its parameters are
            shards of the TP shards, not what a rank serves."""
    ddp = None
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        name = type(model).__name__
        if "FullyShardedDataParallel" in name or "FSDP" in name or getattr(
                getattr(model, "ddp_config", None), "use_megatron_fsdp", False):
            raise LayoutError(f"{name}: fully sharded data parallelism splits each rank's parameters further; "
                              "from_megatron serves whole TP/EP shards (Megatron-Core DDP, with or without the "
                              "distributed optimizer): gather them first, or serve from a DDP model")
        if ddp is None and hasattr(model, "ddp_config"):
            ddp = model
        model = model.module
    return model, ddp


def megatron_core_of(model: torch.nn.Module, *, assume: str | None = None) -> MegatronCore:
    """The Megatron-Core record of ``model`` (a ``GPTModel`` / ``MambaModel``, possibly wrapped): the
    imported ``megatron.core.__version__`` and the layout flags of its ``config``.
    ``assume``: a verified version to read an unverified one as (default ``$MEGAREFIT_ASSUME_MEGATRON``).

    Raises:
        TypeError: ``model`` has no Megatron ``config``.
        UnverifiedMegatronError: the version is not verified (and no ``assume``).
    """
    import megatron.core

    assume = assume or os.environ.get(ASSUME_ENV) or None
    return MegatronCore.from_config(megatron.core.__version__, _config_of(unwrap(model)[0]), assume=assume)


def _config_of(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no Megatron config (.config): pass a Megatron-Core model "
                        "(GPTModel / MambaModel, possibly wrapped in DDP or Float16Module)")
    return config


@dataclass(frozen=True)
class ParallelState:
    """This process's coordinates and sizes in Megatron's process grid (``parallel_state``)."""

    tp: int
    pp: int
    ep: int
    etp: int
    vpp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_cp_rank: int = 0  # data-parallel rank with context parallelism (Megatron's dp-cp group)
    dp_cp: int = 1  # that group's size

    @classmethod
    def read(cls) -> ParallelState:
        """Read ``megatron.core.parallel_state``.

        Raises:
            LayoutError: Megatron's model parallel state is not initialized in this process.
        """
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise LayoutError("Megatron's model parallel state is not initialized in this process: call "
                              "megatron.core.parallel_state.initialize_model_parallel(...) before from_megatron")
        return cls(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                   ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
                   vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                   tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   ep_rank=ps.get_expert_model_parallel_rank(),
                   dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
                   dp_cp=ps.get_data_parallel_world_size(with_context_parallel=True))

    @property
    def replica(self) -> bool:
        """Whether another process holds this one's ``(tp, pp, ep)`` shard first (a data-parallel copy).

        Megatron's default rank order puts stage-local rank ``r = tp_rank + tp * dp_cp_rank`` at
        :func:`~megarefit.layout.parallel.stage_pair`; the pairs repeat every
        :func:`~megarefit.layout.parallel.pair_period` ranks, before which each is held once.

        Raises:
            LayoutError: this process's tp / ep ranks are not where that order puts them.
        """
        r = self.tp_rank + self.tp * self.dp_cp_rank
        if stage_pair(r, self.tp, self.ep, self.etp) != (self.tp_rank, self.ep_rank):
            raise LayoutError(f"tp rank {self.tp_rank}, ep rank {self.ep_rank} at data-parallel rank {self.dp_cp_rank}: "
                              f"not Megatron's default rank order tp-cp-ep-dp-pp (tp={self.tp}, etp={self.etp}, "
                              f"ep={self.ep}); from_megatron reads that order only")
        return r >= pair_period(self.tp, self.ep, self.etp)

    @property
    def copy(self) -> int:
        """Which data-parallel copy of its ``(tp, pp, ep)`` shard this process holds
        (:attr:`RankCoord.copy <megarefit.layout.parallel.RankCoord.copy>`; 0: the first).

        Raises:
            LayoutError: as :attr:`replica`."""
        self.replica  # noqa: B018 -- checks the rank order
        return (self.tp_rank + self.tp * self.dp_cp_rank) // pair_period(self.tp, self.ep, self.etp)

    def check_config(self, config: Any) -> None:
        """Refuse a ``TransformerConfig`` whose parallel sizes differ from the process grid.

        Raises:
            LayoutError: naming the config field, its value and ``parallel_state``'s.
        """
        pairs = [("tensor_model_parallel_size", self.tp, 1), ("pipeline_model_parallel_size", self.pp, 1),
                 ("expert_model_parallel_size", self.ep, 1), ("virtual_pipeline_model_parallel_size", self.vpp, 1),
                 ("expert_tensor_parallel_size", self.etp, self.tp)]  # (field, parallel_state's, config's None)
        wrong = [f"config.{field}={getattr(config, field)!r} but parallel_state says {value}"
                 for field, value, unset in pairs
                 if hasattr(config, field) and (unset if getattr(config, field) is None else getattr(config, field))
                 != value]
        if wrong:
            raise LayoutError("the model's TransformerConfig disagrees with Megatron's process grid: "
                              + "; ".join(wrong) + " (build the model after initialize_model_parallel, "
                              "with the same sizes)")


def stage_layers(config: Any, pp: int, vpp: int) -> tuple[int, ...]:
    """Decoder layers of each of the ``pp * vpp`` (virtual) stages, as Megatron-Core builds them
    (``get_num_layers_to_build`` / ``get_transformer_layer_offset`` for every pipeline rank and
    model chunk, uneven first/last stages included), in virtual-stage order.

    Raises:
        LayoutError: a custom ``pipeline_model_parallel_layout`` (not read yet), or stages that
            do not hold consecutive layers in virtual-stage order.
    """
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise LayoutError("config.pipeline_model_parallel_layout is set: from_megatron does not read custom "
                          "pipeline layouts yet; describe the stages with the explicit Publisher(..., layout=...)")
    if pp * vpp == 1:
        return (config.num_layers,)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    counts, at = [], 0
    for stage in range(pp * vpp):
        vp, p = (stage // pp, stage % pp) if vpp > 1 else (None, stage)
        n = get_num_layers_to_build(config, vp_stage=vp, pp_rank=p)
        offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=p)
        if offset != at:
            raise LayoutError(f"Megatron places pipeline rank {p}'s chunk {vp} at layer {offset}, but the stages "
                              f"before it hold layers 0..{at - 1}: not a contiguous split megarefit can describe")
        counts.append(n)
        at += n
    if at != config.num_layers:
        raise LayoutError(f"Megatron's stages hold {at} layers, config.num_layers={config.num_layers}")
    return tuple(counts)


def _spelling(dims: ModelDims, layout: SourceLayout, rank: RankCoord,
              names: Sequence[str]) -> tuple[frozenset[LayerSpec], ExpertLayout | None]:
    """(the layer specs whose spec-table rows explain every one of ``names``, the expert layout
    those rows name or ``None``). A chunk without fused norms fits both specs, one without routed
    experts names no expert layout: :func:`agree` settles them with the other stages. Names that
    fit no spec leave both open (the Publisher then names the tensor that does not fit)."""
    conds = dims.conditions(layout.pp, layout.megatron)
    fits, experts = [], set()
    for spelling in LAYER_SPECS:
        try:
            rows = [dims.spec.match(n, conds, spelling, rank=rank).spec for n in names]
        except UnknownParameterError:
            continue
        fits.append(spelling)
        experts |= {r.expert_layout for r in rows if r.expert_layout is not None}
    if len(experts) > 1:
        raise LayoutError(f"rank {rank}: parameter names of several expert layouts {sorted(experts)}")
    return frozenset(fits or LAYER_SPECS), next(iter(experts), None)


def agree(chunks: Sequence[tuple[int, frozenset[LayerSpec], ExpertLayout | None]]) -> tuple[LayerSpec, ExpertLayout]:
    """The one layer spec and expert layout of every ``(stage, specs that fit, expert layout or
    None)`` (all stages of the pipeline): where no name decides, ``"local"`` / ``"sequential"``.

    Raises:
        LayoutError: two stages' names decide differently, naming them.
    """
    specs = frozenset(LAYER_SPECS).intersection(*(fits for _, fits, _ in chunks))
    experts = {e for _, _, e in chunks if e is not None}
    if not specs or len(experts) > 1:
        seen = "; ".join(f"stage {st}: {sorted(fits)} / {e or 'no experts'}" for st, fits, e in sorted(chunks))
        raise LayoutError(f"the pipeline stages' parameter names disagree on the layer spec or expert layout ({seen})")
    return ("local" if "local" in specs else "te"), next(iter(experts), "sequential")


def _stages(model: torch.nn.Module, config: Any, dims: ModelDims, state: ParallelState) -> tuple[int, ...]:
    """Layers per (virtual) stage of ``model``'s pipeline, checked against the HF config's count."""
    if {c.__name__ for c in type(model).__mro__} & {"MambaModel", "HybridModel"}:  # hybrid pattern symbols
        if state.pp * state.vpp > 1:
            raise LayoutError(f"{type(model).__name__} with pp={state.pp} vpp={state.vpp}: from_megatron reads hybrid "
                              "models at pp=1; describe the stages with the explicit Publisher(..., layout=...)")
        return (dims.num_layers,)
    if config.num_layers != dims.num_layers:
        raise LayoutError(f"config.num_layers={config.num_layers} but the HF config has {dims.num_layers} decoder "
                          "layers: is this the model's hf_config?")
    return stage_layers(config, state.pp, state.vpp)


def _vp_stage(model: torch.nn.Module, index: int, state: ParallelState) -> int | None:
    """The chunk's virtual stage: ``model.vp_stage`` (Megatron-Core sets it), which must be its
    position among the rank's chunks.

    Raises:
        LayoutError: no ``vp_stage`` under an interleaved pipeline, or chunks out of order."""
    if state.vpp == 1:
        return None
    vp = getattr(model, "vp_stage", None)
    if vp != index or not 0 <= vp < state.vpp:
        raise LayoutError(f"model chunk {index} of pipeline rank {state.pp_rank} has vp_stage={vp}: build each chunk "
                          f"with vp_stage=c and pass the rank's {state.vpp} chunks in virtual-stage order")
    return vp


def _check_layers(model: torch.nn.Module, layout: SourceLayout, stage: int) -> None:
    """The chunk's own decoder layers against the layout's stage (count and first global index)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        return
    want = layout.stage_layers[stage]
    first = getattr(layers[0], "layer_number", None) if len(layers) else None
    if len(layers) != want or (first is not None and first - 1 != layout.layer_offset(stage)):
        raise LayoutError(f"stage {stage} holds {len(layers)} decoder layers starting at layer "
                          f"{None if first is None else first - 1}; Megatron's config places {want} starting at "
                          f"{layout.layer_offset(stage)}")


def _warn_unwrapped(ddp: Any, params: Mapping[str, torch.Tensor], rank: RankCoord) -> None:
    """Warn where the parameters carry Megatron DDP's ``main_grad`` but no DDP wrapper came with
    them: the deferred param-gather check (:mod:`megarefit.online.trainer.param_sync`) cannot run."""
    if ddp is None and any(hasattr(p, "main_grad") for p in params.values()):
        warnings.warn(f"rank {rank}: the parameters belong to a Megatron-Core DistributedDataParallel, which was not "
                      "passed: with the distributed optimizer and overlap_param_gather a publish can read shards "
                      "the next forward has not gathered yet; pass the DDP-wrapped chunk (or ddp=)", stacklevel=4)


def read_chunk(model: torch.nn.Module, dims: ModelDims, state: ParallelState, index: int = 0) -> MegatronChunk:
    """Read one (possibly wrapped) model chunk of this rank: see the module docstring.

    Raises:
        TypeError: not a Megatron-Core model.
        LayoutError: config and process grid disagree; layers or vocab rows differ from the
            HF config's; a pipeline split megarefit cannot describe.
        UnverifiedMegatronError: the Megatron-Core version or a layout flag is not verified.
    """
    inner, ddp = unwrap(model)
    config = _config_of(inner)
    state.check_config(config)
    layers = _stages(inner, config, dims, state)
    padded = getattr(inner, "vocab_size", None)
    if not isinstance(padded, int) or padded < dims.vocab_size:
        raise LayoutError(f"{type(inner).__name__}.vocab_size={padded!r}: expected Megatron's padded vocab, at least "
                          f"the HF config's vocab_size={dims.vocab_size} (is this the right hf_config?)")
    vp = _vp_stage(inner, index, state)
    rank = RankCoord(state.tp_rank, state.pp_rank if vp is None else virtual_stage(state.pp_rank, vp, state.pp),
                     state.ep_rank, state.copy)
    layout = SourceLayout(state.tp, state.pp * state.vpp, state.ep, padded, layers, etp=state.etp,
                          mtp_layers=getattr(config, "mtp_num_layers", None) or 0,
                          megatron=megatron_core_of(inner), dp=state.dp_cp)
    params = refit_tensors(inner)
    fits, experts = _spelling(dims, layout, rank, [c for n in params if (c := canonical_name(n)) is not None])
    _check_layers(inner, layout, rank.pp)
    _warn_unwrapped(ddp, params, rank)
    return MegatronChunk(rank, layout, params, ddp, vp, replica=state.replica, fits=fits, experts=experts)


def read_chunks(model_or_chunks: torch.nn.Module | Sequence[torch.nn.Module], dims: ModelDims) -> list[MegatronChunk]:
    """:func:`read_chunk` for each of the rank's model chunks (one module, or a list in
    virtual-stage order); all of them in one layout. With ``pp > 1`` a collective over Megatron's
    pipeline-parallel group (every stage must call it): the stages agree on the layer spec and
    expert layout (:func:`agree`: a stage without experts or fused norms cannot tell), and a
    stage that refuses makes every stage raise, naming it.

    Raises:
        LayoutError: as :func:`read_chunk`; another stage refused; chunks or stages whose layouts
            differ; a list whose length is not the virtual pipeline size.
    """
    chunks = [model_or_chunks] if isinstance(model_or_chunks, torch.nn.Module) else list(model_or_chunks)
    state = ParallelState.read()
    out, error = [], None
    try:
        if len(chunks) != state.vpp:
            raise LayoutError(f"got {len(chunks)} model chunk(s); Megatron's virtual pipeline size is {state.vpp}: "
                              "pass every chunk of this rank, in virtual-stage order")
        out = [read_chunk(c, dims, state, i) for i, c in enumerate(chunks)]
    except (LayoutError, TypeError, MegarefitError) as exc:
        error = exc
    seen = _pipeline_peers(state, error, [(c.rank.pp, c.fits, c.experts) for c in out])
    spelling, experts = agree(seen)
    out = [dataclasses.replace(c, layout=dataclasses.replace(c.layout, layer_spec=spelling, expert_layout=experts))
           for c in out]
    for c in out[1:]:
        check_stated(out[0].layout, c.layout)  # the chunks of one rank: one layout
    return out


_EXPERT_CODES: tuple[str | None, ...] = (None, "sequential", "te_grouped", "legacy_grouped")


def _encode(error: Exception | None, mine: list[tuple[int, frozenset[str], str | None]], vpp: int) -> list[int]:
    """``[refused, (stage, layer-spec bits, expert-layout code) per chunk]`` as plain ints (the
    pipeline group exchanges tensors, never pickles); -1 where a refusing rank has no chunk."""
    row = [int(error is not None)]
    for i in range(vpp):
        if error is None and i < len(mine):
            stage, fits, experts = mine[i]
            row += [stage, sum(1 << k for k, spec in enumerate(LAYER_SPECS) if spec in fits),
                    _EXPERT_CODES.index(experts)]
        else:
            row += [-1, -1, -1]
    return row


def _pipeline_peers(state: ParallelState, error: Exception | None,
                    mine: list[tuple[int, frozenset[str], str | None]]) -> list[tuple[int, frozenset[str], str | None]]:
    """Every stage's ``mine`` (this rank's alone at ``pp == 1``), gathered over Megatron's
    pipeline-parallel group as an int64 tensor per rank, with each stage's refusal; raises
    ``error`` here, and a LayoutError naming the refusing pipeline rank elsewhere."""
    if state.pp == 1:
        if error is not None:
            raise error
        return mine
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    row = torch.tensor(_encode(error, mine, state.vpp), dtype=torch.int64, device=device)
    rows = [torch.empty_like(row) for _ in range(state.pp)]
    dist.all_gather(rows, row, group=group)
    if error is not None:
        raise error
    table = torch.stack(rows).cpu().tolist()
    refused = [p for p, r in enumerate(table) if r[0]]
    if refused:
        raise LayoutError(f"pipeline rank {refused[0]} refused its model (its own error names why): this rank stops too")
    return [(r[1 + 3 * i], frozenset(spec for k, spec in enumerate(LAYER_SPECS) if r[2 + 3 * i] >> k & 1),
             _EXPERT_CODES[r[3 + 3 * i]]) for r in table for i in range(state.vpp)]


def source_layout(hf_config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, vpp: int = 1,
                  first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                  layer_spec: LayerSpec = "local", expert_layout: ExpertLayout = "sequential", mtp_layers: int = 0,
                  make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
                  megatron: MegatronCore | None = None) -> SourceLayout:
    """The trainer's layout stated by hand, in Megatron's terms (what ``Publisher.from_megatron``
    reads from the model instead): Megatron's padded vocab (``vocab_size`` rounded up to a
    multiple of ``make_vocab_size_divisible_by * tp``), its even or uneven stage split, and with
    ``vpp > 1`` a plain pipeline of ``pp * vpp`` virtual stages (publish chunk ``c`` of pipeline
    rank ``p`` as stage :func:`~megarefit.layout.parallel.virtual_stage` ``(p, c, pp)``).
    ``megatron``: default the ``megatron.core`` this process imported, flags unread
    (:meth:`MegatronCore.in_process`). On 0.17+ planning then refuses where a flag matters. On
    0.16.1 (megarefit's reference release), and where megatron.core is not imported, the layout
    states that the trainer's flags are those the spec tables need, and none is checked: a real
    trainer passes ``megatron=megatron_core_of(model)`` (or serves with ``from_megatron``).

    Raises:
        LayoutError: the sizes do not fit the model (heads, experts or layers do not split).
        ConfigError: ``hf_config`` is not a config megarefit reads.
    """
    dims = hf_config if isinstance(hf_config, ModelDims) else ModelDims.from_hf_config(load_hf_config(hf_config))
    dims.check_layout(tp, pp * vpp, ep, etp)
    if vpp > 1 and (first_stage_layers is not None or last_stage_layers is not None):
        raise LayoutError("uneven first/last stages with vpp > 1: let Publisher.from_megatron read the split "
                          "from Megatron (it splits each stage's layers over its chunks)")
    return SourceLayout.build(tp=tp, pp=pp * vpp, ep=ep, padded_vocab_size=dims.padded_vocab_size(
        tp, make_vocab_size_divisible_by), num_layers=dims.num_layers, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, layer_spec=layer_spec, etp=etp, expert_layout=expert_layout,
        mtp_layers=mtp_layers, megatron=megatron or MegatronCore.in_process())


def check_stated(read: SourceLayout, stated: SourceLayout | None) -> None:
    """Refuse a layout the caller stated that differs from the one read from Megatron.

    Raises:
        LayoutError: naming each differing field, the stated value and the model's.
    """
    if stated is None or stated == read:
        return
    if stated.copies == 1 and read.copies > 1:  # stated without dp: the model's data-parallel size
        stated = dataclasses.replace(stated, dp=read.dp)
        if stated == read:
            return
    if (stated.megatron.flags is None or stated.megatron.table_flags) and (
            stated.megatron.version, stated.megatron.assume) == (read.megatron.version, read.megatron.assume):
        stated = dataclasses.replace(stated, megatron=read.megatron)  # stated without flags: the version is checked
        if stated == read:
            return
    fields = [f.name for f in dataclasses.fields(SourceLayout)]
    wrong = [f"{f}: stated {getattr(stated, f)!r}, the model has {getattr(read, f)!r}"
             for f in fields if getattr(stated, f) != getattr(read, f)]
    raise LayoutError("the stated layout disagrees with the Megatron model: " + "; ".join(wrong)
                      + " (drop layout= to use the model's, or fix the statement)")


__all__ = ["MegatronChunk", "ParallelState", "agree", "check_stated", "megatron_core_of", "read_chunk", "read_chunks",
           "refit_tensors", "source_layout", "stage_layers", "unwrap"]
