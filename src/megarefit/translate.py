"""Offline translation between Megatron-Core shards and HF checkpoint tensors.

Both directions execute a plan from :mod:`megarefit.planner` through the
in-process :class:`~megarefit.transport.LocalTransport`, so the offline path and
the online refit path share one planner and one set of layout facts.

Shards are keyed by Megatron rank ``(tp_rank, pp_rank, ep_rank)``; each value is
that rank's ``dict(model.named_parameters())`` (local layer indices, optional
``module.`` wrapper prefixes and ``_extra_state`` entries are accepted).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from megarefit.errors import (
    LayoutError,
    MegarefitError,
    MissingParameterError,
    ShapeMismatchError,
    UnexpectedParameterError,
)
from megarefit.layout import RankCoord, SourceLayout
from megarefit.specs.megatron_core import MegatronCore
from megarefit.layout.dims import DEFAULT_VOCAB_DIVISOR, ModelDims, load_hf_config
from megarefit.layout.shards import check_ranks, resolve_layer_spec
from megarefit.plan import Plan
from megarefit.planner import plan_hf_to_megatron, plan_megatron_to_hf
from megarefit.quant import Fp8Format, resolve_quantization
from megarefit.quant.planning import plan_fp8, quantize_sources
from megarefit.specs.table import ExpertLayout, LayerSpec, Role, Stage, canonical_name
from megarefit.transport.execute import materialize, run_refit_cycle
from megarefit.transport.local import LocalTransport

Shards = Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]]

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def normalize_shards(shards: Shards) -> dict[RankCoord, dict[str, torch.Tensor]]:
    """Key by :class:`RankCoord`, strip ``module.`` prefixes, drop ``_extra_state`` entries."""
    out: dict[RankCoord, dict[str, torch.Tensor]] = {}
    for rank, params in shards.items():
        if not (isinstance(rank, tuple) and len(rank) == 3 and all(isinstance(x, int) for x in rank)):
            raise MegarefitError(f"shard keys must be (tp_rank, pp_rank, ep_rank) int tuples, got {rank!r}")
        coord = RankCoord(*rank)
        clean: dict[str, torch.Tensor] = {}
        for name, tensor in params.items():
            canon = canonical_name(name)
            if canon is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise MegarefitError(f"parameter {name!r} on rank {coord} is {type(tensor).__name__}, not a tensor")
            if canon in clean:
                raise UnexpectedParameterError(f"parameter {canon!r} appears twice on rank {coord}")
            clean[canon] = tensor
        out[coord] = clean
    return out


def _model_dtype(tensors: Mapping[Any, Mapping[str, torch.Tensor]]) -> str:
    """The model's dtype: the one most tensors have (rows that pin their own dtype, like
    an fp32 router bias, are checked against it by :func:`check_shapes`)."""
    counts: dict[torch.dtype, int] = {}
    for params in tensors.values():
        for t in params.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    if not counts:
        raise MissingParameterError("no tensors given")
    return _dtype_name(max(counts, key=counts.__getitem__))


def _padded_vocab(dims: ModelDims, shards: Mapping[RankCoord, Mapping[str, torch.Tensor]], tp: int,
                  divisible_by: int | None) -> int:
    if divisible_by is not None:
        return dims.padded_vocab_size(tp, divisible_by)
    vocab_names = [r.megatron for r in dims.spec.entries if r.role is Role.VOCAB and not r.per_layer]
    for rank, params in sorted(shards.items()):
        for name in vocab_names:
            if name in params:
                rows = params[name].shape[0] * tp
                if rows < dims.vocab_size:
                    raise ShapeMismatchError(
                        f"{name!r} on rank {rank} has {params[name].shape[0]} rows x tp={tp} = {rows}, "
                        f"fewer than vocab_size={dims.vocab_size}"
                    )
                return rows
    return dims.padded_vocab_size(tp, DEFAULT_VOCAB_DIVISOR)


def _stage_split(dims: ModelDims, tensors: Mapping[RankCoord, Mapping[str, torch.Tensor]],
                 pp: int) -> dict[str, int | None]:
    """Infer an uneven pipeline split from the layer indices each stage holds.

    Returns ``first_stage_layers`` / ``last_stage_layers`` for
    ``SourceLayout.build`` when the names show Megatron's uneven split; an even
    split (or names that fit none) returns no override and is checked later.
    """
    if pp == 1:
        return {}
    counts = [0] * pp
    for rank, params in tensors.items():
        for name in params:
            layer = dims.spec.layer_index(name)
            if layer is not None:
                counts[rank.pp] = max(counts[rank.pp], layer + 1)
    if sum(counts) != dims.num_layers or len(set(counts[1:-1])) > 1 or counts == [counts[0]] * pp:
        return {}
    return {"first_stage_layers": counts[0], "last_stage_layers": counts[-1]}


def check_shapes(plan: Plan, tensors: Mapping[RankCoord | None, Mapping[str, torch.Tensor]]) -> None:
    """Every plan source must exist in ``tensors`` with the planned shape.

    Raises:
        MissingParameterError: naming tensor and rank.
        ShapeMismatchError: naming tensor, rank, expected and actual shape.
    """
    for ref, meta in plan.sources.items():
        t = tensors.get(ref.rank, {}).get(ref.name)
        if t is None:
            raise MissingParameterError(f"tensor {ref} is missing")
        if tuple(t.shape) != (meta.storage_shape or meta.shape):
            raise ShapeMismatchError(
                f"tensor {ref}: expected shape {meta.storage_shape or meta.shape} from the config and layout "
                f"(tp={plan.layout.tp}, pp={plan.layout.pp}), got {tuple(t.shape)}"
            )
        if _dtype_name(t.dtype) != meta.dtype:
            raise ShapeMismatchError(f"tensor {ref}: expected dtype {meta.dtype}, got {_dtype_name(t.dtype)}")


def _infer_etp(dims: ModelDims, tensors: Mapping[RankCoord, Mapping[str, torch.Tensor]], tp: int) -> int:
    """Expert-TP size from an expert fc1 shard's rows (``2 * moe_ffn / etp``); ``dims.default_etp(tp)`` if none."""
    if not dims.num_experts:
        return tp
    fc1_rows = [r for r in dims.spec.entries if r.role in (Role.EXPERT_GATED_MLP, Role.EXPERT_GATE_UP_FUSED)]
    for rank, params in sorted(tensors.items()):
        for name, t in params.items():
            if t.dim() == 2 and t.shape[0] and any(r.matches(name) for r in fc1_rows):
                return max(1, 2 * dims.moe_ffn_hidden_size // t.shape[0])
    return dims.default_etp(tp)


def megatron_to_hf(shards: Shards, hf_config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1,
                   etp: int | None = None, make_vocab_size_divisible_by: int | None = None,
                   quantization: str | Fp8Format | None = "auto",
                   megatron: MegatronCore | None = None) -> dict[str, torch.Tensor]:
    """Translate Megatron-Core shards to full HF checkpoint tensors.

    Args:
        shards: ``{(tp_rank, pp_rank, ep_rank): {megatron_name: local_tensor}}`` for
            every rank of the ``tp x pp x ep`` grid (one data-parallel replica).
        hf_config: HF ``config.json`` dict, path, or ``PretrainedConfig``.
        tp, pp, ep: the trainer's parallel sizes.
        etp: expert tensor parallel size (1 or ``tp``); by default inferred from
            the expert shards' shapes.
        make_vocab_size_divisible_by: Megatron's vocab padding divisor; by
            default inferred from the embedding shard's row count.
        quantization: ``"auto"`` (default): the config's ``quantization_config``;
            ``"fp8"``: block FP8 (:mod:`megarefit.quant`): every linear weight becomes
            ``...weight`` float8_e4m3fn plus ``...weight_scale_inv`` float32
            ``[ceil(N/128), ceil(K/128)]``, bit-identical to vLLM's
            ``per_block_cast_to_fp8``; each shard is quantized on its own block grid
            where the blocks allow (as a trainer would), the rest after assembly
            (:func:`~megarefit.quant.planning.plan_fp8`); ``"none"``: the shards' dtype.
        megatron: the Megatron-Core that made the shards (its release names MTP and Mamba
            conv parameters and lays out the DSA indexer; see
            :mod:`megarefit.specs.megatron_core`); default :meth:`MegatronCore.in_process`.

    The norm spelling (local / Transformer-Engine spec) and the expert layout
    (SequentialMLP / TE grouped) are detected from the names.

    Returns:
        ``{hf_name: tensor}`` with on-disk HF checkpoint names and shapes
        (e.g. ``model.layers.0.self_attn.q_proj.weight`` ``[heads*head_dim, hidden]``),
        vocab padding trimmed, no ``lm_head.weight`` when embeddings are tied.
        Where the layout allows, tensors are zero-copy views of the shards
        (norms, and at TP=1 most weights); copy them before mutating the shards.
        Other tensors are allocated on the shards' device.

    Raises:
        LayoutError: a rank is missing/extra, or tp/pp/ep do not fit the config.
        UnknownParameterError: a name matches no spec-table row (names tensor and rank).
        MissingParameterError / UnexpectedParameterError: names differ from the layout.
        ShapeMismatchError: a shard's shape or dtype disagrees with the config.
        UnsupportedQuantizationError: a quantization method megarefit does not produce.
        UnverifiedMegatronError: ``megatron`` is not verified for this model.
    """
    cfg = load_hf_config(hf_config)
    dims = ModelDims.from_hf_config(cfg)
    fmt = resolve_quantization(quantization, cfg)
    layout, tensors = _layout_of_shards(dims, normalize_shards(shards), tp, pp, ep, etp,
                                        make_vocab_size_divisible_by, megatron)
    plan = plan_megatron_to_hf(dims, layout, _model_dtype(tensors))
    check_shapes(plan, tensors)
    return _pull_hf(plan, tensors, fmt)


def _layout_of_shards(dims: ModelDims, tensors: dict[RankCoord, dict[str, torch.Tensor]], tp: int, pp: int, ep: int,
                      etp: int | None, divisible_by: int | None,
                      megatron: MegatronCore | None) -> tuple[SourceLayout, dict[RankCoord, dict[str, torch.Tensor]]]:
    """The layout the shards show at sizes ``tp x pp x ep`` (expert TP, vocab padding, uneven
    stages, MTP layers, layer spec and expert layout read from them when not given; ``megatron``
    default :meth:`MegatronCore.in_process`), and the shards of the ranks Megatron's grid forms.

    Raises:
        LayoutError: a rank is missing or outside the grid, or the sizes do not fit the config.
        UnknownParameterError / MissingParameterError / UnexpectedParameterError: see
            :func:`~megarefit.layout.shards.resolve_layer_spec`.
    """
    outside = sorted(r for r in tensors if not (r.tp < tp and r.pp < pp and r.ep < ep))
    if outside or not tensors:
        raise LayoutError(f"shards for tp={tp} pp={pp} ep={ep}: " + (
            f"unexpected {[tuple(r) for r in outside]} (wrong tp/pp/ep?)" if outside else "no shards given"))
    etp = _infer_etp(dims, tensors, tp) if etp is None else etp
    dims.check_layout(tp, pp, ep, etp)
    mtp = {i for params in tensors.values() for n in params if (i := dims.spec.layer_index(n, Stage.MTP)) is not None}
    base = SourceLayout.build(tp=tp, pp=pp, ep=ep, padded_vocab_size=_padded_vocab(dims, tensors, tp, divisible_by),
                              num_layers=dims.num_layers, etp=etp, mtp_layers=max(mtp) + 1 if mtp else 0,
                              **_stage_split(dims, tensors, pp), megatron=megatron or MegatronCore.in_process())
    check_ranks(base, tensors)
    tensors = {r: v for r, v in tensors.items() if r in set(base.ranks())}  # copies Megatron's grid lacks
    return resolve_layer_spec(dims, base, {r: list(p) for r, p in tensors.items()}), tensors


def _pull_hf(plan: Plan, tensors: dict[RankCoord, dict[str, torch.Tensor]],
             fmt: Fp8Format | None) -> dict[str, torch.Tensor]:
    """Run ``plan`` in process on the shards' device, FP8-quantized when ``fmt`` is given."""
    device = next(t for params in tensors.values() for t in params.values()).device
    if fmt is not None:  # as the trainers would: FP8 shards where blocks allow, the rest quantized after the pull
        plan = plan_fp8(plan, fmt)
        tensors = quantize_sources(plan, tensors, fmt)  # type: ignore[assignment]
    return dict(run_refit_cycle(plan, LocalTransport(tensors), device=device))


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1,
                   etp: int | None = None, layer_spec: LayerSpec = "local",
                   expert_layout: ExpertLayout = "sequential",
                   make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
                   first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                   mtp_layers: int = 0, megatron: MegatronCore | None = None) -> dict[RankCoord, dict[str, torch.Tensor]]:
    """Translate full HF checkpoint tensors to Megatron-Core shards: the exact inverse of
    :func:`megatron_to_hf`.

    Returns ``{RankCoord(tp, pp, ep): {megatron_name: local_tensor}}`` (``RankCoord``
    is a plain tuple) with local layer indices per stage, vocab padding rows zero,
    and, with tied embeddings and ``pp > 1``, the last stage's ``output_layer.weight``
    copy of the embedding. ``layer_spec`` picks the norm spelling (``"local"`` or
    ``"te"``); ``first_stage_layers`` / ``last_stage_layers`` give Megatron's uneven
    pipeline split (``num_layers_in_first/last_pipeline_stage``); ``etp`` (default
    ``tp``; 1 for experts with biases) and ``expert_layout`` (``"sequential"`` / ``"te_grouped"``) shape the
    experts. Tensors may be zero-copy views of ``hf_state`` (replicated tensors are
    shared between TP ranks); copy them before mutating.

    An in-memory ``lm_head.weight`` of a tied model (as ``state_dict()`` returns it)
    is accepted and ignored. ``mtp_layers`` (Megatron ``mtp_num_layers``) builds that
    many multi-token-prediction layers from HF layers ``num_layers + i``; the copies
    of the embedding and head some checkpoints keep there (``embed_tokens``,
    ``shared_head.head``) are accepted and ignored. ``megatron``: the Megatron-Core the shards
    are for (default :meth:`MegatronCore.in_process`), whose release names some parameters.

    Raises:
        LayoutError: tp/pp/ep do not fit the config.
        UnverifiedMegatronError: ``megatron`` is not verified for this model.
        MissingParameterError / UnexpectedParameterError: HF names differ from the config's.
        ShapeMismatchError: an HF tensor's shape or dtype disagrees with the config.
    """
    cfg = load_hf_config(hf_config)
    dims = ModelDims.from_hf_config(cfg)
    etp = dims.default_etp(tp) if etp is None else etp
    dims.check_layout(tp, pp, ep, etp)
    state = _hf_tensors_to_plan(dims, hf_state)
    layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, padded_vocab_size=dims.padded_vocab_size(
        tp, make_vocab_size_divisible_by), num_layers=dims.num_layers, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, layer_spec=layer_spec, etp=etp, expert_layout=expert_layout,
        mtp_layers=mtp_layers, megatron=megatron or MegatronCore.in_process())
    plan = plan_hf_to_megatron(dims, layout, _model_dtype({None: state}))
    _check_hf_names(dims, plan, state, mtp_layers)
    check_shapes(plan, {None: state})
    out: dict[RankCoord, dict[str, torch.Tensor]] = defaultdict(dict)
    device = next(iter(state.values())).device
    for ref, tensor in materialize(plan, LocalTransport({None: state}), device=device):
        out[ref.rank][ref.name] = tensor
    return dict(out)


def _hf_tensors_to_plan(dims: ModelDims, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_state`` less the copies megarefit ignores: a tied model's ``lm_head.weight`` and the
    embedding and head copies some checkpoints keep in their MTP layers."""
    state = dict(hf_state)
    if dims.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i in range(dims.num_layers, dims.num_layers + dims.mtp_layers):
        for copy in ("embed_tokens.weight", "shared_head.head.weight"):
            state.pop(f"model.layers.{i}.{copy}", None)
    return state


# HF tensors of a checkpoint that no spec table moves: name prefix -> what they are
_NOT_MOVED = (("model.visual.", "the vision tower of a vision-language checkpoint, which megarefit does not move"),
              ("mtp.", "the multi-token-prediction layer of Qwen3.5 / Qwen3-Next / DeepSeek-V4, which megarefit does "
                       "not translate yet"))


def _not_moved_hint(extra: list[str]) -> str:
    for prefix, what in _NOT_MOVED:
        if any(k.startswith(prefix) for k in extra):
            return f" ({prefix}* is {what}: leave those tensors out)"
    return ""


def _check_hf_names(dims: ModelDims, plan: Plan, state: Mapping[str, torch.Tensor], mtp_layers: int) -> None:
    """Raise unless ``state`` holds exactly the HF names ``plan`` reads.

    Raises:
        MissingParameterError / UnexpectedParameterError: naming examples (and an MTP layer
            one ``mtp_layers`` too few would leave unread).
    """
    expected = {ref.name for ref in plan.sources}
    if expected - state.keys():
        missing = sorted(expected - state.keys())
        raise MissingParameterError(f"HF state lacks {len(missing)} tensor(s) the config implies, e.g. {missing[:3]}")
    if state.keys() - expected:
        extra = sorted(state.keys() - expected)
        mtp = [k for k in extra if k.startswith(f"model.layers.{dims.num_layers + mtp_layers}.")]
        hint = (f" (multi-token-prediction layer {dims.num_layers + mtp_layers}: pass mtp_layers="
                f"{mtp_layers + 1} to build it, or drop it)" if mtp and dims.spec.mtp_key else
                f" (layers from {dims.num_layers} on are the checkpoint's multi-token-prediction modules, which "
                f"megarefit does not translate for {dims.family}: drop them)" if mtp else _not_moved_hint(extra))
        raise UnexpectedParameterError(f"HF state has {len(extra)} tensor(s) the {dims.family} table does not "
                                       f"expect, e.g. {extra[:3]}{hint}")
