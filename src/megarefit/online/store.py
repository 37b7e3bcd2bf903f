"""The rendezvous' key-value store: bound where asked, open only to holders of the job secret.

``torch.distributed.TCPStore`` listens on every interface whatever host it is given and lets
anyone who reaches the port read and write. :class:`KeyValueStore` serves the same small API
(``set`` / ``get`` / ``add`` / ``check`` / ``multi_get`` / ``wait`` / ``delete_key``, bytes
values, blocking reads with a timeout) through Python's ``multiprocessing.managers``: the
server listens on the one address it is given (loopback by default), and every connection
must first answer an HMAC challenge keyed with the job secret
(``multiprocessing.connection``'s authentication), so a process without the secret can
neither read nor write a record. The server is a process of its own
(:mod:`~megarefit.online.store_server`, standard library only), so a busy serving process
(a training loop) does not delay its answers. One table per server; each client thread gets
its own connection.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.managers import BaseManager
from pathlib import Path

from megarefit.errors import MegarefitError


class StoreError(MegarefitError):
    """The store refused a connection (wrong job secret), could not be reached, or a read timed out."""


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class KeyValueStore:
    """A client of a served table (``TCPStore``'s calls megarefit uses). ``timeout``: seconds a
    blocking read waits by default."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        manager = type("_Client", (BaseManager,), {})
        manager.register("table")
        self._manager = manager(address=(host, port), authkey=secret)
        try:
            self._manager.connect()
        except AuthenticationError:
            raise StoreError(f"the rendezvous at {host}:{port} refused this process: wrong job secret") from None
        except OSError as exc:
            raise StoreError(f"cannot reach the rendezvous at {host}:{port}: {exc}") from None
        self._table = self._manager.table()  # type: ignore[attr-defined]
        self._server: subprocess.Popen | None = None

    @classmethod
    def serve(cls, host: str, port: int, secret: bytes, timeout: float) -> KeyValueStore:
        """Start a table's server process (:mod:`~megarefit.online.store_server`) on ``host:port``
        (``port=0``: a free one) and connect to it. The server lives until this process exits.

        Raises:
            StoreError: the address cannot be bound (in use, not an address of this host)."""
        server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("store_server.py")), host,
                                   str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(secret.hex() + "\n")
        server.stdin.flush()
        line = server.stdout.readline().strip()
        if not line.isdigit():
            server.kill()
            why = server.stderr.read().strip() if server.stderr else ""
            raise StoreError(f"cannot serve the rendezvous on {host}:{port}: {why or 'the server exited'}")
        client = cls(host, int(line), secret, timeout)
        client._server = server  # its stdin pipe stays open while this process lives
        return client

    def set(self, key: str, value: bytes | str) -> None:
        self._table.set(key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to appear.

        Raises:
            StoreError: it did not appear in time."""
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._table.multi_get(list(keys), self.timeout)
        if values is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {self.timeout:.1f} s")
        return values

    def add(self, key: str, amount: int) -> int:
        return int(self._table.add(key, int(amount)))

    def check(self, keys: Iterable[str]) -> bool:
        return bool(self._table.check(list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists.

        Raises:
            StoreError: not within ``timeout`` (default: the store's)."""
        seconds = _seconds(timeout, self.timeout)
        if self._table.multi_get(list(keys), seconds) is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {seconds:.1f} s")

    def delete_key(self, key: str) -> bool:
        return bool(self._table.delete_key(key))


__all__ = ["KeyValueStore", "StoreError"]
