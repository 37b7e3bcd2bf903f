"""Adapter-only LoRA into a running vLLM (vllm-cpu, in process), in memory (issue 61).

A tiny random Qwen3-architecture model is served by a vLLM engine with LoRA enabled and
megarefit's worker extension. Two versions of a random PEFT LoRA adapter (``peft``, every
linear of every layer, nonzero ``lora_B``) are installed in memory under one name, the second
replacing the first without a restart. After each install, vLLM's greedy generation with the
returned ``LoRARequest`` must equal transformers + ``peft`` generating with the same adapter
(token ids, chosen-token logprobs within 1e-3), differ from the other version and from the base
model, and the base model (no LoRA request) must still generate as before. A prompt longer than a
KV block shows that the versioned ``lora_path`` keeps vLLM's prefix cache apart per version
(a request of the older version reuses that version's blocks). The oracle is checked by mutants
(scaling doubled, a module dropped) that must not match it. Refused: a module vLLM's LoRA does not
serve (the previous version keeps serving), a second name while the CPU LoRA cache is full of pinned
adapters, a vLLM internal that is missing (``VllmVersionError``), DoRA, a rank above
``max_lora_rank``, an engine without LoRA. A refit that would leave the workers on different
versions takes the adapter out of every worker: the coordination on a stand-in engine of two
workers (the one real worker here cannot disagree with itself), the removal on the real engine.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from vllm_helpers import EXT, PROMPTS, e2e_config, hf_generate, same_generation, vllm_generate  # noqa: E402

from megarefit.errors import BaseChangedError, MegarefitError  # noqa: E402
from megarefit.integrations.hf import build_hf_model, save_checkpoint  # noqa: E402
from megarefit.integrations.vllm_install import VllmVersionError, vllm_version  # noqa: E402
from megarefit.integrations.vllm_lora import (  # noqa: E402
    check_adapter,
    install_lora,
    lora_internals,
    plain_peft_config,
    refit_lora,
)
from megarefit.online.receiver.cycle import StaleVersionError  # noqa: E402
from megarefit.transport.nixl_agent import TransferError  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS}
LONG = [(7 * i) % 480 + 3 for i in range(40)]  # a full KV block (block_size=32: what vllm-cpu allows) and 8 more
ALL = [*PROMPTS, LONG]
NAME = "policy"


def peft_adapter(base: torch.nn.Module, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``base`` wrapped by ``peft`` with random factors (lora_B nonzero), and its PEFT state dict."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**CONFIG, lora_dropout=0.0))
    state = peft.get_peft_model_state_dict(model)
    g = torch.Generator().manual_seed(seed)
    peft.set_peft_model_state_dict(model, {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in state.items()})
    return model.eval(), {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def _mutants(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[dict, dict]]:
    """Wrong installs of an adapter, each of which the oracle must tell from the right one."""
    dropped = {k: v for k, v in tensors.items() if ".layers.0.self_attn.q_proj." not in k}
    return {"scaling doubled": (tensors, {**CONFIG, "lora_alpha": 2 * CONFIG["lora_alpha"]}),
            "q_proj of layer 0 dropped": (dropped, CONFIG)}


def base_and_adapters(ckpt) -> tuple[dict, torch.nn.Module, list]:
    """(config, the random 2-layer base saved as a checkpoint at ``ckpt``, two random PEFT adapters of it:
    ``(peft model, PEFT tensors)``): what these tests and the by-hand scenarios serve."""
    cfg = {**e2e_config(), "num_hidden_layers": 2}
    torch.manual_seed(0)
    base = build_hf_model(cfg).eval()
    save_checkpoint(ckpt, cfg, {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"})
    return cfg, base, [peft_adapter(base, seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("base")
    cfg, base, ((peft1, v1), (peft2, v2)) = base_and_adapters(ckpt)
    out = {"hf": {"base": hf_generate(base, ALL), 1: hf_generate(peft1, ALL), 2: hf_generate(peft2, ALL)},
           "v2_tensors": v2}
    llm = vllm.LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=128, block_size=32, enable_prefix_caching=True, max_num_seqs=4,
                   enable_lora=True, max_lora_rank=8, max_loras=1, worker_extension_cls=EXT)
    out["llm"] = llm
    out["base"] = vllm_generate(llm, ALL)
    before = {k: t.clone() for k, t in v1.items()}
    out["req1"] = install_lora(llm, NAME, v1, CONFIG, version=1)
    out["caller_tensors_kept"] = all(torch.equal(before[k], v1[k]) for k in before)
    out[1] = vllm_generate(llm, ALL, out["req1"])
    out["mutants"] = {}
    for i, (what, (tensors, config)) in enumerate(_mutants(v1).items()):
        out["mutants"][what] = vllm_generate(llm, PROMPTS, install_lora(llm, NAME, tensors, config, version=10 + i))
    out["req2"] = install_lora(llm, NAME, v2, peft2.peft_config["default"].to_dict(), version=2)  # PEFT's own
    out[2] = vllm_generate(llm, ALL, out["req2"])
    out["base_after"] = vllm_generate(llm, ALL)
    out["req1_after"] = vllm_generate(llm, ALL, out["req1"])  # version 1's request: version 2's weights
    out["versions"] = llm.collective_rpc("megarefit_lora_versions")
    out["refit"] = _refit_from_trainers(llm, cfg, v1, v2)
    return out


def _refit_from_trainers(llm, cfg, v1, v2):
    """Adapter-only refit cycles over megarefit's transport: tp-2 LoraPublishers serve v1's shards (CanonicalLoRA's
    layout, from ``peft_to_lora``), then v2's written inside the seqlock; ``refit_lora`` pulls each into the
    engine's workers (checksums verified) and installs it under the same name."""
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.parallel import SourceLayout
    from megarefit.online.store.rendezvous import SECRET_ENV, Rendezvous
    from megarefit.online.trainer.lora_publisher import LoraPublisher
    from megarefit.translate_peft import peft_to_lora

    job = f"vllm-lora-refit-{os.getpid()}"
    rdzv = Rendezvous.serve(job=job)
    saved, os.environ[SECRET_ENV] = os.environ.get(SECRET_ENV), rdzv.secret  # the workers' job secret
    try:
        dims = ModelDims.from_hf_config(cfg)
        layout = SourceLayout.build(tp=2, pp=1, padded_vocab_size=dims.padded_vocab_size(2), num_layers=dims.num_layers)
        shards1, shards2 = (peft_to_lora(v, CONFIG, cfg, tp=2, wrapper="canonical_lora") for v in (v1, v2))
        pubs = [LoraPublisher({n: x.clone() for n, x in shards1[t].items()}, cfg, rank=(t, 0, 0), layout=layout,
                              rendezvous=rdzv.channel(f"lora/{NAME}"), alpha=CONFIG["lora_alpha"],
                              agent_name=f"{job}-t{t}", checksums=True) for t in range(2)]
        for p in pubs:
            p.publish(21)
        out = {"req1": refit_lora(llm, NAME, "127.0.0.1", rdzv.port, job=job, verify_checksums=True)}
        out[1] = vllm_generate(llm, ALL, out["req1"])
        out["acked"] = pubs[0].wait_receivers(21, timeout=30)
        for p in pubs:
            with p.updating(22):  # the optimizer step on the adapter
                for n, x in shards2[p.rank.tp].items():
                    p.params[n].copy_(x)
        out["req2"] = refit_lora(llm, NAME, "127.0.0.1", rdzv.port, job=job, verify_checksums=True)
        out[2] = vllm_generate(llm, ALL, out["req2"])
        out["versions"] = llm.collective_rpc("megarefit_lora_versions")
        out["hook"] = _pulled_by_vllms_own_add(llm, pubs, shards1, rdzv.port, job)
        out["removed"] = _removed(llm)
        install_lora(llm, NAME, v2, CONFIG, version=2)  # the state the tests after these expect: v2, pinned
        return out
    finally:
        if saved is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = saved


def _removed(llm):
    """What never_a_mix does to a real engine: megarefit_remove_lora takes the adapter out of vLLM's manager."""
    from megarefit.integrations.vllm_lora import adapter_id

    before = set(llm.llm_engine.list_loras())
    removed = llm.collective_rpc("megarefit_remove_lora", kwargs={"name": NAME})
    return {"before": before, "after": set(llm.llm_engine.list_loras()), "id": adapter_id(NAME), "removed": removed,
            "versions": llm.collective_rpc("megarefit_lora_versions"),
            "again": llm.collective_rpc("megarefit_remove_lora", kwargs={"name": NAME})}


def _pulled_by_vllms_own_add(llm, pubs, shards, port, job):
    """What ``/v1/load_lora_adapter`` does over HTTP: vLLM's own ``add_lora`` of ``lora_path(NAME, 23)``,
    ``load_inplace``. The workers pull version 23 (v1's factors again) in vLLM's ``_load_adapter``; then an
    add of a version never published fails and version 23 keeps serving."""
    from megarefit.integrations.vllm_lora import adapter_id, lora_path

    llm.collective_rpc("megarefit_init_lora", kwargs={"host": "127.0.0.1", "port": port, "job": job, "timeout": 3.0,
                                                      "verify_checksums": True})
    for p in pubs:
        with p.updating(23):
            for n, x in shards[p.rank.tp].items():
                p.params[n].copy_(x)
    request = vllm.lora.request.LoRARequest(NAME, adapter_id(NAME), lora_path(NAME, 23), load_inplace=True)
    out = {"added": llm.llm_engine.add_lora(request), "acked": pubs[0].wait_receivers(23, timeout=30)}
    out[1] = vllm_generate(llm, ALL, request)
    missing = vllm.lora.request.LoRARequest(NAME, adapter_id(NAME), lora_path(NAME, 99), load_inplace=True)
    try:
        llm.llm_engine.add_lora(missing)
        out["missing"] = None
    except Exception as exc:  # noqa: BLE001 - vLLM re-raises the worker's error as it comes
        out["missing"] = f"{type(exc).__name__}: {exc}"
    out["after_missing"] = vllm_generate(llm, ALL, request)
    return out


def test_vllms_own_add_lora_pulls_a_megarefit_path_from_the_trainers(run):
    """The route /v1/load_lora_adapter takes: vLLM's add_lora of lora_path(name, version) pulls that version
    from the trainers inside vLLM's loader; a version that never comes is an error, the last one serves on."""
    hook = run["refit"]["hook"]
    assert hook["added"] and list(hook["acked"].values()) == ["acked"]
    assert same_generation(hook[1], run["hf"][1]), (hook[1], run["hf"][1])
    assert hook["missing"] is not None and "99" in hook["missing"], hook["missing"]
    assert same_generation(hook["after_missing"], run["hf"][1])


def test_remove_takes_the_adapter_out_of_vllms_manager(run):
    """megarefit_remove_lora (what a refit that would leave a mix does) on the real engine: the id leaves
    vLLM's own list_loras and the worker's version record; a second removal finds nothing."""
    r = run["refit"]["removed"]
    assert r["id"] in r["before"] and r["id"] not in r["after"], r
    assert r["removed"] == [True] and r["again"] == [False] and r["versions"] == [{}], r


def test_adapter_refit_cycles_from_trainers_generate_as_peft(run):
    """Version 21 (v1's factors) and 22 (v2's, written in the seqlock) pulled from tp-2 trainer ranks over NIXL,
    assembled into PEFT tensors by the adapter plan and installed: vLLM generates as transformers + peft."""
    refit = run["refit"]
    assert same_generation(refit[1], run["hf"][1]), (refit[1], run["hf"][1])
    assert same_generation(refit[2], run["hf"][2]), (refit[2], run["hf"][2])
    assert list(refit["acked"].values()) == ["acked"] and refit["versions"] == [{NAME: 22}]
    assert refit["req2"].lora_path.endswith("/v22") and refit["req1"].lora_path.endswith("/v21")


def test_base_model_unchanged(run):
    assert same_generation(run["base"], run["hf"]["base"])
    assert same_generation(run["base_after"], run["hf"]["base"])


def test_install_leaves_the_callers_tensors_alone(run):
    """vLLM folds the scaling into lora_B in place: on the caller's tensors (in-process engine)
    that would rescale the trainer's own adapter."""
    assert run["caller_tensors_kept"]


def test_version_1_generates_as_peft(run):
    assert same_generation(run[1], run["hf"][1]), (run[1], run["hf"][1])
    assert [t for t, _ in run[1]] != [t for t, _ in run["hf"]["base"]]


def test_version_2_replaces_version_1_without_restart(run):
    assert same_generation(run[2], run["hf"][2]), (run[2], run["hf"][2])
    for other in (run["hf"][1], run["hf"]["base"]):
        assert [t for t, _ in run[2]] != [t for t, _ in other]
    assert run["versions"] == [{NAME: 2}]
    assert run["req2"].lora_int_id == run["req1"].lora_int_id and run["req2"].lora_path != run["req1"].lora_path


def test_prefix_cache_kept_apart_per_version(run):
    """Version 2's request does not reuse the KV blocks version 1 computed for the long prompt
    (its tokens equal peft's above); version 1's request, served by version 2's weights, does."""
    stale = run["req1_after"]
    assert same_generation(stale[:len(PROMPTS)], run["hf"][2][:len(PROMPTS)])  # short prompts: no block cached
    assert not same_generation(stale[-1:], run["hf"][2][-1:])


@pytest.mark.parametrize("what", list(_mutants({})))
def test_oracle_tells_wrong_installs(run, what):
    assert not same_generation(run["mutants"][what], run["hf"][1][:len(PROMPTS)]), what


def test_unsupported_module_refused_and_previous_version_serves(run):
    bad = dict(run["v2_tensors"])
    bad["base_model.model.model.layers.1.self_attn.q_norm.lora_A.weight"] = torch.ones(8, 64)
    bad["base_model.model.model.layers.1.self_attn.q_norm.lora_B.weight"] = torch.ones(64, 8)
    with pytest.raises(MegarefitError, match=r"do not serve .*model\.layers\.1\.self_attn\.q_norm"):
        install_lora(run["llm"], NAME, bad, {**CONFIG, "target_modules": [*TARGETS, "q_norm"]}, version=3)
    assert same_generation(vllm_generate(run["llm"], PROMPTS, run["req2"]), run["hf"][2][:len(PROMPTS)])


def test_second_name_refused_while_the_cpu_cache_is_full_of_pinned_adapters(run):
    with pytest.raises(MegarefitError, match="max_cpu_loras=1 pinned adapters"):
        install_lora(run["llm"], "another-policy", run["v2_tensors"], CONFIG, version=1)
    assert same_generation(vllm_generate(run["llm"], PROMPTS, run["req2"]), run["hf"][2][:len(PROMPTS)])


@pytest.mark.parametrize(("module", "owner", "attr"), [("vllm.lora.lora_model", "LoRAModel", "from_lora_tensors"),
                                                     ("vllm.lora.model_manager", "LRUCacheLoRAModelManager",
                                                      "_pin_lora_in_cpu_cache")])
def test_missing_vllm_internal_refused(run, monkeypatch, module, owner, attr):
    import importlib

    monkeypatch.delattr(getattr(importlib.import_module(module), owner), attr)
    with pytest.raises(VllmVersionError, match=rf"vLLM {vllm_version()}: {owner} has no '{attr}'"):
        install_lora(run["llm"], NAME, run["v2_tensors"], CONFIG, version=3)
    monkeypatch.undo()
    assert same_generation(vllm_generate(run["llm"], PROMPTS, run["req2"]), run["hf"][2][:len(PROMPTS)])


def test_rank_above_max_lora_rank_refused_by_vllm_checks(run):
    big = {k: torch.zeros(16, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 16)
           for k, v in run["v2_tensors"].items()}
    with pytest.raises(MegarefitError, match="refused by vLLM's checks: LoRA rank 16 is greater than max_lora_rank 8"):
        install_lora(run["llm"], NAME, big, {**CONFIG, "r": 16}, version=3)


def test_adapter_checks_before_vllm():
    a, b = torch.zeros(8, 4), torch.zeros(4, 8)
    ok = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}
    assert [m.module for m in check_adapter(ok, CONFIG)] == ["model.layers.0.self_attn.q_proj"]
    with pytest.raises(MegarefitError, match="use_dora=True refused: DoRA"):
        check_adapter(ok, {**CONFIG, "use_dora": True})
    with pytest.raises(MegarefitError, match="lora_A and lora_B are both needed"):
        check_adapter({k: v for k, v in ok.items() if "lora_A" in k}, CONFIG)
    with pytest.raises(MegarefitError, match="not a PEFT LoRA factor"):
        check_adapter({**ok, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": a}, CONFIG)
    with pytest.raises(MegarefitError, match="not among peft_config target_modules"):
        check_adapter(ok, {**CONFIG, "target_modules": ["v_proj"]})


def test_peft_configs_own_dict_is_carried_plain():
    config = plain_peft_config(peft.LoraConfig(**CONFIG).to_dict())
    assert config["target_modules"] == sorted(TARGETS) and config["peft_type"] == "LORA"
    assert check_adapter({}, config) == []


def test_engine_without_lora_refused():
    class Runner:  # what lora_internals reads of a model runner whose engine runs without LoRA
        lora_config = None

    with pytest.raises(MegarefitError, match="enable_lora=True"):
        lora_internals(Runner())


class _Engine:
    """Stand-in for an engine of several workers, for refit_lora's coordination alone (one real worker in
    the engine above cannot land on another version than itself). ``pulls``: the trainers' current version
    as each pull reaches them, in order (a pull of an explicit older version is refused, as the trainers
    serve their current one only); ``fail``: ``{(pass, worker): exception}``. Every worker runs each call,
    then the first error is raised, as vLLM's ``collective_rpc`` does."""

    def __init__(self, held, pulls, fail=None):
        self.held, self.pulls, self.fail, self.calls, self.passes = list(held), iter(pulls), fail or {}, [], 0

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, dict(kwargs or {})))
        self.passes += method == "megarefit_refit_lora"
        out, errors = [], []
        for w in range(len(self.held)):
            try:
                out.append(getattr(self, method)(w, **(kwargs or {})))
            except Exception as exc:  # noqa: BLE001 - raised after every worker ran
                errors.append(exc)
        if errors:
            raise errors[0]
        return out

    def megarefit_refit_lora(self, w, name, version, lora_int_id, **_):
        if (self.passes, w) in self.fail:
            raise self.fail[self.passes, w]
        now = next(self.pulls)
        if version is not None and version != now:
            raise StaleVersionError(f"trainers serve version {now}, not {version}")
        self.held[w] = now
        return {"name": name, "lora_int_id": lora_int_id, "version": now, "modules": 4}

    def megarefit_install_lora(self, w, name, version, lora_int_id, **_):
        if (1, w) in self.fail:
            raise self.fail[1, w]
        self.held[w] = version
        return {"name": name, "lora_int_id": lora_int_id, "version": version, "modules": 1}

    def megarefit_lora_versions(self, w):
        return {} if self.held[w] is None else {NAME: self.held[w]}

    def megarefit_remove_lora(self, w, name, lora_int_id):
        self.held[w] = None
        return True


def _refit(engine):
    return refit_lora(engine, NAME, "127.0.0.1", 1, job="j")


def test_workers_on_different_versions_all_pull_the_newest():
    engine = _Engine([2, 2], pulls=[3, 4, 4, 4])  # the trainers published 4 between the two workers' pulls
    assert _refit(engine).lora_path.endswith("/v4") and engine.held == [4, 4]
    assert [kw["version"] for m, kw in engine.calls if m == "megarefit_refit_lora"] == [None, 4]


def test_a_mix_left_after_the_second_pass_is_taken_out_of_every_worker():
    engine = _Engine([2, 2], pulls=[3, 4, 5, 5])  # 5 published before the second pass: it cannot pull 4
    with pytest.raises(StaleVersionError) as err:
        _refit(engine)
    assert engine.held == [None, None], engine.held
    assert any("versions [3, 4]" in n and "taken out of every worker" in n for n in err.value.__notes__)


def test_a_worker_failing_while_the_other_installed_leaves_no_mix():
    engine = _Engine([2, 2], pulls=[3], fail={(1, 1): TransferError("checksum of q_proj differs")})
    with pytest.raises(TransferError):
        _refit(engine)
    assert engine.held == [None, None], engine.held


def test_a_failure_on_every_worker_alike_leaves_the_installed_version_serving():
    refused = BaseChangedError("the adapter trains on base version 7, the engine holds 6")
    engine = _Engine([2, 2], pulls=[], fail={(1, 0): refused, (1, 1): refused})
    with pytest.raises(BaseChangedError):
        _refit(engine)
    assert engine.held == [2, 2] and not [m for m, _ in engine.calls if m == "megarefit_remove_lora"]


def test_an_install_failing_on_one_worker_leaves_no_mix():
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{q}.lora_A.weight": torch.zeros(8, 16), f"{q}.lora_B.weight": torch.zeros(16, 8)}
    engine = _Engine([2, 2], pulls=[], fail={(1, 1): MemoryError("no room for the adapter on worker 1")})
    with pytest.raises(MemoryError) as err:
        install_lora(engine, NAME, tensors, CONFIG, version=3)
    assert engine.held == [None, None], engine.held
    assert any("versions [2, 3]" in n for n in err.value.__notes__)
