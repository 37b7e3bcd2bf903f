"""``Publisher.from_megatron``: the layout read from real Megatron-Core models on CPU (two gloo
processes) equals the layout stated by hand (``source_layout``); the ranks the processes read are
exactly the layout's process grid, and the parameters Megatron built on each are exactly what the
independent reference planner places there under the read layout; a model that disagrees with a stated
layout, its hf_config or Megatron's process grid is refused, naming the mismatch.

Cases: dense at TP=2, MoE at TP=2 EP=2 with expert-TP 1, an uneven pipeline (first stage 1 layer
of 4), an interleaved pipeline (PP=2 x VPP=2, served as a ``PublisherGroup`` and pulled by a real
receiver; expected tensors from the reference sharder, not from megarefit), DeepSeek-V3 MLA + MoE
with one MTP layer at PP=2, and the dense model behind Megatron-Core's DDP and Float16Module. The families
the demo builds are read the same way by every ``megarefit demo`` run (demo/offline.py checks
the read layout against the stated one).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("nixl")

import megatron.core  # noqa: E402
from conftest import tiny_config  # noqa: E402
from from_megatron_jobs import Case, read_job  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402
from moe_cases import moe_config  # noqa: E402
from reference import reference_shards, unshard  # noqa: E402
from reference_planner import Layout, reference_megatron_to_hf  # noqa: E402
from test_megatron_mla_glm import _config  # noqa: E402

from megarefit import ModelDims, SourceLayout  # noqa: E402
from megarefit.demo.megatron_cpu import megatron_series  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.errors import (
    LayoutError,  # noqa: E402
    UnverifiedMegatronError,  # noqa: E402
)
from megarefit.layout.megatron_model import agree, check_stated, megatron_core_of, source_layout, unwrap  # noqa: E402
from megarefit.online import RefitReceiver, VersionMismatchError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout  # noqa: E402

pytestmark = pytest.mark.megatron

DENSE = tiny_config("Qwen3-0.6B", num_hidden_layers=4)
MTP = {**_config("deepseek"), "num_nextn_predict_layers": 1, "num_hidden_layers": 4}
CASES = [
    Case("dense-tp2", {**DENSE, "num_hidden_layers": 2}, tp=2),
    Case("moe-tp2-ep2-etp1", moe_config("Qwen3-30B-A3B"), tp=2, ep=2, etp=1),
    Case("moe-tp2-etp1", moe_config("Qwen3-30B-A3B"), tp=2, etp=1),  # tp does not divide etp * ep: both serve
    Case("uneven-pp2", DENSE, pp=2, arch=(("first_stage_layers", 1),)),
    Case("vpp", DENSE, pp=2, vpp=2),
    Case("mtp-pp2", MTP, pp=2, arch=(("mtp_layers", 1),)),
]
if megatron_series() < (0, 17):  # GroupedMLP (gone from 0.17): stage 0 holds the dense layer 0 only, its
    CASES.append(Case("moe-pp2-grouped", moe_config("Qwen3-30B-A3B"), pp=2,  # names cannot tell the experts
                      arch=(("moe_grouped_gemm", True),)))
# the same models stated by hand
STATED = {
    "dense-tp2": dict(tp=2), "moe-tp2-ep2-etp1": dict(tp=2, ep=2, etp=1), "moe-tp2-etp1": dict(tp=2, etp=1), "uneven-pp2": dict(pp=2, first_stage_layers=1),
    "vpp": dict(pp=2, vpp=2), "mtp-pp2": dict(pp=2, mtp_layers=1),
    "moe-pp2-grouped": dict(pp=2, expert_layout="legacy_grouped"),
}
JOB = "from-megatron"
# the config flags the CPU harness sets where Megatron-Core's defaults differ (SwiGLU without biases, q / k norms,
# DeepSeek-V3's sigmoid router with its score-correction bias)
HARNESS_FLAGS = {"activation_func": "silu", "add_bias_linear": False, "gated_linear_unit": True, "qk_layernorm": True,
                 "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


def _pull_while_alive(rdzv: Rendezvous, group, seconds: float = 600) -> dict[str, torch.Tensor]:
    """Version 1 pulled from the workers' VPP group; a worker that fails meanwhile (a layout read
    wrong: tests/from_megatron_jobs.py checks each against Megatron's grid) is reported within
    seconds, not after the whole wait."""
    receiver = RefitReceiver(rdzv, name=f"{JOB}-receiver", timeout=5)
    deadline = time.monotonic() + seconds
    while True:
        try:
            return {n: t.clone() for n, t in receiver.run_refit_cycle(1)}
        except (RendezvousTimeout, VersionMismatchError):
            group.check()
            if time.monotonic() > deadline:
                raise


@pytest.fixture(scope="module")
def read():
    """Both processes' results, and the VPP group's pull through a real receiver."""
    rdzv = Rendezvous.serve(job=JOB)
    group = start_workers(read_job, world_size=2, args=(CASES, ("127.0.0.1", rdzv.port, JOB)))
    try:
        pulled = _pull_while_alive(rdzv, group)
        rdzv.mark_consumed(1)
    finally:
        per_rank = group.join(900)
    return per_rank, pulled


def _case(key: str) -> Case:
    return next(c for c in CASES if c.key == key)


@pytest.mark.parametrize("key", [c.key for c in CASES])
def test_read_layout_is_the_stated_one(read, key):
    per_rank, _ = read
    case = _case(key)
    results = [r[key] for r in per_rank]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    layouts = {SourceLayout.from_dict(d) for r in results for d in r["layouts"]}
    assert len(layouts) == 1, layouts  # every chunk of every rank reads one layout
    got = layouts.pop()
    assert got.megatron.version == megatron.core.__version__
    # every flag of the release read from the model's config: Megatron-Core's defaults but what the harness sets
    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    unread = {f.name for f in got.megatron.release.flags} - {k for k, _ in got.megatron.flags}
    assert unread <= {"mla_down_proj_fusion"}, unread  # MLATransformerConfig's own (these are GPT configs)
    assert {k: v for k, v in got.megatron.flags if defaults.get(k, "absent") != v}.items() <= HARNESS_FLAGS.items()
    stated = source_layout(case.cfg, megatron=got.megatron, **STATED[key])
    check_stated(got, stated)  # raises naming each differing field
    ranks = [tuple(rank) for r in results for rank in r["ranks"]]
    assert sorted(ranks) == sorted(tuple(r) for r in stated.ranks())  # each coordinate exactly once
    built = {tuple(rank): {n: math.prod(s) for n, s in shapes.items()}
             for r in results for rank, shapes in zip(r["ranks"], r["shapes"])}
    assert built == _expected_sizes(case.cfg, got)


def _expected_sizes(cfg: dict, layout: SourceLayout) -> dict[tuple, dict[str, int]]:
    """Every rank's parameters and their elements under ``layout``, from the independent reference
    planner (tests/reference_planner.py: Megatron's conventions restated, none of megarefit's
    geometry; it plans legacy GroupedMLP on the [E_local, a, b] view, hence elements, not shapes).
    MTP layers, which it does not plan, restated here from Megatron-Core's
    ``MultiTokenPredictionLayer``: on the last stage, after its decoder layers, a decoder layer
    of the next index (planned as one more layer of that stage, then renamed ``mtp.layers.{i}.``
    + ``transformer_layer.`` / ``mtp_model_layer.`` from 0.17), and its own ``enorm`` /
    ``hnorm`` / ``final_layernorm`` ``[hidden]`` and ``eh_proj`` ``[hidden / tp, 2 hidden]``; and
    the last stage embeds the tokens the MTP layer predicts from, so it holds the embedding too
    (``[padded vocab / tp, hidden]``)."""
    mtp, last = layout.mtp_layers, layout.pp - 1
    stages = tuple(n + (mtp if s == last else 0) for s, n in enumerate(layout.stage_layers))
    plain = Layout(layout.tp, layout.pp, layout.ep, layout.etp, layout.padded_vocab_size, stages,
                   layout.layer_spec, layout.expert_layout)
    sources, _, _ = reference_megatron_to_hf({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + mtp}, plain,
                                             "float32")
    inner = "transformer_layer." if megatron_series() < (0, 17) else "mtp_model_layer."
    out: dict[tuple, dict[str, int]] = {}
    for ref, meta in sources.items():
        name, rank = ref.name, tuple(ref.rank)
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if mtp and rank[1] == last and m and int(m[1]) >= layout.stage_layers[last]:
            name = f"mtp.layers.{int(m[1]) - layout.stage_layers[last]}.{inner}{m[2]}"
        out.setdefault(rank, {})[name] = math.prod(meta.shape)
    hidden = cfg["hidden_size"]
    for rank in (r for r in out if r[1] == last):
        for i in range(mtp):
            own = {"enorm.weight": hidden, "hnorm.weight": hidden, "final_layernorm.weight": hidden,
                   "eh_proj.weight": hidden // layout.tp * 2 * hidden}
            out[rank].update({f"mtp.layers.{i}.{n}": k for n, k in own.items()})
        if mtp:
            out[rank]["embedding.word_embeddings.weight"] = layout.padded_vocab_size // layout.tp * hidden
    return out


def test_ddp_and_float16_wrappers_are_seen_through(read):
    """Megatron's own nesting, DDP(Float16Module(model)): the same layout and ranks as the bare
    model, the DDP wrapper kept for the param-gather check, the bf16 parameters served."""
    per_rank, _ = read
    for r in per_rank:
        assert r["wrapped-ddp"]["dtypes"] == ["torch.bfloat16"]
        assert r["wrapped-ddp"]["layouts"] == r["dense-tp2"]["layouts"]
        assert r["wrapped-ddp"]["ranks"] == r["dense-tp2"]["ranks"]
        assert r["wrapped-ddp"]["ddp"] == [True] and r["dense-tp2"]["ddp"] == [False]
        assert any("belong to a Megatron-Core DistributedDataParallel, which was not passed" in w
                   for w in r["unwrapped-warning"]), r["unwrapped-warning"]


def test_every_copy_serves_unless_asked_not_to(read):
    """At dp=2 both processes read coordinate (0, 0, 0), the data-parallel copy (rank 1) as copy 1
    (checked in the job against the coordinates every process reports); it serves as copy 1 under
    its own rendezvous keys and agent; with ``serve_copies=False`` it gets an empty PublisherGroup."""
    per_rank, _ = read
    assert [r["dp2"]["ranks"] for r in per_rank] == [[(0, 0, 0)], [(0, 0, 0, 1)]]
    assert [r["dp2"]["replica"] for r in per_rank] == [[False], [True]]
    assert per_rank[1]["dp2"]["publisher"] == ("PublisherGroup", False, 0)
    assert per_rank[1]["dp2"]["copy"] == ("Publisher", True, (0, 0, 0, 1), 2, "megarefit-trainer-0-0-0-1")
    assert all(r[c.key]["replica"] == [False] * len(r[c.key]["ranks"]) for r in per_rank for c in CASES)


def test_a_model_that_disagrees_is_refused(read):
    per_rank, _ = read
    for r in per_rank:
        assert r["wrong-hf-config"]["error"].startswith("LayoutError: config.num_layers=2 but the HF config has 4")
        assert "config.tensor_model_parallel_size=2 but parallel_state says 1" in r["wrong-grid"]["error"]
        assert "got 1 model chunk(s); Megatron's virtual pipeline size is 2" in r["one-chunk-of-two"]["error"]
    assert per_rank[0]["one-stage-refuses"]["error"].startswith("LayoutError: pipeline rank 1 refused its model")
    assert "got 1 model chunk(s)" in per_rank[1]["one-stage-refuses"]["error"]


def test_a_stated_layout_that_differs_is_refused(read):
    per_rank, _ = read
    for r in per_rank:  # stated without megatron= (the version this process imported, flags unread)
        assert r["stated-right"] is None
        assert r["stated-wrong"].startswith("LayoutError: the stated layout disagrees with the Megatron model: tp: "
                                            "stated 1, the model has 2")
    got = SourceLayout.from_dict(per_rank[0]["moe-tp2-ep2-etp1"]["layouts"][0])
    stated = source_layout(_case("moe-tp2-ep2-etp1").cfg, tp=2, ep=2, megatron=got.megatron)  # etp left at tp
    with pytest.raises(LayoutError, match=r"etp: stated 2, the model has 1"):
        check_stated(got, stated)
    with pytest.raises(LayoutError, match=r"tp: stated 1, the model has 2.*padded_vocab_size"):
        check_stated(got, dataclasses.replace(stated, tp=1, etp=1, padded_vocab_size=got.padded_vocab_size + 1))


def test_vpp_chunks_are_served_as_one_group(read):
    """Each process's two chunks: one PublisherGroup of two Publishers at virtual stages p and
    p + 2; a receiver pulls all four stages and gets the HF tensors the reference sharder puts
    the chunks' parameters back into."""
    per_rank, pulled = read
    assert [r["group"] for r in per_rank] == [{"type": "PublisherGroup", "ranks": [(0, 0, 0), (0, 2, 0)]},
                                             {"type": "PublisherGroup", "ranks": [(0, 1, 0), (0, 3, 0)]}]
    shards = {tuple(rank): params for r in per_rank for rank, params in zip(r["vpp"]["ranks"], r["vpp"]["params"])}
    want = unshard(shards, pulled, lambda hf: reference_shards(hf, DENSE, tp=1, pp=4))
    assert pulled.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(pulled[name], t), name


def test_stages_agree_on_what_their_names_cannot_tell():
    """A stage of dense layers fits any expert layout, one without fused norms either layer spec:
    the stage that can tell decides for all; two that tell differently are refused, naming them."""
    assert agree([(0, frozenset({"local", "te"}), None), (1, frozenset({"te"}), "te_grouped")]) == ("te", "te_grouped")
    assert agree([(0, frozenset({"local", "te"}), None)]) == ("local", "sequential")
    with pytest.raises(LayoutError, match=r"stage 0: \['local'\] / sequential; stage 1: \['local'\] / legacy_grouped"):
        agree([(1, frozenset({"local"}), "legacy_grouped"), (0, frozenset({"local"}), "sequential")])
    with pytest.raises(LayoutError, match="disagree on the layer spec"):
        agree([(0, frozenset({"local"}), None), (1, frozenset({"te"}), None)])


def test_fully_sharded_wrappers_are_refused():
    class FullyShardedDataParallel(torch.nn.Module):  # Megatron FSDP's class name; its params are sub-shards
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(LayoutError, match="FullyShardedDataParallel: fully sharded data parallelism"):
        unwrap(FullyShardedDataParallel(torch.nn.Linear(2, 2)))


def test_an_assumed_release_reads_an_unverified_one(monkeypatch):
    """``$MEGAREFIT_ASSUME_MEGATRON`` reaches the record from_megatron reads (as MegatronCore.detect)."""
    model = torch.nn.Linear(2, 2)
    model.config = MLATransformerConfig.__new__(MLATransformerConfig)  # flags read by attribute; none set
    real = megatron.core.__version__
    monkeypatch.setattr(megatron.core, "__version__", "0.16.9")
    with pytest.raises(UnverifiedMegatronError, match="0.16.9"):
        megatron_core_of(model)
    monkeypatch.setenv("MEGAREFIT_ASSUME_MEGATRON", real)
    assert megatron_core_of(model).assume == real

