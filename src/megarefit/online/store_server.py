"""The rendezvous store's server, run as its own process by ``KeyValueStore.serve``.

Standard library only, started as a script (``python store_server.py HOST PORT``, the job
secret as hex on the first line of standard input, never on the command line): it binds
``HOST:PORT`` (``PORT`` 0: a free one), prints the port, and serves one table through
``multiprocessing.managers`` (every connection answers an HMAC challenge keyed with the
secret) until its standard input closes, i.e. until the serving process exits. Its own
process, so the store answers at once however busy the serving process's Python threads are
(a training loop, a receiver): a server thread there would wait for the GIL.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.managers import BaseManager


class Table:
    """The served table: bytes values, a condition for blocking reads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes] | None:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout):
                return None
            return [self._data[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    secret = bytes.fromhex(sys.stdin.readline().strip())
    table = Table()

    class Manager(BaseManager):
        pass

    Manager.register("table", callable=lambda: table)
    try:
        server = Manager(address=(host, port), authkey=secret).get_server()
    except OSError as exc:
        print(f"cannot bind {host}:{port}: {exc}", file=sys.stderr, flush=True)
        return 1
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.address[1], flush=True)
    sys.stdin.read()  # returns when the serving process closes the pipe (it exited)
    return 0


if __name__ == "__main__":
    sys.exit(main())
