"""The signed-record codec of the rendezvous (:mod:`megarefit.online.store.rendezvous`).

A record is ``mr1:<mac>:<n>:<payload>``: the HMAC-SHA256 (job secret) over the job, the
key, ``n`` and the payload, ``n`` drawn from the job's counter in the store. A reader
refuses a record that is unsigned, signed with another secret, or older than one it
already read under that key (replayed). This module holds the job-secret resolution,
the codec and the rendezvous's errors; it reads and writes nothing itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading

from megarefit.errors import MegarefitError
from megarefit.online.store.server import check_secret

SECRET_ENV = "MEGAREFIT_JOB_SECRET"
RECORD_FORMAT = b"mr1"
MAX_COUNTER_DIGITS = 20


class RendezvousTimeout(MegarefitError, TimeoutError):
    """A key did not appear in time (a trainer rank that never published, or died)."""


class RecordAuthenticationError(MegarefitError):
    """A rendezvous record is unsigned, signed with another job's secret (or forged), or an older
    record written again (replayed); nothing was done with it. Names the key and the fix."""


def ensure_job_secret() -> str:
    """``$MEGAREFIT_JOB_SECRET``, set to a new random secret first if unset: for a launcher that
    starts the job's processes itself on this host (they inherit it), e.g. the demo and the
    benchmarks. A multi-host job sets the variable (or passes ``secret=``) on every host."""
    return os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))


def resolve_secret(secret: bytes | str | None, *, serving: bool) -> tuple[bytes, bool]:
    """(the job secret, whether it was generated): ``secret``, else ``$MEGAREFIT_JOB_SECRET``,
    else (serving side only) a new random one.

    Raises:
        MegarefitError: a connecting side has neither (names the fix)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        if not serving:
            raise MegarefitError(f"no job secret: pass secret= (the serving side's Rendezvous.secret) to "
                                 f"Rendezvous.connect, or set {SECRET_ENV} for every process of the job")
        return secrets.token_hex(32).encode(), True
    try:
        return check_secret(secret), False
    except ValueError as exc:
        raise MegarefitError(str(exc)) from None


class RecordCodec:
    """Signs and verifies the records of job ``job`` with ``secret``; remembers, per thread,
    the highest counter read under each key (older ones are replays)."""

    def __init__(self, job: str, secret: bytes):
        self.job = job
        self._secret = secret
        # key -> the highest n this thread read (older ones are replays). Per thread: another
        # thread may verify, later, a record it fetched before this thread read a newer one.
        self._reads = threading.local()

    def _mac(self, key: str, n: bytes, payload: bytes) -> bytes:
        msg = b"\0".join([self.job.encode(), key.encode(), n, payload])
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, n: int, payload: bytes | str) -> bytes:
        """The signed record of ``payload`` under full key ``key`` with counter value ``n``."""
        payload = payload.encode() if isinstance(payload, str) else bytes(payload)
        counter = str(n).encode()
        return b":".join([RECORD_FORMAT, self._mac(key, counter, payload), counter, payload])

    def unseal(self, key: str, record: bytes) -> bytes:
        """The payload of a signed record read under full key ``key``.

        Raises:
            RecordAuthenticationError: unsigned, malformed, signed with another secret, or older
                than a record already read under this key (by this thread)."""
        return self.unseal_counted(key, record)[1]

    def unseal_counted(self, key: str, record: bytes, *, ordered: bool = True) -> tuple[int, bytes]:
        """``(n, payload)`` of a signed record read under full key ``key``: :meth:`unseal`, and
        the record's counter (drawn from the job's clock when it was sealed; a record sealed
        later under any key has a larger one). ``ordered=False``: a key several processes write
        (a copy's write marker and fence record), whose last write may carry a smaller counter
        than one read before; no replay check (readers compare such records for equality).

        Raises:
            RecordAuthenticationError: as :meth:`unseal` (not "older" where ``ordered`` is false)."""
        parts = bytes(record).split(b":", 3)
        if (len(parts) != 4 or parts[0] != RECORD_FORMAT or len(parts[1]) != 64 or not parts[2].isdigit()
                or len(parts[2]) > MAX_COUNTER_DIGITS):
            raise RecordAuthenticationError(
                f"record {key!r} is not a signed megarefit record ({len(record)} bytes): written by another "
                "program or another megarefit version; nothing was done with it")
        if not hmac.compare_digest(parts[1], self._mac(key, parts[2], parts[3])):
            raise RecordAuthenticationError(
                f"record {key!r} has a wrong signature: written with another job secret, or forged; check that "
                f"every process of job {self.job!r} uses the same secret ({SECRET_ENV}); nothing was done with it")
        n = int(parts[2])
        if not ordered:
            return n, parts[3]
        latest = self._reads.__dict__.setdefault("latest", {})
        if n < latest.get(key, 0):
            raise RecordAuthenticationError(
                f"record {key!r} is older than one already read under that key (replayed); nothing was done with it")
        latest[key] = n
        return n, parts[3]


__all__ = ["MAX_COUNTER_DIGITS", "RECORD_FORMAT", "SECRET_ENV", "RecordAuthenticationError", "RecordCodec",
           "RendezvousTimeout", "ensure_job_secret", "resolve_secret"]
