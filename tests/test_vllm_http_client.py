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
from megarefit.integrations.vllm_http import MIXED, PREVIOUS_KEPT, RefitHTTPError, VllmHttpRefit


def _server(update_error: str | None, hang: bool = False, prefetch: list[str] | None = None):
    """``prefetch``: the phases ``megarefit_prefetched`` answers in turn (the last one repeats);
    ``"missing"``: ``/collective_rpc`` fails as a worker without the megarefit extension does."""
    calls: list[str] = []
    phases = list(prefetch or [])

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
