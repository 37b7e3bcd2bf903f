"""The rendezvous store on a shared cluster: nothing received from a socket is unpickled or
run, every message is authenticated, idle connections cannot keep members out, short secrets
are refused, replay protection needs no clock, TLS works.

Attackers here are real sockets on loopback: a fake store that answers with a code-running
pickle (before and after a correct handshake), hundreds of idle connections, a tampered and a
replayed frame. Whatever megarefit executed would create a marker file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import threading
import time

import pytest

from megarefit.errors import MegarefitError
from megarefit.online.store.kv import KeyValueStore, StoreError, StoreTLS
from megarefit.online.store.rendezvous import Heartbeat, Rendezvous
from megarefit.online.store.server import NONCE_BYTES, Channel, StoreServer, encode, proof

SECRET = b"store-test-secret-" + os.urandom(8).hex().encode()


class _RunsCommand:
    """Unpickling this runs a shell command (what a malicious store would send)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def _recv_frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    n, body = int.from_bytes(head, "big"), b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return body


@contextlib.contextmanager
def _fake_store(answer):
    """A TCP server on a free loopback port: ``answer(conn)`` talks to each client."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                with contextlib.suppress(OSError):
                    answer(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


@contextlib.contextmanager
def _in_thread_server(secret: bytes, **options):
    """megarefit's StoreServer on a free loopback port, on an event loop in a thread (its
    handshake timeout and pending cap can be set small here)."""
    loop = asyncio.new_event_loop()
    store = StoreServer(secret, **options)
    server = loop.run_until_complete(asyncio.start_server(store.handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        async def shutdown():
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_fake_store_answering_with_a_pickle_runs_nothing(tmp_path):
    """The old managers client unpickled a store's answer. Here a fake store sends a pickle
    that would create a marker file: first instead of the hello, then (knowing the secret,
    as a caller of vLLM's /init_weight_transfer_engine may choose it) inside a correctly
    tagged message. The client refuses both, naming the address; the marker never appears."""
    marker = tmp_path / "ran"
    evil = pickle.dumps(_RunsCommand(f"touch {marker}"))
    assert b"system" in evil

    with _fake_store(lambda conn: conn.sendall(_frame(evil))) as port:
        with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{port} is not a megarefit rendezvous"):
            KeyValueStore("127.0.0.1", port, SECRET, 2.0)

    def knows_the_secret(conn):
        server_nonce = os.urandom(NONCE_BYTES)
        conn.sendall(_frame(json.dumps({"protocol": "megarefit-store/1", "nonce": server_nonce.hex()}).encode()))
        client_nonce = bytes.fromhex(json.loads(_recv_frame(conn))["nonce"])
        conn.sendall(_frame(json.dumps({"proof": proof(SECRET, "server", server_nonce, client_nonce).hex()}).encode()))
        channel = Channel(proof(SECRET, "session", server_nonce, client_nonce), "s")
        while True:
            channel.open(_recv_frame(conn))
            conn.sendall(_frame(channel.seal(evil)))  # tagged: only its content is hostile

    with _fake_store(knows_the_secret) as port:
        store = KeyValueStore("127.0.0.1", port, SECRET, 2.0)
        for call in (lambda: store.get("k"), lambda: store.add("n", 1), lambda: store.check(["k"])):
            with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{port} failed during"):
                call()
    time.sleep(0.2)
    assert not marker.exists()


def test_a_server_that_cannot_prove_the_secret_is_not_talked_to():
    def wrong_proof(conn):
        conn.sendall(_frame(json.dumps({"protocol": "megarefit-store/1", "nonce": os.urandom(32).hex()}).encode()))
        _recv_frame(conn)
        conn.sendall(_frame(json.dumps({"proof": os.urandom(32).hex()}).encode()))
        time.sleep(0.5)

    with _fake_store(wrong_proof) as port:
        with pytest.raises(StoreError, match="does not hold the job secret: it is not this job's rendezvous"):
            KeyValueStore("127.0.0.1", port, SECRET, 2.0)


def test_secrets_shorter_than_16_bytes_are_refused_and_bytes_secrets_work():
    for short in ("abc", b"abc", "fifteen-bytes!!"):
        with pytest.raises(MegarefitError, match=r"has \d+ bytes; at least 16 are required"):
            Rendezvous.serve(job="short", secret=short)
    raw = b"\xff\xfe" + os.urandom(30)  # not UTF-8
    rdzv = Rendezvous.serve(job="raw", secret=raw)
    peer = Rendezvous.connect("127.0.0.1", rdzv.port, job="raw", secret=raw)
    again = Rendezvous.connect("127.0.0.1", rdzv.port, job="raw", secret=rdzv.secret)  # the text form
    with pytest.raises(MegarefitError, match="at least 16 are required"):
        Rendezvous.connect("127.0.0.1", rdzv.port, job="raw", secret=raw[:3])
    beat = Heartbeat(peer, "rx", interval=0.05)  # the receiver's heartbeat took the secret as text before
    try:
        deadline = time.monotonic() + 10
        while again.store.add(again.prefix + "beat/rx", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    assert again.store.add(again.prefix + "beat/rx", 0) >= 2
    rdzv.mark_consumed(4)
    again.wait_consumed(4, timeout=5)


def test_members_are_served_past_hundreds_of_idle_connections():
    """400 connections that never answer the handshake, against the real server process
    (pending cap 256: the oldest are dropped); a member still connects and works at once."""
    rdzv = Rendezvous.serve(job="idle", secret=SECRET)
    idle = [socket.create_connection(("127.0.0.1", rdzv.port), timeout=10) for _ in range(400)]
    try:
        t0 = time.monotonic()
        member = Rendezvous.connect("127.0.0.1", rdzv.port, job="idle", secret=SECRET)
        member.mark_consumed(1)
        rdzv.wait_consumed(1, timeout=10)
        assert time.monotonic() - t0 < 10
        dropped = 0
        for s in idle[:100]:  # the oldest were dropped when the cap was reached
            s.settimeout(5)
            with contextlib.suppress(OSError):
                while s.recv(4096):
                    pass
                dropped += 1
        assert dropped == 100
    finally:
        for s in idle:
            s.close()


def test_a_silent_connection_is_closed_after_the_handshake_timeout_and_the_cap_holds():
    with _in_thread_server(SECRET, handshake_timeout=2.0, max_pending=8) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        store = KeyValueStore("127.0.0.1", port, SECRET, 2.0)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        t0 = time.monotonic()
        for s in idle:
            with pytest.raises(ConnectionError):  # closed (EOF or reset), not a timeout of this test's socket
                while True:
                    _recv_frame(s)  # the hello (unless dropped at once), then closed: by the cap or the timeout
        assert time.monotonic() - t0 < 9
        for s in idle:
            s.close()


def _session(port: int) -> tuple[socket.socket, Channel]:
    """A raw authenticated connection (what a client holding the secret could send anything on)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello = json.loads(_recv_frame(sock))
    sn, cn = bytes.fromhex(hello["nonce"]), os.urandom(NONCE_BYTES)
    sock.sendall(_frame(json.dumps({"nonce": cn.hex(), "proof": proof(SECRET, "client", sn, cn).hex()}).encode()))
    _recv_frame(sock)
    return sock, Channel(proof(SECRET, "session", sn, cn), "c")


def test_malformed_frames_end_only_their_own_connection():
    """The real server process, with its standard error unread: hostile handshakes (an error
    object, JSON nested thousands deep, garbage) from 200 connections, and malformed requests
    from a holder of the secret (a NaN wait, an infinite amount, an unknown operation) are
    answered or dropped; members are served all along."""
    rdzv = Rendezvous.serve(job="hostile", secret=SECRET)
    port = rdzv.port
    hostile = [json.dumps({"error": "x"}).encode(), b"[" * 4000, b"\xff" * 100, b"{}"]
    for i in range(200):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            _recv_frame(s)
            s.sendall(_frame(hostile[i % len(hostile)]))
            with contextlib.suppress(OSError):
                s.recv(4096)
    sock, channel = _session(port)
    for header in ({"op": "get", "keys": ["missing"], "timeout": float("nan")},
                   {"op": "add", "key": "n", "amount": 1e400}, {"op": "evaluate", "key": "x"}):
        sock.sendall(_frame(channel.seal(encode(header, []))))
        answer = json.loads(channel.open(_recv_frame(sock))[4:].split(b'"sizes"')[0].rstrip(b",") + b"}")
        assert "malformed" in answer["error"], answer
    sock.close()
    member = Rendezvous.connect("127.0.0.1", port, job="hostile", secret=SECRET)
    member.mark_consumed(9)
    rdzv.wait_consumed(9, timeout=10)
    with pytest.raises(StoreError, match="finite number of seconds"):
        member.store.wait(["x"], timeout=float("inf"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_handshakes_count_as_pending(tmp_path):
    """With TLS, 300 connections that never start it are pending like any other: a member
    connects past them at once."""
    cert, key = _certificate(tmp_path)
    rdzv = Rendezvous.serve(job="tls-idle", secret=SECRET, tls=StoreTLS(certfile=cert, keyfile=key))
    idle = [socket.create_connection(("127.0.0.1", rdzv.port), timeout=10) for _ in range(300)]
    try:
        t0 = time.monotonic()
        member = Rendezvous.connect("127.0.0.1", rdzv.port, job="tls-idle", secret=SECRET, tls=StoreTLS(cafile=cert))
        member.mark_consumed(1)
        assert time.monotonic() - t0 < 5
    finally:
        for s in idle:
            s.close()


def test_the_server_exits_with_its_process_even_with_members_connected():
    store = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    member = KeyValueStore("127.0.0.1", store.port, SECRET, 5.0, connect_timeout=1.0)  # it retries that long
    member.set("k", b"v")
    server = store._server
    assert server is not None and server.poll() is None
    server.stdin.close()  # what happens when the serving process exits
    server.wait(timeout=10)
    with pytest.raises(StoreError, match=rf"cannot reach the rendezvous at 127\.0\.0\.1:{store.port}"):
        member.get("k")


def test_an_interrupted_request_never_hands_its_answer_to_the_next(monkeypatch):
    import megarefit.online.store.kv as store_module

    store = KeyValueStore.serve("127.0.0.1", 0, SECRET, 5.0)
    store.set("a", b"1")
    real = store_module._recv_frame
    calls = []

    def interrupted(sock, limit, deadline=None):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt  # after the request was sent, before its answer was read
        return real(sock, limit, deadline)

    monkeypatch.setattr(store_module, "_recv_frame", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.add("n", 41)
    assert store.check(["nope"]) is False and store.add("m", 1) == 1 and store.get("a") == b"1"
    assert store.add("n", 0) == 41  # the interrupted add did happen


def test_every_message_is_authenticated():
    """After a correct handshake, a frame with a wrong tag, or a correct frame sent again
    (replayed), closes the connection without an answer; the table is unchanged."""
    with _in_thread_server(SECRET) as port:
        store = KeyValueStore("127.0.0.1", port, SECRET, 2.0)
        sock, channel = _session(port)
        sealed = channel.seal(encode({"op": "set", "key": "k"}, [b"forged"]))
        sock.sendall(_frame(sealed[:-1] + bytes([sealed[-1] ^ 1])))
        with pytest.raises(ConnectionError):
            _recv_frame(sock)
        sock, channel = _session(port)
        sealed = channel.seal(encode({"op": "add", "key": "n", "amount": 1}, []))
        sock.sendall(_frame(sealed))
        _recv_frame(sock)
        sock.sendall(_frame(sealed))  # the same bytes again
        with pytest.raises(ConnectionError):
            _recv_frame(sock)
        assert not store.check(["k"]) and store.add("n", 0) == 1


def test_replays_are_judged_by_the_store_counter_not_by_clocks(monkeypatch):
    """A trainer restarted on a host whose clock is behind: its records are newer all the same
    (before, the record counter started at the wall clock and the reader refused them)."""
    rdzv = Rendezvous.serve(job="clock", secret=SECRET)
    reader = Rendezvous.connect("127.0.0.1", rdzv.port, job="clock", secret=SECRET)
    rdzv.put("version/0.0.0", "1")
    assert reader.fetch("version/0.0.0") == b"1"
    monkeypatch.setattr(time, "time_ns", lambda: 1)
    monkeypatch.setattr(time, "time", lambda: 1e-9)
    restarted = Rendezvous.connect("127.0.0.1", rdzv.port, job="clock", secret=SECRET)
    restarted.put("version/0.0.0", "2")
    assert reader.fetch("version/0.0.0") == b"2"


def _certificate(folder) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost: (certfile, keyfile)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(tmp_path):
    cert, key = _certificate(tmp_path)
    rdzv = Rendezvous.serve(job="tls", secret=SECRET, tls=StoreTLS(certfile=cert, keyfile=key))
    peer = Rendezvous.connect("127.0.0.1", rdzv.port, job="tls", secret=SECRET, tls=StoreTLS(cafile=cert))
    rdzv.mark_consumed(2)
    peer.wait_consumed(2, timeout=5)
    with pytest.raises(StoreError, match="is not a megarefit rendezvous"):  # plain TCP to a TLS store
        KeyValueStore("127.0.0.1", rdzv.port, SECRET, 2.0, connect_timeout=1.0)
    with pytest.raises(StoreError, match="CERTIFICATE_VERIFY_FAILED"):  # a CA that did not sign it
        Rendezvous.connect("127.0.0.1", rdzv.port, job="tls", secret=SECRET, tls=StoreTLS())


def test_a_vllm_server_with_a_job_secret_joins_no_store_a_caller_picks(monkeypatch):
    """A caller of /init_weight_transfer_engine against a server started with
    $MEGAREFIT_JOB_SECRET: naming another secret is refused before any connection, and leaving
    it out makes the worker prove the server's own secret, which a store of the caller's does
    not hold."""
    pytest.importorskip("vllm")
    from megarefit.integrations.vllm import check_init_secret
    from megarefit.online.store.rendezvous import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert check_init_secret(None) is None and check_init_secret(SECRET.decode()) == SECRET.decode()
    with pytest.raises(MegarefitError, match=r"init refused: its secret differs from this vLLM server's"):
        check_init_secret("the-callers-own-secret-0123456789")
    callers = Rendezvous.serve(job="rl", secret="the-callers-own-secret-0123456789")
    with pytest.raises(StoreError, match="refused this process: wrong job secret"):
        Rendezvous.connect("127.0.0.1", callers.port, job="rl")  # what the worker does without init's secret


def test_a_version_no_receiver_consumed_is_not_named_as_a_rank():
    from megarefit.online.store.rendezvous import Rendezvous, RendezvousTimeout

    rdzv = Rendezvous.serve(job="consumed-message")
    with pytest.raises(RendezvousTimeout, match=r"no receiver consumed version 7 after .* check that the receivers") as e:
        rdzv.wait_consumed(7, timeout=0.2)
    assert "trainer ranks" not in str(e.value)
