"""Plans: exact cover over many layouts, validation that can fail, JSON round trip, speed of big plans."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import real_config
from dense_cases import dense_config
from megarefit import ModelDims, Plan, SourceLayout, plan_hf_to_megatron, plan_megatron_to_hf, validate_plan
from megarefit.errors import LayoutError, PlanValidationError
from megarefit.layout import Box


@st.composite
def dims_and_layout(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 4]))
    cfg = draw(dense_config(tp, pp))
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp, draw(st.sampled_from([1, 8, 128]))),
                                num_layers=dims.num_layers, layer_spec=draw(st.sampled_from(["local", "te"])))
    return dims, layout


@settings(max_examples=200, deadline=None)
@given(dims_and_layout(), st.sampled_from(["bfloat16", "float32"]))
def test_every_plan_covers_exactly(case, dtype):
    dims, layout = case
    for plan in (plan_megatron_to_hf(dims, layout, dtype), plan_hf_to_megatron(dims, layout, dtype)):
        validate_plan(plan)  # also run inside the planner; explicit here
        written = {t: 0 for t in plan.targets}
        for op in plan.ops:
            written[op.dst] += op.numel
        for t, meta in plan.targets.items():
            assert written[t] + sum(b.numel for b in meta.zero_fill) == meta.numel
    export = plan_megatron_to_hf(dims, layout, dtype)
    # export reads every HF element once: bytes moved == bytes of the HF model
    assert export.nbytes == sum(m.numel for m in export.targets.values()) * (2 if dtype == "bfloat16" else 4)


def _plan():
    dims = ModelDims.from_hf_config(real_config("Qwen3-0.6B") | {"num_hidden_layers": 4})
    return plan_megatron_to_hf(dims, SourceLayout.build(tp=2, pp=2, padded_vocab_size=dims.padded_vocab_size(2),
                                                        num_layers=4))


def test_validation_rejects_a_missing_op():
    plan = _plan()
    broken = dataclasses.replace(plan, ops=plan.ops[1:])
    with pytest.raises(PlanValidationError, match="cover"):
        validate_plan(broken)


def test_validation_rejects_an_overlap():
    plan = _plan()
    broken = dataclasses.replace(plan, ops=plan.ops + plan.ops[:1])
    with pytest.raises(PlanValidationError, match="overlaps"):
        validate_plan(broken)


def test_validation_rejects_out_of_bounds():
    plan = _plan()
    op = plan.ops[0]
    shifted = dataclasses.replace(op, dst_box=Box((op.dst_box.offsets[0] + 10**6,) + op.dst_box.offsets[1:],
                                                  op.dst_box.lengths))
    with pytest.raises(PlanValidationError, match="outside"):
        validate_plan(dataclasses.replace(plan, ops=(shifted,) + plan.ops[1:]))


def test_validation_rejects_a_lying_kind():
    plan = _plan()
    i = next(i for i, op in enumerate(plan.ops) if op.kind == "scratch")
    lie = dataclasses.replace(plan.ops[i], kind="contiguous")
    with pytest.raises(PlanValidationError, match="kind"):
        validate_plan(dataclasses.replace(plan, ops=plan.ops[:i] + (lie,) + plan.ops[i + 1:]))


def _moe_plan():
    """DeepSeek-V3 (MLA, shared experts), tp=2 ep=2, legacy GroupedMLP experts (transposed ops)."""
    from moe_cases import case_config

    dims = ModelDims.from_hf_config(case_config("deepseek_v3"))
    return plan_megatron_to_hf(dims, SourceLayout.build(tp=2, pp=1, ep=2, etp=1,
                                                        padded_vocab_size=dims.padded_vocab_size(2),
                                                        num_layers=dims.num_layers, expert_layout="legacy_grouped"))


def _gpt_oss_plan():
    """gpt-oss, tp=2 pp=2 ep=2: fused experts (one transposed box per gate / up / down per expert
    into [E, h, f, 2] / [E, f, h] views; bias boxes strided by the interleave), tiled targets."""
    from moe_cases import moe_config

    dims = ModelDims.from_hf_config(moe_config("gpt-oss-120b"))
    return plan_megatron_to_hf(dims, SourceLayout.build(tp=2, pp=2, ep=2, etp=1,
                                                        padded_vocab_size=dims.padded_vocab_size(2),
                                                        num_layers=dims.num_layers, expert_layout="te_grouped"))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_single_op_corruption_is_caught(data):
    """One random corruption of one op of a valid plan (a box offset or length moved on
    either side, the kind flipped, a recorded offset moved, the op dropped or doubled):
    ``validate_plan`` raises, and its vectorized pass (plan_columns.py) flags the op or
    its target itself -- the column checks never wave a broken plan through."""
    from megarefit.plan.columns import PlanColumns, vectorized_checks

    plan = data.draw(st.sampled_from([_plan(), _moe_plan(), _gpt_oss_plan()]))
    bad_ops, odd = vectorized_checks(PlanColumns.from_plan(plan))
    assert bad_ops.numel() == 0 and odd.numel() == 0  # transposed, viewed and tiled ops proved on columns
    i = data.draw(st.integers(0, len(plan.ops) - 1))
    op = plan.ops[i]
    how = data.draw(st.sampled_from(["src_off", "src_len", "dst_off", "dst_len", "kind", "flat", "drop", "double"]))
    if how in ("drop", "double"):
        ops = plan.ops[:i] + plan.ops[i + 1:] if how == "drop" else plan.ops + (op,)
    else:
        if how == "kind":
            bad = dataclasses.replace(op, kind="scratch" if op.kind == "contiguous" else "contiguous")
        elif how == "flat":
            bad = dataclasses.replace(op, dst_offset=op.dst_offset + data.draw(st.sampled_from([-1, 1])))
        else:
            box = op.src_box if how.startswith("src") else op.dst_box
            d = data.draw(st.integers(0, len(box.offsets) - 1))
            delta = data.draw(st.sampled_from([-1, 1]))
            if how.endswith("off"):
                box = Box(box.offsets[:d] + (box.offsets[d] + delta,) + box.offsets[d + 1:], box.lengths)
            else:
                box = Box(box.offsets, box.lengths[:d] + (box.lengths[d] + delta,) + box.lengths[d + 1:])
            bad = dataclasses.replace(op, **{how[:3] + "_box": box})
        ops = plan.ops[:i] + (bad,) + plan.ops[i + 1:]
    broken = dataclasses.replace(plan, ops=ops)
    with pytest.raises(PlanValidationError):
        validate_plan(broken)
    bad_ops, odd = vectorized_checks(PlanColumns.from_plan(broken))
    assert bad_ops.numel() + odd.numel() > 0


def test_json_round_trip():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again.ops == plan.ops and dict(again.targets) == dict(plan.targets) and again.digest == plan.digest


def test_row_parallel_ops_are_scratch_and_column_ops_contiguous():
    plan = _plan()
    kinds = {(op.dst.name.rsplit(".", 2)[-2], op.kind) for op in plan.ops}
    assert ("o_proj", "scratch") in kinds and ("down_proj", "scratch") in kinds
    assert ("q_proj", "contiguous") in kinds and ("gate_proj", "contiguous") in kinds
    assert not any(k == "scratch" for n, k in kinds if n in {"q_proj", "k_proj", "gate_proj", "embed_tokens"})


def test_llama_405b_plan_is_quick():
    dims = ModelDims.from_hf_config(real_config("Llama-3.1-405B"))
    with pytest.raises(LayoutError, match="first_stage_layers=7"):
        SourceLayout.build(tp=8, pp=16, padded_vocab_size=dims.padded_vocab_size(8), num_layers=dims.num_layers)
    layout = SourceLayout.build(tp=8, pp=16, padded_vocab_size=dims.padded_vocab_size(8), num_layers=126,
                                first_stage_layers=7, last_stage_layers=7)
    plan_megatron_to_hf.cache_clear()
    t0 = time.perf_counter()
    plan = plan_megatron_to_hf(dims, layout, "bfloat16")
    assert time.perf_counter() - t0 < 20  # generous: ~0.3 s on a 2-core CPU
    # every byte of the 405B model is read once
    assert plan.nbytes == 2 * sum(m.numel for m in plan.targets.values())
    assert 800e9 < plan.nbytes < 820e9
    assert layout.stage_layers == (7,) + (8,) * 14 + (7,)


def test_adjacent_row_runs_merge_into_one_pull():
    from megarefit.plan import TensorMeta, TensorRef, make_op
    from megarefit.plan import merge_ops as merge

    src, dst = TensorRef(None, "src"), TensorRef(None, "dst")

    def merge_ops(ops):
        return merge(ops, {src: TensorMeta((8, 4), "bfloat16")}, {dst: TensorMeta((10, 4), "bfloat16")})

    def rows(s0, d0, n):  # src rows [s0, s0+n) of an (8, 4) tensor -> dst rows [d0, d0+n) of a (10, 4) tensor
        return make_op(src, (8, 4), Box.rows((8, 4), s0, n), dst, (10, 4), Box.rows((10, 4), d0, n), 2)

    merged = merge_ops([rows(0, 2, 2), rows(2, 4, 2), rows(4, 6, 3)])
    assert len(merged) == 1
    assert merged[0].src_box == Box.rows((8, 4), 0, 7) and merged[0].dst_box == Box.rows((10, 4), 2, 7)
    assert (merged[0].kind, merged[0].nbytes, merged[0].src_offset, merged[0].dst_offset) == ("contiguous", 56, 0, 8)
    assert len(merge_ops([rows(0, 2, 2), rows(2, 5, 2)])) == 2  # target runs not adjacent
    assert len(merge_ops([rows(0, 2, 2), rows(3, 4, 2)])) == 2  # source runs not adjacent
    column = make_op(src, (8, 4), Box.rows((8, 4), 2, 2), dst, (10, 4), Box((4, 0), (2, 4)), 2)
    partial = make_op(src, (8, 4), Box((2, 0), (2, 2)), dst, (10, 4), Box((4, 0), (2, 2)), 2)
    assert partial.kind == "scratch" and len(merge_ops([rows(0, 2, 2), partial])) == 2
    assert len(merge_ops([rows(0, 2, 2), column])) == 1
