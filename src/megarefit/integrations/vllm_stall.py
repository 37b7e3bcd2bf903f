"""The generation stall of a refit, as a streaming client sees it.

What RL users wait on is not the transfer but the gap in token output around it: the longest
time between two tokens arriving at a client that streams while the server refits.
:class:`StallProbe` is such a client (standard library only): on a thread it streams greedy
completions from a vLLM server's ``/v1/completions`` (``stream: true``), one after the other,
and records when each chunk of tokens arrives. A request that the pause ends (``/pause?mode=abort``)
is followed at once by the next one, which waits for ``/resume`` (vLLM 0.32) or is answered
HTTP 503 ``engine_paused`` and retried every ``retry_s`` (vLLM 0.33), so its first token marks
the end of the stall.

The stall is not the whole cost of a refit to a client: a prefetch shares the server's cores (or
GPU) with generation, which then runs slower for as long as it takes. :func:`tokens_lost` counts
what the client lost over the whole refit, against its own steady rate before it::

    steady rate  r = (chunks in [start - steady_s, start)) / steady_s                 tokens/s
    window         [start, first)   first = the first chunk after ``end`` (/resume answered)
    tokens lost    r * (first - start) - (chunks in [start, first))                    tokens

``start`` is when the refit began (the prefetch's start, or ``/pause`` without one). On a stream
that nothing disturbs it lies in [0, 1): the window ends at a chunk it does not count.

Usage::

    with StallProbe("http://127.0.0.1:8000") as probe:
        refit.refit(version, probe=probe)      # VllmHttpRefit: stats.stall_s
    probe.longest_gap(t0, t1)                  # or any window, in time.perf_counter() seconds
    probe.tokens_lost(t0, t1)                  # tokens lost around a refit run from t0 to t1
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from megarefit.errors import MegarefitError


class StallProbe:
    """A client streaming tokens from a vLLM server on a daemon thread (see the module docstring).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        model: the served model's name (default: the first of ``GET /v1/models``).
        prompt: the prompt of every request.
        max_tokens: tokens per request (prompt + ``max_tokens`` must fit the server's
            ``--max-model-len``); each request ignores EOS, so it generates exactly that many.
        timeout: seconds to wait for one chunk (a pause longer than that ends the probe with an error).
        retry_s: seconds between retries while the server refuses new requests (HTTP 503).

    Attributes:
        arrivals: ``time.perf_counter()`` of every chunk received, in order.
        tokens: chunks received (one per engine step that produced a token for the request).
        requests: requests completed or ended by a pause.
        error: what stopped the thread early, else ``None``.
    """

    def __init__(self, base_url: str, model: str | None = None, *, prompt: str = "The weights arrive",
                 max_tokens: int = 64, timeout: float = 600.0, retry_s: float = 0.01) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt, self.max_tokens, self.timeout, self.retry_s = prompt, max_tokens, timeout, retry_s
        self.arrivals: list[float] = []
        self.tokens = 0
        self.requests = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StallProbe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> StallProbe:
        """Resolve the model name, start streaming, and return once the first token arrived.

        Raises:
            MegarefitError: the server answers no model, or no token within ``timeout``."""
        if self.model is None:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=self.timeout) as response:
                models = json.loads(response.read()).get("data") or []
            if not models:
                raise MegarefitError(f"{self.base_url}/v1/models lists no model to stream from")
            self.model = models[0]["id"]
        self._thread = threading.Thread(target=self._run, name="megarefit-stall-probe", daemon=True)
        self._thread.start()
        if not self.wait_token_after(time.perf_counter() - 1.0, self.timeout):
            raise MegarefitError(f"stall probe: no token from {self.base_url} within {self.timeout:.0f} s"
                                 + (f": {self.error}" if self.error else ""))
        return self

    def stop(self) -> None:
        """Stop after the current chunk (the thread is a daemon: a hung request does not block exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._one_request()
        except BaseException as exc:  # reported through .error and wait_token_after
            self.error = exc

    def _one_request(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        request = urllib.request.Request(f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 503:  # 503: paused (vLLM 0.33 'engine_paused'): try again shortly
                raise MegarefitError(f"stall probe: HTTP {exc.code} from /v1/completions: "
                                     f"{exc.read().decode(errors='replace')[:500]}") from None
            time.sleep(self.retry_s)
            return
        with response:
            for line in response:
                if self._stop.is_set():
                    return
                self._chunk(line)
        self.requests += 1

    def _chunk(self, line: bytes) -> None:
        text = line.decode(errors="replace").strip()
        if not text.startswith("data:") or text == "data: [DONE]":
            return
        choices: list[dict[str, Any]] = json.loads(text[5:]).get("choices") or []
        if choices:  # a step's output (its text may be empty: a token that completes no character yet)
            self.arrivals.append(time.perf_counter())
            self.tokens += 1

    def wait_token_after(self, t: float, timeout: float) -> bool:
        """Wait until a chunk arrives after ``t`` (``time.perf_counter()`` seconds); whether one did."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.arrivals and self.arrivals[-1] > t:
                return True
            if self.error is not None or (self._thread is not None and not self._thread.is_alive()):
                return False
            time.sleep(0.002)
        return False

    def longest_gap(self, since: float, until: float) -> float:
        """The longest time between two consecutive chunks where the later one arrived after
        ``since`` and the earlier one before ``until`` (seconds; 0.0 without such a pair): the
        stall of a refit run between ``since`` and ``until``, once a token arrived after it.

        Raises:
            MegarefitError: no chunk arrived after ``until`` yet (the stall is still open)."""
        times = list(self.arrivals)
        if not times or times[-1] <= until:
            raise MegarefitError("stall probe: no token arrived after the window yet (wait_token_after first)")
        gaps = [b - a for a, b in zip(times, times[1:]) if b > since and a < until]
        return max(gaps, default=0.0)

    def tokens_lost(self, start: float, end: float, *, steady_s: float = 3.0) -> float:
        """:func:`tokens_lost` of this client's chunks so far (tokens; see the module docstring)."""
        return tokens_lost(list(self.arrivals), start, end, steady_s=steady_s)


def steady_rate(arrivals: Sequence[float], start: float, steady_s: float) -> float:
    """Chunks per second in ``[start - steady_s, start)``: a client's rate before a refit.

    Args:
        arrivals: arrival times in seconds (one clock, ascending).

    Raises:
        MegarefitError: ``steady_s`` is not positive, or the arrivals begin after ``start - steady_s``
            (the client was not streaming for the whole window: its rate would read low)."""
    if steady_s <= 0:
        raise MegarefitError(f"stall probe: steady_s must be > 0 seconds, got {steady_s}")
    if not arrivals or arrivals[0] > start - steady_s:
        first = f"{arrivals[0] - start:+.3f} s" if arrivals else "none"
        raise MegarefitError(f"stall probe: the steady rate needs chunks from {steady_s} s before the refit's "
                             f"start; the first chunk came at {first} from it: stream longer before the refit")
    return sum(start - steady_s <= t < start for t in arrivals) / steady_s


def tokens_short(arrivals: Sequence[float], rate: float, t0: float, t1: float) -> float:
    """``rate * (t1 - t0)`` minus the chunks in ``[t0, t1)``: tokens a client at ``rate``
    (tokens/s) did not get in that window (negative where it got more)."""
    return rate * (t1 - t0) - sum(t0 <= t < t1 for t in arrivals)


def tokens_lost(arrivals: Sequence[float], start: float, end: float, *, steady_s: float = 3.0) -> float:
    """Tokens a streaming client lost to a refit run from ``start`` to ``end`` (seconds, the
    clock of ``arrivals``): at its steady rate over the ``steady_s`` before ``start``, the chunks it
    would have got from ``start`` to its first chunk after ``end``, minus the chunks it got (the
    formula is in the module docstring). A float, in tokens.

    Raises:
        MegarefitError: ``end`` is before ``start``, no chunk arrived after ``end`` yet (the
            refit's window is still open), or :func:`steady_rate` refuses the window before ``start``."""
    if end < start:
        raise MegarefitError(f"stall probe: the refit ends ({end}) before it starts ({start})")
    rate = steady_rate(arrivals, start, steady_s)
    first = next((t for t in arrivals if t > end), None)
    if first is None:
        raise MegarefitError("stall probe: no token arrived after the refit yet (wait_token_after first)")
    return tokens_short(arrivals, rate, start, first)


__all__ = ["StallProbe", "steady_rate", "tokens_lost", "tokens_short"]
