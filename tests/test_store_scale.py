"""The rendezvous store at cluster scale: a thousand clients connecting at once are all served
(the server drops the oldest pending handshakes past its cap, clients reconnect with jittered
backoff), a restarted server is reconnected to, a server that never comes back fails each
client at its own timeout naming the address, and a wrong secret is never retried.

Real server processes on free loopback ports; clients are threads of this process."""

from __future__ import annotations

import resource
import socket
import threading
import time
import types

import pytest

from megarefit.online.store import kv
from megarefit.online.store.kv import KeyValueStore, StoreError

SECRET = b"store-scale-secret-0123456789abcdef"
CLIENTS = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(store: KeyValueStore) -> None:
    """End the server process ``store`` started (what the serving process's exit does)."""
    server = store._server
    assert server is not None
    server.stdin.close()
    server.wait(timeout=10)


@pytest.fixture
def many_files():
    """Room for a thousand client sockets in this process (and their server ends in the server's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * CLIENTS + 256))
    if want < 2 * CLIENTS + 64:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is below {2 * CLIENTS + 64}: raise it (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _all_at_once(monkeypatch, n: int) -> None:
    """Every thread's first TCP connect waits until ``n`` are open: the server then holds ``n``
    connections at once before any handshake (what a thousand ranks starting together do, on
    more cores than this test has). Later attempts (reconnects) do not wait."""
    opened, first = threading.Barrier(n, timeout=60), threading.local()
    real = socket.create_connection

    def create_connection(*args, **kwargs):
        sock = real(*args, **kwargs)
        if not getattr(first, "done", False):
            first.done = True
            opened.wait()
        return sock

    monkeypatch.setattr(kv, "socket", types.SimpleNamespace(create_connection=create_connection, socket=socket.socket))


def test_a_thousand_clients_connecting_at_once_are_all_served(many_files, monkeypatch):
    """1000 threads connect at once (four times the server's 256 pending handshakes: the oldest
    are dropped, and reconnect) and count themselves in; every one succeeds, and all 1000 stay
    connected."""
    served = KeyValueStore.serve("127.0.0.1", 0, SECRET, 30.0)
    _all_at_once(monkeypatch, CLIENTS)
    start, done = threading.Barrier(CLIENTS), threading.Barrier(CLIENTS + 1, timeout=120)
    clients: list[KeyValueStore] = []
    errors: list[BaseException] = []

    def member() -> None:
        try:
            start.wait(60)
            store = KeyValueStore("127.0.0.1", served.port, SECRET, 30.0, connect_timeout=60.0)
            store.add("members", 1)
            clients.append(store)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the count
            errors.append(exc)
        done.wait()

    old = threading.stack_size(256 << 10)
    try:
        threads = [threading.Thread(target=member, daemon=True) for _ in range(CLIENTS)]
    finally:
        threading.stack_size(old)
    t0 = time.monotonic()
    for t in threads:
        t.start()
    done.wait()
    elapsed = time.monotonic() - t0
    try:
        assert not errors, f"{len(errors)} of {CLIENTS} failed, e.g. {errors[0]!r}"
        assert served.add("members", 0) == CLIENTS and len(clients) == CLIENTS
        assert elapsed < 60, f"{CLIENTS} connects took {elapsed:.1f} s"
    finally:
        for store in clients:
            store.close()
        _stop(served)


def test_a_restarted_server_is_reconnected_to():
    """The server goes away and comes back on the same port: an existing client's next
    idempotent requests, and a client created while it is down, reach the new one."""
    first = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    port = first.port
    client = KeyValueStore("127.0.0.1", port, SECRET, 5.0, connect_timeout=20.0)
    client.set("before", b"1")
    _stop(first)
    box: list[KeyValueStore] = []
    restart = threading.Timer(1.0, lambda: box.append(KeyValueStore.serve("127.0.0.1", port, SECRET, 5.0)))
    restart.start()
    try:
        t0 = time.monotonic()
        late = KeyValueStore("127.0.0.1", port, SECRET, 5.0, connect_timeout=20.0)  # refused until the restart
        assert time.monotonic() - t0 >= 0.9
        client.set("after", b"2")  # its old connection is broken: sent again on a new one
        assert late.get("after") == b"2" and not client.check(["before"])  # a new server, a new table
    finally:
        restart.join()
        for store in box:
            _stop(store)


def test_a_server_that_never_comes_back_fails_each_client_at_its_timeout():
    served = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    port = served.port
    client = KeyValueStore("127.0.0.1", port, SECRET, 5.0, connect_timeout=1.5)
    _stop(served)
    for call in (lambda: KeyValueStore("127.0.0.1", port, SECRET, 5.0, connect_timeout=1.5),
                 lambda: client.get("k")):
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=rf"cannot reach the rendezvous at 127\.0\.0\.1:{port} within 1\.5 s "
                                             r"\(\d+ attempts; last: .*refused"):
            call()
        assert 1.4 < time.monotonic() - t0 < 3.0
    nobody = _free_port()
    with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{nobody} within 0\.5 s"):
        KeyValueStore("127.0.0.1", nobody, SECRET, 5.0, connect_timeout=0.5)


def test_an_add_whose_connection_broke_is_not_sent_again():
    """``add`` is not idempotent: when its connection breaks, it fails (it may have been
    applied) instead of adding twice; the next call reconnects."""
    first = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    port = first.port
    client = KeyValueStore("127.0.0.1", port, SECRET, 5.0, connect_timeout=10.0)
    client.add("n", 1)
    _stop(first)
    second = KeyValueStore.serve("127.0.0.1", port, SECRET, 5.0)
    try:
        with pytest.raises(StoreError, match=r"failed during 'add'.*may or may not have been applied"):
            client.add("n", 1)
        assert client.add("n", 5) == 5
    finally:
        _stop(second)


def test_a_wrong_secret_fails_at_once_and_is_not_retried():
    served = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="refused this process: wrong job secret"):
            KeyValueStore("127.0.0.1", served.port, b"another-secret-0123456789", 5.0, connect_timeout=30.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        _stop(served)
