"""Checksums of fused and grouped experts (issue 38): ``verify_checksums=True`` checks every box
a refit pulls, or refuses before a byte moves.

- gpt-oss fused experts (``gate_up_proj`` [E, h, 2f] interleaved, ``down_proj``): real trainer
  shards from the independent reference sharder (tests/reference.py), real NIXL (UCX loopback);
  every box is checked (``checked_boxes`` equals the plan's op count), the HF tensors equal
  transformers' own state dict, a byte changed in one expert's ``linear_fc1`` on a trainer is
  named.
- Legacy GroupedMLP experts (``weight1`` stored [h, E*2F], memory [E, h, 2F]): summed per
  expert, checked against a plain-Python reference over the raw bits of each expert's block.
- A plan with a box no sum covers is refused in one error naming the tensor, rank and box,
  before any READ.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.layout import Box
from megarefit.plan import CopyOp, TensorRef
from megarefit.transport.checksum import MODULUS, box_sums, sum_frame, tensor_checksum

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}
_JOBS = itertools.count()


def _expert_reference(flat: list[int], experts: int, rows: int, cols: int) -> list[int]:
    """Row sums of every expert's [rows, cols] block (memory order), then column sums, as
    signed 64-bit Python integers: weights n mod 65521 + 1 by position inside the block."""
    w = [n % MODULUS + 1 for n in range(max(rows, cols))]
    blocks = [[flat[(e * rows + i) * cols:(e * rows + i + 1) * cols] for i in range(rows)] for e in range(experts)]
    sums = [sum(w[j] * x[i][j] for j in range(cols)) for x in blocks for i in range(rows)]
    sums += [sum(w[i] * x[i][j] for i in range(rows)) for x in blocks for j in range(cols)]
    return [((s + 2**63) % 2**64) - 2**63 for s in sums]


@settings(max_examples=50, deadline=None)
@given(experts=st.integers(2, 4), rows=st.integers(1, 5), cols=st.integers(1, 6), fc1=st.booleans(),
       dtype=st.sampled_from(list(_BITS)), seed=st.integers(0, 1000), data=st.data())
def test_grouped_experts_are_summed_per_expert(experts, rows, cols, fc1, dtype, seed, data):
    """weight1 stored [rows, E*cols] / weight2 stored [E*rows, cols], memory [E, rows, cols]:
    the published sums are each expert block's row then column sums; one expert's whole rows
    or one expert's columns (a gate or up block) give back their slice, and a flipped bit in
    the pulled box is seen."""
    g = torch.Generator().manual_seed(seed)
    stored = (rows, experts * cols) if fc1 else (experts * rows, cols)
    t = (torch.randn(stored, generator=g) * 100).to(dtype)
    frame = sum_frame(stored, "grouped_expert_fc1" if fc1 else "grouped_expert_fc2", experts)
    assert frame == (experts, rows, cols)
    published = tensor_checksum(t, frame=frame)
    assert published.tolist() == _expert_reference(t.reshape(-1).view(_BITS[dtype]).tolist(), experts, rows, cols)
    e = data.draw(st.integers(0, experts - 1))
    if data.draw(st.booleans()):  # whole rows of expert e
        a = data.draw(st.integers(0, rows - 1))
        b = data.draw(st.integers(a + 1, rows))
        box = Box((e, a, 0), (1, b - a, cols))
    else:  # every row of expert e, some columns
        a = data.draw(st.integers(0, cols - 1))
        b = data.draw(st.integers(a + 1, cols))
        box = Box((e, 0, a), (1, rows, b - a))
    ref = TensorRef(None, "w")
    view = (experts, rows, cols)
    op = CopyOp(ref, box, ref, box, "scratch", 0, 0, t.element_size(), src_view=view)
    pulled = t.reshape(view)[box.slices()].contiguous()
    kind, first, sums = box_sums(op, stored, pulled, frame)
    assert sums.tolist() == published[first:first + sums.numel()].tolist()
    flipped = pulled.view(torch.uint8).clone()
    flipped.view(-1)[data.draw(st.integers(0, flipped.numel() - 1))] ^= 1 << data.draw(st.integers(0, 7))
    _, _, bad = box_sums(op, stored, flipped.view(dtype), frame)
    assert bad.tolist() != published[first:first + sums.numel()].tolist()


def test_a_grouped_box_in_stored_coordinates_is_not_taken_for_an_expert_box():
    """A box addressed in the stored [h, E*2F] shape of a tensor summed per expert matches no
    published sum: it is reported uncheckable, never checked against the wrong entries."""
    ref = TensorRef(None, "w")
    box = Box((0, 0), (4, 3))  # every stored row, stored columns [0, 3)
    op = CopyOp(ref, box, ref, box, "scratch", 0, 0, 2)
    frame = sum_frame((4, 6), "grouped_expert_fc1", 2)
    assert box_sums(op, (4, 6), torch.zeros(4, 3, dtype=torch.bfloat16), frame) is None


# ---- end to end, real NIXL (UCX loopback) ----------------------------------------------------


def _layout(cfg, *, tp, ep, etp, expert_layout, layer_spec="local"):
    from megarefit import ModelDims, SourceLayout

    dims = ModelDims.from_hf_config(cfg)
    return dims, SourceLayout.build(tp=tp, pp=1, ep=ep, etp=etp, padded_vocab_size=dims.padded_vocab_size(tp),
                                    num_layers=dims.num_layers, expert_layout=expert_layout, layer_spec=layer_spec)


def _serve(cfg, shards, *, tp, ep, etp, expert_layout, layer_spec="local"):
    """Publishers (checksums on) of the ``shards`` of Megatron's process grid, version 1 published."""
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    _, layout = _layout(cfg, tp=tp, ep=ep, etp=etp, expert_layout=expert_layout, layer_spec=layer_spec)
    job = f"sums-fused-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    pubs = [Publisher({n: t.contiguous().clone() for n, t in shards[tuple(r)].items()}, cfg, rank=tuple(r),
                      layout=layout, rendezvous=rdzv, agent_name=f"{job}-t{r.tp}{r.ep}", checksums=True)
            for r in layout.ranks()]
    for p in pubs:
        p.publish(1)
    return job, rdzv, pubs


def _plan_ops(cfg, target, **geo) -> int:
    """How many boxes a receiver of ``target`` pulls: the op count of its plan."""
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.targets import plan_megatron_to_vllm

    dims, layout = _layout(cfg, **geo)
    plan = plan_megatron_to_hf(dims, layout) if target is None else plan_megatron_to_vllm(dims, layout, "bfloat16",
                                                                                           target)
    return len(plan.ops)


def _gpt_oss():
    transformers = pytest.importorskip("transformers")
    from moe_cases import case_config

    cfg = case_config("gpt_oss")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    return cfg, {k: torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("expert_layout, layer_spec", [("sequential", "local"), ("te_grouped", "te")])
@pytest.mark.parametrize("budget", [None, 250_000])
def test_gpt_oss_fused_experts_are_checked_and_a_changed_byte_is_named(expert_layout, layer_spec, budget):
    """gpt-oss at tp 2 ep 2 into full HF tensors and into a vLLM tp=2 worker: every box is
    checked (the fused gate_up_proj / w13 boxes too), the HF tensors equal transformers' state
    dict bit for bit; one byte of expert 1's linear_fc1 changed on a trainer (no publish) is
    a named mismatch, and that expert's tensor is never handed over."""
    pytest.importorskip("nixl")
    from moe_cases import megatron_shards

    from megarefit.online import RefitReceiver
    from megarefit.online.receiver.receiver import TornUpdateError
    from megarefit.targets import VllmTarget
    from megarefit.transport.checksum import ChecksumMismatchError

    cfg, hf = _gpt_oss()
    geo = dict(tp=2, ep=2, etp=1, expert_layout=expert_layout, layer_spec=layer_spec)
    shards = megatron_shards(hf, cfg, "gpt_oss", 2, 2, 1, expert_layout, layer_spec)
    job, rdzv, pubs = _serve(cfg, shards, **geo)
    for target in (None, VllmTarget(2, 1)):
        rx = RefitReceiver(rdzv, name=f"{job}-rx{target is None}", timeout=30, target=target, memory_budget=budget,
                           verify_checksums=True)
        got = {n: t.clone() for n, t in rx.run_refit_cycle(1)}
        if target is None:
            assert got.keys() == hf.keys() and all(torch.equal(got[n], hf[n]) for n in hf)
        else:
            plain = RefitReceiver(rdzv, name=f"{job}-plain", timeout=30, target=target)
            want = {n: t.clone() for n, t in plain.run_refit_cycle(1)}
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
            plain.close()
        assert rx.stats.checked_boxes == _plan_ops(cfg, target, **geo) > 0
        assert rx.stats.checked_bytes == rx.stats.bytes_moved and rx.stats.unchecked_bytes == 0
        rx.close()
    fc1 = ("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight" if expert_layout == "sequential"
           else "decoder.layers.1.mlp.experts.linear_fc1.weight1")
    first = next(p for p in pubs if tuple(p.rank) == (0, 0, 0))  # its local expert 1 is expert 1
    first.params[fc1].view(torch.uint8)[40, 7] ^= 16  # gate row 40: in vLLM worker 1's ffn half too
    for target, into in ((None, r"gate_up_proj"), (VllmTarget(2, 1), r"w13_weight")):
        rx = RefitReceiver(rdzv, name=f"{job}-bad{target is None}", timeout=30, target=target, memory_budget=budget,
                           verify_checksums=True)
        handed = []
        named = rf"{fc1.replace('.', '[.]')} of rank \(0, 0, 0\).*pulled into .*layers\.1\.mlp\.experts\..*{into}"
        with pytest.raises((ChecksumMismatchError, TornUpdateError), match=named) as err:
            for name, _ in rx.run_refit_cycle(1):
                handed.append(name)
        assert not any(".layers.1.mlp.experts." in n for n in handed)
        assert (handed == []) == isinstance(err.value, ChecksumMismatchError)
        rx.close()


@pytest.mark.parametrize("tp, ep, etp", [(2, 2, 1), (2, 1, 2)])
def test_legacy_grouped_experts_are_checked_and_a_changed_byte_is_named(tp, ep, etp):
    """Qwen3-MoE with legacy GroupedMLP experts (weight1 [h, E*2F], weight2 [E*F, h]), which
    used to be left unchecked: every box checked into HF tensors and a vLLM tp=2 worker (EP on
    and off), HF tensors equal to the source; a byte of weight1 changed is named with its
    expert, column and the up_proj it lands in."""
    pytest.importorskip("nixl")
    from moe_cases import megatron_shards, moe_config
    from reference import moe_hf_state

    from megarefit.online import RefitReceiver
    from megarefit.targets import VllmTarget
    from megarefit.transport.checksum import ChecksumMismatchError

    cfg = moe_config("Qwen3-30B-A3B")
    hf = moe_hf_state(cfg, "qwen3_moe", seed=1, dtype=torch.bfloat16)
    geo = dict(tp=tp, ep=ep, etp=etp, expert_layout="legacy_grouped")
    job, rdzv, pubs = _serve(cfg, megatron_shards(hf, cfg, "qwen3_moe", tp, ep, etp, "legacy_grouped", "local"), **geo)
    for target in (None, VllmTarget(2, 1), VllmTarget(2, 0, expert_parallel=True)):
        rx = RefitReceiver(rdzv, name=f"{job}-rx{next(_JOBS)}", timeout=30, target=target, verify_checksums=True)
        got = {n: t.clone() for n, t in rx.run_refit_cycle(1)}
        if target is None:
            assert got.keys() == hf.keys() and all(torch.equal(got[n], hf[n]) for n in hf)
        assert rx.stats.checked_boxes == _plan_ops(cfg, target, **geo) > 0
        assert rx.stats.checked_bytes == rx.stats.bytes_moved
        rx.close()
    # layer 1's weight1 on rank (0, 0, 0), stored [h, E_local*C2], is memory [E_local, h, C2] (C2 = 2F/etp):
    # stored element (5, 50) is flat 5*E_local*C2 + 50, in expert flat // (h*C2), column flat % C2
    w1 = next(p for p in pubs if tuple(p.rank) == (0, 0, 0)).params["decoder.layers.1.mlp.experts.weight1"]
    per_ep, f = cfg["num_experts"] // ep, cfg["moe_intermediate_size"] // etp
    c2 = 2 * f
    flat = 5 * w1.shape[1] + 50
    expert, col = flat // (w1.shape[0] * c2), flat % c2
    w1.view(torch.uint8)[5, 2 * 50] ^= 4  # the low byte of bf16 element (5, 50)
    assert expert < per_ep and col >= f  # an up_proj column of a local expert
    rx = RefitReceiver(rdzv, name=f"{job}-bad", timeout=30, verify_checksums=True)
    with pytest.raises(ChecksumMismatchError, match=rf"experts\.weight1 of rank \(0, 0, 0\) .*col {col} of expert "
                                                    rf"{expert}, pulled into model\.layers\.1\.mlp\.experts\."
                                                    rf"{expert}\.up_proj\.weight"):
        list(rx.run_refit_cycle(1))
    rx.close()


def test_a_box_no_sum_covers_is_refused_before_a_byte_moves(config, monkeypatch):
    """A plan whose q box of linear_qkv is split into column halves (each some rows and some
    columns: no published sum covers them) -- no shipped layout plans such a box, so the plan
    is altered here -- is refused in one error naming the tensor, rank, box and fix, before
    the receiver posts any READ."""
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    import megarefit.online.receiver.receiver as receiver_module
    from megarefit.online import RefitReceiver
    from megarefit.plan import make_op
    from megarefit.planner import plan_megatron_to_hf
    from megarefit.transport.checksum import UncheckableBoxError

    cfg = config("Llama-3.1-8B", num_hidden_layers=2)
    job, rdzv, _ = _serve(cfg, reference_shards(reference_hf_state(cfg, "llama"), cfg, tp=2, pp=1), tp=2, ep=1,
                          etp=2, expert_layout="sequential")

    def split(*args, **kwargs):
        plan = plan_megatron_to_hf(*args, **kwargs)
        op = next(o for o in plan.ops if o.src.name.endswith("0.self_attention.linear_qkv.weight")
                  and o.dst.name.endswith("q_proj.weight") and o.src.rank.tp == 1)
        (r0, c0), (nr, nc) = op.src_box.offsets, op.src_box.lengths
        (d0, e0) = op.dst_box.offsets
        src_shape, dst_shape = plan.sources[op.src].shape, plan.targets[op.dst].shape
        halves = [make_op(op.src, src_shape, Box((r0, c0 + k * nc // 2), (nr, nc // 2)), op.dst, dst_shape,
                          Box((d0, e0 + k * nc // 2), (nr, nc // 2)), op.itemsize) for k in range(2)]
        ops = tuple(o for o in plan.ops if o is not op) + tuple(halves)
        return dataclasses.replace(plan, ops=ops, digest=plan.digest + "-split")

    monkeypatch.setattr(receiver_module, "plan_megatron_to_hf", split)
    rx = RefitReceiver(rdzv, name=f"{job}-rx", timeout=30, verify_checksums=True)
    reads = []
    for name in ("execute", "start", "read_blocks"):
        real = getattr(rx.transport, name)
        monkeypatch.setattr(rx.transport, name, lambda *a, _real=real, _name=name, **k: reads.append(_name) or
                            _real(*a, **k))
    with pytest.raises(UncheckableBoxError) as err:
        list(rx.run_refit_cycle(1))
    text = str(err.value)
    assert "cannot check 2 of the" in text and "Nothing was pulled" in text and "verify_checksums=False" in text
    assert "decoder.layers.0.self_attention.linear_qkv.weight of rank (1, 0, 0)" in text
    assert "neither whole rows nor every row" in text and "(and 1 more box(es))" in text
    assert reads == []
    rx.close()
