"""Legacy GroupedMLP (``experts.weight1`` / ``weight2``): a real Megatron-Core model built for
inspection (a looped stand-in for the grouped_gemm kernel). Its parameter names and
stored shapes must equal the plan's, and its own forward, run on the weights
``hf_to_megatron`` produced in the legacy layout, must equal the HF expert MLPs
``down(silu(gate x) * up x)`` computed from the HF tensors (TP=1 and TP=2 halves)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import megarefit  # noqa: E402
from conftest import real_config  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron, megatron_series  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from reference import moe_hf_state  # noqa: E402

pytestmark = pytest.mark.megatron

CFG = real_config("Qwen3-30B-A3B") | {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "num_hidden_layers": 1, "vocab_size": 256, "head_dim": 32, "num_experts": 4,
                                      "moe_intermediate_size": 48, "intermediate_size": 96, "rope_scaling": None,
                                      "num_experts_per_tok": 2}


@pytest.mark.skipif(megatron_series() < (0, 17), reason="megatron-core 0.16 has GroupedMLP (tested below)")
def test_legacy_grouped_is_refused_where_megatron_removed_it():
    """megatron-core 0.17 removed GroupedMLP: megarefit refuses to plan it for such a trainer."""
    from megatron.core.transformer.moe import experts

    assert not hasattr(experts, "GroupedMLP")
    dims = megarefit.ModelDims.from_hf_config(CFG)
    layout = megarefit.SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=1,
                                          expert_layout="legacy_grouped", megatron=harness_megatron())
    with pytest.raises(megarefit.errors.UnverifiedMegatronError, match="GroupedMLP .* removed in megatron-core 0.17"):
        megarefit.plan_hf_to_megatron(dims, layout, "float32")


@pytest.mark.skipif(megatron_series() >= (0, 17), reason="GroupedMLP was removed in megatron-core 0.17")
@pytest.mark.parametrize("tp", [1, 2])
def test_grouped_mlp_layout(tp):
    import grouped_jobs

    hf = moe_hf_state(CFG, "qwen3_moe", seed=2)
    results = run_workers(grouped_jobs.inspect_grouped, world_size=tp, args=(CFG, hf, tp), timeout=600)
    dims = megarefit.ModelDims.from_hf_config(CFG)
    layout = megarefit.SourceLayout.build(tp=tp, pp=1, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=1,
                                          expert_layout="legacy_grouped")
    plan = megarefit.plan_hf_to_megatron(dims, layout, "float32")
    for rank, res in enumerate(results):
        assert res["expert_class"] == "GroupedMLP"
        want = {r.name: m.storage_shape or m.shape for r, m in plan.targets.items() if r.rank == (rank, 0, 0)}
        assert res["names"] == want
        # the module's own forward on our weights == the HF expert MLPs (this TP rank's ffn half)
        x, counts = res["x"], res["tokens_per_expert"].tolist()
        f = CFG["moe_intermediate_size"] // tp
        parts, start = [], 0
        for e, n in enumerate(counts):
            E = f"model.layers.0.mlp.experts.{e}."
            gate = hf[E + "gate_proj.weight"][rank * f:(rank + 1) * f]
            up = hf[E + "up_proj.weight"][rank * f:(rank + 1) * f]
            down = hf[E + "down_proj.weight"][:, rank * f:(rank + 1) * f]
            xe = x[start:start + n]
            parts.append((torch.nn.functional.silu(xe @ gate.T) * (xe @ up.T)) @ down.T)
            start += n
        want_y = torch.cat(parts)
        assert (res["y"] - want_y).abs().max().item() < 1e-5 * want_y.abs().max().item()  # fp32 rounding only
