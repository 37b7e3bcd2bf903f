"""The CPU ``MambaModel`` harness's parts (:mod:`megarefit.demo.megatron_mamba`): its torch SSD
scan against transformers' chunked scan, and reading NemotronH configs (what it refuses).

Real Megatron-Core ``MambaModel`` against transformers' ``NemotronHForCausalLM`` runs through
``megarefit demo`` (tests/test_cli.py: the Nano config shrunk, tp 2, megarefit's plan, the
classifier against the spec table), and as trainers refitting vLLM (tests/test_vllm_refit.py).
Loaded with an independent Bridge-scheme conversion instead, the harness also matched HF to
~2.4e-6 at (tp, ep, etp) = (1,1,1), (1,2,1), (2,1,1), (2,2,1), (2,1,2) (not in CI: the demo
covers the path).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from megarefit.demo.megatron_mamba import mamba_arch_from_hf, torch_mamba_chunk_scan  # noqa: E402
from megarefit.errors import MegarefitError  # noqa: E402

pytestmark = pytest.mark.megatron

HF_CONFIG = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
    "layers_block_type": ["linear_attention", "full_attention", "moe", "mlp"],  # "M*E-"
    "hidden_size": 64, "vocab_size": 256, "layer_norm_epsilon": 1e-5,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4,
    "chunk_size": 4, "time_step_min": 1e-9,  # HF clamps softplus(dt) to >= time_step_min; Megatron does not
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 80, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False,
    "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
}


def test_torch_scan_matches_hf_chunked_scan():
    """The recurrence equals transformers' chunked torch SSD (other chunk size, initial state)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hfm

    g = torch.Generator().manual_seed(1)
    b, seq, h, p, grp, n = 2, 11, 4, 3, 2, 5
    x, dt = torch.randn(b, seq, h, p, generator=g), torch.randn(b, seq, h, generator=g)
    B, C = torch.randn(b, seq, grp, n, generator=g), torch.randn(b, seq, grp, n, generator=g)
    A, D, dt_bias = -torch.rand(h, generator=g) * 3, torch.randn(h, generator=g), torch.randn(h, generator=g)
    s0 = torch.randn(b, h, p, n, generator=g)
    kw = {"D": D, "dt_bias": dt_bias, "initial_states": s0, "dt_softplus": True, "return_final_states": True}
    y, s = torch_mamba_chunk_scan(x, dt, A, B, C, 4, **kw)
    y_ref, s_ref = hfm.mamba2_chunk_scan(x, dt, A, B, C, 4, **kw)
    assert (y - y_ref).abs().max().item() < 1e-4 and (s - s_ref).abs().max().item() < 1e-4


def test_arch_from_hf():
    arch = mamba_arch_from_hf(HF_CONFIG, tp=2)
    assert (arch.pattern, arch.padded_vocab_size, arch.shared_expert_ffn, arch.router_topk_scaling_factor) == \
        ("M*E-", 256, 80, 2.5)
    legacy = {k: v for k, v in HF_CONFIG.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M*E-"}
    assert mamba_arch_from_hf(legacy, tp=2) == arch


@pytest.mark.parametrize("change, words", [
    ({"layer_norm_epsilon": 1e-6}, "eps"), ({"norm_topk_prob": False}, "renormalises"),
    ({"n_groups": 1}, "tp=2"), ({"use_bias": True}, "bias"), ({"mlp_hidden_act": "silu"}, "relu2"),
    ({"n_shared_experts": 2}, "n_shared_experts"), ({"moe_latent_size": 32}, "latent"),
    ({"layers_block_type": ["linear_attention", "indexed_attention"]}, "indexed_attention"),
])
def test_arch_from_hf_refuses(change, words):
    with pytest.raises(MegarefitError, match=words):
        mamba_arch_from_hf(HF_CONFIG | change, tp=2)
