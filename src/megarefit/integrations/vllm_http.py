"""Refit a ``vllm serve`` server over HTTP: the RL controller's side of the megarefit backend.

Most RL stacks drive vLLM as a server. The trainers publish their live shards
(:class:`~megarefit.online.publisher.Publisher`, one per Megatron rank, against a
:class:`~megarefit.online.rendezvous.Rendezvous`); the server runs with
``--weight-transfer-config '{"backend": "megarefit"}'`` (and ``VLLM_SERVER_DEV_MODE=1`` for
the weight-transfer routes); whoever orchestrates the RL loop calls :meth:`VllmHttpRefit.refit`
after each training step::

    controller                      vLLM server (every worker)               trainers
    POST /pause                     stops scheduling, clears the prefix cache
    POST /start_weight_update       opens the layerwise reload
    POST /update_weights {v}        pulls version v over NIXL / CUDA IPC  <-- shards (v)
    POST /finish_weight_update {v}  finalizes, acknowledges v   ------------> wait_receivers(v) returns
    POST /resume                    serves version v (GET /weight_info == "v")

vLLM ends an update when ``/update_weights`` fails; megarefit's engine then gives every
layer its previous weights back, so the server stays healthy on its previous version and
:class:`RefitHTTPError` carries the server's error text (see docs/http.md). Only the
standard library is used: a trainer or controller process needs neither vLLM nor
``requests``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from megarefit.errors import MegarefitError


class RefitHTTPError(MegarefitError):
    """A weight-transfer route of the vLLM server answered with an error (or not at all).

    Attributes:
        step: the route, e.g. ``"update_weights"``.
        status: the HTTP status (``None``: no answer: the server is down or timed out).
        body: the server's response text (vLLM puts the exception there).
    """

    def __init__(self, step: str, status: int | None, body: str) -> None:
        self.step, self.status, self.body = step, status, body
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"vLLM /{step} failed ({where}): {body.strip()[:2000]}")


class VllmHttpRefit:
    """Drive one vLLM server's megarefit weight updates over HTTP.

    Args:
        base_url: the server, e.g. ``"http://10.0.0.5:8000"``.
        timeout: seconds to wait for one HTTP answer (a pull of a large model is one
            ``/update_weights`` call: leave room for it).

    Example (after ``Rendezvous.serve`` on the trainer side)::

        refit = VllmHttpRefit("http://127.0.0.1:8000")
        refit.init(host, rdzv_port, job="rl")       # once
        refit.refit(version)                        # after every optimizer step
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None,
              query: str = "") -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}/{route}{query}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise RefitHTTPError(route, exc.code, exc.read().decode(errors="replace")) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise RefitHTTPError(route, None, str(exc)) from None
        return json.loads(text) if text.strip() else {}

    def init(self, host: str, port: int, job: str = "default", **init_info: Any) -> None:
        """``POST /init_weight_transfer_engine``: connect every worker's receiver to the trainers'
        rendezvous at ``host:port`` for ``job``. ``init_info`` takes the backend's other keys
        (``sharded``, ``memory_budget``, ``verify_checksums``, ``transport``, ``timeout``,
        ``secret``: see :class:`~megarefit.integrations.vllm.MegarefitInitInfo`)."""
        self._call("POST", "init_weight_transfer_engine",
                   {"init_info": {"host": host, "port": port, "job": job, **init_info}})

    def refit(self, version: int, *, pause: bool = True, timeout: float | None = None, draft: bool = False) -> float:
        """One weight update to ``version``; returns its seconds (pause to resume).

        ``pause``: ``/pause`` before (in-flight requests are aborted, the prefix cache is
        cleared, so no cached prefix of the old weights is served) and ``/resume`` after,
        also after a failed update (the server then serves its previous version).
        ``timeout``: seconds the workers wait for ``version`` to be published (default:
        ``init``'s). ``draft``: the server runs MTP speculative decoding
        (``--speculative-config '{"method": "mtp", ...}'``): after the target model, refit its
        draft model too, in the same pause (``/start_draft_weight_update`` ->
        ``/update_weights`` -> ``/finish_weight_update``; the trainers must publish their MTP
        layers, Megatron ``mtp_num_layers``).

        Raises:
            RefitHTTPError: naming the route that failed and the server's error text (a failed
                draft update names ``start_draft_weight_update`` or ``update_weights (draft model)``: the
                target model then holds ``version`` and the draft model its previous one).
        """
        t0 = time.perf_counter()
        if pause:
            self._call("POST", "pause")
        info: dict[str, Any] = {"version": int(version)}
        if timeout is not None:
            info["timeout"] = float(timeout)
        try:
            for start in ("start_weight_update", "start_draft_weight_update")[:2 if draft else 1]:
                self._call("POST", start)
                try:
                    self._call("POST", "update_weights", {"update_info": info})  # on an error vLLM ends the update
                except RefitHTTPError as exc:
                    if start == "start_weight_update":
                        raise
                    raise RefitHTTPError("update_weights (draft model)", exc.status, exc.body) from None
                self._call("POST", "finish_weight_update", {"weight_version": str(version)})
        except RefitHTTPError:
            if pause:  # the server holds its previous version: serve it again, report the failure
                try:
                    self._call("POST", "resume")
                except RefitHTTPError:
                    pass
            raise
        if pause:
            self._call("POST", "resume")
        return time.perf_counter() - t0

    def weight_version(self) -> str | None:
        """``GET /weight_info``: the version set by the last ``/finish_weight_update``."""
        return self._call("GET", "weight_info").get("weight_version")


__all__ = ["RefitHTTPError", "VllmHttpRefit"]
