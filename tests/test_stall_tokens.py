"""Tokens lost around a refit (megarefit.integrations.vllm_stall.tokens_lost, and
benchmarks/bench_stall.py's rows and table) on synthetic chunk arrival times: no server.

The expectations are counted by hand from streams built here (a chunk every ``period`` seconds,
with gaps and slow stretches placed where a refit would put them), not computed with the
functions under test; the recorded rows of 2026-11-27 give the numbers issue 57 computed by hand
from them (item 11: 20.6 against 13.7 tokens with shadows, 13.0 against 8.1 with full tensors)."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

from megarefit.errors import MegarefitError
from megarefit.integrations.vllm_stall import tokens_lost, tokens_short

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_stall", ROOT / "benchmarks" / "bench_stall.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_stall"] = bench  # dataclasses look their module up by name
_spec.loader.exec_module(bench)


def stream(t0: float, t1: float, period: float) -> list[float]:
    """A chunk every ``period`` seconds from ``t0`` (included) while before ``t1``."""
    n = int((t1 - t0) / period) + 2
    return [round(t0 + i * period, 9) for i in range(n) if t0 + i * period < t1 - 1e-9]


# 10 tokens/s from -5 s; the refit starts at 0. Chunks at -4.95, -4.85, ...: 30 of them in [-3, 0).
STEADY = stream(-4.95, 0.0, 0.1)


def test_a_pause_loses_the_tokens_of_its_window():
    """Paused from 0.5 s, /resume answered at 2.0 s, first chunk after it at 2.03 s: the window
    [0, 2.03) would have held 20.3 chunks at 10/s and held 5 (0.05 ... 0.45)."""
    arrivals = STEADY + stream(0.05, 0.5, 0.1) + stream(2.03, 3.0, 0.1)
    assert tokens_lost(arrivals, 0.0, 2.0) == pytest.approx(20.3 - 5)


def test_a_prefetch_loses_the_slow_stretch_and_the_pause():
    """Half rate for the 2 s prefetch (0.1, 0.3, ... 1.9: 10 chunks), paused 2.0-2.4, first chunk
    after /resume at 2.45: 24.5 expected, 10 got; 10 of the 14.5 lost before the pause."""
    arrivals = STEADY + stream(0.1, 2.0, 0.2) + stream(2.45, 3.0, 0.1)
    assert tokens_lost(arrivals, 0.0, 2.4) == pytest.approx(24.5 - 10)
    assert tokens_short(arrivals, 10.0, 0.0, 2.0) == pytest.approx(20 - 10)


def test_the_window_edges():
    """A chunk at ``start`` is in the window, not the steady rate; one at ``start - steady_s`` is
    in the rate; one at ``end`` is not after it (the window ends at the next one, not counted)."""
    before = stream(-3.0, 0.0, 0.5)  # -3.0 ... -0.5: 6 chunks, 2/s
    arrivals = [-3.5, *before, 0.0, 1.0, 2.0]
    # rate 6 / 3 s; first after end=1.0 is 2.0; got 0.0 and 1.0
    assert tokens_lost(arrivals, 0.0, 1.0) == pytest.approx(2.0 * 2.0 - 2)
    assert tokens_lost(arrivals, 0.0, 1.0, steady_s=1.5) == pytest.approx(3 / 1.5 * 2.0 - 2)


def test_an_undisturbed_stream_loses_under_one_token():
    """Without a refit the loss lies in [0, 1) for any phase and window (it ends at a chunk)."""
    rng = random.Random(57)
    for _ in range(200):
        period = rng.uniform(0.05, 0.5)
        arrivals = stream(-10 + rng.uniform(0, period), 20.0, period)
        end = rng.uniform(0.0, 8.0)
        steady_s = period * rng.randint(4, 15)  # a whole number of periods: the rate is exact
        assert -1e-9 <= tokens_lost(arrivals, 0.0, end, steady_s=steady_s) < 1.0 + 1e-9


@pytest.mark.parametrize(("arrivals", "end", "steady_s", "says"), [
    ([-4.0, -1.0, 0.5], 1.0, 3.0, "no token arrived after the refit"),
    ([-2.0, -1.0, 2.0], 1.0, 3.0, "first chunk came at -2.000 s"),
    ([], 1.0, 3.0, "first chunk came at none"),
    ([-4.0, 2.0], -1.0, 3.0, "ends (-1.0) before it starts"),
    ([-4.0, 2.0], 1.0, 0.0, "steady_s must be > 0"),
])
def test_refusals(arrivals, end, steady_s, says):
    with pytest.raises(MegarefitError, match=says.replace("(", r"\(").replace(")", r"\)")):
        tokens_lost(arrivals, 0.0, end, steady_s=steady_s)


def _row(mode: str, arrivals: list[list[float]], total_s: float, prefetch_s: float | None) -> dict:
    """A bench row as _one_refit records it: arrivals in ms from the refit's start."""
    return {"mode": mode, "version": 3, "cold": False, "steady_s": 3.0, "total_s": total_s, "prefetch_s": prefetch_s,
            "stall_s": [0.4] * len(arrivals), "paused_s": 0.4, "update_s": 0.3, "tokens_per_s_before": 10.0,
            "tokens_per_s_prefetch": 5.0 if prefetch_s else None,
            "arrivals_ms": [[round(t * 1000, 1) for t in a] for a in arrivals]}


def test_a_row_keeps_the_window_and_gives_each_clients_loss():
    """_arrivals_ms keeps the last chunk before start - steady_s (the client was streaming) to the
    first after end, only; client_losses reads it back."""
    arrivals = STEADY + stream(0.1, 2.0, 0.2) + stream(2.45, 3.0, 0.1)
    kept = bench._arrivals_ms([100.0 + t for t in arrivals], 100.0, 97.0, 102.4)
    assert kept[0] == pytest.approx(-3050.0) and kept[-1] == pytest.approx(2450.0) and len(kept) == 1 + 30 + 10 + 1
    paused = STEADY + stream(0.05, 0.5, 0.1) + stream(2.03, 3.0, 0.1)
    lost, early = bench.client_losses(_row("prefetch", [arrivals, paused], 2.4, 2.0))
    # the second client: paused from 0.5 s, first chunk after /resume (2.4 s) at 2.43 s: 24.3 expected,
    # 5 + 4 got (0.05 ... 0.45, 2.03 ... 2.33); 20 - 5 of them short before 2.0 s
    assert lost == pytest.approx([14.5, 24.3 - 9]) and early == pytest.approx([10.0, 20.0 - 5])


def test_the_recorded_rows_give_the_issues_estimates():
    """Rows without arrivals: before x (prefetch + stall) - during x prefetch per client, the
    median over the clients per refit, then over the warm refits (issue 57's numbers)."""
    for name, pause, prefetch in (("stall_cpu_2026-11-27.jsonl", 8.1, 13.0),
                                  ("stall_cpu_direct_2026-11-27.jsonl", 13.7, 20.6)):
        rows = [json.loads(line) for line in (ROOT / "docs" / name).read_text().splitlines()]
        ways = {m: bench.Way.of([r for r in rows if not r["cold"] and r["mode"] == m]) for m in bench.MODES}
        assert round(statistics.median(ways["pause"].lost), 1) == pause
        assert round(statistics.median(ways["prefetch"].lost), 1) == prefetch
        assert "~" in bench.table(rows) and "Too few refits" in bench.table(rows)
        with pytest.raises(ValueError, match="these rows hold 2 runs"):  # a run appended to another
            bench.table(rows + rows)


def test_the_table_flags_fewer_than_eight_warm_refits_and_states_the_trade():
    """Eight warm refits of each way: no flag; seven of one: the flag. The trade sentence gives
    the medians and which way loses more."""
    prefetched = STEADY + stream(0.1, 2.0, 0.2) + stream(2.45, 3.0, 0.1)  # 14.5 lost, 10 in the prefetch
    paused = STEADY + stream(0.05, 0.5, 0.1) + stream(2.03, 3.0, 0.1)  # 15.3 lost
    head = {"model": "m", "model_bytes": 2**20, "trainers": "t", "server": "s", "clients": 1, "machine": "x",
            "date": "d", "versions": {}}
    rows = [{**head, **_row("pause", [paused], 2.0, None), "stall_s": [1.5]} for _ in range(8)]
    rows += [{**head, **_row("prefetch", [prefetched], 2.4, 2.0), "stall_s": [0.45]} for _ in range(8)]
    rows = [{**rows[-1], "version": 1, "cold": True, "stall_s": [9.0]},  # the cold ones are left out
            {**rows[0], "version": 2, "cold": True, "stall_s": [9.0]}] + rows
    text = bench.table(rows)
    assert "Too few refits" not in text and "~" not in text and "; steady rate over the 3 s before each refit" in text
    assert "| pause | 8 | 1.500 (1.500-1.500) | 15.3 (15.3 to 15.3) |" in text
    assert ("prefetch shortens the longest gap to 30.0% of a paused refit's (0.450 s against 1.500 s), and each "
            "client loses fewer tokens per refit too: 14.5 against 15.3 paused. 10.0 of them") in text
    assert "runs at 50% of its steady rate" in text
    assert "Too few refits for a stable median: 8 warm pause and 7 warm prefetch" in bench.table(rows[:-1])
    even = [r if r["mode"] == "pause" or r["cold"] else {**r, **_row("prefetch", [paused], 2.0, 0.05)} for r in rows]
    assert "and each client loses about as many tokens per refit: 15.3 against 15.3 paused" in bench.table(even)


def test_a_measurement_is_not_appended_to_another_run(tmp_path, monkeypatch):
    """--json naming a file that holds rows is refused before anything starts."""
    old = tmp_path / "stall.jsonl"
    old.write_text('{"version": 1}\n')
    monkeypatch.setattr(bench, "run", lambda ns: pytest.fail("the benchmark started"))
    with pytest.raises(SystemExit, match="already holds rows"):
        bench.main(["--json", str(old)])


def test_a_table_needs_a_warm_refit_of_each_way():
    rows = [{"version": 1, "mode": "prefetch", "cold": True}, {"version": 2, "mode": "pause", "cold": True},
            {"version": 3, "mode": "prefetch", "cold": False}]
    with pytest.raises(ValueError, match=r"no warm refit of \['pause'\]"):
        bench.table(rows)
