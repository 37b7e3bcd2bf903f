"""The columnar export planner against an independent planner (tests/reference_planner.py,
which reads the HF config and plain layout ints and shares no geometry with megarefit):
same sources, targets and ops (as sets), over random dense and MoE models, trainer layouts
and receiver expert sets; one vLLM worker's plan against vLLM's own shard conventions
restated there; plus the tables' own contracts (single rows == the materialized mapping,
ops grouped by target)."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import real_config
from dense_cases import dense_config
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st
from moe_cases import moe_config
from reference_planner import (VLLM_FAMILIES, Layout, Refused, reference_megatron_to_hf, reference_retarget,
                               vllm_params, worker_experts)

from megarefit import ModelDims, Plan, SourceLayout
from megarefit.errors import LayoutError
from megarefit.plan.table import OpTable, TensorTable
from megarefit.planner.megatron_to_hf import plan_export


def plain(layout: SourceLayout) -> Layout:
    """The test boundary: megarefit's layout as the reference's plain ints."""
    return Layout(layout.tp, layout.pp, layout.ep, layout.etp, layout.padded_vocab_size, tuple(layout.stage_layers),
                  layout.layer_spec, layout.expert_layout)


def reference_plan(cfg: dict, dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                   experts: frozenset[int] | None = None) -> Plan:
    """The reference's sources, targets and ops as a Plan (for its summary, and the FP8 step)."""
    sources, targets, ops = reference_megatron_to_hf(cfg, plain(layout), dtype, experts)
    return Plan("megatron_to_hf", dims, layout, dtype, sources, targets, tuple(ops), "reference")


def assert_same_plan(cfg: dict, dims: ModelDims, layout: SourceLayout, dtype: str = "bfloat16",
                     experts: frozenset[int] | None = None) -> None:
    ref = reference_plan(cfg, dims, layout, dtype, experts)
    new = plan_export(dims, layout, dtype, experts)
    assert isinstance(new.ops, OpTable) and isinstance(new.sources, TensorTable)
    assert dict(new.sources) == dict(ref.sources)
    assert dict(new.targets) == dict(ref.targets)
    assert Counter(new.ops) == Counter(ref.ops)
    assert len(new.ops) == len(ref.ops)
    # grouped by target, targets in the table's order, ascending target offset within one
    position = {t: i for i, t in enumerate(new.targets)}
    keys = [(position[op.dst], op.dst_offset) for op in new.ops]
    assert keys == sorted(keys)
    assert new.summary() == ref.summary()
    assert new.nbytes == ref.nbytes


@st.composite
def dense_case(draw):
    """test_plan.py's dense models and layouts (Llama / Qwen2 / Qwen3, tp, pp, vocab padding,
    biases, tied embeddings, both layer specs), with no expert set; the config dict too."""
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 4]))
    cfg = draw(dense_config(tp, pp))
    dims = ModelDims.from_hf_config(cfg)
    padded = dims.padded_vocab_size(tp, draw(st.sampled_from([1, 8, 128])))
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=padded, num_layers=dims.num_layers,
                                layer_spec=draw(st.sampled_from(["local", "te"])))
    return cfg, dims, layout, None


@st.composite
def moe_case(draw):
    """Qwen3-MoE (a dense first layer), Mixtral, DeepSeek-V3 (MLA), GLM-4.5 (shared experts, router
    bias): the MoE families the reference restates (not MTP, GLM-5's DSA indexer or gpt-oss's
    fused experts: tests/test_megatron_mtp.py, test_deepseek_glm.py and test_gpt_oss.py check
    those against real Megatron-Core and HF models)."""
    name = draw(st.sampled_from(["Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "DeepSeek-V3", "GLM-4.5-Air"]))
    tp, ep = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    etp = draw(st.sampled_from([1, tp]))
    n_exp = ep * draw(st.integers(1, 3))
    extra = {"num_hidden_layers": pp * draw(st.integers(1, 2))}
    extra |= {"num_experts": n_exp} if name == "Qwen3-30B-A3B" else (
        {"num_local_experts": n_exp} if name == "Mixtral-8x7B-v0.1" else {"n_routed_experts": n_exp})
    if name != "Mixtral-8x7B-v0.1":
        extra["num_key_value_heads"] = 4  # divisible by every tp drawn
    cfg = moe_config(name, **extra)
    dims = ModelDims.from_hf_config(cfg)
    try:
        layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers,
                                    expert_layout=draw(st.sampled_from(["sequential", "te_grouped", "legacy_grouped"])),
                                    layer_spec=draw(st.sampled_from(["local", "te"])))
        dims.check_layout(tp, pp, ep, etp)
        dims.check_expert_layout(layout.expert_layout)
    except LayoutError:
        reject()  # a layout Megatron-Core cannot build: not a draw
    experts = draw(st.none() | st.frozensets(st.integers(0, n_exp - 1)))
    return cfg, dims, layout, experts


@settings(max_examples=60, deadline=None)
@given(dense_case(), st.sampled_from(["bfloat16", "float32"]))
def test_dense_plans_match_the_reference(case, dtype):
    cfg, dims, layout, experts = case
    assert_same_plan(cfg, dims, layout, dtype, experts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(moe_case())
def test_moe_plans_match_the_reference(case):
    cfg, dims, layout, experts = case
    assert_same_plan(cfg, dims, layout, "bfloat16", experts)


def test_real_deepseek_v3_matches_the_reference():
    """All 61 layers, 256 experts (a sample received), MLA, shared experts, the fp32 router bias:
    tp 2, ep 4, pp 1 (MTP left out: not restated by the reference)."""
    cfg = real_config("DeepSeek-V3") | {"num_nextn_predict_layers": 0}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, ep=4, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, expert_layout="te_grouped")
    assert_same_plan(cfg, dims, layout, experts=frozenset(range(0, 256, 5)))


def test_real_qwen3_moe_matches_the_reference():
    """All 48 layers, 128 experts (a sample received): tp 2, ep 4, pp 2, TE grouped experts."""
    cfg = real_config("Qwen3-30B-A3B")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=2, ep=4, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers, expert_layout="te_grouped", layer_spec="te")
    assert_same_plan(cfg, dims, layout, experts=frozenset(range(0, 128, 5)))


def test_single_rows_agree_with_the_materialized_tables():
    dims = ModelDims.from_hf_config(moe_config("Qwen3-30B-A3B", num_hidden_layers=2))
    layout = SourceLayout.build(tp=2, pp=2, ep=2, padded_vocab_size=dims.padded_vocab_size(2), num_layers=2)
    plan = plan_export(dims, layout)
    for table in (plan.sources, plan.targets):
        refs = list(table)
        assert len(refs) == len(table)
        for i in (0, len(refs) // 2, len(refs) - 1):
            assert table.ref(i) == refs[i] and table.meta(i) == table[refs[i]]
    fresh = plan_export(dims, layout)  # nothing materialized yet: items are built one by one
    for i in (0, 7, len(plan.ops) - 1):
        assert fresh.ops[i] == plan.ops[i]
    assert fresh.ops == plan.ops and list(fresh.ops)[3:5] == list(plan.ops[3:5])


def test_first_layer_targets_come_before_later_layers():
    dims = ModelDims.from_hf_config(moe_config("Qwen3-30B-A3B", num_hidden_layers=4))
    layout = SourceLayout.build(tp=1, pp=2, ep=2, padded_vocab_size=dims.padded_vocab_size(1), num_layers=4)
    names = [t.name for t in plan_export(dims, layout).targets]
    assert names[0] == "model.embed_tokens.weight"
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # expert ep rank 1's experts right after ep rank 0's
        experts = [int(n.split(".")[5]) for n in names if n.startswith("model.layers.1.mlp.experts.") and proj in n]
        assert experts == list(range(dims.num_experts))


def assert_same_fp8_plan(cfg: dict, dims: ModelDims, layout: SourceLayout, fmt,
                         experts: frozenset[int] | None = None) -> None:
    """megarefit's FP8 step on both plans: what it is given (the HF plan) is what is compared."""
    from megarefit.quant.planning import _plan_fp8_ops, plan_fp8

    ref = _plan_fp8_ops(reference_plan(cfg, dims, layout, "bfloat16", experts), fmt)
    new = plan_fp8(plan_export(dims, layout, "bfloat16", experts), fmt)
    assert isinstance(new.ops, OpTable)
    assert dict(new.sources) == dict(ref.sources)
    assert dict(new.targets) == dict(ref.targets)
    assert Counter(new.ops) == Counter(ref.ops)
    assert {q.weight: q for q in new.quantize} == {q.weight: q for q in ref.quantize}  # reasons included
    assert new.nbytes == ref.nbytes and new.summary() == ref.summary()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(dense_case(), moe_case()), st.sampled_from([(128, 128), (4, 4), (8, 16), (3, 5)]), st.booleans())
def test_fp8_plans_match_the_reference(case, block, ue8m0):
    """Blocks from the real 128x128 (nothing fits a tiny model: all receiver-side) to ones
    that split shards every way (some trainer-, some receiver-quantized, the fix point)."""
    from megarefit.quant import Fp8Format

    cfg, dims, layout, experts = case
    assert_same_fp8_plan(cfg, dims, layout, Fp8Format(block, ue8m0), experts)


def test_gpt_oss_block_fp8_is_refused():
    """vLLM serves gpt-oss in bf16 / MXFP4: block FP8 is refused."""
    from megarefit.quant import Fp8Format
    from megarefit.quant.fp8 import UnsupportedQuantizationError
    from megarefit.quant.planning import plan_fp8

    dims = ModelDims.from_hf_config(moe_config("gpt-oss-120b"))
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers)
    with pytest.raises(UnsupportedQuantizationError, match="gpt_oss: block FP8 is not produced"):
        plan_fp8(plan_export(dims, layout), Fp8Format((4, 4)))


def test_real_qwen3_moe_fp8_matches_the_reference():
    from megarefit.quant import Fp8Format

    cfg = real_config("Qwen3-30B-A3B")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, ep=8, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=dims.num_layers)
    assert_same_fp8_plan(cfg, dims, layout, Fp8Format((128, 128)), experts=frozenset(range(0, 128, 7)))


def test_fp8_mixed_plan_matches_the_reference():
    """q rows (4 per group) on the 4-row grid, k / v rows (2 per group) off it: every
    linear_qkv shard is misaligned somewhere, so q/k/v are quantized on the receiver,
    while gate/up/down (4-row, 4-column shards) are quantized on the trainers."""
    from megarefit.quant import Fp8Format
    from megarefit.quant.planning import plan_fp8, where_quantized

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 2, "intermediate_size": 8, "num_hidden_layers": 2,
           "vocab_size": 64, "tie_word_embeddings": False}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=2)
    fmt = Fp8Format((4, 4))
    assert_same_fp8_plan(cfg, dims, layout, fmt)
    where = where_quantized(plan_fp8(plan_export(dims, layout), fmt))
    assert "off the 4-row block grid" in where["model.layers.0.self_attn.q_proj.weight"]
    assert where["model.layers.1.mlp.gate_proj.weight"] == where["model.layers.1.mlp.down_proj.weight"] == "trainer"


def _reference_vllm_plan(cfg: dict, layout: SourceLayout, tp: int, rank: int, ep: bool):
    """One vLLM worker's ``(HF sources, targets, ops)`` from the reference alone: its HF plan
    for the worker's experts, re-targeted onto vLLM's parameters as vLLM's loaders shard them.

    Raises:
        Refused: the model does not split over the worker's groups."""
    params = vllm_params(cfg, tp, rank, ep)
    experts = worker_experts(cfg, tp, rank, ep)
    hf = reference_megatron_to_hf(cfg, plain(layout), "bfloat16", None if experts is None else frozenset(experts))
    return (hf[0], *reference_retarget(hf, params))


def assert_same_vllm_plan(cfg: dict, dims: ModelDims, layout: SourceLayout, tp: int, rank: int, ep: bool) -> None:
    from megarefit.targets import VllmTarget, plan_megatron_to_vllm

    target = VllmTarget(tp, rank, expert_parallel=ep)
    try:
        sources, targets, ops = _reference_vllm_plan(cfg, layout, tp, rank, ep)
    except Refused:  # the worker's groups do not split this model: the planner refuses it too
        with pytest.raises(LayoutError):
            plan_megatron_to_vllm(dims, layout, "bfloat16", target)
        return
    new = plan_megatron_to_vllm(dims, layout, "bfloat16", target)
    assert isinstance(new.ops, OpTable)
    assert dict(new.sources) == sources
    assert dict(new.targets) == targets
    assert Counter(new.ops) == Counter(ops)  # merges included
    assert not new.quantize and new.nbytes == sum(op.numel * op.itemsize for op in ops)


@st.composite
def vllm_case(draw):
    """Dense, Qwen3-MoE and Mixtral models (what the reference restates vLLM's layout for: not
    MLA / DSA, gpt-oss or Mamba, nor FP8 staging -- tests/test_vllm_target.py and
    test_vllm_moe_target.py check those against vLLM's own loaders), any vLLM tp, rank, EP."""
    cfg, dims, layout, _ = draw(dense_case() if draw(st.booleans()) else moe_case())
    assume(dims.family in VLLM_FAMILIES)
    tp = draw(st.sampled_from([1, 2, 4]))
    return cfg, dims, layout, tp, draw(st.integers(0, tp - 1)), bool(dims.num_experts) and draw(st.booleans())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(vllm_case())
def test_vllm_plans_match_the_reference(case):
    """One vLLM worker's plan (fused qkv / gate_up, FusedMoE slots, EP expert sets, vocab
    padding) against the reference's."""
    assert_same_vllm_plan(*case)


def test_real_qwen3_moe_vllm_worker_matches_the_reference():
    cfg = real_config("Qwen3-30B-A3B") | {"num_hidden_layers": 4}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=1, ep=2, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                num_layers=4, expert_layout="te_grouped")
    assert_same_vllm_plan(cfg, dims, layout, 4, 1, False)
    assert_same_vllm_plan(cfg, dims, layout, 2, 1, True)


def test_a_piece_of_an_unplanned_hf_tensor_is_named():
    """A vLLM parameter whose piece names an HF tensor the HF plan lacks (a spec-table /
    vLLM-layout mismatch) is refused naming the parameter and the HF tensor."""
    import pytest

    from megarefit.errors import PlanValidationError
    from megarefit.layout import Box
    from megarefit.planner.megatron_to_hf import plan_export
    from megarefit.targets.vllm_columns import retarget
    from megarefit.targets.vllm_layout import VllmParam, VllmPiece

    dims = ModelDims.from_hf_config(real_config("Qwen3-0.6B") | {"num_hidden_layers": 2})
    layout = SourceLayout.build(tp=1, pp=1, padded_vocab_size=dims.padded_vocab_size(1), num_layers=2)
    hf_plan = plan_export(dims, layout)
    bogus = {"model.norm.weight": (VllmParam((4,), (VllmPiece("model.bogus.weight", Box((0,), (4,)), Box((0,), (4,))),)),
                                   None)}
    with pytest.raises(PlanValidationError, match=r"model.norm.weight.*'model.bogus.weight'"):
        retarget(hf_plan, bogus, set(), "bfloat16", [], "x")


def test_table_lookup_names_only_what_it_is_asked():
    """``TensorTable.lookup`` (used to validate quantize steps without naming every target)
    gives the same metas as the full mapping, for a GLM-5 FP8 plan's staging / weight / scale
    refs and a sample of others, and leaves out refs that are not rows."""
    import random

    from megarefit.plan import TensorRef
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.quant import Fp8Format, planning

    cfg = real_config("GLM-5") | {"num_hidden_layers": 8, "n_routed_experts": 16}
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=2, pp=2, ep=4, padded_vocab_size=dims.padded_vocab_size(2), num_layers=8)
    plan = planning.plan_fp8(plan_megatron_to_hf(dims, layout, "bfloat16"), Fp8Format())
    refs = [r for q in plan.quantize for r in (q.staging, q.weight, q.scale)]
    assert refs  # the rotated indexer wq_b is quantized on the receiver
    fresh = lambda t: TensorTable(t.groups, t.group, t.layer, t.expert)  # noqa: E731 - nothing named yet
    full = dict(plan.targets)
    sample = random.Random(0).sample(list(full), 60) + refs
    missing = [TensorRef(None, "model.layers.99.mlp.gate.weight"), TensorRef(None, "lm_head.weight:staging")]
    got = fresh(plan.targets).lookup(sample + missing)
    assert got == {r: full[r] for r in sample}
    src = dict(plan.sources)
    some = random.Random(1).sample(list(src), 40)
    assert fresh(plan.sources).lookup(some) == {r: src[r] for r in some}
