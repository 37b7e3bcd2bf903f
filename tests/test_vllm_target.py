"""Megatron shards planned straight into vLLM tensor-parallel parameter shards.

For each case, random HF tensors are sharded for a Megatron trainer (the independent
reference sharder), then ``plan_megatron_to_vllm`` for vLLM rank t of T is executed.
Every vLLM parameter shard must equal what *vLLM's own* layers (``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` /
``ParallelLMHead``) hold after their ``weight_loader``s load the full HF tensors, in
two real vLLM tensor-parallel processes on CPU (gloo). Cases cover trainer TP larger
and smaller than vLLM's, GQA with vLLM TP above the kv-head count (replicated kv
heads), q/k/v biases, Qwen3 q/k norms, tied and untied embeddings, vocab padding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

import megarefit  # noqa: E402
from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.transport.execute import run_refit_cycle  # noqa: E402
from megarefit.transport import LocalTransport  # noqa: E402
from megarefit.targets import VllmTarget, plan_megatron_to_vllm  # noqa: E402
from reference import reference_hf_state, reference_shards, vllm_reference  # noqa: E402
from vllm_loader_jobs import vllm_shards_job  # noqa: E402

CASES = {  # name: (config, family, overrides, trainer tp, trainer pp)
    "qwen3-tied": ("Qwen3-0.6B", "qwen3", {"num_key_value_heads": 1}, 1, 2),  # vLLM tp 2 > 1 kv head
    "qwen2-bias": ("Qwen2.5-0.5B", "qwen2", {}, 2, 1),
    "llama-mha": ("Llama-3.1-8B", "llama", {"vocab_size": 250, "num_key_value_heads": 4}, 4, 1),  # trainer tp 4
}


@pytest.fixture(scope="module")
def cases(tiny_config_module):
    out = {}
    for key, (name, family, extra, tp, pp) in CASES.items():
        cfg = tiny_config_module(name, **extra)
        hf = reference_hf_state(cfg, family)
        out[key] = (cfg, hf, reference_shards(hf, cfg, tp=tp, pp=pp), tp, pp)
    return out


@pytest.fixture(scope="module")
def tiny_config_module():
    from conftest import tiny_config

    return tiny_config


@pytest.fixture(scope="module")
def vllm_shards(cases):
    """Per case: what vLLM's layers hold on rank 0 and 1 of vLLM tp=2."""
    per_rank = run_workers(vllm_shards_job,
                           start_method="spawn", world_size=2, args=({k: (c[0], c[1]) for k, c in cases.items()},),
                           timeout=600)
    return {key: [per_rank[rank][key] for rank in range(2)] for key in cases}


@pytest.mark.parametrize("key", list(CASES))
def test_plan_matches_vllm_weight_loaders(cases, vllm_shards, key):
    cfg, hf, shards, tp, pp = cases[key]
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers)
    transport = LocalTransport({megarefit.RankCoord(*r): s for r, s in shards.items()})
    for rank in range(2):
        plan = plan_megatron_to_vllm(dims, layout, "float32", VllmTarget(2, rank))
        got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
        want = vllm_shards[key][rank]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape == want[name].shape, (name, rank)
            assert torch.equal(got[name], want[name]), (name, rank)
        # a worker moves 1/T of the big tensors, not the whole model
        assert plan.nbytes < 0.75 * megarefit.plan_megatron_to_hf(dims, layout, "float32").nbytes


def test_kv_heads_replicated_when_vllm_tp_exceeds_them(cases):
    """vLLM tp=4 with 2 kv heads: ranks 0,1 hold kv head 0 and ranks 2,3 kv head 1 (vLLM's
    num_kv_head_replicas rule), checked against the HF k_proj rows directly."""
    cfg, hf, shards, tp, pp = cases["qwen2-bias"]
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers)
    transport = LocalTransport({megarefit.RankCoord(*r): s for r, s in shards.items()})
    d, q_local = dims.head_dim, dims.num_attention_heads // 4 * dims.head_dim
    k = hf["model.layers.1.self_attn.k_proj.weight"]
    for rank in range(4):
        plan = plan_megatron_to_vllm(dims, layout, "float32", VllmTarget(4, rank))
        got = dict(run_refit_cycle(plan, transport))["model.layers.1.self_attn.qkv_proj.weight"]
        head = rank // 2
        assert torch.equal(got[q_local:q_local + d], k[head * d:(head + 1) * d])


def test_sharded_install_checks_everything_before_writing():
    """install_shards checks every name, shape and dtype (and that every parameter is
    pulled) against the model-format metadata vLLM recorded, before writing anything;
    then installs through vLLM's layerwise reload (a toy model: no post-load step). A
    model vLLM did not build (no reload metadata) is refused."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from megarefit.errors import MegarefitError, MissingParameterError
    from megarefit.integrations.vllm import _receiver, install_shards

    model = torch.nn.Sequential(torch.nn.Linear(2, 4, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    model.register_parameter("norm", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(MegarefitError, match="no reload metadata"):
        install_shards(model, [("0.weight", torch.ones(4, 2)), ("norm", torch.ones(2))])
    record_metadata_for_reloading(model)
    with pytest.raises(MegarefitError, match=r"norm is torch.float32 \(2,\) in vLLM, pulled torch.float32 \(3,\)"):
        install_shards(model, [("0.weight", torch.ones(4, 2)), ("norm", torch.ones(3))])
    with pytest.raises(MegarefitError, match="no parameter 'missing'"):
        install_shards(model, [("0.weight", torch.ones(4, 2)), ("missing", torch.ones(1))])
    with pytest.raises(MissingParameterError, match=r"1 vLLM parameter\(s\) not pulled, e.g. \['norm'\]"):
        install_shards(model, [("0.weight", torch.ones(4, 2))])
    assert not model[0].weight.any() and not model.norm.any() and not model[0].weight.is_meta
    kernel = model[0].weight
    install_shards(model, [("0.weight", torch.ones(4, 2)), ("norm", torch.full((2,), 2.0))])
    assert model[0].weight is kernel and kernel.eq(1).all() and model.norm.eq(2).all()  # same storage, new bytes
    assert "weight_loader" not in model.norm.__dict__  # the copy loaders are gone again
    with pytest.raises(MegarefitError, match="needs the live vLLM model"):
        _receiver("127.0.0.1", 1, "job", 1.0, 0, None, sharded=True)


@st.composite
def _vllm_case(draw):
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3"]))
    trainer_tp = draw(st.sampled_from([1, 2, 4]))
    vllm_tp = draw(st.sampled_from([1, 2, 4, 8]))
    groups = trainer_tp * draw(st.sampled_from([1, 2]))
    if vllm_tp < groups and groups % vllm_tp:
        groups = vllm_tp
    if vllm_tp > groups and vllm_tp % groups:
        groups = trainer_tp
    heads = groups * draw(st.sampled_from([1, 2])) * max(1, vllm_tp // groups)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = {"architectures": [arch], "model_type": family, "hidden_size": 16, "num_attention_heads": heads,
           "num_key_value_heads": groups, "head_dim": draw(st.sampled_from([2, 4])),
           "intermediate_size": 8 * draw(st.integers(1, 2)), "num_hidden_layers": 2,
           "vocab_size": draw(st.integers(3, 150)), "tie_word_embeddings": draw(st.booleans())}
    return family, cfg, trainer_tp, draw(st.sampled_from([1, 2])), vllm_tp, draw(st.integers(0, vllm_tp - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_vllm_case(), st.integers(0, 1000))
def test_vllm_shards_match_an_independent_reference(case, seed):
    family, cfg, tp, pp, T, t = case
    if (cfg["num_attention_heads"] % T or (T < cfg["num_key_value_heads"] and cfg["num_key_value_heads"] % T)
            or (T > cfg["num_key_value_heads"] and T % cfg["num_key_value_heads"])):
        return  # vLLM itself refuses this split
    hf = reference_hf_state(cfg, family, seed)
    shards = reference_shards(hf, cfg, tp=tp, pp=pp)
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=2)
    plan = plan_megatron_to_vllm(dims, layout, "float32", VllmTarget(T, t))
    got = dict(run_refit_cycle(plan, LocalTransport({megarefit.RankCoord(*r): s for r, s in shards.items()})))
    want = vllm_reference(hf, cfg, T, t)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
