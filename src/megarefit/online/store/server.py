"""The rendezvous store's wire protocol and its server (standard library only).

Nothing on the wire is ever unpickled or executed: every message is a length-prefixed frame
holding a JSON header and raw byte values, and every frame after the handshake carries an
HMAC-SHA256 tag. The protocol, ``megarefit-store/1``::

    frame      = length (4 bytes, big-endian) | payload
    handshake  server -> {"protocol": "megarefit-store/1", "nonce": sn}       (32 random bytes, hex)
               client -> {"nonce": cn, "proof": HMAC(secret, "client" sn cn)}
               server -> {"proof": HMAC(secret, "server" sn cn)}  |  {"error": "..."} and close
    session    key = HMAC(secret, "session" sn cn)        (fresh for every connection)
    message    payload = body | HMAC(key, direction | counter | body)
               body    = header length (4 bytes) | header JSON | values (raw bytes, "sizes" in the header)

Both sides prove the secret (a client does not talk to a store that cannot), each direction
numbers its messages (a frame replayed, reordered or moved to another connection fails its
tag), and a handshake frame larger than :data:`HELLO_MAX` bytes or not finished within the
handshake timeout closes the connection. Pending (not yet authenticated) connections are
capped: past the cap the oldest pending one is dropped, so idle connections cannot keep the
job's members out. TLS (``--certfile`` / ``--keyfile``) encrypts the wire: the server sends
:data:`TLS_PREAMBLE` in plain, then both sides start TLS, and the handshake runs inside it
(TLS starts inside the connection's handshake window, so pending TLS connections are capped
and timed out like any other).

Run as a script by :meth:`megarefit.online.store.kv.KeyValueStore.serve`:
``python server.py HOST PORT [--certfile F --keyfile F]``, the job secret as hex on
the first line of standard input (never on the command line). It binds ``HOST:PORT``
(``PORT`` 0: a free one), prints the port, and serves one table until its standard input
closes, i.e. until the serving process exits. Its own process, so it answers at once however
busy the serving process's Python threads are (a training loop, a receiver).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import hmac
import json
import os
import ssl
import sys
import threading
from typing import Any

PROTOCOL = "megarefit-store/1"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
TAG_BYTES = 32
HELLO_MAX = 4096  # bytes of a handshake frame (before authentication)
FRAME_MAX = 1 << 30  # bytes of an authenticated frame (manifests of large models are tens of MB)
HANDSHAKE_TIMEOUT = 10.0  # seconds
MAX_PENDING = 256  # connections not yet authenticated; past it the oldest is dropped (clients retry)
BACKLOG = 4096  # connections the kernel queues before accept (capped by net.core.somaxconn)
MAX_WAIT = 86400.0  # seconds a blocking read may wait
TLS_PREAMBLE = b"MRSTLS1\n"  # a TLS store's first (plain) bytes: the client starts TLS after them
OPS = ("set", "mset", "get", "add", "check", "delete")


class ProtocolError(Exception):
    """A peer broke the protocol: malformed frame, bad tag, wrong proof, or too large."""


def check_secret(secret: bytes | str) -> bytes:
    """``secret`` as bytes (text is UTF-8 encoded; bytes need not be text).

    Raises:
        ValueError: shorter than :data:`MIN_SECRET_BYTES` bytes (names the fix)."""
    key = secret.encode("utf-8", "surrogateescape") if isinstance(secret, str) else bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"the job secret has {len(key)} bytes; at least {MIN_SECRET_BYTES} are required: use a "
                         "long random one, e.g. secrets.token_hex(32)")
    return key


def proof(secret: bytes, role: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 proof that a side holds ``secret``, bound to both nonces (``role``: client,
    server, or session for the connection's message key)."""
    msg = b"\0".join([PROTOCOL.encode(), role.encode(), server_nonce, client_nonce])
    return hmac.new(secret, msg, hashlib.sha256).digest()


class Channel:
    """Per-connection message authentication: tags this side's frames and checks the peer's,
    each direction with its own counter (``side``: ``"c"`` client or ``"s"`` server)."""

    def __init__(self, key: bytes, side: str):
        self._key = key
        self._out, self._in = (b"c", b"s") if side == "c" else (b"s", b"c")
        self._sent = 0
        self._received = 0

    def _tag(self, direction: bytes, counter: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + counter.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        """One frame's payload: ``body`` and its tag."""
        tag = self._tag(self._out, self._sent, body)
        self._sent += 1
        return body + tag

    def open(self, payload: bytes) -> bytes:
        """The body of the peer's next frame.

        Raises:
            ProtocolError: the tag does not match (forged, replayed, reordered or truncated)."""
        body, tag = payload[:-TAG_BYTES], payload[-TAG_BYTES:]
        if len(payload) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(self._in, self._received, body)):
            raise ProtocolError("a message failed its authentication tag (forged, replayed or cut)")
        self._received += 1
        return body


def encode(header: dict[str, Any], values: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    """A message body: the JSON header (with the values' ``sizes``) and the raw values."""
    head = json.dumps({**header, "sizes": [len(v) for v in values]}, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "big") + head + b"".join(values)


def decode(body: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """(header, values) of a message body.

    Raises:
        ProtocolError: not a header and values in this protocol's form."""
    if len(body) < 4:
        raise ProtocolError("a message shorter than its header length")
    n = int.from_bytes(body[:4], "big")
    try:
        header = json.loads(body[4:4 + n])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("a message header that is not JSON") from None
    sizes = header.get("sizes") if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise ProtocolError("a message header without valid value sizes")
    if 4 + n + sum(sizes) != len(body):
        raise ProtocolError("a message whose values do not add up to its length")
    values, at = [], 4 + n
    for size in sizes:
        values.append(body[at:at + size])
        at += size
    return header, values


def hello_json(data: bytes, fields: tuple[str, ...]) -> dict[str, str]:
    """A handshake frame: a JSON object whose ``fields`` are all hex strings or, at the
    server's refusal, ``{"error": text}`` (returned as is).

    Raises:
        ProtocolError: anything else."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("a handshake frame that is not JSON") from None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return {"error": obj["error"]}
    if not isinstance(obj, dict) or not all(isinstance(obj.get(f), str) for f in fields):
        raise ProtocolError(f"a handshake frame without {list(fields)}")
    try:
        for f in fields:
            if f != "protocol":
                bytes.fromhex(obj[f])
    except ValueError:
        raise ProtocolError("a handshake field that is not hex") from None
    return obj


def checked_wait(seconds: Any) -> float:
    """A blocking read's timeout: a finite number of seconds in [0, :data:`MAX_WAIT`].

    Raises:
        ValueError: anything else (NaN would spin the server, infinity overflows sockets)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_WAIT:
        raise ValueError(f"timeout {seconds!r}: give a finite number of seconds from 0 to {MAX_WAIT:.0f}")
    return float(seconds)


class Table:
    """The served table: bytes values; reads that wait for keys to appear (single-threaded,
    on the server's event loop)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def get(self, keys: list[str], timeout: float) -> list[bytes] | None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not all(k in self._data for k in keys):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return [self._data[k] for k in keys]

    async def apply(self, header: dict[str, Any], values: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """One request: the response's header and values.

        Raises:
            ValueError: a malformed request (unknown operation, a timeout that is not a finite
                number of seconds up to :data:`MAX_WAIT`, an amount that is not an integer)."""
        op = header.get("op")
        if op == "set":
            self._data[str(header["key"])] = values[0]
            self._notify()
            return {}, []
        if op == "mset":  # several keys in one step: no reader sees some written and not the others
            keys = [str(k) for k in header["keys"]]
            if len(keys) != len(values):
                raise ValueError(f"mset of {len(keys)} keys with {len(values)} values")
            self._data.update(zip(keys, values))
            self._notify()
            return {}, []
        if op == "get":
            found = await self.get([str(k) for k in header["keys"]], checked_wait(header["timeout"]))
            return ({"found": False}, []) if found is None else ({"found": True}, found)
        if op == "add":
            key = str(header["key"])
            amount = header["amount"]
            if type(amount) is not int:
                raise ValueError(f"amount {amount!r} is not an integer")
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._notify()
            return {"value": value}, []
        if op == "check":
            return {"value": all(str(k) in self._data for k in header["keys"])}, []
        if op == "delete":
            return {"value": self._data.pop(str(header["key"]), None) is not None}, []
        raise ValueError(f"unknown operation {op!r}; known: {list(OPS)}")


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    n = int.from_bytes(await reader.readexactly(4), "big")
    if n > limit:
        raise ProtocolError(f"a frame of {n} bytes (at most {limit} here)")
    return await reader.readexactly(n)


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(len(payload).to_bytes(4, "big") + payload)


class StoreServer:
    """Serves one :class:`Table` to clients that prove the job secret."""

    def __init__(self, secret: bytes, *, handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 max_pending: int = MAX_PENDING, tls: ssl.SSLContext | None = None):
        self.secret = check_secret(secret)
        self.tls = tls  # TLS starts inside each connection's handshake window, after admission
        self.table = Table()
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self._pending: collections.OrderedDict[int, asyncio.StreamWriter] = collections.OrderedDict()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
        server_nonce = os.urandom(NONCE_BYTES)
        write_frame(writer, json.dumps({"protocol": PROTOCOL, "nonce": server_nonce.hex()}).encode())
        await writer.drain()
        answer = hello_json(await read_frame(reader, HELLO_MAX), ("nonce", "proof"))
        if "nonce" not in answer or "proof" not in answer:
            raise ProtocolError("a client's handshake without nonce and proof")
        client_nonce = bytes.fromhex(answer["nonce"])
        if len(client_nonce) != NONCE_BYTES or not hmac.compare_digest(
                bytes.fromhex(answer["proof"]), proof(self.secret, "client", server_nonce, client_nonce)):
            write_frame(writer, json.dumps({"error": "wrong job secret"}).encode())
            await writer.drain()
            raise ProtocolError("a client without the job secret")
        self._pending.pop(id(writer), None)  # proven: no longer droppable, though the drain below may yield
        write_frame(writer, json.dumps({"proof": proof(self.secret, "server", server_nonce,
                                                       client_nonce).hex()}).encode())
        await writer.drain()
        return Channel(proof(self.secret, "session", server_nonce, client_nonce), "s")

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Count ``writer`` as pending, dropping the oldest pending connection past the cap."""
        while len(self._pending) >= self.max_pending:
            _, oldest = self._pending.popitem(last=False)
            oldest.close()
        self._pending[id(writer)] = writer

    async def _open(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
        """TLS (if served) and the secret handshake of a new connection. TLS starts after the
        plain :data:`TLS_PREAMBLE`, which the client awaits before its ClientHello: reading is
        paused first, so no TLS byte is read as plain data."""
        if self.tls is not None:
            writer.transport.pause_reading()
            writer.write(TLS_PREAMBLE)
            await writer.start_tls(self.tls)
        return await self._handshake(reader, writer)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: admitted as pending, authenticated within the handshake timeout,
        then served request by request. Whatever a peer sends ends at most its own connection."""
        self._admit(writer)
        try:
            channel = await asyncio.wait_for(self._open(reader, writer), self.handshake_timeout)
            self._pending.pop(id(writer), None)
            while True:
                header, values = decode(channel.open(await read_frame(reader, FRAME_MAX)))
                try:
                    response = await self.table.apply(header, values)
                except Exception as exc:  # noqa: BLE001 - a malformed request: answered, the server goes on
                    response = {"error": f"malformed {header.get('op')!r} request: {type(exc).__name__}: "
                                         f"{str(exc)[:200]}"}, []
                write_frame(writer, channel.seal(encode(*response)))
                await writer.drain()
        except Exception:  # noqa: BLE001 - a peer's bad frame, a dropped or timed-out connection
            pass
        except asyncio.CancelledError:  # the server shuts down: this connection ends with it
            pass
        finally:
            self._pending.pop(id(writer), None)
            writer.close()


def _tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if certfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


async def serve(host: str, port: int, secret: bytes, tls: ssl.SSLContext | None,
                started: threading.Event | None = None, box: list | None = None) -> None:
    """Serve until cancelled; the bound port goes to ``box`` and ``started`` is set."""
    store = StoreServer(secret, tls=tls)
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)  # nothing a peer does is logged
    server = await asyncio.start_server(store.handle, host, port, backlog=BACKLOG)
    if box is not None:
        box.append(server.sockets[0].getsockname()[1])
    if started is not None:
        started.set()
    async with server:
        await server.serve_forever()


def _raise_file_limit() -> None:
    """The soft limit on open files up to the hard one: many idle connections must not starve accept."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description="megarefit's rendezvous store (secret on stdin, as hex)")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args()
    _raise_file_limit()
    try:
        secret = check_secret(bytes.fromhex(sys.stdin.readline().strip()))
        tls = _tls(args.certfile, args.keyfile)
        if tls is not None and sys.version_info < (3, 11):
            raise ValueError("TLS needs Python 3.11 or later (asyncio's StreamWriter.start_tls)")
    except (ValueError, OSError, ssl.SSLError) as exc:
        print(f"cannot serve: {exc}", file=sys.stderr, flush=True)
        return 1
    loop = asyncio.new_event_loop()
    box: list[int] = []
    started = threading.Event()
    task = loop.create_task(serve(args.host, args.port, secret, tls, started, box))

    def announce() -> None:
        started.wait()
        print(box[0], flush=True)
        quiet = os.open(os.devnull, os.O_WRONLY)  # nobody reads the pipe from now on: a full one would block
        os.dup2(quiet, 2)
        sys.stdin.read()  # returns when the serving process closes the pipe (it exited)
        os._exit(0)  # at once, whatever connections are open (Python 3.12+ would wait for them to close)

    threading.Thread(target=announce, daemon=True).start()
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        return 0
    except OSError as exc:
        print(f"cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
