"""VllmHttpRefit's decisions after a failed refit, against a stand-in server (the standard
library's HTTP server; real vLLM servers are in test_vllm_http.py, where the engine's states come
from real failures): a server that answers with no megarefit state, or not at all, is left paused
(no ``/resume``) and the error says so; the pause mode goes to ``/pause?mode=``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm_http import (
    ABANDONED,
    MIXED,
    OPEN_UPDATE,
    PREVIOUS_KEPT,
    RefitHTTPError,
    VllmHttpRefit,
)


def _server(update_error: str | None, hang: bool = False, prefetch: list[str] | None = None,
            errors: dict[str, list[str]] | None = None):
    """``prefetch``: the phases ``megarefit_prefetched`` answers in turn (the last one repeats);
    ``"missing"``: ``/collective_rpc`` fails as a worker without the megarefit extension does.
    ``errors``: per route, the worker errors its next calls fail with (vLLM's HTTP 500 text)."""
    calls: list[str] = []
    phases = list(prefetch or [])
    errors = {route: list(said) for route, said in (errors or {}).items()}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            calls.append(self.path if self.path != "/collective_rpc" else f"rpc {body['method']}")
            if self.path == "/collective_rpc":
                return self._rpc(body)
            if errors.get(self.path):
                calls[-1] += f" {json.dumps(body, sort_keys=True)}"
                said = errors[self.path].pop(0)
                message = (f"Call to collective_rpc method failed: Worker failed with error '{said}', please check "
                           "the stack trace above for the root cause")
                return self._answer(500, {"error": {"message": message, "type": "InternalServerError"}})
            if self.path == "/update_weights" and hang:
                return  # no answer: the client times out
            if self.path == "/update_weights" and update_error is not None:
                return self._answer(500, {"error": {"message": update_error}})
            self._answer(200, {})

        def _rpc(self, body: dict) -> None:
            phase = phases[0] if len(phases) == 1 else phases.pop(0)
            if phase == "missing":
                return self._answer(500, {"error": f"'Worker' object has no attribute '{body['method']}'"})
            state = {"phase": phase, "version": 4, "pulled": 4 if phase == "ready" else None, "seconds": 0.1,
                     "retries": 0, "error": "VersionMismatchError: not published" if phase == "failed" else None}
            self._answer(200, {"results": [state, state]})  # two workers

        def do_GET(self):  # noqa: N802
            calls.append(self.path)
            self._answer(200, {"weight_version": "3"})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, calls


@pytest.mark.parametrize(("error", "state", "resumed"), [
    (f"failed {PREVIOUS_KEPT} ...", "previous", True),
    (f"failed {MIXED} ...", "mixed", False),
    ("failed, says nothing of its weights", "unknown", False),
])
def test_a_failed_refit_resumes_only_a_server_that_kept_its_weights(error, state, resumed):
    httpd, calls = _server(error)
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}", mode="wait")
        with pytest.raises(RefitHTTPError) as info:
            refit.refit(4)
    finally:
        httpd.shutdown()
    exc = info.value
    assert (exc.state, exc.resumed, exc.paused, exc.version, exc.served) == (state, resumed, not resumed, 4, "3")
    assert calls[0] == "/pause?mode=wait" and ("/resume" in calls) == resumed, calls
    assert "version 4" in str(exc) and ("PAUSED" in str(exc)) == (not resumed), str(exc)


def test_no_answer_leaves_the_server_paused():
    httpd, calls = _server(None, hang=True)
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}", timeout=1.0)
        with pytest.raises(RefitHTTPError) as info:
            refit.refit(4)
    finally:
        httpd.shutdown()
    assert (info.value.status, info.value.state, info.value.paused) == (None, "unknown", True)
    assert "/resume" not in calls and "may or may not be installed" in str(info.value)


def test_an_unknown_pause_mode_is_refused():
    with pytest.raises(MegarefitError, match=r"pause mode 'drain'.*\('abort', 'wait', 'keep'\)"):
        VllmHttpRefit("http://127.0.0.1:1", mode="drain")


def test_a_prefetched_refit_pauses_once_every_worker_holds_the_version():
    httpd, calls = _server(None, prefetch=["pulling", "pulling", "pulling", "ready"])
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}", prefetch=True, poll_s=0.001)
        refit.refit(4)
    finally:
        httpd.shutdown()
    assert calls == ["rpc megarefit_prefetch"] + ["rpc megarefit_prefetched"] * 3 + [
        "/pause?mode=abort", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"], calls
    stats = refit.stats
    assert stats.version == 4 and stats.prefetch_s > 0 and len(stats.workers) == 2 and stats.stall_s is None
    assert stats.total_s >= stats.prefetch_s + stats.paused_s - 1e-6 and stats.paused_s >= stats.update_s


@pytest.mark.parametrize(("phase", "says"), [("failed", "worker 1: VersionMismatchError: not published"),
                                             ("missing", "--worker-extension-cls")])
def test_a_failed_prefetch_never_pauses_the_server(phase, says):
    """A worker whose prefetch failed, or a server without the extension: the error names the
    route and what to do, and the server was never paused (it serves its version)."""
    httpd, calls = _server(None, prefetch=[phase])
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}", prefetch=True)
        with pytest.raises(RefitHTTPError) as info:
            refit.refit(4)
    finally:
        httpd.shutdown()
    exc = info.value
    assert exc.step.startswith("collective_rpc megarefit_prefetch") and says in str(exc), str(exc)
    assert (exc.state, exc.paused, exc.resumed, exc.served) == ("previous", False, False, "3")
    assert not any(c.startswith("/pause") for c in calls) and "it serves them" in str(exc), (calls, str(exc))


ENDED = f"{ABANDONED} update_weights: ... version 4 ... {PREVIOUS_KEPT} weight version 4 was rolled back; ..."
ABANDON = '/update_weights {"update_info": {"abandon": true}}'


def test_init_ends_an_open_update_unserved_then_inits():
    """A server whose engine refuses the init as an update is open (its controller died): the
    controller ends it unserved (``abandon``: an error answer saying what the server holds), keeps
    that account and inits again; the server is neither finished (no label) nor resumed."""
    httpd, calls = _server(None, errors={"/init_weight_transfer_engine": [f"... holds version 4 {OPEN_UPDATE} ..."],
                                         "/update_weights": [ENDED]})
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}")
        refit.init("10.0.0.1", 29600, job="rl")
    finally:
        httpd.shutdown()
    init = '/init_weight_transfer_engine {"init_info": {"host": "10.0.0.1", "job": "rl", "port": 29600}}'
    assert calls == [init, ABANDON, "/init_weight_transfer_engine"], calls
    assert refit.recovered == ENDED, refit.recovered


def test_a_refit_whose_start_is_refused_as_an_update_is_open_ends_it_first():
    """vLLM's worker refuses ``/start_weight_update`` while an update is open (vLLM 0.32's text): the
    refit ends that update unserved, starts again and goes on to label and serve its version."""
    refused = ("start_weight_update called while a weight update is already active. Call finish_weight_update "
               "first.")
    httpd, calls = _server(None, errors={"/start_weight_update": [refused], "/update_weights": [ENDED]})
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}")
        refit.refit(5)
    finally:
        httpd.shutdown()
    assert calls == ["/pause?mode=abort", "/start_weight_update {}", ABANDON, "/start_weight_update",
                     "/update_weights", "/finish_weight_update", "/resume"], calls
    assert refit.recovered == ENDED and refit.stats.version == 5


@pytest.mark.parametrize("route", ["/init_weight_transfer_engine", "/start_weight_update"])
def test_an_open_update_is_ended_only_where_the_engine_says_so(route):
    """Other errors of init or start are not taken for an open update, and an answer to the abandon
    without the engine's account (not the megarefit backend) is an error, not a recovery."""
    other = "no job secret: pass secret= ..."
    httpd, calls = _server(None, errors={route: [other]})
    try:
        refit = VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}")
        with pytest.raises(RefitHTTPError, match="no job secret"):
            refit.init("10.0.0.1", 29600) if route.startswith("/init") else refit.refit(5)
    finally:
        httpd.shutdown()
    assert ABANDON not in calls and refit.recovered is None, calls
    httpd, calls = _server(None, errors={"/update_weights": ["start_weight_update must be called before "
                                                            "update_weights."]})
    try:
        with pytest.raises(RefitHTTPError, match="must be called before"):
            VllmHttpRefit(f"http://127.0.0.1:{httpd.server_port}").abandon()
    finally:
        httpd.shutdown()
