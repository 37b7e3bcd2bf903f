"""End to end into a real vLLM engine on CPU (vllm-cpu), over real NIXL, from real Megatron-Core.

Two Megatron-Core trainer processes (TP=2, Qwen3-style tiny config, tied
embeddings) serve three weight versions. A vLLM engine in this process refits
version 1 through the worker extension (sharded, ``direct=True``), version 2 through vLLM's
native weight-transfer API (backend "megarefit"), version 3 through the extension again
(warm path, prefetched: its linear layers packed off the pause, the norms copied), inside the
colocated lifecycle: ``sleep(level=1)`` -> ``wake_up(["weights"])``
-> refit -> ``wake_up(["kv_cache"])`` (on vllm-cpu sleep and wake-up move no memory, they
only pause and resume the engine: what this proves is the order of calls), then the
receiver gives its arena back (``megarefit_release_memory``). After each, greedy generation must equal HF transformers loaded
with that version's trainer snapshot (token ids and chosen-token logprobs). Then
a refit that fails (version skew, a dead trainer) must leave vLLM on version 3.
The engine has a real (BPE) tokenizer: after each refit its prompt logprobs of a text prompt
must equal the Megatron trainer's own forward logprobs on the same tokens, over the whole
vocabulary (train/infer mismatch; max / mean |delta| and token-level KL reported); and the
same in bf16, with bf16 trainers (the CPU harness in bfloat16) and a bf16 engine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from reference import hf_checkpoint_state, reference_shards, unshard  # noqa: E402
from vllm_helpers import (  # noqa: E402
    EXT,
    PROMPT_TEXT,
    PROMPTS,
    e2e_config,
    initial_checkpoint,
    same_generation,
    vllm_prompt_logprobs,  # noqa: E402
)
from vllm_helpers import hf_generate as _hf_generate  # noqa: E402
from vllm_helpers import vllm_generate as _vllm_generate  # noqa: E402

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.integrations.hf import save_checkpoint  # noqa: E402
from megarefit.online import VersionMismatchError  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402
from megarefit.transport.nixl_agent import TransferError  # noqa: E402

pytestmark = pytest.mark.megatron


@contextlib.contextmanager
def _reload_log():
    """Every record vLLM's layerwise-reload logger (the engine runs in this process) hands its
    handlers meanwhile, each as (level, message); no megarefit filter on it to begin with (one left
    by an earlier module's engine would hide what this refit's own path installs)."""
    from vllm.logger import init_logger

    from megarefit.integrations.vllm_install import RELOAD_LOGGER, ExpectedUnloaded

    log = init_logger(RELOAD_LOGGER)
    for old in [f for f in log.filters if isinstance(f, ExpectedUnloaded)]:
        log.removeFilter(old)
    seen: list[tuple[int, str]] = []
    handler = logging.Handler(logging.NOTSET)
    handler.emit = lambda record: seen.append((record.levelno, record.getMessage()))
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from vllm.config import WeightTransferConfig

    from megarefit.integrations.vllm import register

    register()  # the entry point does this in vLLM's own processes; explicit here for in-process use
    cfg = e2e_config()
    job = "vllm-e2e"
    rdzv = Rendezvous.serve(job=job)
    ckpt = tmp_path_factory.mktemp("initial")
    tokenizer, initial = initial_checkpoint(ckpt, cfg)  # a real tokenizer: the engine tokenizes PROMPT_TEXT itself
    tokens = torch.tensor([tokenizer(PROMPT_TEXT).input_ids])  # what the trainers' own forward pass reads
    snapdir = tmp_path_factory.mktemp("snapshots")
    group = start_workers(serving_trainer_job, world_size=2,
                          args=(TrainerCase(job, cfg, 2, 1, tokens), ("127.0.0.1", rdzv.port, job), 4, 0.01,
                                str(snapdir)))
    llm = vllm.LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=128, max_logprobs=-1,
                   worker_extension_cls=EXT, weight_transfer_config=WeightTransferConfig(backend="megarefit"))
    out = {"initial": _vllm_generate(llm), "initial_hf": _hf_generate(initial), "reports": {}, "prompt": {},
           "tokens": tokens[0].tolist()}

    with _reload_log() as out["reload_log"]:  # the extension's first refit, before any engine call
        llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 120.0),
                           kwargs={"sharded": True, "direct": True})
        out["reports"][1] = llm.collective_rpc("update_weights_from_megatron", args=(1,))[0]
    out[1] = _vllm_generate(llm)
    out["prompt"][1] = vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"])
    rdzv.mark_consumed(1)

    llm.init_weight_transfer_engine({"init_info": {"host": "127.0.0.1", "port": rdzv.port, "job": job}})
    # an update whose pull fails (version 99 is never published): vLLM ends the update, the
    # engine restores the layers it opened, version 1 keeps serving
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": 99, "timeout": 2.0}})
    except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
        out["update_error"] = exc
    out["after_failed_update"] = _vllm_generate(llm)
    acks = lambda: {rid: rdzv.acked(rid) for rid in rdzv.receivers()}  # noqa: E731
    try:  # both the extension and the engine hold a receiver: which one must be said
        llm.collective_rpc("megarefit_prefetch", kwargs={"version": 2})
    except Exception as exc:  # noqa: BLE001
        out["ambiguous_prefetch"] = exc
    llm.collective_rpc("megarefit_prefetch", kwargs={"version": 2, "path": "engine"})  # returns at once
    out["during_prefetch"] = _vllm_generate(llm)  # the engine keeps serving version 1
    out["prefetch_ready"] = _prefetched(llm, "engine")
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 2}})  # installs the prefetched arena
    out["acked_before_finish"] = acks()  # installed into the open reload, not yet acknowledged
    llm.finish_weight_update(weight_version="2")
    out["acked_after_finish"] = acks()
    out["prefetch_after"] = llm.collective_rpc("megarefit_prefetched", kwargs={"path": "engine"})[0]
    out[2] = _vllm_generate(llm)
    out["spans"] = [o.outputs[0].weight_versions for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], vllm.SamplingParams(max_tokens=4, temperature=0.0))]
    out["prompt"][2] = vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"])
    rdzv.mark_consumed(2)

    llm.sleep(level=1)  # colocated RL: the engine sleeps while the trainer steps
    llm.wake_up(tags=["weights"])  # weights back (GPU: KV cache still released), then refit into them
    llm.collective_rpc("megarefit_prefetch", kwargs={"version": 3, "path": "extension"})
    _prefetched(llm, "extension")
    out["reports"][3] = llm.collective_rpc("update_weights_from_megatron", args=(3,))[0]
    llm.wake_up(tags=["kv_cache"])
    out[3] = _vllm_generate(llm)
    out["prompt"][3] = vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"])
    out["released"] = llm.collective_rpc("megarefit_release_memory")[0]  # before the next sleep
    rdzv.mark_consumed(3)

    # faults: the trainers now serve version 4; ask for 99, then kill a trainer
    errors = []
    try:
        llm.collective_rpc("update_weights_from_megatron", args=(99, 2.0))
    except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
        errors.append(exc)
    out["after_skew"] = _vllm_generate(llm)
    group.kill(1)
    llm.collective_rpc("megarefit_prefetch", kwargs={"version": 4, "timeout": 10.0, "path": "extension"})
    out["dead_prefetch"] = _prefetched(llm, "extension")
    try:  # the failed prefetch is dropped: this update pulls again and fails the same way, the model untouched
        llm.collective_rpc("update_weights_from_megatron", args=(4, 10.0))
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    out["after_dead_peer"] = _vllm_generate(llm)
    out["errors"] = errors
    rdzv.mark_consumed(4)
    with pytest.raises(RuntimeError, match="worker 1"):
        group.join(timeout=120)
    snapshots = {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0.pt") for t in range(2)} for v in (1, 2, 3)}
    out["trainer_logits"] = {v: torch.load(snapdir / f"logits-v{v}-tp0.pt") for v in (1, 2, 3)}
    return cfg, out, snapshots


def _prefetched(llm, path: str) -> dict:
    """Poll the worker's prefetch until it is no longer pulling; its state."""
    while (state := llm.collective_rpc("megarefit_prefetched", kwargs={"path": path})[0])["phase"] == "pulling":
        time.sleep(0.01)
    return state


def _hf_model(cfg, shards, tmp_path):
    """HF transformers loaded (from_pretrained) with a version's trainer snapshot, translated
    offline -- an independent path from the NIXL refit into vLLM."""
    import transformers

    like = hf_checkpoint_state(cfg, tmp_path / "like")  # HF's own names and shapes (save_pretrained)
    hf = unshard(shards, like, functools.partial(reference_shards, cfg=cfg, tp=2, pp=1))  # no megarefit layout code
    save_checkpoint(tmp_path / "hf", cfg, hf)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


def _assert_same(vllm_out, hf_out):
    assert same_generation(vllm_out, hf_out), (vllm_out, hf_out)


def test_initial_engine_matches_its_checkpoint(run):
    _, out, _ = run
    _assert_same(out["initial"], out["initial_hf"])  # the comparison itself works on this engine


@pytest.mark.parametrize("version", [1, 2, 3])
def test_vllm_matches_hf_after_each_refit(run, version, tmp_path):
    cfg, out, snapshots = run
    want = _hf_generate(_hf_model(cfg, snapshots[version], tmp_path))
    _assert_same(out[version], want)
    assert out[version] != out["initial"]  # the refit really changed the engine's weights


def test_an_extension_refit_logs_no_failed_to_load_warning(run):
    """The worker extension's own path (init_megarefit, then a refit, no weight-transfer engine
    call yet) quiets vLLM's "Failed to load weights" for the layers no refit loads (the rotary
    cache, the tied head): each is logged, demoted to DEBUG and explained, none at WARNING. After
    the extension's and the engine's refits, vLLM's reload logger holds one such filter."""
    _, out, _ = run
    failed = [(level, msg) for level, msg in out["reload_log"] if "Failed to load weights" in msg]
    assert failed, "vLLM's layerwise reload logged no 'Failed to load weights' at all: the test sees nothing"
    assert all(level == logging.DEBUG and "(expected:" in msg for level, msg in failed), failed
    from megarefit.integrations.vllm_install import RELOAD_LOGGER, ExpectedUnloaded

    filters = [f for f in logging.getLogger(RELOAD_LOGGER).filters if isinstance(f, ExpectedUnloaded)]
    assert len(filters) == 1, filters  # installed by init_megarefit and every engine update: one, replaced


def test_engine_follows_vllms_update_lifecycle(run):
    """The weight-transfer engine: a failed pull inside start/update ends the update with the
    server healthy on its previous version (vLLM ends the update on an error; the engine
    restores what it opened) and the error says why; a version is acknowledged to the
    trainers at finish_weight_update, not before."""
    _, out, _ = run
    assert isinstance(out["update_error"], VersionMismatchError) and "99" in str(out["update_error"])
    _assert_same(out["after_failed_update"], out[1])
    before, after = out["acked_before_finish"], out["acked_after_finish"]
    newly = [rid for rid in after if after[rid] == 2 and before.get(rid) != 2]
    assert len(newly) == 1, (before, after)


def test_a_prefetch_serves_meanwhile_and_installs_without_pulling(run):
    """Version 2 was prefetched through the weight-transfer engine's receiver while the engine
    kept serving version 1 (exactly); the update then took it (nothing left prefetched), the
    engine serves version 2 (test_vllm_matches_hf_after_each_refit) and vLLM labels the tokens
    with it. With two receivers in the worker, a prefetch must say which."""
    _, out, _ = run
    assert "pass path='engine' or path='extension'" in str(out["ambiguous_prefetch"])
    _assert_same(out["during_prefetch"], out[1])
    assert (out["prefetch_ready"]["phase"], out["prefetch_ready"]["pulled"]) == ("ready", 2), out["prefetch_ready"]
    assert out["prefetch_after"] is None
    assert all([(s.version, s.start, s.end) for s in spans] == [("2", 0, 4)] for spans in out["spans"]), out["spans"]


def test_warm_refit_registers_nothing_new(run):
    _, out, _ = run
    r1, r3 = out["reports"][1], out["reports"][3]
    assert r1["cold"] and not r3["cold"]
    for key in ("registrations", "registered_bytes", "remote_agents", "dlists", "xfers", "plans_built"):
        assert r3["counters"][key] == r1["counters"][key], key
    # the whole share again (sharded, one worker: the trainers' bytes less their vocab padding)
    assert r3["bytes_moved"] == r1["bytes_moved"] > 0.99 * r3["model_bytes"] and r3["refit"] == "full"
    assert set(r3["seconds"]) == {"discover", "version", "plan", "prepare", "pull", "pull.read", "pull.scratch", "fence", "load"}


def test_a_prefetched_extension_refit_packs_linear_layers_off_the_pause(run):
    """Version 3 was prefetched through the extension's receiver (sharded, ``direct=True``): vLLM's
    linear layers, embedding and tied LM head were processed on the prefetch thread and the
    norms copied, so the install ran no layer through vLLM's reload; it serves as HF with
    version 3 (the tests above)."""
    cfg, out, _ = run
    r1, r3 = out["reports"][1], out["reports"][3]
    assert r1["shadow_layers"] == 0 and not r1["prefetched"], r1
    assert r3["prefetched"] and r3["shadow_error"] is None and r3["copied_tensors"] > 0, r3
    assert r3["shadow_layers"] == 4 * cfg["num_hidden_layers"] + 2, r3


def test_release_memory_gives_the_arena_back(run):
    _, out, _ = run
    assert out["released"] == out["reports"][3]["peak_extra_bytes"] > 0


def test_failed_refits_leave_the_previous_weights(run):
    _, out, _ = run
    skew, dead = out["errors"]
    assert isinstance(skew, VersionMismatchError) and "version 99" in str(skew)
    assert isinstance(dead, TransferError) and "megarefit-trainer-1-0-0" in str(dead)
    assert out["dead_prefetch"]["phase"] == "failed" and "megarefit-trainer-1-0-0" in out["dead_prefetch"]["error"]
    assert out["after_skew"] == out[3] and out["after_dead_peer"] == out[3]


@pytest.mark.parametrize(("moe_intermediate_size", "sharded", "streamed"),
                         [(48, False, False)], ids=["ffn48"])  # ffn64 (run by hand): the silent case
def test_moe_refit_into_vllm_matches_hf(tmp_path, moe_intermediate_size, sharded, streamed):
    """Qwen3-MoE, two real Megatron trainer processes at EP=2 -> NIXL -> vLLM (CPU).
    Version 1 through the worker extension, version 2 through the weight-transfer
    API; after each, vLLM's greedy tokens + logprobs equal HF transformers loaded
    (from_pretrained) with that version's trainer snapshot.

    vllm-cpu 0.32.0 skips the CPU expert pad + prepack on reload: with
    ``moe_intermediate_size=48`` (padded to 64 by its kernel) that raised a shape
    mismatch, with 64 (no padding) it silently served unpacked weights as packed.
    Both fail without :func:`megarefit.integrations.vllm._cpu_moe_reload` (the same fix; CI runs
    48, ``python tests/vllm_moe_scenario.py DIR 64`` the other).
    With ``moe_intermediate_size=48`` version 2 is sharded (``engine-sharded``): the worker's own
    vLLM-format shards. ``sharded`` (the scenario's option): both refits pull the worker's own
    vLLM-format shards (``qkv_proj``,
    ``experts.routed_experts.w13_weight``, ...) and install them through vLLM's layerwise
    reload, which re-runs the CPU linear repack and expert pad + prepack. ``streamed`` (the
    scenario's option, run by hand: ``... 48 sharded streamed``): both refits stream groups of
    layers through a bounded ring. In CI, streamed refits into a real engine run in
    ``test_a_torn_streamed_refit_is_pulled_again_and_a_mix_is_never_served`` (weight-transfer
    API and extension) and, for MoE at vLLM tp=2, in test_vllm_install.py (the install path).
    (Its own process: one vLLM engine per process.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("vllm_moe_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(moe_intermediate_size)]
                          + (["sharded"] if sharded else []) + (["streamed"] if streamed else [])
                          + (["engine-sharded"] if moe_intermediate_size == 48 else []),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["initial_ok"], "the comparison itself must work on this engine"
    # one worker, no expert parallelism: vLLM's routed-experts layers are found, every expert is pulled
    assert result["experts"] == {"owned": None, "routed_layers": 2, "ep_layers": 0}
    report = result["report"]
    assert (report["target"] == "VllmTarget(tp=1, rank=0, dp=1, dp_rank=0, expert_parallel=False, "
            "expert_placement='linear', expert_map=None, vocab_padding=64)") == sharded, report
    # 3 + per layer: full HF tensors 2 norms, q k v o, q/k norm, gate, 4 experts x 3 = 21;
    # sharded 2 norms, qkv_proj, o_proj, q/k norm, gate, w13, w2 = 9
    assert report["tensors"] == 3 + 2 * (9 if sharded else 21), report
    assert report["install"] == ("streamed" if streamed else "staged"), report
    engine = result["engine_report"]
    engine_sharded = sharded or moe_intermediate_size == 48
    assert (engine["target"] is not None) == engine_sharded and engine["version"] == 2, engine
    assert engine["tensors"] == 3 + 2 * (9 if engine_sharded else 21), engine
    if streamed:  # several groups, and never more extra memory than the budget
        assert report["groups"] >= 3 and report["peak_extra_bytes"] <= 640_000, report
    for version in ("1", "2"):
        assert result["vllm"][version] != result["vllm"]["initial"], "the refit must change the engine's weights"
        assert same_generation(result["vllm"][version], result["hf"][version]), (version, result)


def test_a_torn_streamed_refit_is_pulled_again_and_a_mix_is_never_served(tmp_path):
    """Trainer ranks step mid-cycle during streamed sharded refits into a real vLLM engine
    (scenario in tests/vllm_torn_scenario.py): the torn cycle is pulled and installed again
    and vLLM then generates as HF with the new weights; with ``retries=0`` the update raises
    PartialUpdateError saying the model holds a mix, a refit before any request mends it, and
    a request that comes first is refused rather than served from mixed weights. Checksums are
    on throughout (trainers publish them, both receivers verify every box): every byte of a
    whole cycle is checked, and a torn cycle's mismatches are retried, not raised. The extension
    writes directly (``direct=True``): after its first cycle, what vLLM kept byte for byte is
    READ in place, torn cycles included. The trainers publish deltas: after a whole cycle, a sparse
    step patches those parameters with only the changed elements, and vLLM generates as HF."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("vllm_torn_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first, retried, mended = result["first"], result["retried"], result["mended"]
    for report in (result["engine"], first, retried, mended):  # the weight-transfer API, then the extension
        assert report["install"] == "streamed" and report["groups"] >= 3, report
        assert report["checked_bytes"] == report["bytes_moved"] and report["unchecked_bytes"] == 0, report
    assert first["direct_bytes"] == 0 and retried["direct_bytes"] > 0 and mended["direct_bytes"] > 0, (first, retried)
    for report in (result["engine"], first):
        assert report["version"] == 1 and report["peak_extra_bytes"] <= 1_200_000 and report["retries"] == 0, report
    assert result["ok1"] and result["ok2"] and result["ok3"], result
    assert retried["version"] == 2 and retried["retries"] == 1, retried
    for gave_up in (result["gave_up"], result["gave_up_again"]):
        assert gave_up.startswith("PartialUpdateError") and "mix of versions" in gave_up, gave_up
    assert mended["version"] == 3 and mended["retries"] == 0, mended
    assert "served_mix" not in result and result["refused"].startswith("PartialUpdateError"), result
    assert "holds a mix of weight versions" in result["refused"], result
    # trainers publish deltas: after a whole cycle, a sparse step patches vLLM's direct parameters
    # in place (the rest streams), and vLLM generates as HF with the new weights
    again, delta = result["mended"], result["delta"]
    assert again["refit"] == "full" and (delta["refit"], delta["delta_base"]) == ("delta", 3), (again, delta)
    assert delta["direct_bytes"] > 0 and delta["bytes_moved"] < again["bytes_moved"], delta
    assert delta["checked_bytes"] == again["checked_bytes"] and result["ok4"], (delta, result)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_owned_experts_follow_vllm_placement(strategy):
    """The expert set a vLLM EP worker pulls comes from vLLM's own expert map
    (``determine_expert_map``, as its routed-experts layers hold it in ``_expert_map``):
    linear placement gives rank r experts [r*E/ep, (r+1)*E/ep), round robin {r, r+ep, ...}."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from megarefit.integrations.vllm import owned_experts

    experts, ep = 8, 4
    for rank in range(ep):
        model = torch.nn.Sequential()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.use_ep = True
            layer.register_buffer("_expert_map", determine_expert_map(ep, rank, experts, strategy)[1],
                                  persistent=False)
            model.append(layer)
        want = set(range(rank * 2, rank * 2 + 2)) if strategy == "linear" else set(range(rank, experts, ep))
        assert owned_experts(model) == want
    assert owned_experts(torch.nn.Linear(2, 2)) is None  # no routed-experts layer: every expert


def _parity(trainer_logits: torch.Tensor, served: torch.Tensor, vocab: int, record, tag: str
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """The trainer's log-softmax (fp64, ``[len - 1, vocab]``) and max / mean |delta logprob|
    and token-level KL(trainer || vLLM) against vLLM's ``served`` prompt logprobs, recorded."""
    trainer = torch.log_softmax(trainer_logits[0, :-1, :vocab].double(), -1)
    assert served.shape == trainer.shape and torch.isfinite(served).all()
    delta = (trainer - served).abs()
    kl = (trainer.exp() * (trainer - served)).sum(-1)
    report = {"max_abs_delta": float(delta.max()), "mean_abs_delta": float(delta.mean()),
              "max_token_kl": float(kl.max()), "mean_token_kl": float(kl.mean())}
    for key, value in report.items():
        record(f"{tag}_{key}", value)
    print(f"{tag}: {report}")
    return trainer, report


@pytest.mark.parametrize("version", [1, 2, 3])
def test_served_logprobs_equal_the_trainers_own(run, version, record_property):
    """Train/infer mismatch, as RL users watch it: after the refit of ``version``, vLLM's
    prompt logprobs of a text prompt (tokenized by the engine's own BPE tokenizer) against the
    Megatron trainer's forward pass on the same token ids (the logits its last stage computed
    for that version), over the whole vocabulary at every position. Max and mean |delta
    logprob| and the token-level KL(trainer || vLLM) are reported; both fail past a tolerance
    from the dtype: |delta| <= sqrt(eps) (fp32: 3.5e-4); KL <= V * eps (fp32, V = 500: 6e-5),
    the first-order error of normalizing a softmax over V entries, which KL inherits."""
    cfg, out, _ = run
    ids, served = out["prompt"][version]
    assert ids == out["tokens"]  # the engine tokenized the text as the trainer's tokens were made
    _, report = _parity(out["trainer_logits"][version], served, cfg["vocab_size"], record_property, f"v{version}")
    eps = torch.finfo(torch.float32).eps
    assert report["max_abs_delta"] <= eps ** 0.5 and report["max_token_kl"] <= cfg["vocab_size"] * eps, report
    for other in {1, 2, 3} - {version}:  # the check can fail: another version's weights are far outside it
        logits = out["trainer_logits"][other][0, :-1, :cfg["vocab_size"]].double()
        assert (torch.log_softmax(logits, -1) - served).abs().max() > 100 * eps ** 0.5


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """Logprob parity in bf16, as most RL runs train and serve: bf16 trainers, a bf16 engine."""
    cfg = e2e_config()
    job = "vllm-bf16"
    rdzv = Rendezvous.serve(job=job)
    ckpt = tmp_path_factory.mktemp("initial")
    tokenizer, _ = initial_checkpoint(ckpt, cfg)
    tokens = torch.tensor([tokenizer(PROMPT_TEXT).input_ids])
    snapdir = tmp_path_factory.mktemp("snapshots")
    group = start_workers(serving_trainer_job, world_size=2,
                          args=(TrainerCase(job, cfg, 2, 1, tokens, dtype="bfloat16"), ("127.0.0.1", rdzv.port, job),
                                1, 0.01, str(snapdir)))
    llm = vllm.LLM(model=str(ckpt), dtype="bfloat16", enforce_eager=True, max_model_len=128, max_logprobs=-1,
                   worker_extension_cls=EXT)
    out = {"before": vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"]), "tokens": tokens[0].tolist()}
    llm.collective_rpc("init_megarefit", args=("127.0.0.1", rdzv.port, job, 120.0))
    out["report"] = llm.collective_rpc("update_weights_from_megatron", args=(1,))[0]
    out["after"] = vllm_prompt_logprobs(llm, PROMPT_TEXT, cfg["vocab_size"])
    rdzv.mark_consumed(1)
    group.join(timeout=120)
    out["trainer"] = torch.load(snapdir / "logits-v1-tp0.pt")
    return cfg, out


def test_bf16_served_logprobs_equal_the_trainers_own(bf16_run, record_property):
    """bf16 on both sides: max |delta logprob| <= sqrt(eps_bf16) (0.088), token KL <= eps_bf16 / 2
    (0.0039, KL of logprob errors of that size) plus the fp32 normalization term V * eps_fp32;
    the served model before the refit is far outside it (the check can fail)."""
    cfg, out = bf16_run
    ids, served = out["after"]
    assert ids == out["tokens"] and out["report"]["version"] == 1
    trainer, report = _parity(out["trainer"], served, cfg["vocab_size"], record_property, "bf16")
    eps = torch.finfo(torch.bfloat16).eps
    kl_tol = eps / 2 + cfg["vocab_size"] * torch.finfo(torch.float32).eps
    assert report["max_abs_delta"] <= eps ** 0.5 and report["max_token_kl"] <= kl_tol, report
    assert (trainer - out["before"][1]).abs().max() > 10 * eps ** 0.5
