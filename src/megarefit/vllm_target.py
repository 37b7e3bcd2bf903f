"""vLLM tensor-parallel targets: plan Megatron shards straight into one vLLM worker's own
parameter shards, so a worker pulls 1/T of the model instead of every full HF tensor.

A vLLM worker of tensor-parallel rank ``t`` of ``T`` holds (vLLM's ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` /
``ParallelLMHead``, as their ``weight_loader``s fill them from full HF tensors)::

    qkv_proj      [q heads of t; k heads of t; v heads of t] rows   (kv heads replicated
                  when T > kv heads: rank t holds kv head t // (T / kv_heads))
    gate_up_proj  [gate.chunk(T)[t]; up.chunk(T)[t]] rows
    o_proj, down_proj   columns chunk t (row-parallel)
    embed_tokens, lm_head   rows [t*P, (t+1)*P) of the vocab padded to a multiple of 64
                  (P = padded / T); rows past vocab_size are zero
    norms (and q_norm / k_norm)   whole

Each vLLM parameter is a list of :class:`VllmPiece` -- a box of one HF tensor placed
at a box of the parameter -- and :func:`plan_megatron_to_vllm` re-targets the
Megatron -> HF plan through them: every op's HF box is intersected with each piece,
so bytes still move once, from the trainer shard to their final place in the vLLM
parameter. The result is validated (exact cover, zero-filled vocab padding) like
any plan. Dense families (Llama, Mistral, Qwen2, Qwen3) only; MoE and MLA raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megarefit.dims import ModelDims
from megarefit.errors import LayoutError, UnsupportedModelError
from megarefit.layout import Box, SourceLayout
from megarefit.plan import CopyOp, Plan, TensorMeta, TensorRef, digest_of, make_op, validate_plan
from megarefit.planner import hf_shapes, plan_megatron_to_hf
from megarefit.specs.table import Role, Stage

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class VllmTarget:
    """One vLLM worker: tensor-parallel ``rank`` of ``tp``."""

    tp: int
    rank: int
    vocab_padding: int = VLLM_VOCAB_PADDING

    def __post_init__(self) -> None:
        if not (isinstance(self.tp, int) and self.tp >= 1 and 0 <= self.rank < self.tp):
            raise LayoutError(f"vLLM target rank {self.rank} of tp={self.tp} is not a valid rank")


@dataclass(frozen=True)
class VllmPiece:
    """``param[param_box] = hf_tensor[hf_box]``."""

    hf_name: str
    hf_box: Box
    param_box: Box


# vLLM stacks a multi-tensor role's HF tensors (in the spec row's order: q, k, v / gate,
# up) into one parameter, named after the first with this part replaced.
_VLLM_STACKED = {Role.QKV: ("q_proj", "qkv_proj"), Role.GATED_MLP: ("gate_proj", "gate_up_proj")}


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise LayoutError(f"{what}={n} does not split over vLLM tp={tp}")
    return n // tp


def vllm_params(dims: ModelDims, target: VllmTarget) -> dict[str, tuple[tuple[int, ...], tuple[VllmPiece, ...]]]:
    """vLLM parameter name -> (local shape, pieces), in HF order.

    Raises:
        UnsupportedModelError: an MoE or MLA model (not planned for vLLM shards yet).
        LayoutError: heads / ffn / hidden do not split over ``target.tp``.
    """
    if dims.num_experts or dims.kv_lora_rank:
        raise UnsupportedModelError(f"{dims.family}: vLLM-sharded targets cover dense models only; "
                                    "use full HF tensors (plan_megatron_to_hf)")
    T, t, d = target.tp, target.rank, dims.head_dim
    heads = _split(dims.num_attention_heads, T, "num_attention_heads")
    kv = dims.num_query_groups
    if T >= kv:
        if T % kv:
            raise LayoutError(f"vLLM tp={T} must be a multiple of num_key_value_heads={kv} (or divide it)")
        kv_local, kv_start = 1, t // (T // kv)
    else:
        kv_local = _split(kv, T, "num_key_value_heads")
        kv_start = t * kv_local
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.vocab_size, num_layers=dims.num_layers)
    rows = [r for r in dims.spec.rows(dims.conditions(1), "local") if not r.duplicate]
    out: dict[str, tuple[tuple[int, ...], tuple[VllmPiece, ...]]] = {}
    for row in rows:
        layers = range(dims.num_layers) if row.stage is Stage.LAYER else [None]
        if row.stage is Stage.MTP:
            continue  # vLLM loads MTP layers into a separate draft model
        for layer in layers:
            named = list(zip(row.hf_names(layer), hf_shapes(row, dims, layout)))
            if row.role in _VLLM_STACKED:
                part, stacked = _VLLM_STACKED[row.role]
                local_rows, pieces = 0, []
                for i, (hf_name, shape) in enumerate(named):
                    if row.role is Role.QKV:  # q heads of rank t, then its k and v heads
                        n, first = (heads * d, t * heads * d) if i == 0 else (kv_local * d, kv_start * d)
                    else:  # gate chunk t, then up chunk t
                        n = _split(shape[0], T, f"{hf_name} rows")
                        first = t * n
                    pieces.append(VllmPiece(hf_name, Box.rows(shape, first, n),
                                            Box((local_rows,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))))
                    local_rows += n
                out[named[0][0].replace(part, stacked)] = ((local_rows,) + tuple(named[0][1][1:]), tuple(pieces))
                continue
            for hf_name, shape in named:
                if row.role is Role.ROW:
                    n = _split(shape[1], T, f"{hf_name} columns")
                    out[hf_name] = ((shape[0], n), (VllmPiece(hf_name, Box((0, t * n), (shape[0], n)),
                                                              Box.full((shape[0], n))),))
                elif row.role is Role.VOCAB:
                    padded = -(-shape[0] // target.vocab_padding) * target.vocab_padding
                    per = padded // T
                    start, stop = t * per, min((t + 1) * per, shape[0])
                    local = (per,) + tuple(shape[1:])
                    pieces = (VllmPiece(hf_name, Box.rows(shape, start, stop - start),
                                        Box.rows(local, 0, stop - start)),) if stop > start else ()
                    out[hf_name] = (local, pieces)
                elif row.role is Role.REPLICATED:
                    out[hf_name] = (shape, (VllmPiece(hf_name, Box.full(shape), Box.full(shape)),))
                else:
                    raise UnsupportedModelError(f"{hf_name}: role {row.role.value} has no vLLM shard rule")
    return out


def _intersect(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


@lru_cache(maxsize=64)
def plan_megatron_to_vllm(dims: ModelDims, layout: SourceLayout, dtype: str, target: VllmTarget) -> Plan:
    """Plan Megatron shards (``layout``) into vLLM worker ``target``'s own parameter shards.

    Targets are vLLM parameter names (``model.layers.L.self_attn.qkv_proj.weight``,
    ``...mlp.gate_up_proj.weight``, ...) with local shapes; vocab rows past
    ``vocab_size`` are ``zero_fill``. Cached per arguments.

    Raises:
        UnsupportedModelError / LayoutError: see :func:`vllm_params`.
        PlanValidationError: internal inconsistency (a bug).
    """
    hf_plan = plan_megatron_to_hf(dims, layout, dtype)
    by_hf = hf_plan.ops_by_target
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    for param, (shape, pieces) in vllm_params(dims, target).items():
        dst = TensorRef(None, param)
        meta = hf_plan.targets[TensorRef(None, pieces[0].hf_name)] if pieces else None
        tdtype = meta.dtype if meta is not None else dtype
        written = 0
        for piece in pieces:
            for op in by_hf[TensorRef(None, piece.hf_name)]:
                if op.transpose or op.src_view is not None:
                    raise UnsupportedModelError(f"{op.src}: transposed / viewed sources are not planned for vLLM")
                inter = _intersect(op.dst_box, piece.hf_box)
                if inter is None:
                    continue
                src_box = Box(tuple(s + i - o for s, i, o in zip(op.src_box.offsets, inter.offsets, op.dst_box.offsets)),
                              inter.lengths)
                dst_box = Box(tuple(p + i - h for p, i, h in
                                    zip(piece.param_box.offsets, inter.offsets, piece.hf_box.offsets)), inter.lengths)
                ops.append(make_op(op.src, hf_plan.sources[op.src].shape, src_box, dst, shape, dst_box, op.itemsize))
                written += inter.numel
        zero = ()
        total = 1
        for n in shape:
            total *= n
        if written < total:  # vocab padding rows past vocab_size (the only part no HF element lands in)
            filled = sum(p.param_box.lengths[0] for p in pieces)
            zero = (Box.rows(shape, filled, shape[0] - filled),)
        targets[dst] = TensorMeta(shape, tdtype, zero)
    plan = Plan("megatron_to_vllm", dims, layout, dtype, hf_plan.sources, targets, tuple(ops),
                digest_of("megatron_to_vllm", hf_plan.digest, target.tp, target.rank, target.vocab_padding))
    validate_plan(plan)
    return plan


__all__ = ["VLLM_VOCAB_PADDING", "VllmPiece", "VllmTarget", "plan_megatron_to_vllm", "vllm_params"]
