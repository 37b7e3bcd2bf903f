"""An RL loop that refits a ``vllm serve`` server over HTTP with megarefit: copy and adapt.

Three parts, usually three kinds of processes:

1. the **rendezvous** (once per job, e.g. on the trainer's rank 0 host)::

       python examples/rl_http.py rendezvous --job rl            # prints host and port

2. the **server** (once per vLLM replica), the megarefit backend enabled::

       VLLM_SERVER_DEV_MODE=1 MEGAREFIT_JOB_SECRET=... python -m vllm.entrypoints.openai.api_server \\
           --model /path/to/initial/checkpoint --weight-transfer-config '{"backend": "megarefit"}'

3. the **trainer** (every Megatron rank) and the **controller** (one process, here the
   trainer's global rank 0): after each optimizer step every rank publishes its live shards,
   rank 0 refits the servers, and everyone waits until each server acknowledged::

       publisher = megarefit_publisher(model, hf_config, rdzv_host, rdzv_port, job="rl")
       servers = [VllmHttpRefit("http://10.0.0.5:8000")]
       connect(servers, rdzv_host, rdzv_port, job="rl")            # once, rank 0
       for step in range(steps):
           train_step(model)
           publisher.publish(step + 1)                            # every rank: a version number
           if rank == 0:
               for server in servers:
                   server.refit(step + 1)                         # pause, pull, finish, resume
           publisher.wait_receivers(step + 1)                     # every server acknowledged

A server with MTP speculative decoding (``--speculative-config '{"method": "mtp", ...}'``)
refits its draft model too: ``server.refit(step + 1, draft=True)``, with the trainers built
and published with ``mtp_num_layers``.

All processes share the job secret (``MEGAREFIT_JOB_SECRET``): every record on the
rendezvous is signed with it (docs/security.md). The lifecycle and what each step
guarantees: docs/http.md. tests/test_vllm_http.py runs this loop end to end on CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from megarefit.integrations.vllm_http import VllmHttpRefit
from megarefit.online.rendezvous import SECRET_ENV, Rendezvous


def megarefit_publisher(model: Any, hf_config: dict, host: str, port: int, job: str) -> Any:
    """This Megatron rank's Publisher of ``model`` (a Megatron-Core ``GPTModel`` chunk) against
    the job's rendezvous: registered once, then ``publish(version)`` after every step."""
    from megatron.core import parallel_state as ps

    from megarefit.integrations.megatron import refit_tensors
    from megarefit.online.publisher import Publisher

    rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())
    # a Transformer-Engine layer spec, TE-grouped experts, uneven pipeline stages: pass layer_spec="te",
    # expert_layout=..., first_stage_layers=... as the trainer builds its model
    return Publisher(refit_tensors(model), hf_config, rank=rank, tp=ps.get_tensor_model_parallel_world_size(),
                     pp=ps.get_pipeline_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                     rendezvous=Rendezvous.connect(host, port, job=job))


def connect(servers: list[VllmHttpRefit], host: str, port: int, job: str, **init_info: Any) -> None:
    """Point every server's workers at the trainers' rendezvous (``init_info``: ``sharded``,
    ``memory_budget``, ``transport``, ...: see docs/api.md)."""
    for server in servers:
        server.init(host, port, job, **init_info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("rendezvous", help="run the job's rendezvous store until interrupted")
    serve.add_argument("--job", default="rl", help="job name (default rl)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback)")
    ns = ap.parse_args()
    if not os.environ.get(SECRET_ENV):
        raise SystemExit(f"set {SECRET_ENV} to the job's secret (the same in every trainer, server and this process)")
    rdzv = Rendezvous.serve(host=ns.host, job=ns.job)
    print(f"rendezvous for job {ns.job!r} on {ns.host}:{rdzv.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
