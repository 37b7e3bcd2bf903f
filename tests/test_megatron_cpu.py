"""Real Megatron-Core on CPU (2 gloo processes) against real HF transformers.

For Llama-, Qwen2- and Qwen3-style tiny configs (shrunk from the real configs)
at TP=1, TP=2 and PP=2: Megatron forward logits == HF forward logits after
``megatron_to_hf`` (saved as safetensors and loaded with ``from_pretrained``, so
HF's own loader checks every on-disk name), and the classifier agrees with the
spec tables on the live model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megarefit  # noqa: E402
from conftest import hf_model_from, tiny_config  # noqa: E402
from megarefit.integrations.hf import hf_logits  # noqa: E402
from megarefit.demo.trainer_jobs import TrainerCase  # noqa: E402
from megarefit.demo.workers import run_workers  # noqa: E402
from megarefit.demo.megatron_cpu import harness_megatron  # noqa: E402

pytestmark = pytest.mark.megatron
MEGATRON = harness_megatron()  # the installed megatron-core, with the harness's layout flags

FAMILIES = {"llama": "Llama-3.1-8B", "qwen2": "Qwen2.5-0.5B", "qwen3": "Qwen3-0.6B"}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
TOKENS = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(7))
CASES = {f"{fam}-tp{tp}-pp{pp}": (fam, tp, pp) for fam in FAMILIES for tp, pp in LAYOUTS}


def _config(fam):
    return tiny_config(FAMILIES[fam])


@pytest.fixture(scope="module")
def runs():
    import megatron_jobs

    cases = [TrainerCase(key, _config(fam), tp, pp, TOKENS) for key, (fam, tp, pp) in CASES.items()]
    per_rank = run_workers(megatron_jobs.job, world_size=2, args=(cases, _config("qwen3")), timeout=900)
    out = {}
    for key in CASES:
        entries = [r[key] for r in per_rank if r[key]]
        out[key] = {
            "shards": {e["coord"]: e["params"] for e in entries},
            "logits": next(e["logits"] for e in entries if e["logits"] is not None),
            "problems": [p for e in entries for p in e["problems"]],
        }
    out["classifier"] = per_rank[0]["classifier"]
    return out


_hf_model_from = hf_model_from


@pytest.mark.parametrize("key", list(CASES))
def test_megatron_logits_equal_hf_logits(runs, key, tmp_path):
    fam, tp, pp = CASES[key]
    cfg = _config(fam)
    run = runs[key]
    assert run["problems"] == []  # classifier agrees with the table on every rank
    hf = megarefit.megatron_to_hf(run["shards"], cfg, tp=tp, pp=pp, megatron=MEGATRON)
    if cfg.get("tie_word_embeddings"):
        assert "lm_head.weight" not in hf
    model = _hf_model_from(hf, cfg, tmp_path)
    want = run["logits"][..., : cfg["vocab_size"]]
    got = hf_logits(model, TOKENS)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 0.1  # a real signal, not all zeros


def test_round_trip_of_live_shards_is_exact(runs):
    """megatron -> hf -> megatron gives the live shards back bit for bit, except Megatron's
    vocab padding rows (random in a live model), which come back zero."""
    cfg = _config("qwen3")
    shards = runs["qwen3-tp2-pp1"]["shards"]
    again = megarefit.hf_to_megatron(megarefit.megatron_to_hf(shards, cfg, tp=2, megatron=MEGATRON), cfg, tp=2,
                                     megatron=MEGATRON)
    assert again.keys() == shards.keys()
    real_rows = {(0, 0, 0): 128, (1, 0, 0): 250 - 128}  # padded vocab 256 over tp=2
    for rank, params in shards.items():
        assert again[rank].keys() == params.keys()
        for name, t in params.items():
            if name == "embedding.word_embeddings.weight":
                n = real_rows[rank]
                assert torch.equal(again[rank][name][:n], t[:n])
                assert not again[rank][name][n:].any()
            else:
                assert torch.equal(again[rank][name], t), (rank, name)


def test_naive_gated_concat_breaks_logits(runs, tmp_path):
    """Negative control: treating TP fc1 shards as [gate; up] after plain concatenation
    (the mistake DESIGN.md warns about) must be caught by the logits comparison."""
    cfg = _config("llama")
    run = runs["llama-tp2-pp1"]
    hf = dict(megarefit.megatron_to_hf(run["shards"], cfg, tp=2, megatron=MEGATRON))
    fc1 = torch.cat([run["shards"][(t, 0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"] for t in range(2)])
    hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"] = fc1.chunk(2)
    got = hf_logits(_hf_model_from(hf, cfg, tmp_path), TOKENS)
    assert (got - run["logits"][..., :250]).abs().max().item() > 1e-2


def test_classifier_on_live_model(runs):
    c = runs["classifier"]
    rows = {name: rest for name, *rest in c["wrapped"]}
    # module. prefixes stripped; three independent sources agree
    cls, mode, attr, role, problem = rows["decoder.layers.1.self_attention.linear_proj.weight"]
    assert (cls, mode.value, attr.value, role.value, problem) == ("RowParallelLinear", "row", "row", "row", None)
    cls, mode, attr, role, problem = rows["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (cls, mode.value, attr.value, role.value) == ("ColumnParallelLinear", "column", "column", "qkv")
    cls, mode, attr, role, problem = rows["embedding.word_embeddings.weight"]
    assert (cls, mode.value, attr.value, role.value) == ("VocabParallelEmbedding", "column", "column", "vocab")
    assert rows["decoder.layers.0.self_attention.q_layernorm.weight"][3].value == "replicated"
    assert all(r[4] is None for r in rows.values())
    # a wrong override is caught by the table and by Megatron's own partition_dim
    assert c["overridden_problems"] == sorted(
        f"decoder.layers.{i}.{m}.weight" for i in range(4) for m in ("self_attention.linear_proj", "mlp.linear_fc2"))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in c["raised"] and "replicated" in c["raised"]


def test_layout_ranks_match_megatron_rank_generator():
    """The (tp, pp, ep) coordinates a layout expects are exactly those Megatron-Core's own
    RankGenerator forms (decoder grid tp/dp/pp, expert grid etp/ep/edp/pp, order
    "tp-cp-ep-dp-pp"), including etp=1 < tp where some (tp, ep) pairs never exist."""
    from megatron.core.parallel_state import RankGenerator

    from megarefit import SourceLayout

    for tp, pp, ep, etp, dp in [(2, 1, 2, 1, 2), (2, 2, 4, 1, 4), (4, 1, 2, 1, 2), (2, 1, 2, 2, 2), (1, 2, 4, 1, 4),
                                (4, 1, 8, 1, 8), (2, 1, 1, 1, 3), (8, 1, 4, 1, 4)]:
        world = tp * pp * dp
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        coord = {}
        for kind, gen, dim in (("tp", dense, "tp"), ("pp", dense, "pp"), ("ep", expert, "ep")):
            for group in gen.get_ranks(dim):
                for i, r in enumerate(group):
                    coord.setdefault(r, {})[kind] = i
        want = {(c["tp"], c["pp"], c["ep"]) for c in coord.values()}
        layout = SourceLayout.build(tp=tp, pp=pp, ep=ep, etp=etp, padded_vocab_size=tp * 8, num_layers=pp)
        assert {tuple(r) for r in layout.ranks()} == want, (tp, pp, ep, etp, dp)
