"""Signed state reads of the rendezvous: the embedded store against Redis and etcd.

    python benchmarks/bench_rendezvous.py [--ranks 16] [--n 2000] [--repeat 5] [--record docs/store_latency.jsonl]
    python benchmarks/bench_rendezvous.py --from-json docs/store_latency.jsonl    # the recorded table

What a receiver's fence costs per cycle: ``Rendezvous.state`` reads every rank's update
sequence and version (2 x ranks signed records) in one round trip and verifies each
record's HMAC-SHA256. The same read is timed on

* the embedded store (``megarefit-store/1``: authenticated connection, every message tagged),
  plain and over TLS (a self-signed certificate made with ``openssl``);
* Redis (``redis-server`` started here, ``requirepass``; ``MGET`` through ``redis``-py, then the
  same verification), if ``redis-server`` and ``redis`` are installed;
* etcd (``etcd`` started here, no auth; one range read of the keys' prefix through its HTTP
  gateway with ``etcd3gw``, then the same verification), if ``etcd`` and ``etcd3gw`` are
  installed;
* ``torch.distributed.TCPStore`` ``multi_get`` of the same keys (unauthenticated, every
  interface; no verification): the floor of a store round trip from Python.

Each row: the median of ``--repeat`` means of ``--n`` calls, with the range.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

from recorded import recorded_main  # benchmarks/recorded.py: the script's folder is on sys.path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(f: Callable[[], object], n: int, repeat: int) -> dict[str, float]:
    """Per-call microseconds: median of ``repeat`` means of ``n`` calls, and the range."""
    f()
    means = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        means.append((time.perf_counter() - t0) / n * 1e6)
    return {"median_us": statistics.median(means), "min_us": min(means), "max_us": max(means)}


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@contextlib.contextmanager
def _process(args: list[str], port: int) -> Iterator[None]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def _records(rdzv, ranks) -> dict[str, bytes]:
    """The signed records a fence reads: full key -> record."""
    keys = [rdzv.prefix + kind + f"{r.tp}.{r.pp}.{r.ep}" for kind in ("seq/", "version/") for r in ranks]
    return dict(zip(keys, rdzv.store.multi_get(keys)))


def _verify(rdzv, keys: list[str], values: list[bytes]) -> list[int]:
    return [int(rdzv.unseal(k, v)) for k, v in zip(keys, values)]


def _redis_row(rdzv, records: dict[str, bytes], secret: str, ns) -> dict[str, float] | None:
    if shutil.which("redis-server") is None:
        return None
    try:
        import redis
    except ImportError:
        return None
    port = _free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--requirepass", secret]
    with _process(args, port):
        client = redis.Redis(host="127.0.0.1", port=port, password=secret)
        client.mset(records)
        keys = list(records)
        return _timed(lambda: _verify(rdzv, keys, client.mget(keys)), ns.n, ns.repeat)


def _etcd_row(rdzv, records: dict[str, bytes], ns) -> dict[str, float] | None:
    if shutil.which("etcd") is None:
        return None
    try:
        from etcd3gw.client import Etcd3Client
    except ImportError:
        return None
    port, peer = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as data:
        args = ["etcd", "--data-dir", data, "--listen-client-urls", f"http://127.0.0.1:{port}",
                "--advertise-client-urls", f"http://127.0.0.1:{port}", "--listen-peer-urls",
                f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}"]
        with _process(args, port):
            client = Etcd3Client(host="127.0.0.1", port=port, api_path="/v3/")
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.status()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            state = "etcd-bench/state/"
            for k, v in records.items():
                client.put(state + k, v)
            keys = list(records)

            def read() -> list[int]:
                got = {meta["key"].decode()[len(state):]: value for value, meta in client.get_prefix(state)}
                return _verify(rdzv, keys, [got[k] for k in keys])

            return _timed(read, max(ns.n // 4, 50), ns.repeat)


def _tls_files(folder: str) -> tuple[str, str] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = f"{folder}/cert.pem", f"{folder}/key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert], check=True,
                   capture_output=True)
    return cert, key


def measure(ns) -> dict:
    import os
    import platform
    import secrets
    from datetime import timedelta

    import torch.distributed as dist

    import megarefit
    from megarefit.demo.bench import machine
    from megarefit.layout import RankCoord
    from megarefit.online.store.kv import StoreTLS
    from megarefit.online.store.rendezvous import Rendezvous

    secret = secrets.token_hex(32)
    ranks = [RankCoord(t, 0, 0) for t in range(ns.ranks)]
    served = Rendezvous.serve(job="bench", secret=secret)
    for r in ranks:
        served.begin_update(r)
        served.end_update(r, 1)
    rdzv = Rendezvous.connect("127.0.0.1", served.port, job="bench", secret=secret)
    records = _records(rdzv, ranks)
    rows = {"embedded store": _timed(lambda: rdzv.state(ranks), ns.n, ns.repeat)}
    with tempfile.TemporaryDirectory() as folder:
        files = _tls_files(folder)
        if files is not None:
            tls = Rendezvous.serve(job="bench", secret=secret, tls=StoreTLS(certfile=files[0], keyfile=files[1]))
            for key, record in records.items():
                tls.store.set(key, record)
            peer = Rendezvous.connect("127.0.0.1", tls.port, job="bench", secret=secret, tls=StoreTLS(cafile=files[0]))
            rows["embedded store, TLS"] = _timed(lambda: peer.state(ranks), ns.n, ns.repeat)
    for name, row in (("Redis (MGET)", _redis_row(rdzv, records, secret, ns)),
                      ("etcd (range read, HTTP gateway)", _etcd_row(rdzv, records, ns))):
        if row is not None:
            rows[name] = row
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for k, v in records.items():
        tcp.set(k, v)
    keys = list(records)
    rows["TCPStore multi_get (no verification)"] = _timed(lambda: tcp.multi_get(keys), ns.n, ns.repeat)
    versions = {"python": f"Python {platform.python_version()}", "megarefit": f"megarefit {megarefit.__version__}"}
    for tool, name, pattern in (("redis-server", "Redis", r"v=([0-9.]+)"), ("etcd", "etcd", r"Version: ([0-9.]+)")):
        if shutil.which(tool):
            found = re.search(pattern, subprocess.run([tool, "--version"], capture_output=True, text=True).stdout)
            versions[tool] = f"{name} {found.group(1) if found else '?'}"
    return {"ranks": ns.ranks, "records": len(records), "n": ns.n, "repeat": ns.repeat, "rows": rows,
            "machine": machine(), "cores": os.cpu_count(), "versions": versions, "date": time.strftime("%Y-%m-%d")}


def print_table(result: dict) -> None:
    print(f"A signed state read of {result['ranks']} trainer ranks ({result['records']} records, one round trip, "
          f"each record's HMAC checked), per call: median of {result['repeat']} means, with the range; "
          f"{result['machine']}, {result['date']}, loopback, {', '.join(result['versions'].values())}.\n")
    print("| store | median | range |")
    print("|---|---:|---:|")
    for name, row in result["rows"].items():
        print(f"| {name} | {row['median_us']:.0f} us | {row['min_us']:.0f}-{row['max_us']:.0f} us |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    recorded_main(ap, measure, print_table)


if __name__ == "__main__":
    main()
