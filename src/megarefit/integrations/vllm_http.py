"""Refit a ``vllm serve`` server over HTTP: the RL controller's side of the megarefit backend.

Most RL stacks drive vLLM as a server. The trainers publish their live shards
(:class:`~megarefit.online.trainer.publisher.Publisher`, one per Megatron rank, against a
:class:`~megarefit.online.store.rendezvous.Rendezvous`); the server runs with
``--weight-transfer-config '{"backend": "megarefit"}'`` (and ``VLLM_SERVER_DEV_MODE=1`` for
the weight-transfer routes); whoever orchestrates the RL loop calls :meth:`VllmHttpRefit.refit`
after each training step::

    controller                      vLLM server (every worker)               trainers
    POST /pause                     stops scheduling, clears the prefix cache
    POST /start_weight_update       opens the layerwise reload
    POST /update_weights {v}        pulls version v over NIXL / CUDA IPC  <-- shards (v)
    POST /finish_weight_update {v}  finalizes, acknowledges v   ------------> wait_receivers(v) returns
    POST /resume                    serves version v (GET /weight_info == "v")

vLLM ends an update when ``/update_weights`` fails; megarefit's engine then puts every
layer's previous weights back and says so in its error text (:data:`PREVIOUS_KEPT`): the
controller resumes the server on its previous version and raises :class:`RefitHTTPError`.
Where the engine could not put them all back (:data:`MIXED`), or its state is unknown (no
answer, another backend), the server is left paused and the error says so
(``RefitHTTPError.resumed`` is False; see docs/http.md). Only the standard library is used:
a trainer or controller process needs neither vLLM nor ``requests``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarefit.errors import MegarefitError

if TYPE_CHECKING:
    from megarefit.integrations.vllm_stall import StallProbe

# What megarefit's engine appends to a failed update's error text (vLLM returns it as the response body)
PREVIOUS_KEPT = "[megarefit: previous weights kept]"  # the previous version is whole: it may be served again
MIXED = "[megarefit: mixed weights]"  # a mix of versions: the engine refuses to run the model until an update completes
OPEN_UPDATE = "[megarefit: open update]"  # init refused: an update is open (its controller may have died mid-refit)
ABANDONED = "[megarefit: update abandoned]"  # an open update ended unserved (update_weights {"abandon": true})
PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's /pause?mode=...


class RefitHTTPError(MegarefitError):
    """A weight-transfer route of the vLLM server answered with an error (or not at all).

    Attributes:
        step: the route, e.g. ``"update_weights"``.
        status: the HTTP status (``None``: no answer: the server is down or timed out).
        body: the server's response text (vLLM puts the exception there).
        version: the weight version the failed refit asked for (``None``: not a refit).
        state: the server's weights afterwards: ``"previous"`` (its previous version, whole),
            ``"mixed"`` (the engine refuses to run the model) or ``"unknown"``.
        resumed: whether :meth:`VllmHttpRefit.refit` resumed the server (only on ``"previous"``).
        paused: whether the server is left paused (by :meth:`VllmHttpRefit.refit`'s ``/pause``).
        served: the server's ``GET /weight_info`` after the failure (``None``: not asked or no answer).
    """

    def __init__(self, step: str, status: int | None, body: str, *, version: int | None = None,
                 state: str = "unknown", resumed: bool = False, served: str | None = None,
                 paused: bool = False) -> None:
        self.step, self.status, self.body = step, status, body
        self.version, self.state, self.resumed, self.served, self.paused = version, state, resumed, served, paused
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"vLLM /{step} failed ({where}): {body.strip()[:2000]}{self._outcome()}")

    def _outcome(self) -> str:
        if self.version is None:
            return ""
        outcome = {"previous": "was not installed", "mixed": "was installed only in part"}
        asked = f"weight version {self.version} {outcome.get(self.state, 'may or may not be installed')}"
        if self.state == "previous":
            held = f"its previous weights (GET /weight_info: {self.served!r})"
            then = ("it was resumed" if self.resumed else "it is still paused: POST /resume to serve them"
                    if self.paused else "it serves them")
            return f" -- {asked}; the server holds {held} whole and {then}; refit again to install {self.version}"
        why = ("its engine could not put the previous weights back and refuses to run the model"
               if self.state == "mixed" else "its weights are unknown (no answer, or a backend that does not say)")
        where = ("The server is left PAUSED (requests wait or get HTTP 503 'engine_paused')" if self.paused
                 else "Keep requests away from it")
        return (f" -- {asked}; {why}. {where}: refit again (VllmHttpRefit.refit({self.version}) resumes it on "
                "success), or restart it")


# vLLM 0.32's worker refuses /start_weight_update with this while its own update flag is set, before the engine runs
VLLM_UPDATE_OPEN = "while a weight update is already active"


def _said(body: str) -> str:
    """The worker's error text in a vLLM error response (``{"error": {"message": "Call to
    collective_rpc method failed: Worker failed with error '...', please check ..."}}``), else ``body``."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()
    message = str((error.get("message") if isinstance(error, dict) else error) or body).strip()
    inner = re.search(r"Worker failed with error '(.*)', please check", message, re.DOTALL)
    return inner.group(1) if inner else message


PREFETCH_NEEDS = ("prefetch needs the worker extension's RPCs: start the server with VLLM_SERVER_DEV_MODE=1 "
                  "(for /collective_rpc) and --worker-extension-cls "
                  "megarefit.integrations.vllm.MegarefitWorkerExtension")


@dataclass(frozen=True)
class HttpRefitStats:
    """One :meth:`VllmHttpRefit.refit`, timed by the controller (wall seconds).

    Attributes:
        version: the weight version installed.
        prefetch_s: ``/collective_rpc megarefit_prefetch`` until every worker held the version
            fenced, while the server kept generating (``None``: no prefetch).
        paused_s: ``/pause`` sent until ``/resume`` answered: generation stood still this long
            (the stall's bound on the server side; with ``pause=False``, the update's time).
        update_s: ``/start_weight_update`` sent until ``/finish_weight_update`` answered: the
            install alone after a prefetch, else pull and install.
        total_s: the whole call.
        stall_s: the longest gap between tokens a streaming client saw (``probe``), else ``None``.
        workers: each worker's prefetch state when it was ready (``PrefetchState`` dicts).
    """

    version: int
    prefetch_s: float | None
    paused_s: float
    update_s: float
    total_s: float
    stall_s: float | None = None
    workers: tuple[dict[str, Any], ...] = ()


class VllmHttpRefit:
    """Drive one vLLM server's megarefit weight updates over HTTP.

    Args:
        base_url: the server, e.g. ``"http://10.0.0.5:8000"``.
        timeout: seconds to wait for one HTTP answer (a pull of a large model is one
            ``/update_weights`` call: leave room for it).
        mode: vLLM's ``/pause`` mode for requests in flight when a refit starts: ``"abort"``
            (the default: they end, with what they generated so far), ``"wait"`` (the pause waits
            until they finish on the old weights) or ``"keep"`` (they are frozen and go on with
            the new weights after ``/resume``: one request may then mix versions). While paused,
            new requests wait (vLLM 0.32) or get a retryable HTTP 503 ``engine_paused`` (vLLM 0.33).
        prefetch: pull each version while the server keeps generating, then pause only to install
            it (docs/http.md, "Zero-stall refits"): ``/collective_rpc`` ``megarefit_prefetch`` on
            every worker, ``megarefit_prefetched`` polled every ``poll_s`` seconds until all hold
            it fenced, then the usual pause and update, whose ``/update_weights`` installs from
            the receivers' arenas. Needs staged receivers (no ``memory_budget``), and the server
            started with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
            megarefit.integrations.vllm.MegarefitWorkerExtension``.
        poll_s: seconds between prefetch polls (each is one RPC between engine steps).

    Attributes:
        stats: the last successful refit's :class:`HttpRefitStats` (``None`` before).
        recovered: the engine's account of the last open update this controller ended unserved
            (:meth:`abandon`, from :meth:`init` or :meth:`refit`), ``None`` before.

    Raises:
        MegarefitError: an unknown ``mode``.

    Example (after ``Rendezvous.serve`` on the trainer side)::

        refit = VllmHttpRefit("http://127.0.0.1:8000")
        refit.init(host, rdzv_port, job="rl")       # once
        refit.refit(version)                        # after every optimizer step
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0, mode: str = "abort", prefetch: bool = False,
                 poll_s: float = 0.02) -> None:
        if mode not in PAUSE_MODES:
            raise MegarefitError(f"pause mode {mode!r}: vLLM's /pause takes one of {PAUSE_MODES}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.mode = mode
        self.prefetch = prefetch
        self.poll_s = poll_s
        self.stats: HttpRefitStats | None = None
        self.recovered: str | None = None

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
        ``secret``, ``direct``, ``node``, ``lora``: see :class:`~megarefit.integrations.vllm.MegarefitInitInfo`).

        A server whose engine holds an open weight update (a controller that died mid-refit: the
        engine refuses the init, saying what the update holds, :data:`OPEN_UPDATE`) gets that
        update ended unserved first (:meth:`abandon`; its account in :attr:`recovered`, also
        logged), then the init. The server stays paused until the next :meth:`refit` resumes it.

        Raises:
            RefitHTTPError: the init failed (or the open update could not be ended)."""
        body = {"init_info": {"host": host, "port": port, "job": job, **init_info}}
        try:
            self._call("POST", "init_weight_transfer_engine", body)
        except RefitHTTPError as exc:
            if OPEN_UPDATE not in exc.body:
                raise
            self.abandon()
            self._call("POST", "init_weight_transfer_engine", body)

    def refit_lora(self, name: str, version: int) -> str:
        """An adapter-only refit over HTTP: ``POST /v1/load_lora_adapter`` of ``lora_path(name, version)``,
        in place. Every worker pulls that version of adapter ``name`` from the trainers' ``LoraPublisher`` s
        inside vLLM's own loader (:func:`~megarefit.integrations.vllm_lora.enable_lora_pulls`; the server
        inited with ``lora=True``, started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``),
        and the server points ``name`` at it. No pause: vLLM swaps adapters between engine steps. Returns
        ``name``: requests name it as their ``model``; the versioned path keeps vLLM's prefix cache apart
        per version.

        Raises:
            RefitHTTPError: the server refused (its text says why: a version not published in time, an
                adapter on another base, a module vLLM's LoRA does not serve ...); the version it served
                before keeps serving."""
        from megarefit.integrations.vllm_lora import lora_path  # imported here: this module imports no torch

        body = {"lora_name": name, "lora_path": lora_path(name, version), "load_inplace": True}
        try:
            self._call("POST", "v1/load_lora_adapter", body)
        except json.JSONDecodeError:  # vLLM answers success in plain text (RefitHTTPError is raised on)
            pass
        return name

    def abandon(self) -> str:
        """End the server's open weight update without serving it: what a new controller does after
        one died mid-refit (its ``/update_weights`` may have completed inside the server after it
        died). ``POST /update_weights {"update_info": {"abandon": true}}``: the engine puts the
        previous weights back where it kept them (``keep_previous``; the server then holds the version
        ``GET /weight_info`` names, whole), else refuses to run the model until a refit completes,
        and raises, which is how vLLM 0.32 ends an update without labelling a version. The server is
        not resumed.

        Returns:
            the engine's account (also :attr:`recovered`): what the update held and what the server
            holds now (ends with :data:`PREVIOUS_KEPT` or :data:`MIXED`).

        Raises:
            RefitHTTPError: the server answered without :data:`ABANDONED` (no update open in vLLM,
                another backend, no answer)."""
        try:
            self._call("POST", "update_weights", {"update_info": {"abandon": True}})
        except RefitHTTPError as exc:
            if ABANDONED not in exc.body:
                raise
            self.recovered = _said(exc.body)
            logging.getLogger(__name__).warning("%s: %s", self.base_url, self.recovered)
            return self.recovered
        raise RefitHTTPError("update_weights", 200, "the server ended no update (not the megarefit backend?)")

    def reports(self, path: str = "engine") -> list[dict[str, Any] | None]:
        """Each worker's report of its last completed update (``/collective_rpc``
        ``megarefit_report``; needs the worker extension, as ``prefetch`` does): timings
        (``seconds.load``: the install), bytes, ``prefetched``, ``copied_tensors``,
        ``shadow_layers``, ...; ``None`` for a worker that completed none.

        Raises:
            RefitHTTPError: the server lacks dev mode or the worker extension (says so)."""
        return self._rpc("megarefit_report", {"path": path})

    def refit(self, version: int, *, pause: bool = True, timeout: float | None = None, draft: bool = False,
              probe: StallProbe | None = None) -> float:
        """One weight update to ``version``; returns its seconds (prefetch, if on, to resume).
        :attr:`stats` then holds its :class:`HttpRefitStats`.

        ``pause``: ``/pause?mode=...`` before (``mode`` of the constructor; the prefix cache is
        cleared, so no cached prefix of the old weights is served) and ``/resume`` after. After a
        failure the server is resumed only when its engine says it holds its previous weights
        whole (:data:`PREVIOUS_KEPT`); otherwise it is left paused. ``timeout``: seconds the
        workers wait for ``version`` to be published (default: ``init``'s). ``draft``: the server
        runs MTP speculative decoding (``--speculative-config '{"method": "mtp", ...}'``): after
        the target model, refit its draft model too, in the same pause
        (``/start_draft_weight_update`` -> ``/update_weights`` -> ``/finish_weight_update``; the
        trainers must publish their MTP layers, Megatron ``mtp_num_layers``; the draft model is
        pulled in the pause, not prefetched). ``probe``: a running
        :class:`~megarefit.integrations.vllm_stall.StallProbe`; once a token arrived after
        ``/resume``, ``stats.stall_s`` is the longest gap it saw around the pause.

        Raises:
            RefitHTTPError: naming the route that failed, the server's error text, ``version``,
                the server's state afterwards (``state``, ``resumed``, ``served``) and what to do. A
                failed draft update names ``start_draft_weight_update`` or ``update_weights (draft
                model)``: the target model then holds ``version``. A failed prefetch names
                ``collective_rpc megarefit_prefetch``: nothing was paused or written.
        """
        t0 = time.perf_counter()
        prefetch_s, workers = self._prefetched(int(version), timeout) if self.prefetch else (None, ())
        t_pause = time.perf_counter()
        if pause:
            self._call("POST", "pause", query=f"?mode={self.mode}")
        t_update = time.perf_counter()
        self._update(int(version), timeout, draft, pause)
        t_installed = time.perf_counter()
        if pause:
            self._call("POST", "resume")
        t_end = time.perf_counter()
        stall = None
        if probe is not None and probe.wait_token_after(t_end, self.timeout):
            stall = probe.longest_gap(t_pause, t_end)
        self.stats = HttpRefitStats(int(version), prefetch_s, t_end - t_pause, t_installed - t_update, t_end - t0,
                                    stall, workers)
        return t_end - t0

    def _update(self, version: int, timeout: float | None, draft: bool, paused: bool) -> None:
        """``/start_weight_update`` -> ``/update_weights`` -> ``/finish_weight_update`` (and the draft
        model's); a failure becomes a :class:`RefitHTTPError` with the server's state."""
        info: dict[str, Any] = {"version": version}
        if timeout is not None:
            info["timeout"] = float(timeout)
        try:
            for start in ("start_weight_update", "start_draft_weight_update")[:2 if draft else 1]:
                self._start(start)
                try:
                    self._call("POST", "update_weights", {"update_info": info})  # on an error vLLM ends the update
                except RefitHTTPError as exc:
                    if start == "start_weight_update":
                        raise
                    raise RefitHTTPError("update_weights (draft model)", exc.status, exc.body) from None
                self._call("POST", "finish_weight_update", {"weight_version": str(version)})
        except RefitHTTPError as exc:
            raise self._failed(exc, version, paused) from None

    def _start(self, route: str) -> None:
        """``POST /start_weight_update`` (or the draft's); where vLLM's worker refuses it as an
        update is open already (one whose controller died, or this one's after a timeout), that
        update is ended unserved (:meth:`abandon`) and the start sent again."""
        try:
            self._call("POST", route)
        except RefitHTTPError as exc:
            if VLLM_UPDATE_OPEN not in exc.body:
                raise
            self.abandon()
            self._call("POST", route)

    def _rpc(self, method: str, kwargs: dict[str, str]) -> list[Any]:
        """``POST /collective_rpc``: ``method`` on every worker; their results."""
        try:
            answer = self._call("POST", "collective_rpc", {"method": method, "kwargs": kwargs})
        except RefitHTTPError as exc:
            hint = f" -- {PREFETCH_NEEDS}" if exc.status == 404 or "attribute" in exc.body else ""
            raise RefitHTTPError(f"collective_rpc {method}", exc.status, exc.body + hint) from None
        return list(answer.get("results") or [])

    def _prefetched(self, version: int, timeout: float | None) -> tuple[float, tuple[dict[str, Any], ...]]:
        """Every worker pulls and fences ``version`` while the server serves; seconds until all hold it."""
        t0 = time.perf_counter()
        kwargs = {"version": str(version)} if timeout is None else {"version": str(version), "timeout": str(timeout)}
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout) + 30.0  # + planning
        try:
            self._rpc("megarefit_prefetch", kwargs)
            while True:
                states = self._rpc("megarefit_prefetched", {})
                bad = {i: s for i, s in enumerate(states) if not isinstance(s, dict) or s.get("phase") == "failed"}
                if bad:
                    said = "; ".join(f"worker {i}: {s.get('error') if isinstance(s, dict) else repr(s)}"
                                     for i, s in bad.items())
                    raise RefitHTTPError("collective_rpc megarefit_prefetch", 200,
                                         f"{len(bad)} of {len(states)} workers' prefetch failed: {said}")
                if states and all(s["phase"] == "ready" for s in states):
                    return time.perf_counter() - t0, tuple(states)
                if time.monotonic() > deadline:
                    raise RefitHTTPError("collective_rpc megarefit_prefetch", None,
                                         f"workers not ready after {time.perf_counter() - t0:.1f} s: {states}")
                time.sleep(self.poll_s)
        except RefitHTTPError as exc:
            raise RefitHTTPError(exc.step, exc.status, exc.body, version=version, state="previous",
                                 served=self._served()) from None

    def _served(self) -> str | None:
        try:
            return self.weight_version()
        except RefitHTTPError:
            return None

    def _failed(self, exc: RefitHTTPError, version: int, paused: bool) -> RefitHTTPError:
        """``exc`` with the server's state: resumed only where the engine kept its previous weights."""
        state = "mixed" if MIXED in exc.body else "previous" if PREVIOUS_KEPT in exc.body else "unknown"
        resumed = False
        if paused and state == "previous":
            try:
                self._call("POST", "resume")
                resumed = True
            except RefitHTTPError:
                pass
        served = self._served()
        return RefitHTTPError(exc.step, exc.status, exc.body, version=version, state=state, resumed=resumed,
                              served=served, paused=paused and not resumed)

    def weight_version(self) -> str | None:
        """``GET /weight_info``: the version set by the last ``/finish_weight_update``."""
        return self._call("GET", "weight_info").get("weight_version")


__all__ = ["HttpRefitStats", "RefitHTTPError", "VllmHttpRefit"]
