"""An independent reference for the Megatron-Core layout, straight from the layout facts.

Written with plain torch ``cat``/``chunk``/``reshape`` and its own name strings,
sharing no code with megarefit's planner, so tests can compare against it.
"""

from __future__ import annotations

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
