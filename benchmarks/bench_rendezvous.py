"""Round trips of the rendezvous store: what a receiver's fence costs per cycle.

    python benchmarks/bench_rendezvous.py [--ranks 2] [--n 2000]

Times, in this process against a store served here: one ``check``, one ``multi_get`` of the
ranks' sequences, and ``Rendezvous.state`` (sequences and versions, signed, verified), against
``torch.distributed.TCPStore`` doing the same ``check`` / ``multi_get`` (unauthenticated, all
interfaces: what megarefit used before).
"""

from __future__ import annotations

import argparse
import os
import time


def _per_call(f, n: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from megarefit.layout import RankCoord
    from megarefit.online.rendezvous import Rendezvous, ensure_job_secret

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000)
    ns = ap.parse_args()
    ensure_job_secret()
    served = Rendezvous.serve(job="bench")
    ranks = [RankCoord(t, 0, 0) for t in range(ns.ranks)]
    for r in ranks:
        served.begin_update(r)
        served.end_update(r, 1)
    rdzv = Rendezvous.connect("127.0.0.1", served.port, job="bench")
    keys = [rdzv.prefix + f"seq/{r.tp}.0.0" for r in ranks]
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for k in keys:
        tcp.set(k, "2")
    rows = {"store check": _per_call(lambda: rdzv.store.check(keys), ns.n),
            "store multi_get": _per_call(lambda: rdzv.store.multi_get(keys), ns.n),
            "Rendezvous.state (signed, verified)": _per_call(lambda: rdzv.state(ranks), ns.n),
            "TCPStore check": _per_call(lambda: tcp.check(keys), ns.n),
            "TCPStore multi_get": _per_call(lambda: tcp.multi_get(keys), ns.n)}
    print(f"{os.cpu_count()} cores, {ns.ranks} ranks")
    for name, s in rows.items():
        print(f"| {name} | {s * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
