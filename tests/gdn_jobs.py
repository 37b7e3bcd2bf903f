"""Worker body for test_megatron_gdn.py (module level so spawn can import it): Megatron-Core's own
``GatedDeltaNet`` and gated ``SelfAttention`` (``attention_output_gate``) on CPU in real
tensor-parallel processes (gloo), filled with megarefit's shards of a transformers
``Qwen3_5ForCausalLM``, against that model's own layers on the same input.

What makes them run on CPU (nothing about the weights' layout changes):

* ``fla`` (flash-linear-attention) is absent: the GDN's module flag says it is there and its
  ``l2norm`` is torch's (what fla computes); the forward runs the deterministic torch path
  (``deterministic_mode``: ``F.conv1d`` and Megatron's ``torch_chunk_gated_delta_rule``);
* norms: Transformer Engine's ``TENorm`` with ``layernorm_zero_centered_gamma`` (what
  Megatron-Bridge sets for Qwen3.5) computes ``(1 + w) * rmsnorm(x)``; :class:`ZeroCenteredRMSNorm`
  computes the same here (Megatron's local ``WrappedTorchNorm`` refuses zero-centered gamma);
* the CUDA RNG tracker's ``fork`` is a no-op (no dropout runs).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``(1 + weight) * x / rms(x)``: TENorm with ``zero_centered_gamma`` (weight stores w - 1), for
    Megatron's norm slots (``build_module(norm, config=, hidden_size=, eps=)``)."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _megatron_layers(cfg: dict, tp: int) -> tuple[Any, Any]:
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    common = gated_delta_net.common if hasattr(gated_delta_net, "common") else gated_delta_net
    common.HAVE_FLA = True
    common.l2norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    config = TransformerConfig(
        num_layers=2, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"], kv_channels=cfg["head_dim"], normalization="RMSNorm",
        qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2, linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"], linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"], linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"],
        activation_func=F.silu, add_bias_linear=False, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        perform_initialization=False, deterministic_mode=True, layernorm_epsilon=1e-6, params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    gdn = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm,
                                                        out_proj=RowParallelLinear), layer_number=1, pg_collection=pg)
    attention = SelfAttention(config, SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear,
        q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm), layer_number=2,
        attn_mask_type=AttnMaskType.causal, pg_collection=pg)
    return gdn, attention


def gdn_layers_job(rank: int, world_size: int, port: int, cfg: dict, hf: dict[str, torch.Tensor],
                   shards: dict[tuple[int, int, int], dict[str, torch.Tensor]]) -> dict[str, float]:
    """Layer 0 (GDN) and layer 1 (gated full attention) of ``cfg``'s model (Qwen3.5's text model or
    Qwen3-Next's, by ``model_type``): Megatron-Core's modules
    loaded from this TP rank's ``shards`` (their ``self_attention.*`` tensors), HF's from ``hf``,
    on one random input; returns ``{layer: (max |Megatron - HF|, max |HF|)}``."""
    shards = shards[(rank, 0, 0)]
    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarefit.demo.megatron_cpu import init_parallel

    init_parallel(rank=rank, world_size=world_size, master_port=port, tp=world_size, pp=1)
    gdn, attention = _megatron_layers(cfg, world_size)
    for i, module in enumerate((gdn, attention)):
        prefix = f"decoder.layers.{i}.self_attention."
        missing = module.load_state_dict({n[len(prefix):]: t for n, t in shards.items()  # type: ignore[union-attr]
                                          if n.startswith(prefix)}, strict=False)
        assert not missing.unexpected_keys and not [k for k in missing.missing_keys if "_extra_state" not in k], missing
    keys = {k: v for k, v in cfg.items() if k != "architectures"}
    next_ = cfg["model_type"] == "qwen3_next"  # Qwen3-Next: in_proj_qkvz / in_proj_ba packed per key head
    hf_cfg = (transformers.Qwen3NextConfig if next_ else transformers.Qwen3_5TextConfig)(**keys)
    hf_cfg._attn_implementation = "eager"
    model = (transformers.Qwen3NextForCausalLM if next_ else transformers.Qwen3_5ForCausalLM)(hf_cfg).float().eval()
    loaded = model.load_state_dict(hf, strict=False)  # Qwen3-Next's checkpoint names experts one by one
    assert all(".mlp." in k for k in loaded.missing_keys + loaded.unexpected_keys), loaded  # only MLPs, not compared
    s = 10
    x = torch.randn(1, s, cfg["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_gdn = model.model.layers[0].linear_attn(x)
        cos, sin = model.model.rotary_emb(x, torch.arange(s)[None])
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        want_attention, _ = model.model.layers[1].self_attn(x, (cos, sin), mask)
        got_gdn, _ = gdn(x.transpose(0, 1).contiguous(), None)
        rope = RotaryEmbedding(kv_channels=cfg["head_dim"], rotary_percent=hf_cfg.rope_parameters["partial_rotary_factor"],
                               rotary_base=hf_cfg.rope_parameters["rope_theta"], use_cpu_initialization=True)(s)
        got_attention, _ = attention(x.transpose(0, 1).contiguous(), torch.ones(1, 1, s, s, dtype=torch.bool).triu(1),
                                     rotary_pos_emb=rope)
    return {name: ((got.transpose(0, 1) - want).abs().max().item(), want.abs().max().item())
            for name, got, want in (("gdn", got_gdn, want_gdn), ("attention", got_attention, want_attention))}
