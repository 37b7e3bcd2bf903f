"""An independent export planner and vLLM worker layout, for tests/test_plan_columns.py to
compare megarefit's planners against, op for op.

It reads the model's sizes from the HF config dict and takes the trainer's layout as plain
ints (:class:`Layout`); its name table and shard geometry are written here from
Megatron-Core's and vLLM's conventions. From megarefit it takes only the plan's output format:
``TensorRef`` / ``TensorMeta`` / ``CopyOp`` and their ``Box`` and ``RankCoord`` fields (named
through :mod:`megarefit.plan.ops`), as plain records: an op's flat offsets, its kind (one run
or not) and the joining of continuing ops are computed here (:func:`_op`, :func:`_merge`), none
of ``Box``'s methods nor ``make_op`` / ``merge_ops``. Nothing of ``megarefit.layout``'s dims,
``megarefit.specs``, ``megarefit.planner`` or ``megarefit.targets`` is imported.

Export plans: Llama / Qwen2 / Qwen3 (dense), Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA with
q_lora_rank) and GLM-4.5 (routed experts in all three Megatron expert layouts, shared experts,
the router's fp32 score-correction bias), both layer specs, any tp / pp / ep / etp, tied
embeddings. vLLM worker layouts (:func:`vllm_params`): the dense families, Qwen3-MoE and
Mixtral. Not restated (no comparison here): MTP layers, GLM-5's DSA indexer, gpt-oss's fused
experts, Mamba (Nemotron-H), MLA's vLLM layout and FP8 receiver staging in vLLM targets.
Megatron-Core's conventions::

    ranks        tp fastest: stage-local rank r is tp rank r % tp, expert ep rank (r // etp) % ep
    column       rank r holds rows [r*n/tp, (r+1)*n/tp)       row: columns, the same
    replicated   whole on every rank; read round-robin over a stage's tp ranks (megarefit's read policy)
    vocab        rows split over the padded vocab; rows >= vocab_size are padding
    qkv          per query group g: [q_g (hq*d rows); k_g (d); v_g (d)], then split by rows
    gated mlp    rank r holds [gate_r; up_r]
    experts      ep rank e holds experts [e*E/ep, (e+1)*E/ep), split over etp like the dense roles
    legacy grouped  weight1 [h, E_l*2F/etp] = per expert [gate_r^T | up_r^T]; weight2 [E_l*F/etp, h]

vLLM's (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, fused_moe)::

    QKVParallelLinear     rank t: [q heads t*H/T..; kv head t // (T/G)] when T >= G (kv replicated),
                          else [q heads t*H/T..; kv heads t*G/T..]; k and v alike
    MergedColumnParallel  [gate_t; up_t]             RowParallelLinear: columns [t*n/T, (t+1)*n/T)
    VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64, rows split over T
    FusedMoE              w13 [E_l, 2F/Tm, h] = [gate_t; up_t] per slot, w2 [E_l, h, F/Tm];
                          EP (Tm = 1): rank t holds E//T experts (+1 for t < E % T), linearly placed
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

from megarefit.plan import CopyOp, TensorMeta, TensorRef, itemsize
from megarefit.plan.ops import Box, RankCoord  # the plan's coordinate types (CopyOp / TensorRef fields)

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
            "DeepseekV3ForCausalLM": "deepseek_v3", "Glm4MoeForCausalLM": "glm4_moe"}
VLLM_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")  # those vllm_params restates


class Layout(NamedTuple):
    """A trainer layout as plain values."""

    tp: int
    pp: int
    ep: int
    etp: int
    padded_vocab: int
    stage_layers: tuple[int, ...]
    layer_spec: str = "local"  # or "te"
    expert_layout: str = "sequential"  # or "te_grouped", "legacy_grouped"


class Row(NamedTuple):
    megatron: str  # with {layer} / {expert}
    role: str
    hf: tuple[str, ...]  # with {layer} / {expert}
    shape: tuple[int, ...]  # unsplit (vocab padded); legacy grouped: one expert's block as stored
    dtype: str | None = None  # None: the model's


class Model:
    """The sizes an HF config dict gives (KeyError: a family this reference does not cover)."""

    def __init__(self, cfg: dict):
        self.family = FAMILIES[cfg["architectures"][0]]
        self.hidden, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.groups = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.ffn, self.vocab, self.layers = cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        self.tied = cfg.get("tie_word_embeddings", False)
        self.experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
        self.moe_ffn = self.ffn if self.family == "mixtral" else cfg.get("moe_intermediate_size", self.ffn)
        self.shared = self.moe_ffn * (cfg.get("n_shared_experts") or 0)  # HF: one MLP of n_shared * moe_ffn
        self.router_bias = self.family == "glm4_moe" or cfg.get("topk_method") == "noaux_tc"
        self.qkv_bias = self.family == "qwen2" or bool(cfg.get("attention_bias"))
        self.proj_bias = self.family not in ("qwen2", "glm4_moe") and bool(cfg.get("attention_bias"))
        self.mlp_bias = self.family == "llama" and bool(cfg.get("mlp_bias"))
        self.qk_norm = self.family in ("qwen3", "qwen3_moe") or (self.family == "glm4_moe" and cfg.get("use_qk_norm"))
        self.mla = {k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim")} if self.family == "deepseek_v3" else None
        if self.mla and not self.mla["q_lora_rank"]:
            raise KeyError("MLA without q_lora_rank")  # not restated here
        self._dense = set(cfg.get("mlp_only_layers") or ())
        self._step = cfg.get("decoder_sparse_step") or 1
        self._first_dense, self._freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1

    def is_moe(self, layer: int) -> bool:
        if self.family == "mixtral":
            return True
        if self.family in ("deepseek_v3", "glm4_moe"):
            return layer >= self._first_dense and layer % self._freq == 0
        return self.family == "qwen3_moe" and layer not in self._dense and (layer + 1) % self._step == 0


def layer_rows(m: Model, layout: Layout, moe: bool) -> list[Row]:
    """One decoder layer's tensors, in the order the replicated ones are read round-robin."""
    return (_mla if m.mla else _attention)(m, layout.layer_spec == "te") + (
        _experts(m, layout.expert_layout) if moe else _mlp(m, layout.layer_spec == "te"))


L, H = "decoder.layers.{layer}.", "model.layers.{layer}."


def _attention(m: Model, te: bool) -> list[Row]:
    h, d, A = m.hidden, m.head_dim, H + "self_attn."
    qkv = (A + "q_proj.", A + "k_proj.", A + "v_proj.")
    rows = [Row(L + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"), "replicated",
                (H + "input_layernorm.weight",), (h,)),
            Row(L + "self_attention.linear_qkv.weight", "qkv", tuple(n + "weight" for n in qkv),
                ((m.heads + 2 * m.groups) * d, h)),
            Row(L + "self_attention.linear_proj.weight", "row", (A + "o_proj.weight",), (h, m.heads * d))]
    if m.qkv_bias:
        rows.insert(2, Row(L + "self_attention.linear_qkv.bias", "qkv", tuple(n + "bias" for n in qkv),
                           ((m.heads + 2 * m.groups) * d,)))
    if m.proj_bias:
        rows.append(Row(L + "self_attention.linear_proj.bias", "replicated", (A + "o_proj.bias",), (h,)))
    if m.qk_norm:
        rows += [Row(L + f"self_attention.{x}_layernorm.weight", "replicated", (A + f"{x}_norm.weight",), (d,))
                 for x in "qk"]
    return rows


def _mla(m: Model, te: bool) -> list[Row]:
    """DeepSeek-V3's MLA: the local spec splits the down-projections over tp (column), TE keeps
    them whole and fuses the two norms into the up-projections."""
    c, h, S, A = m.mla, m.hidden, L + "self_attention.", H + "self_attn."
    q_lora, kv_lora, nope, rope, v = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                     "qk_rope_head_dim", "v_head_dim"))
    down = "replicated" if te else "column"
    return [Row(L + "input_layernorm.weight", "replicated", (H + "input_layernorm.weight",), (h,)),
            Row(S + "linear_q_down_proj.weight", down, (A + "q_a_proj.weight",), (q_lora, h)),
            Row(S + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"), "replicated",
                (A + "q_a_layernorm.weight",), (q_lora,)),
            Row(S + "linear_q_up_proj.weight", "column", (A + "q_b_proj.weight",), (m.heads * (nope + rope), q_lora)),
            Row(S + "linear_kv_down_proj.weight", down, (A + "kv_a_proj_with_mqa.weight",), (kv_lora + rope, h)),
            Row(S + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"), "replicated",
                (A + "kv_a_layernorm.weight",), (kv_lora,)),
            Row(S + "linear_kv_up_proj.weight", "column", (A + "kv_b_proj.weight",), (m.heads * (nope + v), kv_lora)),
            Row(S + "linear_proj.weight", "row", (A + "o_proj.weight",), (h, m.heads * v))]


def _mlp(m: Model, te: bool) -> list[Row]:
    h, M = m.hidden, H + "mlp."
    rows = [Row(L + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"), "replicated",
                (H + "post_attention_layernorm.weight",), (h,)),
            Row(L + "mlp.linear_fc1.weight", "gated", (M + "gate_proj.weight", M + "up_proj.weight"), (2 * m.ffn, h))]
    if m.mlp_bias:
        rows.append(Row(L + "mlp.linear_fc1.bias", "gated", (M + "gate_proj.bias", M + "up_proj.bias"), (2 * m.ffn,)))
    rows.append(Row(L + "mlp.linear_fc2.weight", "row", (M + "down_proj.weight",), (h, m.ffn)))
    if m.mlp_bias:
        rows.append(Row(L + "mlp.linear_fc2.bias", "replicated", (M + "down_proj.bias",), (h,)))
    return rows


def _experts(m: Model, expert_layout: str) -> list[Row]:
    """An MoE layer's norm, router (and its fp32 score-correction bias), routed and shared experts."""
    h, f, B = m.hidden, m.moe_ffn, H + ("block_sparse_moe." if m.family == "mixtral" else "mlp.")
    g, u, dn = (B + "experts.{expert}." + p + ".weight" for p in (
        ("w1", "w3", "w2") if m.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")))
    E = L + "mlp.experts."
    fc1, fc2 = {"sequential": (E + "local_experts.{expert}.linear_fc1.weight",
                               E + "local_experts.{expert}.linear_fc2.weight"),
                "te_grouped": (E + "linear_fc1.weight{expert}", E + "linear_fc2.weight{expert}"),
                "legacy_grouped": (E + "weight1", E + "weight2")}[expert_layout]
    legacy = expert_layout == "legacy_grouped"
    rows = [Row(L + "pre_mlp_layernorm.weight", "replicated", (H + "post_attention_layernorm.weight",), (h,)),
            Row(L + "mlp.router.weight", "replicated", (B + "gate.weight",), (m.experts, h))]
    if m.router_bias:
        rows.append(Row(L + "mlp.router.expert_bias", "replicated", (B + "gate.e_score_correction_bias",),
                        (m.experts,), "float32"))
    rows += [Row(fc1, "grouped_fc1" if legacy else "expert_gated", (g, u), (h, 2 * f) if legacy else (2 * f, h)),
             Row(fc2, "grouped_fc2" if legacy else "expert_row", (dn,), (f, h) if legacy else (h, f))]
    if m.shared:
        S = B + "shared_experts."
        rows += [Row(L + "mlp.shared_experts.linear_fc1.weight", "gated",
                     (S + "gate_proj.weight", S + "up_proj.weight"), (2 * m.shared, h)),
                 Row(L + "mlp.shared_experts.linear_fc2.weight", "row", (S + "down_proj.weight",), (h, m.shared))]
    return rows


def _flat(at, shape) -> int:
    """The row-major flat index of coordinates ``at`` in ``shape``: sum of coordinate x stride."""
    return sum(a * math.prod(shape[d + 1:]) for d, a in enumerate(at))


def _one_run(box: Box, shape) -> bool:
    """Whether ``box``'s elements are one run of row-major ``shape``: its last element's flat
    index is its first's plus its element count less one."""
    last = tuple(o + n - 1 for o, n in zip(box.offsets, box.lengths))
    return _flat(last, shape) - _flat(box.offsets, shape) + 1 == math.prod(box.lengths)


def _op(src, src_shape, src_box: Box, dst, dst_shape, dst_box: Box, item: int, *, transpose: bool = False,
        src_view: bool = False) -> CopyOp:
    """The op copying ``src[src_box]`` into ``dst[dst_box]``: contiguous when both boxes are one
    run and it does not transpose, else through scratch."""
    one = _one_run(src_box, src_shape) and _one_run(dst_box, dst_shape) and not transpose
    return CopyOp(src, src_box, dst, dst_box, "contiguous" if one else "scratch", _flat(src_box.offsets, src_shape),
                  _flat(dst_box.offsets, dst_shape), item, transpose, tuple(src_shape) if src_view else None, None)


def _join(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` as one box where ``b`` starts where ``a`` ends along one dim and they agree on every other."""
    for d in range(len(a.offsets)):
        others = [k for k in range(len(a.offsets)) if k != d]
        if a.offsets[d] + a.lengths[d] == b.offsets[d] and all(
                a.offsets[k] == b.offsets[k] and a.lengths[k] == b.lengths[k] for k in others):
            return Box(a.offsets, tuple(a.lengths[k] + (b.lengths[k] if k == d else 0) for k in range(len(a.lengths))))
    return None


def _merge(ops: list[CopyOp], sources, targets) -> list[CopyOp]:
    """Each contiguous op that continues the one before it (the same two tensors, the next
    elements of both) joined to it, while the joined boxes stay one run each."""
    out: list[CopyOp] = []
    for op in ops:
        prev = out[-1] if out else None
        if prev is not None and prev.kind == op.kind == "contiguous" and (prev.src, prev.dst) == (op.src, op.dst) \
                and prev.src_offset + prev.numel == op.src_offset and prev.dst_offset + prev.numel == op.dst_offset:
            sbox, dbox = _join(prev.src_box, op.src_box), _join(prev.dst_box, op.dst_box)
            if sbox is not None and dbox is not None and _one_run(sbox, sources[op.src].shape) \
                    and _one_run(dbox, targets[op.dst].shape):
                out[-1] = CopyOp(prev.src, sbox, prev.dst, dbox, "contiguous", prev.src_offset, prev.dst_offset,
                                 prev.itemsize)
                continue
        out.append(op)
    return out


def _rows(shape, start, n) -> Box:
    return Box((start,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))


def _full(shape) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def _is_expert(role: str) -> bool:
    return role.startswith(("expert_", "grouped_"))


class _Geometry:
    """Shapes and row runs of one model under one trainer layout."""

    def __init__(self, m: Model, layout: Layout):
        self.m, self.layout = m, layout
        self.per_ep = m.experts // layout.ep if m.experts else 0
        n = math.lcm(layout.tp, layout.etp * layout.ep)  # the (tp, ep) pairs of one stage
        self.pairs = sorted({(r % layout.tp, (r // layout.etp) % layout.ep) for r in range(n)})

    def expert_tps(self, ep: int) -> list[int]:
        return [t for t, e in self.pairs if e == ep]

    def dense_ep(self, tp: int) -> int:  # the copy of a dense shard read: stage-local rank r = tp
        return (tp // self.layout.etp) % self.layout.ep

    def split(self, row: Row) -> int:
        return self.layout.etp if _is_expert(row.role) else self.layout.tp

    def view(self, row: Row) -> tuple[int, ...]:  # legacy grouped: [E_l, h, 2F/etp] / [E_l, F/etp, h]
        (a, b), etp = row.shape, self.layout.etp
        return (self.per_ep, a, b // etp) if row.role == "grouped_fc1" else (self.per_ep, a // etp, b)

    def local(self, row: Row) -> tuple[int, ...]:
        shape, k = row.shape, self.split(row)
        if row.role.startswith("grouped_"):
            e, a, b = self.view(row)
            return (a, e * b) if row.role == "grouped_fc1" else (e * a, b)
        if row.role in ("vocab", "qkv", "gated", "expert_gated", "column"):
            return (shape[0] // k,) + shape[1:]
        return (shape[0], shape[1] // k) if row.role in ("row", "expert_row") else shape

    def hf_shapes(self, row: Row) -> list[tuple[int, ...]]:
        shape, m = row.shape, self.m
        if row.role == "qkv":
            return [(m.heads * m.head_dim,) + shape[1:]] + [(m.groups * m.head_dim,) + shape[1:]] * 2
        if row.role in ("gated", "expert_gated"):
            return [(shape[0] // 2,) + shape[1:]] * 2
        if row.role == "grouped_fc1":
            return [(shape[1] // 2, shape[0])] * 2
        if row.role == "grouped_fc2":
            return [(shape[1], shape[0])]
        return [(m.vocab,) + shape[1:]] if row.role == "vocab" else [shape]

    def runs(self, row: Row, names, r: int) -> list[tuple[str, int, int, int, bool]]:
        """``(HF name, local start, HF start, length, columns)`` of TP rank ``r``'s local tensor."""
        role, shape, k = row.role, row.shape, self.split(row)
        r = r if k > 1 else 0
        n = shape[0] // k
        if role == "replicated":
            return [(names[0], 0, 0, shape[0], False)]
        if role == "column":
            return [(names[0], 0, r * n, n, False)]
        if role in ("row", "expert_row"):
            return [(names[0], 0, r * (shape[1] // k), shape[1] // k, True)]
        if role == "vocab":
            keep = min(n, self.m.vocab - r * n)
            return [(names[0], 0, r * n, keep, False)] if keep > 0 else []
        if role in ("gated", "expert_gated"):
            return [(names[0], 0, r * n // 2, n // 2, False), (names[1], n // 2, r * n // 2, n // 2, False)]
        return self._qkv(names, r * n, (r + 1) * n)

    def _qkv(self, names, lo: int, hi: int) -> list[tuple[str, int, int, int, bool]]:
        d, g = self.m.head_dim, self.m.groups
        hq = self.m.heads // g
        out = []
        for row in range(lo, hi):  # one run per row, joined below
            group, at = divmod(row, (hq + 2) * d)
            which, dst = (0, group * hq * d + at) if at < hq * d else (1 + (at - hq * d) // d, group * d + at % d)
            last = out[-1] if out else None
            if last and last[0] == names[which] and last[2] + last[3] == dst:
                out[-1] = (last[0], last[1], last[2], last[3] + 1, False)
            else:
                out.append((names[which], row - lo, dst, 1, False))
        return out


def _tensors(g: _Geometry):
    """``(rank, Megatron name, row, global layer, global expert, duplicate)`` of every tensor each rank
    holds: stage p holds its ``stage_layers[p]`` layers, the first the embedding, the last the final
    norm and output layer (a kept-in-sync embedding copy when tied and the last is not the first)."""
    m, layout = g.m, g.layout
    vocab = ("vocab", (layout.padded_vocab, m.hidden))
    embed = Row("embedding.word_embeddings.weight", vocab[0], ("model.embed_tokens.weight",), vocab[1])
    for p in range(layout.pp):
        first, last = p == 0, p == layout.pp - 1
        for t, e in g.pairs:
            rank = RankCoord(t, p, e)
            if first:
                yield rank, embed.megatron, embed, None, None, False
            for local in range(layout.stage_layers[p]):
                glob = sum(layout.stage_layers[:p]) + local
                for row in layer_rows(m, layout, m.is_moe(glob)):
                    if "{expert}" in row.megatron:
                        for i in range(g.per_ep):
                            yield rank, row.megatron.format(layer=local, expert=i), row, glob, e * g.per_ep + i, False
                    else:
                        yield rank, row.megatron.format(layer=local), row, glob, None, False
            if last:
                norm = Row("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",), (m.hidden,))
                yield rank, norm.megatron, norm, None, None, False
                if not m.tied or not first:
                    head = Row("output_layer.weight", vocab[0], ("model.embed_tokens.weight" if m.tied
                                                                 else "lm_head.weight",), vocab[1])
                    yield rank, head.megatron, head, None, None, m.tied


def reference_megatron_to_hf(cfg: dict, layout: Layout, dtype: str = "bfloat16",
                             experts: frozenset[int] | None = None):
    """The export plan's ``(sources, targets, ops)``: ops merged per target (the same sources,
    targets and ops, as sets, as megarefit's planner)."""
    g = _Geometry(Model(cfg), layout)
    tensors = list(_tensors(g))
    sources = {TensorRef(rank, name): TensorMeta(g.local(row), row.dtype or dtype) for rank, name, row, *_ in tensors}
    targets: dict[TensorRef, TensorMeta] = {}
    by_target: dict[TensorRef, list[CopyOp]] = defaultdict(list)
    replicas: dict[int, int] = defaultdict(int)  # replicated tensors read round-robin over tp, per stage

    def emit(src, sshape, sbox, name, hshape, dbox, tdtype=dtype, **kw):
        dst = TensorRef(None, name)
        targets.setdefault(dst, TensorMeta(hshape, tdtype))
        by_target[dst].append(_op(src, sshape, sbox, dst, hshape, dbox, itemsize(tdtype), **kw))

    for rank, name, row, layer, expert, duplicate in tensors:
        src = TensorRef(rank, name)
        if duplicate or (not _is_expert(row.role) and rank.ep != g.dense_ep(rank.tp)):
            continue  # a kept-in-sync copy; a dense tensor's copy on another ep rank
        if experts is not None and expert is not None and expert not in experts:
            continue
        if _is_expert(row.role) and layout.etp == 1 and layout.tp > 1:
            tps = g.expert_tps(rank.ep)
            if rank.tp != tps[0]:
                continue  # whole experts on every tp rank: spread over the tp ranks that exist
            if not row.role.startswith("grouped_"):
                src = TensorRef(RankCoord(tps[expert % len(tps)], rank.pp, rank.ep), name)
        if row.role.startswith("grouped_"):
            _grouped(g, src, row, layer, experts, dtype, sources, emit)
            continue
        if row.role == "replicated":
            if rank.tp != 0:
                continue
            k = replicas[rank.pp] % layout.tp
            replicas[rank.pp] += 1
            src = TensorRef(RankCoord(k, rank.pp, g.dense_ep(k)), name)
        names, local = [n.format(layer=layer, expert=expert) for n in row.hf], g.local(row)
        shapes = dict(zip(names, g.hf_shapes(row)))
        for hf_name in names:
            targets.setdefault(TensorRef(None, hf_name), TensorMeta(shapes[hf_name], row.dtype or dtype))
        for hf_name, s, d, n, cols in g.runs(row, names, src.rank.tp):
            shape = shapes[hf_name]
            sbox, dbox = ((_full(local), Box((0, d), (shape[0], n))) if cols
                          else (_rows(local, s, n), _rows(shape, d, n)))
            emit(src, local, sbox, hf_name, shape, dbox, row.dtype or dtype)
    ops = [op for ref in targets for op in _merge(by_target[ref], sources, targets)]
    return sources, targets, ops


def _grouped(g: _Geometry, src, row, layer, experts, dtype, sources, emit) -> None:
    """Legacy GroupedMLP: local expert j of the view is [gate_r^T | up_r^T] (weight1) or down_r^T
    (weight2, ``down_r`` = ``down_proj[:, r*F_l:(r+1)*F_l]``): transposed copies."""
    view, rank = g.view(row), src.rank
    sources[src] = TensorMeta(view, dtype, storage_shape=g.local(row))
    r = rank.tp if g.layout.etp > 1 else 0
    hf_shape = g.hf_shapes(row)[0]
    for j in range(view[0]):
        e = rank.ep * g.per_ep + j
        if experts is not None and e not in experts:
            continue
        names = [n.format(layer=layer, expert=e) for n in row.hf]
        if row.role == "grouped_fc1":
            h, f = view[1], view[2] // 2
            for k in range(2):
                emit(src, view, Box((j, 0, k * f), (1, h, f)), names[k], hf_shape, _rows(hf_shape, r * f, f),
                     transpose=True, src_view=True)
        else:
            f, h = view[1], view[2]
            emit(src, view, Box((j, 0, 0), (1, f, h)), names[0], hf_shape, Box((0, r * f), (h, f)),
                 transpose=True, src_view=True)


# ---- one vLLM worker's parameters, from vLLM's weight loaders

class Piece(NamedTuple):
    hf_name: str
    hf_box: Box  # the part of the HF tensor
    param_box: Box  # where it lands in the vLLM parameter


class Param(NamedTuple):
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


class Refused(Exception):
    """The model does not split over the worker's groups (vLLM would fail to build it)."""


def _div(n: int, k: int, what: str) -> int:
    if n % k:
        raise Refused(f"{what}={n} over {k}")
    return n // k


def _stack(parts, lead=()) -> Param:
    """Rows ``[first, first+n)`` of each HF ``(name, shape, first, n)`` stacked on the first non-slot dim."""
    at, pieces = 0, []
    for name, shape, first, n in parts:
        rest = tuple(shape[1:])
        place = Box(lead + (at,) + (0,) * len(rest), (1,) * len(lead) + (n,) + rest)
        pieces.append(Piece(name, _rows(shape, first, n), place))
        at += n
    return Param((at,) + tuple(parts[0][1][1:]), tuple(pieces))


def _cols(name, shape, T, t) -> Param:
    n = _div(shape[1], T, name)
    return Param((shape[0], n), (Piece(name, Box((0, t * n), (shape[0], n)), _full((shape[0], n))),))


def worker_experts(cfg: dict, tp: int, rank: int, expert_parallel: bool) -> list[int] | None:
    """vLLM's linear EP placement (``determine_expert_map``); ``None``: no EP, every expert."""
    n = Model(cfg).experts
    if not n or not expert_parallel or tp == 1:
        return None
    base, extra = divmod(n, tp)
    start, count = rank * base + min(rank, extra), base + (rank < extra)
    if not count:
        raise Refused(f"EP rank {rank} of {tp} holds none of {n} experts")
    return list(range(start, start + count))


def vllm_params(cfg: dict, T: int, t: int, expert_parallel: bool = False) -> dict[str, Param]:
    """Worker ``t`` of ``T``'s parameters (vLLM's names, local shapes, HF pieces).

    Raises:
        Refused: heads, kv heads, ffn or experts do not split over the worker's groups.
        KeyError: a family outside :data:`VLLM_FAMILIES`."""
    m = Model(cfg)
    if m.family not in VLLM_FAMILIES:
        raise KeyError(f"{m.family}: no vLLM layout restated here")
    h, d = m.hidden, m.head_dim
    slots = worker_experts(cfg, T, t, expert_parallel)
    Tm, tm = (1, 0) if slots is not None else (T, t)
    slots = slots if slots is not None else list(range(m.experts))
    padded = -(-m.vocab // 64) * 64  # vLLM's pad_vocab_size
    per = padded // T
    start, stop = t * per, min((t + 1) * per, m.vocab)

    def vocab(name):
        n = max(stop - start, 0)  # a rank past the real vocab holds padding only
        return Param((per, h), (Piece(name, _rows((m.vocab, h), start, n), _rows((per, h), 0, n)),) if n else ())

    heads = _div(m.heads, T, "num_attention_heads")
    if T >= m.groups:
        kv_n, kv_at = 1, t // _div(T, m.groups, "tp over num_key_value_heads")
    else:
        kv_n = _div(m.groups, T, "num_key_value_heads")
        kv_at = t * kv_n
    out = {"model.embed_tokens.weight": vocab("model.embed_tokens.weight")}
    for layer in range(m.layers):
        H = f"model.layers.{layer}."
        A = H + "self_attn."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[H + norm + ".weight"] = Param((h,), (Piece(H + norm + ".weight", _full((h,)), _full((h,))),))
        for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
            rest = (h,) if kind == "weight" else ()
            q = [(A + "q_proj." + kind, (m.heads * d,) + rest, t * heads * d, heads * d)]
            kv = [(A + p + kind, (m.groups * d,) + rest, kv_at * d, kv_n * d) for p in ("k_proj.", "v_proj.")]
            out[A + "qkv_proj." + kind] = _stack(q + kv)
        out[A + "o_proj.weight"] = _cols(A + "o_proj.weight", (h, m.heads * d), T, t)
        whole = [A + "o_proj.bias"] * m.proj_bias + [A + "q_norm.weight", A + "k_norm.weight"] * m.qk_norm
        out.update((n, Param((k,), (Piece(n, _full((k,)), _full((k,))),))) for n, k in
                   zip(whole, [h] * m.proj_bias + [d, d] * m.qk_norm))
        if m.is_moe(layer):
            out.update(_fused_moe(m, layer, slots, Tm, tm))
            continue
        M, f = H + "mlp.", _div(m.ffn, T, "intermediate_size")
        for kind in ("weight", "bias") if m.mlp_bias else ("weight",):
            rest = (h,) if kind == "weight" else ()
            out[M + "gate_up_proj." + kind] = _stack([(M + p + kind, (m.ffn,) + rest, t * f, f)
                                                      for p in ("gate_proj.", "up_proj.")])
        out[M + "down_proj.weight"] = _cols(M + "down_proj.weight", (h, m.ffn), T, t)
        if m.mlp_bias:
            out[M + "down_proj.bias"] = Param((h,), (Piece(M + "down_proj.bias", _full((h,)), _full((h,))),))
    out["model.norm.weight"] = Param((h,), (Piece("model.norm.weight", _full((h,)), _full((h,))),))
    if not m.tied:
        out["lm_head.weight"] = vocab("lm_head.weight")
    return out


def _fused_moe(m: Model, layer: int, slots: list[int], Tm: int, tm: int) -> dict[str, Param]:
    """The router (ReplicatedLinear) and FusedMoE's w13 / w2 of one MoE layer."""
    B = f"model.layers.{layer}." + ("block_sparse_moe." if m.family == "mixtral" else "mlp.")
    g, u, dn = ("w1", "w3", "w2") if m.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    h, F = m.hidden, m.moe_ffn
    f = _div(F, Tm, "moe_intermediate_size")
    w13 = [p for j, e in enumerate(slots) for p in _stack(
        [(f"{B}experts.{e}.{x}.weight", (F, h), tm * f, f) for x in (g, u)], lead=(j,)).pieces]
    w2 = [Piece(f"{B}experts.{e}.{dn}.weight", Box((0, tm * f), (h, f)), Box((j, 0, 0), (1, h, f)))
          for j, e in enumerate(slots)]
    return {B + "gate.weight": Param((m.experts, h), (Piece(B + "gate.weight", _full((m.experts, h)),
                                                            _full((m.experts, h))),)),
            B + "experts.routed_experts.w13_weight": Param((len(slots), 2 * f, h), tuple(w13)),
            B + "experts.routed_experts.w2_weight": Param((len(slots), h, f), tuple(w2))}


def _intersect(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def _source_part(op: CopyOp, part: Box) -> Box:
    """The sub-box of ``op.src_box`` whose bytes land on ``part`` (a sub-box of ``op.dst_box``)."""
    if not op.transpose:
        return Box(tuple(s + p - d for s, p, d in zip(op.src_box.offsets, part.offsets, op.dst_box.offsets)),
                   part.lengths)
    # transposed: the source's last two dims are the target's last two, swapped; leading dims are 1
    (d0, d1), (p0, p1), (n0, n1) = op.dst_box.offsets[-2:], part.offsets[-2:], part.lengths[-2:]
    lead = op.src_box.offsets[:-2]
    s0, s1 = op.src_box.offsets[-2:]
    return Box(lead + (s0 + p1 - d1, s1 + p0 - d0), (1,) * len(lead) + (n1, n0))


def _placed(piece: Piece, part: Box) -> Box:
    """Where ``part`` (a sub-box of ``piece.hf_box``) lands in the parameter."""
    k = len(piece.param_box.offsets) - len(piece.hf_box.offsets)  # leading expert-slot dims
    return Box(piece.param_box.offsets[:k] + tuple(p + i - h for p, i, h in zip(
        piece.param_box.offsets[k:], part.offsets, piece.hf_box.offsets)), (1,) * k + part.lengths)


def reference_retarget(hf, params: dict[str, Param], dtype: str = "bfloat16"):
    """The worker plan's ``(targets, ops)`` from the HF plan ``hf`` = ``(sources, targets, ops)``:
    every HF op that lands on a piece, cut to it and placed; rows no HF element lands in (vocab
    padding) are ``zero_fill``."""
    sources, _, hf_ops = hf
    by_hf = defaultdict(list)
    for op in hf_ops:
        by_hf[op.dst.name].append(op)
    targets: dict[TensorRef, TensorMeta] = {}
    ops: list[CopyOp] = []
    for name, param in params.items():
        dst, mine, written = TensorRef(None, name), [], 0
        for piece in param.pieces:
            for op in by_hf[piece.hf_name]:
                part = _intersect(op.dst_box, piece.hf_box)
                if part is not None:
                    mine.append(_op(op.src, sources[op.src].shape, _source_part(op, part), dst, param.shape,
                                        _placed(piece, part), op.itemsize, transpose=op.transpose,
                                        src_view=op.src_view is not None))
                    written += math.prod(part.lengths)
        ops += _merge(mine, sources, {dst: TensorMeta(param.shape, dtype)})
        filled = sum(p.param_box.lengths[0] for p in param.pieces)
        zero = (_rows(param.shape, filled, param.shape[0] - filled),) if written < math.prod(param.shape) else ()
        targets[dst] = TensorMeta(param.shape, dtype, zero)
    return targets, ops
