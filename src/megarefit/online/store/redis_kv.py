"""The rendezvous over Redis, for clusters: :class:`RedisStore` serves the calls of
:class:`~megarefit.online.store.kv.KeyValueStore` from a ``redis-server`` the cluster runs.

Selected explicitly, by a ``redis://`` or ``rediss://`` (TLS) address in place of a host::

    Rendezvous.connect("rediss://redis.cluster:6380/0", 0, job="rl", secret=..., tls=StoreTLS(cafile=...))

Records stay signed end to end: :class:`~megarefit.online.store.rendezvous.Rendezvous` signs
every record with the job secret (:mod:`~megarefit.online.store.records`) and verifies it on
read, so a Redis that anyone on the cluster can write cannot forge or alter a record (a reader
refuses it, naming the key). Redis's own password (``password=``, else the URL's
``redis://user:password@host``, else ``$MEGAREFIT_REDIS_PASSWORD``: keep it out of addresses
that get logged) only keeps others off the server; it never appears in
:attr:`RedisStore.where` or any error. What Redis cannot give: its counters (heartbeats, the registry's slots, the
record clock) and key deletion are open to whoever can write it; docs/security.md ("Choosing
the store") says what follows.

Blocking reads poll (``MGET``) with a backoff from 1 ms to 50 ms while keys are missing; a key
that exists answers in one round trip. Needs ``pip install redis``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

from megarefit.online.store.kv import BACKOFF_CAP, BACKOFF_FIRST, StoreError, StoreTLS

SCHEMES = ("redis://", "rediss://")
PASSWORD_ENV = "MEGAREFIT_REDIS_PASSWORD"  # the Redis password when neither password= nor the URL gives one
POLL_FIRST, POLL_CAP = 0.001, 0.05  # seconds between reads of missing keys: first, and at most
IDEMPOTENT = frozenset({"SET", "MSET", "MGET", "EXISTS", "DEL"})  # sent again on a new connection if one breaks


def _is_tls_failure(exc: BaseException) -> bool:
    """A certificate or TLS failure (not retried: it will not heal)."""
    return "certificate" in str(exc).lower() or "ssl" in type(exc.__cause__ or exc).__name__.lower()


def is_redis_address(host: str) -> bool:
    """Whether ``host`` selects :class:`RedisStore` (a ``redis://`` or ``rediss://`` URL)."""
    return isinstance(host, str) and host.lower().startswith(SCHEMES)


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class RedisStore:
    """A rendezvous store on Redis: the :class:`~megarefit.online.store.kv.KeyValueStore` calls
    (bytes values; ``get`` / ``multi_get`` / ``wait`` block up to ``timeout`` seconds).

    ``url``: ``redis://[user[:password]@]host[:port][/db]`` or ``rediss://...`` (TLS, verified
    against ``tls.cafile`` or the system's CAs; ``tls.certfile`` / ``tls.keyfile``: a client
    certificate). ``connect_timeout``: seconds a connection may take.

    Raises:
        StoreError: not a redis URL, ``redis`` is not installed, or the server cannot be reached
            or refused the credentials (names the address without credentials, and the fix)."""

    def __init__(self, url: str, timeout: float, *, password: str | None = None, tls: StoreTLS | None = None,
                 connect_timeout: float = 30.0):
        if not is_redis_address(url):
            raise StoreError(f"{url.split('@')[-1]!r} is not a redis:// or rediss:// address")
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 6379
        self.db = int(parts.path.strip("/") or 0)
        self.timeout, self.tls, self.connect_timeout = timeout, tls, connect_timeout
        self.where = f"{parts.scheme}://{self.host}:{self.port}/{self.db}"  # never the credentials
        self._options = self._redis_options(parts, password)
        self._lock = threading.Lock()
        self._client = self._open()

    def _redis_options(self, parts: Any, password: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {
            "host": self.host, "port": self.port, "db": self.db, "socket_connect_timeout": self.connect_timeout,
            "username": unquote(parts.username) if parts.username else None,
            "password": password or (unquote(parts.password) if parts.password else None) or os.environ.get(PASSWORD_ENV)}
        if parts.scheme.lower() == "rediss":
            tls = self.tls or StoreTLS()
            options.update(ssl=True, ssl_ca_certs=tls.cafile, ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile,
                           ssl_check_hostname=tls.server_hostname is None)
        return options

    def _open(self) -> Any:
        """A client that answered PING: connecting is retried with jittered exponential backoff
        (as :func:`~megarefit.online.store.kv.connect`) for ``connect_timeout`` seconds in all;
        refused credentials fail at once."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise StoreError(f"the rendezvous at {self.where} needs the redis client: pip install redis") from None
        deadline, bound, attempts = time.monotonic() + self.connect_timeout, BACKOFF_FIRST, 0
        while True:
            attempts += 1
            client = redis.Redis(**self._options, retry=Retry(NoBackoff(), 0))  # retries are ours, below
            try:
                client.ping()
                return client
            except redis.AuthenticationError as exc:
                raise StoreError(f"the Redis at {self.where} refused this process's credentials ({exc}): give "
                                 f"its password as password=, in the URL, or in ${PASSWORD_ENV}") from None
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                client.close()
                left = deadline - time.monotonic()
                if left <= 0 or _is_tls_failure(exc):
                    raise StoreError(f"cannot reach the rendezvous at {self.where} within {self.connect_timeout:.1f} "
                                     f"s ({attempts} attempts; last: {type(exc).__name__}: {exc})") from None
                time.sleep(min(left, random.uniform(0.0, bound)))
                bound = min(2 * bound, BACKOFF_CAP)
            except redis.RedisError as exc:
                client.close()
                raise StoreError(f"the server at {self.where} is not a usable Redis: {type(exc).__name__}: "
                                 f"{exc}") from None

    def reopen(self, timeout: float) -> RedisStore:
        """Another client of the same Redis (its own connection), reads waiting ``timeout`` s."""
        other = object.__new__(RedisStore)
        other.__dict__.update(self.__dict__)
        other.timeout = timeout
        other._lock = threading.Lock()
        other._client = other._open()
        return other

    def _do(self, op: str, *args: Any) -> Any:
        """One command; an idempotent one (:data:`IDEMPOTENT`) whose connection broke is sent
        again on a new connection, up to twice (the new client's connection may be dropped as
        well: Redis dropping every client). ``INCRBY`` is never sent twice: it may have been applied."""
        import redis

        client = self._client
        for attempt in range(3):
            try:
                return client.execute_command(op, *args)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if op not in IDEMPOTENT or attempt == 2:
                    raise StoreError(f"the rendezvous at {self.where} failed during {op!r} (it may or may not have "
                                     f"been applied): {type(exc).__name__}: {exc}") from None
            except (redis.RedisError, OSError) as exc:
                raise StoreError(f"the rendezvous at {self.where} failed during {op!r}: {type(exc).__name__}: "
                                 f"{exc}") from None
            with self._lock:  # threads share this store: one reopens, none closes a client another is using
                if self._client is client:
                    self._client = self._open()
                client = self._client
        raise AssertionError("unreachable")

    def set(self, key: str, value: bytes | str) -> None:
        self._do("SET", key, value.encode() if isinstance(value, str) else bytes(value))

    def multi_set(self, items: dict[str, bytes]) -> None:
        """Set several keys in one request, at once (``MSET``: a reader sees all or none)."""
        self._do("MSET", *[part for k, v in items.items() for part in (k, bytes(v))])

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to appear.

        Raises:
            StoreError: it did not appear in time."""
        return self.multi_get([key])[0]

    def _poll(self, keys: list[str], seconds: float) -> list[bytes] | None:
        deadline, pause = time.monotonic() + seconds, POLL_FIRST
        while True:
            values = self._do("MGET", *keys) if keys else []
            if all(v is not None for v in values):
                return [bytes(v) for v in values]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_CAP)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` seconds (default: the store's) for all.

        Raises:
            StoreError: not all appeared in time."""
        wait = self.timeout if timeout is None else timeout
        values = self._poll(list(keys), wait)
        if values is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {wait:.1f} s")
        return values

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 if absent); the new value."""
        return int(self._do("INCRBY", key, int(amount)))

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        return not keys or int(self._do("EXISTS", *keys)) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists.

        Raises:
            StoreError: not within ``timeout`` (default: the store's)."""
        seconds = _seconds(timeout, self.timeout)
        if self._poll(list(keys), seconds) is None:
            raise StoreError(f"rendezvous keys {list(keys)[:4]} did not appear within {seconds:.1f} s")

    def delete_key(self, key: str) -> bool:
        return int(self._do("DEL", key)) > 0

    def close(self) -> None:
        self._client.close()


__all__ = ["RedisStore", "is_redis_address"]
