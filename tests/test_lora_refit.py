"""The adapter-only LoRA refit cycle: LoraPublisher -> LoraReceiver -> PEFT tensors (issue 61).

* The adapter plan (:func:`plan_lora_to_peft`) against a reference written here from the layout
  facts alone (:func:`_reference_peft`: the TP shards concatenated, QKV B reshaped per query group,
  FC1 B halved per rank; no megarefit geometry), over drawn heads, groups, dims, r, TP, PP and both
  Bridge wrappers; every PEFT element written exactly once (``validate_plan``). Against Bridge's own
  ``export_adapter_weights``: tests/test_bridge_lora.py.
* End to end with real NIXL agents: tp-2 trainer ranks serve their adapter shards, a receiver pulls
  PEFT tensors and ``peft_config``; a second version replaces the first through the seqlock; checksums
  catch a changed byte; acknowledgements reach the trainers.
* The base under the adapter: a base tensor written on the trainer makes the publish refuse, and a
  receiver whose engine holds another base version refuses before a byte moves.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarefit.errors import BaseChangedError, LayoutError, MegarefitError
from megarefit.layout.dims import ModelDims
from megarefit.layout.lora import adapter_local_shape
from megarefit.layout.parallel import RankCoord, SourceLayout
from megarefit.online.receiver.cycle import VersionMismatchError
from megarefit.planner.lora_to_peft import adapter_rows, plan_lora_to_peft
from megarefit.specs.lora import CANONICAL_ROWS, LORA_ROWS
from megarefit.translate_peft import lora_to_peft
from megarefit.transport.execute import materialize
from megarefit.transport.local import LocalTransport


def _cfg(heads=8, groups=4, head_dim=16, hidden=64, ffn=96, layers=4):
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim,
            "intermediate_size": ffn, "num_hidden_layers": layers, "vocab_size": 512, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "torch_dtype": "float32"}


def _shards(cfg, rows, r, tp, seed=0, dtype=torch.float32):
    """{tp rank: {megatron name: random local shard}} of one stage holding every layer (pp = 1)."""
    dims = ModelDims.from_hf_config(cfg)
    g = torch.Generator().manual_seed(seed)
    return {t: {row.megatron.format(layer=layer): torch.randn(adapter_local_shape(row, dims, r, tp), generator=g
                                                              ).to(dtype)
                for layer in range(cfg["num_hidden_layers"]) for row in rows} for t in range(tp)}


def _staged(shards, cfg, pp):
    """The pp = 1 shards split over ``pp`` stages, layers renumbered from 0 on each."""
    per = cfg["num_hidden_layers"] // pp
    out = {}
    for (t, names) in shards.items():
        for s in range(pp):
            out[RankCoord(t, s, 0)] = {}
            for name, x in names.items():
                layer = int(name.split(".")[2])
                if s * per <= layer < (s + 1) * per:
                    out[RankCoord(t, s, 0)][name.replace(f"layers.{layer}.", f"layers.{layer - s * per}.")] = x
    return out


_HF = {"self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
       "self_attention.linear_proj": ("self_attn", ("o_proj",)),
       "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")), "mlp.linear_fc2": ("mlp", ("down_proj",))}
_CANONICAL = {"adapter_q": "q_proj", "adapter_k": "k_proj", "adapter_v": "v_proj", "adapter_gate": "gate_proj",
              "adapter_up": "up_proj"}
_NAME = re.compile(r"decoder\.layers\.(\d+)\.(self_attention\.linear_\w+|mlp\.linear_\w+)\.adapter\."
                   r"(?:(adapter_\w+)\.)?linear_(in|out)\.weight")


def _reference_peft(shards, cfg):
    """PEFT tensors of pp = 1 adapter shards ``{tp rank: {name: shard}}``, from Megatron's layout as written
    here: a fused ``linear_qkv`` holds, per query group, its ``n`` query heads, then one key and one value head
    (each rank its own groups), ``linear_fc1`` holds ``[gate_t; up_t]`` on rank ``t``, A of a column base is split
    over r (LoRA's one A serves every projection), A of a row base over its input."""
    groups, d = cfg["num_key_value_heads"], cfg["head_dim"]
    n = cfg["num_attention_heads"] // groups
    out = {}
    for name in shards[0]:
        layer, linear, canonical, io = _NAME.fullmatch(name).groups()
        parts = [shards[t][name] for t in sorted(shards)]
        block, mods = _HF[linear]
        factor = "lora_A" if io == "in" else "lora_B"

        def key(mod, layer=layer, block=block, factor=factor):
            return f"base_model.model.model.layers.{layer}.{block}.{mod}.{factor}.weight"

        if canonical:  # one projection: a plain split over r (A) or over its output rows (B)
            out[key(_CANONICAL[canonical])] = torch.cat(parts, 0)
        elif len(mods) == 1:  # linear_proj / linear_fc2: A split over the input, B over the output
            out[key(mods[0])] = torch.cat(parts, 1 if io == "in" else 0)
        elif io == "in":
            for mod in mods:
                out[key(mod)] = torch.cat(parts, 0)
        elif linear == "self_attention.linear_qkv":
            full = torch.cat(parts, 0).reshape(groups, n + 2, d, -1)
            out[key("q_proj")] = full[:, :n].reshape(groups * n * d, -1)
            out[key("k_proj")] = full[:, n].reshape(groups * d, -1)
            out[key("v_proj")] = full[:, n + 1].reshape(groups * d, -1)
        else:
            halves = [p.chunk(2, 0) for p in parts]
            out[key("gate_proj")] = torch.cat([h[0] for h in halves], 0)
            out[key("up_proj")] = torch.cat([h[1] for h in halves], 0)
    return out


def _layout(cfg, tp, pp):
    dims = ModelDims.from_hf_config(cfg)
    return SourceLayout.build(tp=tp, pp=pp, padded_vocab_size=dims.padded_vocab_size(tp), num_layers=dims.num_layers)


@settings(max_examples=40, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), per_group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([4, 8]),
       hidden=st.sampled_from([16, 32]), ffn=st.sampled_from([8, 24]), r=st.sampled_from([2, 4, 8]),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]), canonical=st.booleans(),
       only=st.sampled_from(["all", "attention", "mlp"]), seed=st.integers(0, 99))
def test_the_adapter_plan_equals_the_reference_layout(groups, per_group, head_dim, hidden, ffn, r, tp, pp,
                                                     canonical, only, seed):
    if groups % tp or r % tp or ffn % tp or hidden % tp:
        return
    cfg = _cfg(groups * per_group, groups, head_dim, hidden, ffn, layers=4)
    rows = [row for row in (CANONICAL_ROWS if canonical else LORA_ROWS)
            if only == "all" or (only == "attention") == (".self_attention." in row.megatron)]
    shards = _shards(cfg, rows, r, tp, seed)
    want = _reference_peft(shards, cfg)
    staged = _staged(shards, cfg, pp)
    plan = plan_lora_to_peft(ModelDims.from_hf_config(cfg), _layout(cfg, tp, pp), "float32", r,
                             adapter_rows(list(staged[RankCoord(0, 0, 0)])))
    got = {ref.name: t.clone() for ref, t in materialize(plan, LocalTransport(staged))}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert plan.nbytes == sum(t.numel() * 4 for t in want.values())  # each PEFT element written once


def test_layers_with_different_adapters_are_refused():
    names = ["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight",
             "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight",
             "decoder.layers.1.mlp.linear_fc1.adapter.linear_in.weight",
             "decoder.layers.1.mlp.linear_fc1.adapter.linear_out.weight"]
    with pytest.raises(LayoutError, match="layers carry different adapters"):
        adapter_rows(names)


# ---- end to end, real NIXL (UCX loopback) ----------------------------------------------------
_JOBS = iter(range(10**6))


class _Trainer:
    """tp-2 LoRA trainer ranks in this process: adapters and a (frozen) base each."""

    def __init__(self, base_version=-1, checksums=True, r=8):
        pytest.importorskip("nixl")
        from megarefit.online.store.rendezvous import Rendezvous
        from megarefit.online.trainer.lora_publisher import LoraPublisher

        self.cfg = _cfg()
        self.job = f"lora-refit-{next(_JOBS)}"
        self.rdzv = Rendezvous.serve(job=self.job)
        self.channel = self.rdzv.channel("lora/policy")
        self.shards = _shards(self.cfg, LORA_ROWS, r, 2, seed=1)
        self.base = {t: {"decoder.layers.0.self_attention.linear_qkv.to_wrap.weight": torch.randn(64, 64)}
                     for t in range(2)}
        self.pubs = [LoraPublisher({**self.shards[t], **self.base[t]}, self.cfg, rank=(t, 0, 0),
                                   layout=_layout(self.cfg, 2, 1), rendezvous=self.channel, alpha=16,
                                   base=self.base[t], base_version=base_version, checksums=checksums,
                                   agent_name=f"{self.job}-t{t}") for t in range(2)]
        for p in self.pubs:
            p.publish(1)

    def want(self):
        return lora_to_peft({t: {n: p.params[n] for n in self.shards[t]} for t, p in enumerate(self.pubs)},
                            self.cfg, alpha=16)[0]


def _receiver(trainer, **options):
    from megarefit.online.receiver.lora_receiver import LoraReceiver

    return LoraReceiver(trainer.channel, name=f"{trainer.job}-rx", timeout=20, **options)


def test_an_adapter_refit_cycle_pulls_peft_tensors_and_the_next_version_replaces_them():
    trainer = _Trainer()
    rx = _receiver(trainer, verify_checksums=True)
    got = rx.pull_adapter()
    want = trainer.want()
    assert got.version == 1 and got.base_version == -1
    assert sorted(got.tensors) == sorted(want) and all(torch.equal(got.tensors[n], want[n]) for n in want)
    assert got.peft_config == {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0,
                               "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                  "v_proj"]}
    assert rx.stats.checked_bytes == rx.stats.bytes_moved == got.nbytes  # LoRA's one A READ for each of q / k / v
    rx.acknowledge()
    assert trainer.pubs[0].wait_receivers(1, timeout=10) == {rx.name: "acked"}
    for p in trainer.pubs:  # an optimizer step on the adapters, inside the seqlock
        with p.updating(2):
            for n in trainer.shards[p.rank.tp]:
                p.params[n].mul_(-0.5).add_(1.0)
    second = rx.pull_adapter(2)
    want2 = trainer.want()
    assert second.version == 2 and all(torch.equal(second.tensors[n], want2[n]) for n in want2)
    assert not torch.equal(second.tensors[next(iter(want))], got.tensors[next(iter(want))])
    assert rx.plans_built == 1  # the second version pulled by the same plan
    rx.timeout = 1.0  # a version not published: the error gives the whole wait, not what was left of it
    with pytest.raises(VersionMismatchError, match=r"do not publish version 9 after 1\.\d s: \(0, 0, 0\): 2"):
        rx.pull_adapter(9)
    rx.close()


def test_a_byte_changed_behind_the_trainer_is_named_and_the_adapter_never_returned():
    from megarefit.transport.checksum import ChecksumMismatchError

    trainer = _Trainer()
    rx = _receiver(trainer, verify_checksums=True)
    rx.pull_adapter()
    name = "decoder.layers.2.mlp.linear_fc2.adapter.linear_in.weight"
    trainer.pubs[1].params[name].view(torch.uint8)[0] ^= 4
    with pytest.raises(ChecksumMismatchError, match=r"linear_fc2\.adapter\.linear_in\.weight of rank \(1, 0, 0\)"):
        rx.pull_adapter()
    rx.close()


def test_a_changed_base_is_refused_on_the_trainer_and_another_base_version_on_the_receiver():
    trainer = _Trainer(base_version=3)
    rx = _receiver(trainer)  # this engine holds the checkpoint's base (-1): the adapter trains on version 3
    with pytest.raises(BaseChangedError, match="base version 3, this engine holds base version -1: refit the base"):
        rx.pull_adapter()
    assert rx.counters.get("posts", 0) == 0 and rx.plans_built == 0  # refused before planning, before a byte moved
    rx.base_version = 3
    assert rx.pull_adapter().base_version == 3
    trainer.base[0]["decoder.layers.0.self_attention.linear_qkv.to_wrap.weight"][5, 7] += 1.0
    changed = r"linear_qkv\.to_wrap\.weight on rank \(tp=0, pp=0, ep=0\) changed"
    with pytest.raises(BaseChangedError, match=changed), trainer.pubs[0].updating(2):
        pass
    trainer.pubs[1].publish(2)
    rx.timeout = 2  # rank 0 stays marked writing: no adapter version 2 is ever accepted from it
    with pytest.raises(MegarefitError):
        rx.pull_adapter(2)
    rx.close()


def test_the_receiver_refuses_a_model_channel_and_options_an_adapter_refit_does_not_take():
    pytest.importorskip("nixl")
    from reference import reference_hf_state, reference_shards

    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.receiver.lora_receiver import LoraReceiver
    from megarefit.online.store.rendezvous import Rendezvous
    from megarefit.online.trainer.publisher import Publisher

    cfg = _cfg(layers=2)
    job = f"lora-model-{next(_JOBS)}"
    rdzv = Rendezvous.serve(job=job)
    shards = reference_shards(reference_hf_state(cfg, "qwen3"), cfg, tp=1, pp=1)
    pub = Publisher(shards[(0, 0, 0)], cfg, rank=(0, 0, 0), layout=source_layout(cfg, tp=1, pp=1),
                    rendezvous=rdzv, agent_name=f"{job}-t0")
    pub.publish(1)
    rx = LoraReceiver(rdzv, name=f"{job}-rx", timeout=20)
    with pytest.raises(MegarefitError, match="publishes model weights on this channel, not a LoRA adapter"):
        rx.pull_adapter()
    rx.close()
    with pytest.raises(MegarefitError, match="LoraReceiver takes no memory_budget="):
        LoraReceiver(rdzv, name=f"{job}-rx2", memory_budget=1 << 20)


def test_a_plain_publisher_of_a_lora_model_is_refused_naming_both_ways_to_serve_it():
    """A Bridge LoRA rank's parameters (``to_wrap`` bases, adapters) given to a plain Publisher: refused before any
    NIXL agent exists, naming the merged and the adapter-only ways."""
    from reference import reference_hf_state, reference_shards

    from megarefit.errors import UnsupportedAdapterError
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.trainer.publisher import Publisher

    cfg = _cfg(layers=2)
    shards = reference_shards(reference_hf_state(cfg, "qwen3"), cfg, tp=1, pp=1)[(0, 0, 0)]
    params = {(n.replace(".weight", ".to_wrap.weight") if ".linear_qkv.weight" in n else n): t
              for n, t in shards.items()}
    params.update(_shards(cfg, LORA_ROWS[:2], 4, 1)[0])
    with pytest.raises(UnsupportedAdapterError, match=r"LoRA-wrapped model .*MergedLoRA.*LoraPublisher"):
        Publisher(params, cfg, rank=(0, 0, 0), layout=source_layout(cfg, tp=1, pp=1), rendezvous=None)


def test_adapter_shards_a_publisher_cannot_serve_are_refused_naming_tensor_rank_and_values():
    """Before any NIXL agent: shards of two adapter ranks r (naming a tensor of each), an MoE expert's adapter
    (the adapter-only refit plans dense ones), and a layer of the stage without its adapters (naming the
    tensors absent)."""
    from megarefit.errors import MissingParameterError, ShapeMismatchError, UnsupportedAdapterError
    from megarefit.online.trainer.lora_publisher import LoraPublisher

    cfg = _cfg()
    shards = _shards(cfg, LORA_ROWS, 8, 1)[0]
    odd = "decoder.layers.2.mlp.linear_fc2.adapter.linear_out.weight"
    mixed = {**shards, odd: torch.zeros(64, 4)}
    with pytest.raises(ShapeMismatchError, match=rf"rank \(tp=0, pp=0, ep=0\): adapters of more than one rank r "
                                                 rf"\(at tp=1\): r=4 in {re.escape(odd)}, r=8 in"):
        LoraPublisher(mixed, cfg, rank=(0, 0, 0), layout=_layout(cfg, 1, 1), rendezvous=None, alpha=16)
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.adapter.linear_in.weight"
    with pytest.raises(UnsupportedAdapterError, match=rf"{re.escape(expert)}.* adapter-only refit plans dense"):
        LoraPublisher({**shards, expert: torch.zeros(8, 64)}, cfg, rank=(0, 0, 0), layout=_layout(cfg, 1, 1),
                      rendezvous=None, alpha=16)
    short = {n: t for n, t in shards.items() if ".layers.3." not in n}
    with pytest.raises(MissingParameterError, match=r"4 layers\) must carry the same adapters; absent: "
                                                    r"\['decoder\.layers\.3\."):
        LoraPublisher(short, cfg, rank=(0, 0, 0), layout=_layout(cfg, 1, 1), rendezvous=None, alpha=16)


@pytest.mark.parametrize("record", [[0, 16.0, -1], [8, float("nan"), -1], [8, 16.0, -2], [True, 16.0, -1],
                                    [8, 16.0], "8,16,-1", [8.0, 16.0, -1]])
def test_a_manifests_lora_record_is_checked_as_it_arrives(record):
    from megarefit.transport.manifest import LoraInfo, ManifestError

    with pytest.raises(ManifestError, match="LoRA record"):
        LoraInfo.parse(record)
    assert LoraInfo.parse([8, 16, 3]) == LoraInfo(8, 16.0, 3)
