"""The rendezvous' key-value store: bound where asked, open only to holders of the job secret,
and nothing received is ever unpickled or executed.

:class:`KeyValueStore` serves the small API megarefit needs (``set`` / ``get`` / ``add`` /
``check`` / ``multi_get`` / ``wait`` / ``delete_key``, bytes values, blocking reads with a
timeout) over its own protocol (:mod:`~megarefit.online.store.server`, standard library
only): JSON headers and raw byte values in length-prefixed frames, a mutual HMAC-SHA256
handshake keyed with the job secret and fresh nonces, then an HMAC-SHA256 tag on every
message in both directions. A process without the secret can neither read nor write, and a
server that does not prove the secret is not talked to. TLS is optional (:class:`StoreTLS`).

The server is a process of its own (a busy serving process, a training loop, does not delay
its answers), listening on the one address it is given (loopback by default). Each client
thread gets its own connection, retried with jittered exponential backoff while the server
refuses, resets or stalls it, within the client's ``connect_timeout`` (a wrong secret fails
at once); a request that needs no answer twice is sent again on a new connection when its
connection breaks.

On a cluster a Redis can hold the table instead
(:class:`~megarefit.online.store.redis_kv.RedisStore`, records still signed with the job
secret); docs/security.md ("Choosing the store") compares them and etcd, with the server
CPU each spends under 512 clients. The embedded store needs no server install, and a job
can serve it from any trainer process.
"""

from __future__ import annotations

import hmac
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from megarefit.errors import MegarefitError
from megarefit.online.store.server import (
    FRAME_MAX,
    HELLO_MAX,
    NONCE_BYTES,
    PROTOCOL,
    TLS_PREAMBLE,
    Channel,
    ProtocolError,
    check_secret,
    checked_wait,
    decode,
    encode,
    hello_json,
    proof,
)


class StoreError(MegarefitError):
    """The store refused a connection (wrong job secret), could not be reached, broke the
    protocol (not a megarefit rendezvous), or a read timed out."""


@dataclass(frozen=True)
class StoreTLS:
    """TLS for the store's connections (PEM files).

    The serving side passes ``certfile`` (its certificate chain) and ``keyfile``; connecting
    sides pass ``cafile`` (the CA that signed it) and, when they connect by an address the
    certificate does not name, ``server_hostname``. The job-secret handshake runs inside TLS."""

    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    server_hostname: str | None = None

    def client_context(self) -> ssl.SSLContext:
        """A verifying client context: ``cafile``, else (the serving side's own connection)
        ``certfile`` when it is self-signed, else the system's CAs."""
        return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.cafile or self.certfile)


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:  # the handshake: one deadline, however slowly a peer trickles bytes
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the handshake did not finish in time")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    n = int.from_bytes(_recv_exactly(sock, 4, deadline), "big")
    if n > limit:
        raise ProtocolError(f"a frame of {n} bytes (at most {limit} here)")
    return _recv_exactly(sock, n, deadline)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(len(payload).to_bytes(4, "big") + payload)


class _Unreachable(Exception):
    """A connection attempt that may succeed later: refused, reset, closed or timed out before the
    handshake finished (a server starting, restarting, or dropping pending connections past its cap)."""


RETRYABLE_SSL = (ssl.SSLEOFError, ssl.SSLZeroReturnError)  # closed mid-TLS-handshake: like a reset
BACKOFF_FIRST, BACKOFF_CAP = 0.02, 1.0  # seconds: the first retry's delay bound, and its ceiling


class _Connection:
    """One authenticated connection (one thread's)."""

    def __init__(self, host: str, port: int, secret: bytes, tls: StoreTLS | None, connect_timeout: float):
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise _Unreachable(str(exc) or type(exc).__name__) from None
        try:
            deadline = time.monotonic() + connect_timeout
            if tls is not None:
                if _recv_exactly(sock, len(TLS_PREAMBLE), deadline) != TLS_PREAMBLE:
                    raise ProtocolError("it does not serve TLS (StoreTLS given here)")
                sock = tls.client_context().wrap_socket(sock, server_hostname=tls.server_hostname or host)
            self.channel = self._handshake(sock, secret, where, deadline)
        except (*RETRYABLE_SSL, ConnectionError, TimeoutError) as exc:
            sock.close()
            raise _Unreachable(f"{type(exc).__name__} during the handshake: {exc}") from None
        except (ProtocolError, OSError, ssl.SSLError, RecursionError) as exc:
            sock.close()
            raise StoreError(f"the server at {where} is not a megarefit rendezvous of this job ({exc}); "
                             "check host, port and TLS settings") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self.sock = sock

    @staticmethod
    def _handshake(sock: socket.socket, secret: bytes, where: str, deadline: float) -> Channel:
        hello = hello_json(_recv_frame(sock, HELLO_MAX, deadline), ("protocol", "nonce"))
        if hello.get("protocol") != PROTOCOL:
            raise ProtocolError(f"it speaks {hello.get('protocol', hello.get('error'))!r}, not {PROTOCOL!r}")
        server_nonce, client_nonce = bytes.fromhex(hello["nonce"]), os.urandom(NONCE_BYTES)
        if len(server_nonce) != NONCE_BYTES:
            raise ProtocolError("a handshake nonce of the wrong length")
        _send_frame(sock, json.dumps({"nonce": client_nonce.hex(),
                                      "proof": proof(secret, "client", server_nonce, client_nonce).hex()}).encode())
        answer = hello_json(_recv_frame(sock, HELLO_MAX, deadline), ("proof",))
        if "error" in answer:
            raise StoreError(f"the rendezvous at {where} refused this process: {answer['error']} (every process "
                             "of the job needs the same secret: secret= or $MEGAREFIT_JOB_SECRET)")
        expected = proof(secret, "server", server_nonce, client_nonce)
        if not hmac.compare_digest(bytes.fromhex(answer["proof"]), expected):
            raise StoreError(f"the server at {where} does not hold the job secret: it is not this job's "
                             "rendezvous; nothing was read from it")
        return Channel(proof(secret, "session", server_nonce, client_nonce), "c")

    def request(self, header: dict[str, Any], values: tuple[bytes, ...], timeout: float | None
                ) -> tuple[dict[str, Any], list[bytes]]:
        self.sock.settimeout(timeout)
        _send_frame(self.sock, self.channel.seal(encode(header, values)))
        return decode(self.channel.open(_recv_frame(self.sock, FRAME_MAX)))

    def close(self) -> None:
        self.sock.close()


def connect(host: str, port: int, secret: bytes, tls: StoreTLS | None, timeout: float) -> _Connection:
    """An authenticated connection, retried with jittered exponential backoff (full jitter:
    a random delay up to 20 ms, doubling to 1 s) while the server refuses, resets, closes or
    stalls it, for at most ``timeout`` seconds in all. A wrong secret, a server without it, or a
    server that is not a megarefit rendezvous fails at once.

    Raises:
        StoreError: refused or not a rendezvous (at once), or unreachable for ``timeout`` seconds
            (names host:port, the attempts and the last error)."""
    start = time.monotonic()
    deadline, bound, attempts = start + timeout, BACKOFF_FIRST, 0
    while True:
        attempts += 1
        try:
            return _Connection(host, port, secret, tls, max(deadline - time.monotonic(), 0.01))
        except _Unreachable as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"cannot reach the rendezvous at {host}:{port} within {timeout:.1f} s "
                                 f"({attempts} attempts; last: {exc}); check that it is serving there and "
                                 "that host and port are the serving side's") from None
            time.sleep(min(left, random.uniform(0.0, bound)))
            bound = min(2 * bound, BACKOFF_CAP)


IDEMPOTENT = frozenset({"set", "get", "check", "delete"})  # sent again on a new connection if one breaks


class KeyValueStore:
    """A client of a served table. ``timeout``: seconds a blocking read waits by default;
    ``secret``: the job secret, ``str`` or ``bytes`` of at least 16 bytes; ``connect_timeout``:
    seconds a connection may take in all, retried with jittered exponential backoff while the
    server refuses, resets or stalls it (starting, restarting, or past its pending cap).

    Raises:
        StoreError: the secret is too short, the store cannot be reached, refused the secret,
            or is not a megarefit rendezvous of this job (names host:port and the fix)."""

    def __init__(self, host: str, port: int, secret: bytes | str, timeout: float, *,
                 tls: StoreTLS | None = None, connect_timeout: float = 30.0):
        try:
            self._secret = check_secret(secret)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        self.host, self.port, self.timeout, self.tls = host, port, timeout, tls
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._connection()  # fail now on a wrong secret or address

    def _connection(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.host, self.port, self._secret, self.tls, self.connect_timeout)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _call(self, header: dict[str, Any], values: tuple[bytes, ...] = (), wait: float = 0.0
              ) -> tuple[dict[str, Any], list[bytes]]:
        """One request; an idempotent one (:data:`IDEMPOTENT`) whose connection breaks (the
        server restarted) is sent once more on a new connection, which is retried for up to
        ``connect_timeout``. ``add`` is never sent twice: it may have been applied."""
        try:
            head, out = self._request(header, values, wait)
        except (ProtocolError, OSError) as exc:
            if header["op"] not in IDEMPOTENT or isinstance(exc, ProtocolError):
                raise self._failed(header, exc) from None
            try:
                head, out = self._request(header, values, wait)
            except (ProtocolError, OSError) as again:
                raise self._failed(header, again) from None
        if "error" in head:
            raise StoreError(f"the rendezvous at {self.host}:{self.port} refused {header['op']!r}: {head['error']}")
        return head, out

    def _failed(self, header: dict[str, Any], exc: BaseException) -> StoreError:
        return StoreError(f"the rendezvous at {self.host}:{self.port} failed during {header['op']!r}: {exc}"
                          + ("" if header["op"] in IDEMPOTENT else " (it may or may not have been applied)"))

    def _request(self, header: dict[str, Any], values: tuple[bytes, ...], wait: float
                 ) -> tuple[dict[str, Any], list[bytes]]:
        conn = self._connection()
        try:
            return conn.request(header, values, wait + self.connect_timeout)
        except BaseException:  # the answer may still come: this connection cannot be used again
            self._local.conn = None
            conn.close()
            raise

    @classmethod
    def serve(cls, host: str, port: int, secret: bytes | str, timeout: float, *,
              tls: StoreTLS | None = None) -> KeyValueStore:
        """Start a table's server process (:mod:`~megarefit.online.store.server`) on ``host:port``
        (``port=0``: a free one) and connect to it. The server lives until this process exits.

        Raises:
            StoreError: the secret is shorter than 16 bytes, the address cannot be bound (in
                use, not an address of this host), or the TLS files cannot be read."""
        try:
            key = check_secret(secret)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        args = [sys.executable, str(Path(__file__).with_name("server.py")), host, str(port)]
        if tls is not None and tls.certfile is not None:
            args += ["--certfile", tls.certfile] + (["--keyfile", tls.keyfile] if tls.keyfile else [])
        server = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(key.hex() + "\n")
        server.stdin.flush()
        line = server.stdout.readline().strip()
        if not line.isdigit():
            server.kill()
            why = server.stderr.read().strip() if server.stderr else ""
            raise StoreError(f"cannot serve the rendezvous on {host}:{port}: {why or 'the server exited'}")
        try:
            client = cls(host, int(line), key, timeout, tls=tls)
        except BaseException:
            server.kill()  # nothing of ours may keep the port
            raise
        client._server = server  # its stdin pipe stays open while this process lives
        return client

    def reopen(self, timeout: float) -> KeyValueStore:
        """Another client of the same store (its own connections), reads waiting ``timeout`` s."""
        return KeyValueStore(self.host, self.port, self._secret, timeout, tls=self.tls,
                             connect_timeout=self.connect_timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self._call({"op": "set", "key": key}, (value.encode() if isinstance(value, str) else bytes(value),))

    def multi_set(self, items: dict[str, bytes]) -> None:
        """Set several keys in one request, at once: a reader sees all of them written or none."""
        self._call({"op": "mset", "keys": list(items)}, tuple(bytes(v) for v in items.values()))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to appear.

        Raises:
            StoreError: it did not appear in time."""
        return self.multi_get([key])[0]

    def _get(self, keys: list[str], seconds: float) -> list[bytes] | None:
        try:
            seconds = checked_wait(seconds)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        head, values = self._call({"op": "get", "keys": list(keys), "timeout": seconds}, wait=seconds)
        if head.get("found") is not True:
            return None
        if len(values) != len(keys):
            raise StoreError(f"the rendezvous at {self.host}:{self.port} answered {len(values)} values for "
                             f"{len(keys)} keys")
        return values

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` seconds (default: the store's) for all.

        Raises:
            StoreError: not all appeared in time."""
        wait = self.timeout if timeout is None else timeout
        values = self._get(keys, wait)
        if values is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {wait:.1f} s")
        return values

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 if absent); the new value."""
        value = self._call({"op": "add", "key": key, "amount": int(amount)})[0].get("value")
        if type(value) is not int:
            raise StoreError(f"the rendezvous at {self.host}:{self.port} answered a non-integer counter")
        return value

    def check(self, keys: Iterable[str]) -> bool:
        return self._call({"op": "check", "keys": list(keys)})[0].get("value") is True

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists.

        Raises:
            StoreError: not within ``timeout`` (default: the store's)."""
        seconds = _seconds(timeout, self.timeout)
        if self._get(keys, seconds) is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {seconds:.1f} s")

    def delete_key(self, key: str) -> bool:
        return self._call({"op": "delete", "key": key})[0].get("value") is True

    def close(self) -> None:
        """Close every thread's connection (the server, if this client started it, keeps running
        until this process exits)."""
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()


__all__ = ["KeyValueStore", "StoreError", "StoreTLS"]
