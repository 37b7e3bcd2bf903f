"""An independent reference for the Megatron-Core layout, straight from the layout facts.

Written with plain torch ``cat``/``chunk``/``reshape`` and its own name strings,
sharing no code with megarefit's planner, so tests can compare against it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F


def reference_shards(hf: dict[str, torch.Tensor], cfg: dict, *, tp: int, pp: int, divisor: int = 128,
                     te: bool = False) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    heads, groups = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    d = cfg.get("head_dim") or hidden // heads
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    tied = cfg.get("tie_word_embeddings", False)
    mult = divisor * tp
    padded = (vocab + mult - 1) // mult * mult
    per_stage = layers // pp

    def pad(w):
        return F.pad(w, (0, 0, 0, padded - vocab))

    def qkv(prefix, bias):
        suffix = "bias" if bias else "weight"
        q, k, v = (hf[f"{prefix}.{p}_proj.{suffix}"] for p in "qkv")
        rest = q.shape[1:]
        q = q.reshape(groups, heads // groups * d, *rest)
        k = k.reshape(groups, d, *rest)
        v = v.reshape(groups, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [q_g; k_g; v_g] per group

    out = {}
    for p in range(pp):
        for t in range(tp):
            s = {}
            if p == 0:
                s["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"]).chunk(tp)[t]
            for local in range(per_stage):
                g = p * per_stage + local
                H, L = f"model.layers.{g}.", f"decoder.layers.{local}."
                norm1 = L + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
                s[norm1] = hf[H + "input_layernorm.weight"]
                s[L + "self_attention.linear_qkv.weight"] = qkv(H + "self_attn", False).chunk(tp)[t]
                if H + "self_attn.q_proj.bias" in hf:
                    s[L + "self_attention.linear_qkv.bias"] = qkv(H + "self_attn", True).chunk(tp)[t]
                if H + "self_attn.q_norm.weight" in hf:
                    s[L + "self_attention.q_layernorm.weight"] = hf[H + "self_attn.q_norm.weight"]
                    s[L + "self_attention.k_layernorm.weight"] = hf[H + "self_attn.k_norm.weight"]
                s[L + "self_attention.linear_proj.weight"] = hf[H + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
                if H + "self_attn.o_proj.bias" in hf:
                    s[L + "self_attention.linear_proj.bias"] = hf[H + "self_attn.o_proj.bias"]
                norm2 = L + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")
                s[norm2] = hf[H + "post_attention_layernorm.weight"]
                gate, up = hf[H + "mlp.gate_proj.weight"], hf[H + "mlp.up_proj.weight"]
                s[L + "mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
                s[L + "mlp.linear_fc2.weight"] = hf[H + "mlp.down_proj.weight"].chunk(tp, dim=1)[t]
            if p == pp - 1:
                s["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
                if not tied:
                    s["output_layer.weight"] = pad(hf["lm_head.weight"]).chunk(tp)[t]
                elif pp > 1:
                    s["output_layer.weight"] = pad(hf["model.embed_tokens.weight"]).chunk(tp)[t]
            out[(t, p, 0)] = s
    return out


def reference_hf_names(cfg: dict, family: str) -> list[str]:
    """HF on-disk names a dense model of ``family`` has (independent list)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    qkv_bias = family == "qwen2" or cfg.get("attention_bias", False)
    for i in range(cfg["num_hidden_layers"]):
        H = f"model.layers.{i}."
        names += [H + "input_layernorm.weight", H + "post_attention_layernorm.weight"]
        names += [H + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [H + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        if qkv_bias:
            names += [H + f"self_attn.{p}_proj.bias" for p in "qkv"]
        if family != "qwen2" and cfg.get("attention_bias", False):
            names.append(H + "self_attn.o_proj.bias")
        if family == "qwen3":
            names += [H + "self_attn.q_norm.weight", H + "self_attn.k_norm.weight"]
    return sorted(names)


def reference_hf_state(cfg: dict, family: str, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random HF tensors with the shapes ``cfg`` implies (independent of megarefit)."""
    heads, groups = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hidden, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or hidden // heads
    shapes = {"embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden), "norm": (hidden,), "layernorm": (hidden,),
              "q_proj.weight": (heads * d, hidden), "k_proj.weight": (groups * d, hidden),
              "v_proj.weight": (groups * d, hidden), "o_proj.weight": (hidden, heads * d),
              "q_proj.bias": (heads * d,), "k_proj.bias": (groups * d,), "v_proj.bias": (groups * d,),
              "o_proj.bias": (hidden,), "q_norm": (d,), "k_norm": (d,), "gate_proj": (ffn, hidden),
              "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in reference_hf_names(cfg, family):
        key = next(k for k in sorted(shapes, key=len, reverse=True) if k in name)
        out[name] = torch.randn(shapes[key], generator=g).to(dtype)
    return out


def servable_hf_state(cfg: dict, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`reference_hf_state` at a trained model's scale, for greedy generation compared
    across engines: norm weights ``1 + 0.1 x``, every other tensor ``0.05 x`` (float32)."""
    return {name: 1 + 0.1 * t if "norm" in name else 0.05 * t
            for name, t in reference_hf_state(cfg, family, seed).items()}


# ---- MoE (Qwen3-MoE / Mixtral style): independent names and layout --------------------------

MOE_HF = {  # family -> (block, gate, expert names gate/up/down)
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
}


def moe_dense_layers(cfg: dict, family: str) -> set[int]:
    if family == "qwen3_moe":
        step = cfg.get("decoder_sparse_step") or 1
        return set(cfg.get("mlp_only_layers") or []) | {i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step}
    return set()


def moe_hf_state(cfg: dict, family: str, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random HF tensors of a Qwen3-MoE / Mixtral model, from the config alone."""
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or hidden // heads
    experts = cfg["num_experts"] if family == "qwen3_moe" else cfg["num_local_experts"]
    ffn = cfg["moe_intermediate_size"] if family == "qwen3_moe" else cfg["intermediate_size"]
    block, gate, (w_gate, w_up, w_down) = MOE_HF[family]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    out = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = r(vocab, hidden)
    dense = moe_dense_layers(cfg, family)
    for i in range(cfg["num_hidden_layers"]):
        H = f"model.layers.{i}."
        out |= {H + "input_layernorm.weight": r(hidden), H + "post_attention_layernorm.weight": r(hidden),
                H + "self_attn.q_proj.weight": r(heads * d, hidden), H + "self_attn.k_proj.weight": r(groups * d, hidden),
                H + "self_attn.v_proj.weight": r(groups * d, hidden), H + "self_attn.o_proj.weight": r(hidden, heads * d)}
        if family == "qwen3_moe":
            out |= {H + "self_attn.q_norm.weight": r(d), H + "self_attn.k_norm.weight": r(d)}
        if i in dense:
            f = cfg["intermediate_size"]
            out |= {H + "mlp.gate_proj.weight": r(f, hidden), H + "mlp.up_proj.weight": r(f, hidden),
                    H + "mlp.down_proj.weight": r(hidden, f)}
            continue
        out[H + f"{block}.{gate}.weight"] = r(experts, hidden)
        for e in range(experts):
            E = H + f"{block}.experts.{e}."
            out |= {E + f"{w_gate}.weight": r(ffn, hidden), E + f"{w_up}.weight": r(ffn, hidden),
                    E + f"{w_down}.weight": r(hidden, ffn)}
    return out


def moe_reference_shards(hf: dict[str, torch.Tensor], cfg: dict, family: str, *, tp: int, pp: int, ep: int,
                         etp: int, layout: str = "sequential", divisor: int = 128) -> dict:
    """Megatron shards of a MoE model: dense parts as ``reference_shards``, experts on
    ep rank ``e // (E/ep)`` with local index ``e % (E/ep)``, split over ``etp``.
    ``layout``: "sequential" (local_experts.{j}), "te_grouped" (linear_fc1.weight{j}) or
    "legacy_grouped" (weight1 / weight2 whose memory is [E_local, h, 2F] / [E_local, F, h]
    of per-expert transposed blocks)."""
    dense_cfg = dict(cfg)
    experts = cfg["num_experts"] if family == "qwen3_moe" else cfg["num_local_experts"]
    block, gate, (w_gate, w_up, w_down) = MOE_HF[family]
    dense_layers = moe_dense_layers(cfg, family)
    per_stage, per_ep = cfg["num_hidden_layers"] // pp, experts // ep
    # dense parts: the dense reference, given placeholder MLPs in MoE layers that are dropped below
    fake, hidden = dict(hf), cfg["hidden_size"]
    for i in set(range(cfg["num_hidden_layers"])) - dense_layers:
        H = f"model.layers.{i}.mlp."
        fake |= {H + "gate_proj.weight": torch.zeros(tp, hidden), H + "up_proj.weight": torch.zeros(tp, hidden),
                 H + "down_proj.weight": torch.zeros(hidden, tp)}
    base = reference_shards(fake, dense_cfg, tp=tp, pp=pp, divisor=divisor)
    out = {}
    for (t, p, _), params in base.items():
        for e_rank in range(ep):
            s = {}
            for name, tensor in params.items():
                if name.startswith("decoder.layers."):
                    local = int(name.split(".")[2])
                    if p * per_stage + local not in dense_layers and ".mlp.linear_fc" in name:
                        continue
                s[name] = tensor
            for local in range(per_stage):
                i = p * per_stage + local
                if i in dense_layers:
                    continue
                H, L = f"model.layers.{i}.{block}.", f"decoder.layers.{local}.mlp."
                s[L + "router.weight"] = hf[H + f"{gate}.weight"]
                fc1s, fc2s = [], []
                for j in range(per_ep):
                    e = e_rank * per_ep + j
                    E = H + f"experts.{e}."
                    rank = t if etp > 1 else 0
                    fc1 = torch.cat([hf[E + f"{w_gate}.weight"].chunk(etp)[rank], hf[E + f"{w_up}.weight"].chunk(etp)[rank]])
                    fc2 = hf[E + f"{w_down}.weight"].chunk(etp, dim=1)[rank]
                    fc1s.append(fc1)
                    fc2s.append(fc2)
                    if layout == "te_grouped":
                        s[L + f"experts.linear_fc1.weight{j}"], s[L + f"experts.linear_fc2.weight{j}"] = fc1, fc2
                    elif layout == "sequential":
                        s[L + f"experts.local_experts.{j}.linear_fc1.weight"] = fc1
                        s[L + f"experts.local_experts.{j}.linear_fc2.weight"] = fc2
                if layout == "legacy_grouped":
                    hidden = fc1s[0].shape[1]
                    s[L + "experts.weight1"] = torch.stack([f.T for f in fc1s]).reshape(hidden, -1)
                    s[L + "experts.weight2"] = torch.stack([f.T for f in fc2s]).reshape(-1, hidden)
            out[(t, p, e_rank)] = s
    return out


def vllm_reference(hf: dict, cfg: dict, T: int, t: int) -> dict:
    """vLLM's documented TP layout from full HF tensors, with cat / chunk (independent of
    the planner): q heads split, kv heads split or replicated, gate/up chunks stacked,
    row-parallel column chunks, vocab padded to 64 and split."""
    out = {}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    for name, w in hf.items():
        if any(s in name for s in ("k_proj", "v_proj", "up_proj")):
            continue
        if ".q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            q_t = w.chunk(T)[t]
            if T >= kv:
                head = t // (T // kv)
                k_t, v_t = k[head * d:(head + 1) * d], v[head * d:(head + 1) * d]
            else:
                k_t, v_t = k.chunk(T)[t], v.chunk(T)[t]
            out[name.replace("q_proj." + kind, "qkv_proj." + kind)] = torch.cat([q_t, k_t, v_t])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [w.chunk(T)[t], hf[name.replace("gate_proj", "up_proj")].chunk(T)[t]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = w.chunk(T, dim=1)[t]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = math.ceil(w.shape[0] / 64) * 64
            full = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
            out[name] = full.chunk(T)[t]
        else:
            out[name] = w
    return out


def hf_checkpoint_state(cfg: dict, directory, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the names and shapes HF transformers' own
    ``save_pretrained`` writes for ``cfg`` (independent of megarefit's tables)."""
    import safetensors.torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          dtype=torch.float32)
    model.save_pretrained(directory)
    shapes = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        shapes |= {k: v.shape for k, v in safetensors.torch.load_file(f).items()}
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shapes[k], generator=g) for k in sorted(shapes)}


def vllm_moe_reference(hf: dict, cfg: dict, T: int, t: int, D: int = 1, d: int = 0, expert_parallel: bool = False,
                       placement: str = "linear", physical_to_logical: list[list[int]] | None = None) -> dict:
    """vLLM's documented layout of an MoE / MLA model on worker (tp rank t of T, dp rank d
    of D), with cat / chunk and vLLM's own ``determine_expert_map`` (independent of the
    planner): attention and dense MLPs as :func:`vllm_reference`; MLA down-projections
    stacked whole into ``fused_qkv_a_proj``; GLM-5's indexer whole, ``wk`` and ``weights_proj``
    stacked into ``wk_weights_proj``; routed experts tensor-parallel over all
    T*D workers (rank d*T + t), or whole experts under EP (EP rank d*T + t); DeepSeek-V3's
    and GLM-5's shared experts whole under sequence-parallel MoE (EP, T > 1, D > 1).
    ``physical_to_logical`` (EPLB, per MoE layer): vLLM places the physical experts, each
    slot holds its layer's logical expert (redundant ones repeat)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    family = cfg["model_type"]
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    n, r = T * D, d * T + t
    ep = expert_parallel and n > 1
    moe_T, moe_r = (1, 0) if ep else (n, r)
    physical = experts if physical_to_logical is None else len(physical_to_logical[0])
    if ep:
        _, emap, _ = determine_expert_map(n, r, physical, placement)
        emap = emap.tolist()
        slots = [emap.index(j) for j in range(max(emap) + 1)]
    else:
        slots = list(range(physical))
    dense, routed, out = {}, {}, {}
    fused = {}  # gpt-oss: model.layers.L.mlp.experts. -> {gate_up_proj, ..._bias, down_proj, ..._bias}
    for name, w in hf.items():
        f = re.match(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$", name)
        if f:
            fused.setdefault(f.group(1), {})[f.group(2) + (f.group(3) or "")] = w
            continue
        m = re.match(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)\.(\w+)\.weight$", name)
        if m:
            routed.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = w
        else:
            dense[name] = w
    sp_shared = family in ("deepseek_v3", "glm_moe_dsa") and ep and T > 1 and D > 1
    for name in list(dense):
        if name not in dense:
            continue  # popped with its gate_proj
        if ".shared_experts." in name and sp_shared:
            out[name.replace("gate_proj", "gate_up_proj")] = (
                torch.cat([dense.pop(name), dense.pop(name.replace("gate_proj", "up_proj"))])
                if ".gate_proj." in name else dense.pop(name))
        elif name.endswith("self_attn.indexer.wk.weight"):  # GLM-5's DSA indexer: replicated, wk + weights_proj fused
            out[name.replace(".wk.", ".wk_weights_proj.")] = torch.cat(
                [dense.pop(name), dense.pop(name.replace(".wk.", ".weights_proj."))])
        elif ".self_attn.indexer." in name and not name.endswith(".weights_proj.weight"):
            out[name] = dense.pop(name)  # (weights_proj goes with wk)
        elif name.endswith("self_attn.q_a_proj.weight"):
            kv = name.replace("q_a_proj", "kv_a_proj_with_mqa")
            out[name.replace("q_a_proj", "fused_qkv_a_proj")] = torch.cat([dense.pop(name), dense.pop(kv)])
        elif name.endswith(("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")) or (
                name.endswith("self_attn.q_proj.weight") and name.replace("q_proj", "kv_a_proj_with_mqa") in hf):
            out[name] = dense.pop(name).chunk(T)[t]  # MLA column-parallel (q_proj: no q_lora_rank)
    sinks = {n: dense.pop(n).chunk(T)[t] for n in list(dense) if n.endswith(".self_attn.sinks")}  # by heads
    if family == "minimax_m2":  # q / k norms over all heads (MiniMaxText01RMSNormTP): the rank's heads' part
        kv = cfg["num_key_value_heads"]
        sinks |= {n: dense.pop(n).chunk(T)[t] for n in list(dense) if n.endswith(".self_attn.q_norm.weight")}
        sinks |= {n: dense.pop(n).chunk(min(T, kv))[t * min(T, kv) // T] for n in list(dense)
                  if n.endswith(".self_attn.k_norm.weight")}  # T > kv: head t // (T / kv), replicated
    out |= vllm_reference(dense, cfg, T, t) | sinks
    if family == "gpt_oss":  # vLLM's GptOssModel spells attn / embedding
        out = {n.replace(".self_attn.", ".attn.").replace("model.embed_tokens.", "model.embedding."): w
               for n, w in out.items()}
    for prefix, ws in fused.items():
        out |= _gpt_oss_experts(prefix, ws, slots, moe_T, moe_r)
    mixtral_names = family in ("mixtral", "minimax_m2")
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    moe_layers = sorted({int(prefix.split(".")[2]) for prefix in routed})
    for prefix, ws in routed.items():
        layer_slots = slots if physical_to_logical is None else [
            physical_to_logical[moe_layers.index(int(prefix.split(".")[2]))][p] for p in slots]
        out[prefix + "routed_experts.w13_weight"] = torch.stack(
            [torch.cat([ws[(e, gate)].chunk(moe_T)[moe_r], ws[(e, up)].chunk(moe_T)[moe_r]]) for e in layer_slots])
        out[prefix + "routed_experts.w2_weight"] = torch.stack([ws[(e, down)].chunk(moe_T, dim=1)[moe_r]
                                                               for e in layer_slots])
    return out


def _gpt_oss_experts(prefix: str, ws: dict, slots: list[int], moe_T: int, moe_r: int) -> dict:
    """vLLM gpt_oss.py's bf16 loader, restated: the worker's experts (``slots``); without EP each
    narrowed to its ffn range [start, end) -- gate_up_proj columns [2*start, 2*end) (gate / up stay
    interleaved) transposed, down_proj rows [start, end) transposed, gate_up bias columns
    [2*start, 2*end); down_proj_bias whole on moe rank 0 and zero elsewhere."""
    f = ws["down_proj"].shape[1] // moe_T
    lo, hi = moe_r * f, (moe_r + 1) * f
    idx = torch.tensor(slots)
    bias = ws["down_proj_bias"][idx]
    return {prefix + "routed_experts.w13_weight": ws["gate_up_proj"][idx][:, :, 2 * lo:2 * hi].permute(0, 2, 1),
            prefix + "routed_experts.w13_bias": ws["gate_up_proj_bias"][idx][:, 2 * lo:2 * hi],
            prefix + "routed_experts.w2_weight": ws["down_proj"][idx][:, lo:hi, :].permute(0, 2, 1),
            prefix + "routed_experts.w2_bias": bias if moe_r == 0 else torch.zeros_like(bias)}


def block_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's block-FP8 recipe restated (``vllm.utils.deep_gemm.per_block_cast_to_fp8``, for
    machines without vLLM; tests/test_fp8.py checks it against vLLM's bit for bit): per
    ``block`` x ``block`` tile, scale = max(amax, 1e-4) / 448, ``w * (1 / scale)`` cast to e4m3."""
    m, n = w.shape
    padded = torch.zeros(-(-m // block) * block, -(-n // block) * block, dtype=w.dtype, device=w.device)
    padded[:m, :n] = w
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = tiles.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles * (1.0 / scale)).to(torch.float8_e4m3fn).view_as(padded)[:m, :n].contiguous()
    return q, scale.view(tiles.shape[0], tiles.shape[2])


def vllm_fp8_checkpoint(hf: dict[str, torch.Tensor], names: set[str] | frozenset[str], *,
                        quantize=None) -> dict[str, torch.Tensor]:
    """A block-FP8 checkpoint made by vLLM's own quantizer (``per_block_cast_to_fp8``), or by
    ``quantize`` (e.g. :func:`block_fp8` where vLLM is not installed): each weight in ``names``
    becomes ``weight`` + ``weight_scale_inv``; the rest pass through."""
    if quantize is None:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        def quantize(w):
            return per_block_cast_to_fp8(w, [128, 128])

    out = {}
    for name, w in hf.items():
        if name in names:
            out[name], out[name + "_scale_inv"] = quantize(w)
        else:
            out[name] = w
    return out


def gpt_oss_reference_shards(hf: dict[str, torch.Tensor], cfg: dict, ranks, *, tp: int, pp: int, ep: int,
                             layout: str = "sequential", divisor: int = 128) -> dict:
    """Megatron shards of a gpt-oss model on ``ranks`` ((tp, pp, ep) tuples; expert-TP 1, the only
    size Megatron-Core builds biased experts at): attention as ``reference_shards`` plus sinks split
    by heads; experts whole on ep rank ``e // (E/ep)``, gate / up taken from the interleaved
    ``gate_up_proj`` [E, h, 2f] with strided slices and transposed, ``[gate; up]`` concatenated."""
    experts, heads = cfg["num_local_experts"], cfg["num_attention_heads"]
    per_stage, per_ep = cfg["num_hidden_layers"] // pp, experts // ep
    fake, hidden = dict(hf), cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        H = f"model.layers.{i}.mlp."
        fake |= {H + "gate_proj.weight": torch.zeros(tp, hidden), H + "up_proj.weight": torch.zeros(tp, hidden),
                 H + "down_proj.weight": torch.zeros(hidden, tp)}
    base = reference_shards(fake, cfg, tp=tp, pp=pp, divisor=divisor)
    out = {}
    for t, p, e_rank in ranks:
        s = {k: v for k, v in base[(t, p, 0)].items() if ".mlp.linear_fc" not in k}
        for local in range(per_stage):
            H, L = f"model.layers.{p * per_stage + local}.", f"decoder.layers.{local}."
            s[L + "self_attention.core_attention.softmax_offset"] = hf[H + "self_attn.sinks"].reshape(tp, heads // tp)[t]
            s[L + "mlp.router.weight"], s[L + "mlp.router.bias"] = hf[H + "mlp.router.weight"], hf[H + "mlp.router.bias"]
            gate_up, gate_up_bias = hf[H + "mlp.experts.gate_up_proj"], hf[H + "mlp.experts.gate_up_proj_bias"]
            down, down_bias = hf[H + "mlp.experts.down_proj"], hf[H + "mlp.experts.down_proj_bias"]
            for j in range(per_ep):
                e = e_rank * per_ep + j
                fc1 = torch.cat([gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T])  # [2f, h] = [gate; up]
                fc1_bias = torch.cat([gate_up_bias[e][0::2], gate_up_bias[e][1::2]])
                X = L + (f"mlp.experts.local_experts.{j}.linear_fc{{}}.{{}}" if layout == "sequential"
                         else f"mlp.experts.linear_fc{{}}.{{}}{j}")
                s[X.format(1, "weight")], s[X.format(1, "bias")] = fc1, fc1_bias
                s[X.format(2, "weight")], s[X.format(2, "bias")] = down[e].T, down_bias[e]
        out[(t, p, e_rank)] = s
    return out


def nemotron_h_reference_shards(hf: dict[str, torch.Tensor], cfg: dict, ranks, *, tp: int, ep: int,
                                layout: str = "sequential") -> dict:
    """Megatron ``MambaModel`` shards (local spec, pp 1, expert TP 1) of a Nemotron-H checkpoint, in
    Megatron-Bridge's scheme (``MambaInProjMapping`` / ``MambaConv1dMapping``): every part of
    ``in_proj`` [z; x; B; C; dt] and ``conv1d`` [x; B; C] reshaped to (tp, -1, ...) and the
    parts concatenated per rank; q / k / v interleaved per query group, then the whole tensor
    chunked over tp (a part of a group per rank when tp > groups); ``ranks``: the (tp, pp, ep)
    ranks to build, experts whole on ep rank e."""
    pattern = cfg["hybrid_override_pattern"]
    groups = cfg["num_key_value_heads"]
    d, hidden, vocab = cfg["head_dim"], cfg["hidden_size"], cfg["vocab_size"]
    inner, gs = cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["n_groups"] * cfg["ssm_state_size"]
    experts = cfg["n_routed_experts"]
    padded = -(-vocab // (128 * tp)) * (128 * tp)

    def parts(w, sizes, t):
        return torch.cat([p.reshape(tp, -1, *p.shape[1:])[t] for p in w.split(sizes)])

    def qkv(prefix):
        q, k, v = (hf[f"{prefix}{x}_proj.weight"] for x in "qkv")
        return torch.cat([q.reshape(groups, -1, hidden), k.reshape(groups, d, hidden), v.reshape(groups, d, hidden)],
                         1).reshape(-1, hidden)

    out = {}
    for t, _, e_rank in ranks:
        if True:
            s = {"embedding.word_embeddings.weight": F.pad(hf["backbone.embeddings.weight"],
                                                           (0, 0, 0, padded - vocab)).chunk(tp)[t],
                 "decoder.final_norm.weight": hf["backbone.norm_f.weight"],
                 "output_layer.weight": F.pad(hf["lm_head.weight"], (0, 0, 0, padded - vocab)).chunk(tp)[t]}
            for i, kind in enumerate(pattern):
                H, L = f"backbone.layers.{i}.mixer.", f"decoder.layers.{i}."
                norm = {"M": "norm", "*": "input_layernorm", "-": "pre_mlp_layernorm", "E": "pre_mlp_layernorm"}[kind]
                s[L + norm + ".weight"] = hf[f"backbone.layers.{i}.norm.weight"]
                if kind == "M":
                    s[L + "mixer.in_proj.weight"] = parts(hf[H + "in_proj.weight"], [inner, inner, gs, gs,
                                                                                     cfg["mamba_num_heads"]], t)
                    for p in ("weight", "bias"):
                        s[L + f"mixer.conv1d.{p}"] = parts(hf[H + f"conv1d.{p}"], [inner, gs, gs], t)
                    for p in ("A_log", "D", "dt_bias", "norm.weight"):
                        s[L + f"mixer.{p}"] = hf[H + p].chunk(tp)[t]
                    s[L + "mixer.out_proj.weight"] = hf[H + "out_proj.weight"].chunk(tp, 1)[t]
                elif kind == "*":
                    s[L + "self_attention.linear_qkv.weight"] = qkv(H).chunk(tp)[t]
                    s[L + "self_attention.linear_proj.weight"] = hf[H + "o_proj.weight"].chunk(tp, 1)[t]
                elif kind == "-":
                    s[L + "mlp.linear_fc1.weight"] = hf[H + "up_proj.weight"].chunk(tp)[t]
                    s[L + "mlp.linear_fc2.weight"] = hf[H + "down_proj.weight"].chunk(tp, 1)[t]
                else:
                    s[L + "mlp.router.weight"] = hf[H + "gate.weight"]
                    s[L + "mlp.router.expert_bias"] = hf[H + "gate.e_score_correction_bias"]
                    s[L + "mlp.shared_experts.linear_fc1.weight"] = hf[H + "shared_experts.up_proj.weight"].chunk(tp)[t]
                    s[L + "mlp.shared_experts.linear_fc2.weight"] = hf[H + "shared_experts.down_proj.weight"].chunk(
                        tp, 1)[t]
                    per = experts // ep
                    for j in range(per):
                        X = H + f"experts.{e_rank * per + j}."
                        names = ((f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                                  f"mlp.experts.local_experts.{j}.linear_fc2.weight") if layout == "sequential" else
                                 (f"mlp.experts.linear_fc1.weight{j}", f"mlp.experts.linear_fc2.weight{j}"))
                        s[L + names[0]], s[L + names[1]] = hf[X + "up_proj.weight"], hf[X + "down_proj.weight"]
            out[(t, 0, e_rank)] = s
    return out


def with_mtp_layer(cfg: dict, hf: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """``hf`` plus MTP layer N (``num_hidden_layers``) as DeepSeek-V3 / GLM-4.5 checkpoints store
    it: fresh random tensors shaped like the last decoder layer's (a MoE layer), and the
    MTP-only ``enorm``, ``hnorm``, ``eh_proj`` [h, 2h] and ``shared_head.norm``."""
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    out = dict(hf)
    last = f"model.layers.{n - 1}."
    for name, t in hf.items():
        if name.startswith(last):
            out[f"model.layers.{n}." + name[len(last):]] = torch.randn(t.shape, generator=g)
    for leaf, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)), ("shared_head.norm", (h,))):
        out[f"model.layers.{n}.{leaf}.weight"] = torch.randn(shape, generator=g)
    return out


def unshard(shards: dict, like: dict[str, torch.Tensor], shard) -> dict[str, torch.Tensor]:
    """The HF tensors (names, shapes and dtypes of ``like``) whose Megatron shards are ``shards``,
    for ``shard(hf) -> {rank: {name: tensor}}``, one of this module's sharding references with its
    arguments bound: ``shard`` runs on tensors holding each HF element's own position (1, 2, ...),
    so each shard element says which HF element it is (0: vocab padding). No inverse layout is
    written twice. Every element of ``like`` must be found, every rank's names must be ``shard``'s,
    and the copies of one element (tp / ep replicas, a tied output layer) must agree.

    Raises:
        AssertionError: a missing or extra name, a shape mismatch, replicas that disagree, an
            element no shard holds."""
    ids, n = {}, 1
    for name, t in like.items():
        ids[name] = torch.arange(n, n + t.numel(), dtype=torch.float64).reshape(t.shape)
        n += t.numel()
    assert n < 2**53, "positions past float64's exact integers"
    flat = torch.full((n,), math.nan, dtype=torch.float64)
    for rank, tagged in shard(ids).items():
        assert tagged.keys() == shards[rank].keys(), (rank, sorted(tagged.keys() ^ shards[rank].keys()))
        for name, tag in tagged.items():
            got = shards[rank][name]
            assert tuple(got.shape) == tuple(tag.shape), (rank, name, tuple(got.shape), tuple(tag.shape))
            where, values = tag.reshape(-1).long(), got.detach().reshape(-1).double()
            where, values = where[where > 0], values[where > 0]
            old = flat[where]
            known = ~old.isnan()
            assert torch.equal(old[known], values[known]), f"{name} on rank {rank}: copies of one element disagree"
            flat[where] = values
    out = {name: flat[i.long()].to(like[name].dtype) for name, i in ids.items()}
    missing = [name for name, i in ids.items() if flat[i.long()].isnan().any()]
    assert not missing, f"HF elements no shard holds: {missing}"
    return out


def qwen35_layer_types(cfg: dict) -> list[str]:
    """``layer_types`` as transformers derives them (every ``full_attention_interval``-th layer full)."""
    every = cfg.get("full_attention_interval", 4)
    return cfg.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]


def qwen3_next_in_proj(qkvz: torch.Tensor, ba: torch.Tensor, cfg: dict, tp: int) -> list[torch.Tensor]:
    """Megatron-Core's GDN ``in_proj`` per TP rank from Qwen3-Next's packed HF tensors, as Megatron-Bridge
    0.6's ``merge_gdn_linear_weights`` writes it: ``in_proj_qkvz`` viewed [key heads, dk + dk + r*dv +
    r*dv, hidden] and ``in_proj_ba`` [key heads, r + r, hidden] (r value heads per key head), split
    into q k v z / b a, each viewed [tp, -1, hidden] and concatenated per rank (reshape / split / cat only)."""
    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r, hidden = cfg["linear_num_value_heads"] // nk, cfg["hidden_size"]
    q, k, v, z = qkvz.reshape(nk, -1, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, -1, hidden).split([r, r], dim=1)
    merged = torch.cat([w.reshape(tp, -1, hidden) for w in (q, k, v, z, b, a)], dim=1)
    return list(merged.unbind(0))


def qwen35_reference_shards(hf: dict[str, torch.Tensor], cfg: dict, *, tp: int, te: bool = False,
                            divisor: int = 128) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Megatron-Core shards (pp 1, dense MLP) of a Qwen3.5 text checkpoint, written from Megatron-Bridge
    0.6's formulas (``merge_gdn_linear_weights`` / ``GDNLinearMappingSeparate``: each of q k v z b a
    split over tp, rank r = [q_r; k_r; v_r; z_r; b_r; a_r]; ``GDNConv1dMapping``: q k v each split;
    ``merge_qkv_weights`` with ``attention_output_gate``: q_proj viewed [heads, 2d] -> q, gate, per
    group [q heads; gate heads; k; v], then a contiguous split; ``RMSNorm2ZeroCenteredRMSNormMapping``:
    out_norm = HF norm - 1), with reshape / cat / chunk only (independent of megarefit)."""
    nh, ng, d, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    qk, v_rows = nk * cfg["linear_key_head_dim"], nv * cfg["linear_value_head_dim"]
    mult = divisor * tp
    padded = (cfg["vocab_size"] + mult - 1) // mult * mult

    def pad(w):
        return F.pad(w, (0, 0, 0, padded - cfg["vocab_size"]))

    def gated_qkv(a):
        qg = hf[a + "q_proj.weight"].reshape(nh, 2 * d, hidden)
        q, gate = qg[:, :d], qg[:, d:]
        k, v = hf[a + "k_proj.weight"].reshape(ng, d, hidden), hf[a + "v_proj.weight"].reshape(ng, d, hidden)
        hpg = nh // ng
        return torch.cat([torch.cat([q[g * hpg:(g + 1) * hpg].reshape(-1, hidden),
                                     gate[g * hpg:(g + 1) * hpg].reshape(-1, hidden), k[g], v[g]])
                          for g in range(ng)])

    out = {}
    for t in range(tp):
        s = {"embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]).chunk(tp)[t],
             "decoder.final_layernorm.weight": hf["model.norm.weight"],
             "output_layer.weight": pad(hf["lm_head.weight"]).chunk(tp)[t]}
        for i, kind in enumerate(qwen35_layer_types(cfg)):
            H, L = f"model.layers.{i}.", f"decoder.layers.{i}."
            if kind == "linear_attention":
                G = H + "linear_attn."
                q, k, v = hf[G + "in_proj_qkv.weight"].split([qk, qk, v_rows])
                parts = (q, k, v, hf[G + "in_proj_z.weight"], hf[G + "in_proj_b.weight"], hf[G + "in_proj_a.weight"])
                s[L + "self_attention.in_proj.weight"] = torch.cat([p.chunk(tp)[t] for p in parts])
                s[L + "self_attention.conv1d.weight"] = torch.cat(
                    [p.chunk(tp)[t] for p in hf[G + "conv1d.weight"].split([qk, qk, v_rows])])
                s[L + "self_attention.A_log"] = hf[G + "A_log"].chunk(tp)[t]
                s[L + "self_attention.dt_bias"] = hf[G + "dt_bias"].chunk(tp)[t]
                s[L + "self_attention.out_norm.weight"] = hf[G + "norm.weight"] - 1
                s[L + "self_attention.out_proj.weight"] = hf[G + "out_proj.weight"].chunk(tp, dim=1)[t]
                norm = "self_attention.in_proj.layer_norm_weight"
            else:
                A = H + "self_attn."
                s[L + "self_attention.linear_qkv.weight"] = gated_qkv(A).chunk(tp)[t]
                s[L + "self_attention.q_layernorm.weight"] = hf[A + "q_norm.weight"]
                s[L + "self_attention.k_layernorm.weight"] = hf[A + "k_norm.weight"]
                s[L + "self_attention.linear_proj.weight"] = hf[A + "o_proj.weight"].chunk(tp, dim=1)[t]
                norm = "self_attention.linear_qkv.layer_norm_weight"
            s[L + (norm if te else "input_layernorm.weight")] = hf[H + "input_layernorm.weight"]
            s[L + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")] = \
                hf[H + "post_attention_layernorm.weight"]
            s[L + "mlp.linear_fc1.weight"] = torch.cat([hf[H + f"mlp.{p}_proj.weight"].chunk(tp)[t]
                                                        for p in ("gate", "up")])
            s[L + "mlp.linear_fc2.weight"] = hf[H + "mlp.down_proj.weight"].chunk(tp, dim=1)[t]
        out[(t, 0, 0)] = s
    return out
