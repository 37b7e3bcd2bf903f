"""MoE property tests: Qwen3-MoE / Mixtral translation agrees with an independent reference
sharder (experts over ep, expert-TP etp in {1, tp}, SequentialMLP, TE-grouped and legacy
GroupedMLP layouts, dense layers mixed in), and the two directions are exact inverses."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megarefit
from reference import moe_hf_state, moe_reference_shards, reference_hf_state, reference_shards, unshard


@st.composite
def moe_case(draw):
    family = draw(st.sampled_from(["qwen3_moe", "mixtral"]))
    tp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2]))
    etp = draw(st.sampled_from([1, tp]))
    experts = ep * draw(st.integers(1, 2))
    groups = tp
    cfg = {"hidden_size": 8, "num_attention_heads": groups * draw(st.sampled_from([1, 2])),
           "num_key_value_heads": groups, "head_dim": 4, "num_hidden_layers": pp * draw(st.integers(1, 2)),
           "vocab_size": draw(st.integers(1, 40)), "tie_word_embeddings": draw(st.booleans())}
    ffn = tp * draw(st.integers(1, 3))
    if family == "qwen3_moe":
        cfg |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
                "moe_intermediate_size": ffn, "intermediate_size": tp * 2,
                "mlp_only_layers": draw(st.sampled_from([[], [0]])), "decoder_sparse_step": draw(st.sampled_from([1, 2]))}
    else:
        cfg |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                "intermediate_size": ffn}
    return family, cfg, tp, pp, ep, etp, draw(st.sampled_from(["sequential", "te_grouped", "legacy_grouped"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_case(), st.integers(0, 1000))
def test_moe_matches_reference_and_round_trips(case, seed):
    family, cfg, tp, pp, ep, etp, layout = case
    hf = moe_hf_state(cfg, family, seed)
    ref = moe_reference_shards(hf, cfg, family, tp=tp, pp=pp, ep=ep, etp=etp, layout=layout)
    back = megarefit.megatron_to_hf(ref, cfg, tp=tp, pp=pp, ep=ep, etp=etp)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], v) for k, v in hf.items())
    # the end-to-end tests' oracle (reference.unshard) inverts the reference sharder exactly
    undone = unshard(ref, hf, functools.partial(moe_reference_shards, cfg=cfg, family=family, tp=tp, pp=pp, ep=ep,
                                                etp=etp, layout=layout))
    assert all(torch.equal(undone[k], v) for k, v in hf.items())
    shards = megarefit.hf_to_megatron(hf, cfg, tp=tp, pp=pp, ep=ep, etp=etp, expert_layout=layout)
    # the reference fills the whole tp x pp x ep grid; with etp=1 < tp Megatron forms only part of it
    assert shards.keys() <= ref.keys() and (etp != 1 or tp == 1 or ep == 1) <= (shards.keys() == ref.keys())
    for rank in shards:
        assert shards[rank].keys() == ref[rank].keys(), rank
        assert all(torch.equal(shards[rank][n], t) for n, t in ref[rank].items()), rank


def test_receiver_owning_some_experts_gets_only_their_ops():
    """vLLM expert parallelism: a receiver owning experts {1, 2, 5} plans ops for those
    experts only (plus every dense tensor), for all three Megatron expert layouts."""
    from megarefit import ModelDims, SourceLayout, plan_megatron_to_hf
    from megarefit.transport.execute import run_refit_cycle
    from megarefit.transport import LocalTransport

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 8,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 20,
           "num_local_experts": 8, "intermediate_size": 4, "tie_word_embeddings": False}
    hf = moe_hf_state(cfg, "mixtral", 1)
    owned = frozenset({1, 2, 5})
    dims = ModelDims.from_hf_config(cfg)
    for layout_name in ("sequential", "te_grouped", "legacy_grouped"):
        shards = moe_reference_shards(hf, cfg, "mixtral", tp=2, pp=1, ep=4, etp=2, layout=layout_name)
        layout = SourceLayout.build(tp=2, pp=1, ep=4, padded_vocab_size=dims.padded_vocab_size(2), num_layers=2,
                                    expert_layout=layout_name)
        plan = plan_megatron_to_hf(dims, layout, "float32", owned)
        got = dict(run_refit_cycle(plan, LocalTransport({megarefit.RankCoord(*r): s for r, s in shards.items()})))
        want = {k: v for k, v in hf.items()
                if ".experts." not in k or int(k.split(".experts.")[1].split(".")[0]) in owned}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert {op.src.rank.ep for op in plan.ops if ".experts." in op.dst.name} == {0, 1, 2}  # experts 1,2 | 5


def test_unshard_finds_a_moved_element():
    """reference.unshard (the end-to-end tests' oracle) on a tied dense model at tp 2, pp 2: the
    reference's own shards give the HF tensors back; a shard with two rows swapped gives them
    swapped; a tied output-layer copy that differs from the embedding, an extra or missing name
    and a wrong shape are refused."""
    cfg = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
           "intermediate_size": 8, "num_hidden_layers": 2, "vocab_size": 30, "tie_word_embeddings": True}
    hf = reference_hf_state(cfg, "qwen3")
    shard = functools.partial(reference_shards, cfg=cfg, tp=2, pp=2)
    shards = shard(hf)
    assert all(torch.equal(unshard(shards, hf, shard)[k], v) for k, v in hf.items())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    moved = {r: dict(s) for r, s in shards.items()}
    moved[(1, 0, 0)][qkv] = moved[(1, 0, 0)][qkv][[1, 0, *range(2, len(moved[(1, 0, 0)][qkv]))]]
    got = unshard(moved, hf, shard)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    copy = {r: dict(s) for r, s in shards.items()}
    copy[(0, 1, 0)]["output_layer.weight"] = copy[(0, 1, 0)]["output_layer.weight"] + 1
    with pytest.raises(AssertionError, match="copies of one element disagree"):
        unshard(copy, hf, shard)
    extra = {r: dict(s) for r, s in shards.items()}
    extra[(0, 0, 0)]["decoder.layers.0.bogus"] = torch.zeros(1)
    with pytest.raises(AssertionError, match="bogus"):
        unshard(extra, hf, shard)
    short = {r: dict(s) for r, s in shards.items()}
    short[(0, 0, 0)][qkv] = short[(0, 0, 0)][qkv][:-1]
    with pytest.raises(AssertionError, match="linear_qkv"):
        unshard(short, hf, shard)
