"""Holders and their choice (megarefit.planner.holders), no processes.

* The holder sets equal those read off Megatron's default rank order, enumerated here from first
  principles (stage-local rank ``r``: tp rank ``r % tp``, ep rank ``(r // etp) % ep``, a copy
  index counted over earlier ranks holding the same pair), over hypothesis-drawn layouts.
* ``assign_holders`` moves each source read to a holder of the same tensor and changes nothing
  else (targets, boxes, bytes); ``served_by_readers`` (columns) equals summing the rewritten
  plans' own summaries (objects).
* Every trainer GPU serves within 10% of the mean, on a real MoE config (planned per worker
  of a whole engine, several replicas), and in the recorded on-paper file for DeepSeek-V3,
  Kimi-K2, GLM-5 and Qwen3-235B-A22B at 64, 256 and 1024 GPUs.
* ``megarefit plan --dp``: the JSON's bytes add up to replicas x every worker's plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CONFIG_DIR, real_config
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit import ModelDims, SourceLayout, validate_plan
from megarefit.cli.main import main
from megarefit.layout.parallel import RankCoord
from megarefit.planner import plan_megatron_to_hf
from megarefit.planner.holders import Reader, assign_holders, holders, read_ranks, served_by_readers, served_bytes
from megarefit.specs.table import Role
from megarefit.targets import VllmTarget, plan_megatron_to_vllm

ROOT = Path(__file__).resolve().parents[1]


def _grid(tp: int, ep: int, etp: int, dp: int) -> list[tuple[int, int, int]]:
    """(tp rank, ep rank, copy) of every stage-local rank, in Megatron's default order."""
    seen: dict[tuple[int, int], int] = {}
    out = []
    for r in range(tp * dp):
        pair = (r % tp, (r // etp) % ep)
        out.append((*pair, seen.get(pair, 0)))
        seen[pair] = seen.get(pair, 0) + 1
    return out


@st.composite
def layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([1, 2, 4, 8]))
    etp = draw(st.sampled_from(sorted({1, tp})))
    import math

    period = math.lcm(tp, etp * ep)
    dp = period // tp * draw(st.integers(1, 3))
    return tp, ep, etp, dp


class _Row:
    def __init__(self, role: Role):
        self.role = role


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from([Role.COLUMN, Role.REPLICATED, Role.EXPERT_GATED_MLP, Role.EXPERT_ROW]))
def test_holder_sets_are_the_ranks_holding_the_same_bytes(lay, role):
    tp, ep, etp, dp = lay
    layout = SourceLayout(tp, 1, ep, tp * 8, (2,), etp=etp, dp=dp)
    grid = _grid(tp, ep, etp, dp)
    for t, e in layout.tp_ep_pairs():
        got = holders(layout, _Row(role), RankCoord(t, 0, e))  # type: ignore[arg-type]
        if role is Role.REPLICATED:
            want = grid
        elif role.is_expert:
            want = [g for g in grid if g[1] == e and (etp == 1 or g[0] == t)]
        else:
            want = [g for g in grid if g[0] == t]
        assert sorted((h.tp, h.ep, h.copy) for h in got) == sorted(want)
        block = len(got) // layout.copies  # copy by copy, equal blocks
        assert len(set(got)) == len(got) and [h.copy for h in got] == [k // block for k in range(len(got))]
    assert layout.copies == max(c for *_, c in grid) + 1
    assert sorted(layout.all_ranks()) == sorted(RankCoord(t, 0, e, c) for t, e, c in grid)


def _moe() -> tuple[ModelDims, SourceLayout]:
    cfg = real_config("Qwen3-30B-A3B")
    dims = ModelDims.from_hf_config(cfg)
    return dims, SourceLayout.build(tp=2, pp=1, ep=4, etp=1, padded_vocab_size=dims.padded_vocab_size(2),
                                    num_layers=dims.num_layers, dp=8)


def test_assign_holders_moves_reads_to_holders_of_the_same_tensor():
    dims, layout = _moe()
    plan = plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(2, 1, dp=2, dp_rank=0, expert_parallel=True))
    moved = assign_holders(plan, Reader(3, 8))
    validate_plan(moved)  # exact cover, bounds, shapes: as planned
    assert moved.digest != plan.digest and moved.nbytes == plan.nbytes
    ops, new = list(plan.ops), list(moved.ops)
    rows = {(g.rank, g.spec.megatron): g.spec for g in plan.ops.sources.groups}
    spec = {name: s for (_, name), s in rows.items()}
    changed = 0
    for a, b in zip(ops, new):
        same = (a.src.name, a.src_box, a.dst, a.dst_box, a.nbytes)
        assert same == (b.src.name, b.src_box, b.dst, b.dst_box, b.nbytes)
        row = next(s for n, s in spec.items() if _matches(n, a.src.name))
        assert b.src.rank in holders(layout, row, a.src.rank)
        changed += b.src.rank != a.src.rank
    assert changed > len(ops) // 2  # most reads leave the first holder (16 holders of each dense shard)
    assert {r.copy for r in read_ranks(moved)} == {3}  # 8 engines of one reader over 4 copies: engine 3, copy 3


def _matches(template: str, name: str) -> bool:
    import re

    return re.fullmatch(re.sub(r"\\\{(layer|expert)\\\}", r"[0-9]+", re.escape(template)), name) is not None


def test_columns_and_objects_agree_and_bytes_spread_evenly():
    dims, layout = _moe()
    replicas, workers = 4, 4
    spread: dict = {}
    for w in range(workers):
        target = VllmTarget(2, w % 2, dp=2, dp_rank=w // 2, expert_parallel=True)
        plan = plan_megatron_to_vllm(dims, layout, "bfloat16", target)
        readers = [Reader.of(r, replicas, w, workers) for r in range(replicas)]
        columns = served_by_readers(plan, readers)
        assert columns == served_bytes(assign_holders(plan, r) for r in readers)
        assert sum(columns.values()) == replicas * plan.nbytes
        for rank, b in columns.items():
            spread[rank] = spread.get(rank, 0) + b
    assert set(spread) == set(layout.all_ranks())
    mean = sum(spread.values()) / len(layout.all_ranks())
    assert max(spread.values()) <= 1.10 * mean, max(spread.values()) / mean


def test_one_copy_without_ep_changes_nothing():
    cfg = real_config("Qwen3-8B")
    dims = ModelDims.from_hf_config(cfg)
    layout = SourceLayout.build(tp=1, pp=2, padded_vocab_size=dims.padded_vocab_size(1), num_layers=dims.num_layers)
    plan = plan_megatron_to_hf(dims, layout)
    assert assign_holders(plan, Reader(0, 1)) is plan


def test_the_recorded_models_serve_within_ten_percent_of_the_mean():
    rows = [json.loads(line) for line in (ROOT / "docs/holders_on_paper.jsonl").read_text().splitlines() if line]
    got = {(r["model"], r["gpus"]) for r in rows}
    assert got == {(m, g) for m in ("DeepSeek-V3", "Kimi-K2", "GLM-5", "Qwen3-235B-A22B") for g in (64, 256, 1024)}
    for r in rows:
        assert r["serving"] == r["trainer_gpus"] and r["busiest"] <= 1.10 * r["mean"], r
        tp, ep, dp = r["trainer"]
        assert r["ranks_per_receiver"] <= max(tp, ep), r  # one copy's ranks (pp 1), however large dp


def test_plan_dp_writes_bytes_per_trainer_gpu(tmp_path, capsys):
    out = tmp_path / "served.json"
    assert main(["plan", "--config", str(CONFIG_DIR / "Qwen3-30B-A3B.json"), "--tp", "2", "--ep", "4", "--etp", "1",
                 "--dp", "8", "--vllm-tp", "2", "--vllm-dp", "2", "--vllm-ep", "--replicas", "3",
                 "--served-json", str(out)]) == 0
    assert "trainer GPUs serve" in capsys.readouterr().out
    s = json.loads(out.read_text())
    dims, layout = _moe()
    every = sum(plan_megatron_to_vllm(dims, layout, "bfloat16", VllmTarget(2, w % 2, dp=2, dp_rank=w // 2,
                                                                           expert_parallel=True)).nbytes
                for w in range(4))
    assert s["bytes"] == sum(r["bytes"] for r in s["per_rank"]) == 3 * every
    assert s["trainer_gpus"] == 16 and s["serving"] == 16 and s["busiest"] <= 1.10 * s["mean"]
