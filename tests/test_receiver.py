"""run_refit_cycle: streams one target at a time, writes in place into buffers, checks them."""

from __future__ import annotations

import pytest
import torch

import megarefit
from megarefit.errors import MegarefitError, ShapeMismatchError
from megarefit.transport.execute import RefitStats, run_refit_cycle
from megarefit.transport import LocalTransport, Transport
from reference import reference_hf_state, reference_shards


@pytest.fixture
def setup(config):
    cfg = config("Qwen3-0.6B")
    hf = reference_hf_state(cfg, "qwen3")
    shards = {megarefit.RankCoord(*r): s for r, s in reference_shards(hf, cfg, tp=2, pp=2).items()}
    dims = megarefit.ModelDims.from_hf_config(cfg)
    layout = megarefit.SourceLayout.build(tp=2, pp=2, padded_vocab_size=256, num_layers=4)
    return hf, shards, megarefit.plan_megatron_to_hf(dims, layout, "float32")


class CountingTransport(LocalTransport):
    def __init__(self, sources):
        super().__init__(sources)
        self.pulled: list[str] = []

    def pull(self, ops, out):
        self.pulled.append(ops[0].dst.name)
        super().pull(ops, out)


def test_streams_one_target_at_a_time(setup):
    hf, shards, plan = setup
    transport = CountingTransport(shards)
    assert isinstance(transport, Transport)
    stream = run_refit_cycle(plan, transport, views=False)
    for i, (name, tensor) in enumerate(stream, start=1):
        assert transport.pulled[-1] == name and len(transport.pulled) == i  # nothing pulled ahead
        assert torch.equal(tensor, hf[name])
    assert len(transport.pulled) == len(hf)


def test_buffers_are_written_in_place(setup):
    hf, shards, plan = setup
    buffers = {name: torch.full_like(t, float("nan")) for name, t in hf.items()}
    stats = RefitStats()
    for name, tensor in run_refit_cycle(plan, LocalTransport(shards), buffers=buffers, stats=stats):
        assert tensor is buffers[name]
    assert all(torch.equal(buffers[k], v) for k, v in hf.items())
    assert stats.views == 0 and stats.bytes_copied == plan.nbytes


def test_bad_buffer_is_rejected_before_writing(setup):
    hf, shards, plan = setup
    name = "model.layers.2.mlp.down_proj.weight"
    buffers = {name: torch.zeros(hf[name].shape[::-1])}
    with pytest.raises(ShapeMismatchError, match=rf"buffer for {name}: expected contiguous float32 \(64, 96\)"):
        list(run_refit_cycle(plan, LocalTransport(shards), buffers=buffers))
    with pytest.raises(ShapeMismatchError, match="bfloat16"):
        list(run_refit_cycle(plan, LocalTransport(shards), buffers={name: hf[name].bfloat16()}))


def test_refuses_an_import_plan(setup):
    _, shards, plan = setup
    imp = megarefit.plan_hf_to_megatron(plan.dims, plan.layout, "float32")
    with pytest.raises(MegarefitError, match="megatron_to_hf / megatron_to_vllm plan, got hf_to_megatron"):
        next(run_refit_cycle(imp, LocalTransport(shards)))


def test_warm_cycles_reuse_compiled_copies_and_follow_the_sources(setup):
    """A warm cycle into the same buffers reuses the compiled (destination, source) views:
    values changed in place are picked up, and a source replaced by a new tensor is
    noticed (recompiled). Compared with the reference HF state each time."""
    hf, shards, plan = setup
    shards = {r: {n: t.clone() for n, t in s.items()} for r, s in shards.items()}  # own memory, no shared views
    transport = LocalTransport(shards)
    buffers = {name: torch.empty_like(t) for name, t in hf.items()}
    list(run_refit_cycle(plan, transport, buffers=buffers))
    compiled = next(iter(transport._compiled.values()))
    for rank in shards:  # an optimizer step: every shard changes in place
        for t in shards[rank].values():
            t.mul_(2)
    list(run_refit_cycle(plan, transport, buffers=buffers))
    assert next(iter(transport._compiled.values())) is compiled
    assert all(torch.equal(buffers[k], v * 2) for k, v in hf.items())
    name = "decoder.layers.0.self_attention.linear_proj.weight"  # a strided (row-parallel) source
    shards[megarefit.RankCoord(1, 0, 0)][name] = shards[megarefit.RankCoord(1, 0, 0)][name].clone().zero_()
    list(run_refit_cycle(plan, transport, buffers=buffers))
    assert next(iter(transport._compiled.values())) is not compiled
    o_proj = buffers["model.layers.0.self_attn.o_proj.weight"]
    cols = o_proj.shape[1] // 2
    assert torch.equal(o_proj[:, :cols], hf["model.layers.0.self_attn.o_proj.weight"][:, :cols] * 2)
    assert not o_proj[:, cols:].any()


@pytest.mark.parametrize("hidden,ffn", [(64, 96), (36, 42)])
def test_widened_bf16_copies_are_bit_exact(config, hidden, ffn):
    """Warm batched cycles move bf16 as int32 / int64 words where sizes and offsets allow
    (64 / 96) and fall back to bf16 element copies where they do not (36 / 42: 21-element
    column slabs at tp=2); either way the bytes equal the reference HF state, NaN payloads
    and all."""
    cfg = config("Llama-3.1-8B", hidden_size=hidden, intermediate_size=ffn, num_attention_heads=4,
                 num_key_value_heads=2)
    hf = {k: v.bfloat16() for k, v in reference_hf_state(cfg, "llama").items()}
    hf["model.layers.0.mlp.down_proj.weight"][0, :4] = torch.tensor([float("nan")] * 4).bfloat16()
    hf["model.layers.0.mlp.down_proj.weight"].view(torch.int16)[0, 1] = 0x7FC1  # a NaN with a payload
    shards = {megarefit.RankCoord(*r): {n: t.clone() for n, t in s.items()}
              for r, s in reference_shards(hf, cfg, tp=2, pp=1).items()}
    dims = megarefit.ModelDims.from_hf_config(cfg)
    layout = megarefit.SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=4)
    plan = megarefit.plan_megatron_to_hf(dims, layout, "bfloat16")
    transport = LocalTransport(shards)
    buffers = {name: torch.empty_like(t) for name, t in hf.items()}
    for _ in range(2):
        list(run_refit_cycle(plan, transport, buffers=buffers))
        assert all(torch.equal(buffers[k].view(torch.int16), v.view(torch.int16)) for k, v in hf.items())
    widened = {s.dtype for s in next(iter(transport._compiled.values())).boxes[1]}
    assert widened == ({torch.int64} if hidden == 64 else {torch.bfloat16})
