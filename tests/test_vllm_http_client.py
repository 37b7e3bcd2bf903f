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


def _server(update_error: str | None, hang: bool = False):
    calls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            calls.append(self.path)
            if self.path == "/update_weights" and hang:
                return  # no answer: the client times out
            if self.path == "/update_weights" and update_error is not None:
                return self._answer(500, {"error": {"message": update_error}})
            self._answer(200, {})

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
