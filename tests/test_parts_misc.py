"""Focused tests of parts split out of larger modules (issue 39): the HF config readers
(layout/hf_dims.py), the rendezvous record codec and receiver registry
(online/store/records.py, online/store/receivers.py) and the NIXL pull coalescing
(transport/nixl_requests.py). Expected values are written out by hand."""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import types

import pytest

from megarefit.errors import MegarefitError, UnsupportedModelError
from megarefit.layout.hf_dims import HFConfigReader, hybrid_dims, read_hf_dims
from megarefit.online.store.receivers import ReceiverRegistry
from megarefit.online.store.records import RecordAuthenticationError, RecordCodec, RendezvousTimeout
from megarefit.online.store.rendezvous import Rendezvous
from megarefit.specs import get_family
from megarefit.transport.nixl_requests import coalesce

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "head_dim": 64,
         "intermediate_size": 768, "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 4,
         "tie_word_embeddings": True, "vocab_size": 1000, "attention_bias": False}


def test_read_hf_dims_reads_a_dense_config():
    dims = read_hf_dims(QWEN3, get_family("qwen3"))
    assert {k: dims[k] for k in ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                 "head_dim", "ffn_hidden_size", "vocab_size", "tie_word_embeddings")} == {
        "family": "qwen3", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
        "head_dim": 64, "ffn_hidden_size": 768, "vocab_size": 1000, "tie_word_embeddings": True}
    assert dims["qk_norm"] is True and dims["qkv_bias"] is False
    assert "num_experts" not in dims  # a dense model: the dataclass defaults stand


def test_read_hf_dims_defaults_groups_and_head_dim_and_names_bad_groups():
    cfg = {k: v for k, v in QWEN3.items() if k not in ("num_key_value_heads", "head_dim")}
    dims = read_hf_dims(cfg, get_family("qwen3"))
    assert (dims["num_query_groups"], dims["head_dim"]) == (8, 32)  # MHA; hidden / heads
    with pytest.raises(MegarefitError, match="num_key_value_heads must be a positive divisor"):
        read_hf_dims({**QWEN3, "num_key_value_heads": 3}, get_family("qwen3"))


@pytest.mark.parametrize("cfg", [{"a": True, "b": 0, "c": 3}, types.SimpleNamespace(a=True, b=0, c=3)])
def test_config_reader_on_dicts_and_objects(cfg):
    r = HFConfigReader(cfg, get_family("qwen3"))
    assert r.need("c") == 3 and r.get("missing", 7) == 7
    assert r.flag("a") is True and r.flag("missing") is False and r.flag(True) is True
    for key in ("a", "b"):  # a bool is not a count; zero is not positive
        with pytest.raises(MegarefitError, match=f"{key} must be a positive integer"):
            r.need(key)
    with pytest.raises(MegarefitError, match="lacks 'missing'"):
        r.need("missing")


def test_hybrid_dims_spells_block_types_as_letters():
    cfg = {"layers_block_type": ["mamba", "attention", "mlp", "moe"], "mamba_num_heads": 8, "mamba_head_dim": 4,
           "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4}
    need = cfg.__getitem__
    assert hybrid_dims("nemotron_h", cfg.get, need) == {"layer_pattern": "M*-E", "mamba_heads": 8,
                                                         "mamba_head_dim": 4, "mamba_groups": 2, "mamba_state": 16,
                                                         "conv_kernel": 4}
    with pytest.raises(UnsupportedModelError, match=r"layers_block_type \['conv'\] unknown"):
        hybrid_dims("nemotron_h", {**cfg, "layers_block_type": ["mamba", "conv"]}.get, need)
    with pytest.raises(UnsupportedModelError, match="biases"):
        hybrid_dims("nemotron_h", {**cfg, "use_bias": True}.get, need)


def test_record_codec_format_and_refusals():
    secret = b"s" * 32
    codec = RecordCodec("job", secret)
    record = codec.seal("megarefit/job/k", 5, "hi")
    mac = hmac.new(secret, b"\0".join([b"job", b"megarefit/job/k", b"5", b"hi"]), hashlib.sha256).hexdigest()
    assert record == b"mr1:" + mac.encode() + b":5:hi"
    assert codec.unseal("megarefit/job/k", record) == b"hi"
    with pytest.raises(RecordAuthenticationError, match="wrong signature"):
        RecordCodec("job", b"t" * 32).unseal("megarefit/job/k", record)
    with pytest.raises(RecordAuthenticationError, match="wrong signature"):  # the key is signed too
        codec.unseal("megarefit/job/other", record)
    with pytest.raises(RecordAuthenticationError, match="wrong signature"):
        codec.unseal("megarefit/job/k", record[:-2] + b"ho")
    with pytest.raises(RecordAuthenticationError, match="not a signed megarefit record"):
        codec.unseal("megarefit/job/k", b"hi")
    older = codec.seal("megarefit/job/k", 4, "old")
    with pytest.raises(RecordAuthenticationError, match="replayed"):
        codec.unseal("megarefit/job/k", older)
    seen = []  # another thread has read nothing newer under the key: it accepts the older record
    t = threading.Thread(target=lambda: seen.append(codec.unseal("megarefit/job/k", older)))
    t.start()
    t.join()
    assert seen == [b"old"]


def test_receiver_registry_on_a_served_store():
    rdzv = Rendezvous.serve(job="parts-misc", secret="p" * 32)
    try:
        reg = ReceiverRegistry(rdzv)
        assert reg.join("group", "a") == ["a"]
        assert reg.join("group", "b") == ["a", "b"]
        assert reg.join("group", "a") == ["a", "b"]  # a restarted member keeps its place
        reg.register_receiver("r1")
        assert rdzv.receivers() == ["r1"] and reg.acked("r1") is None
        reg.acknowledge("r1", 3)
        assert reg.acked("r1") == 3
        assert reg.wait_receivers(3, timeout=5.0) == {"r1": "acked"}
        with pytest.raises(RendezvousTimeout, match=r"r1 \(last acknowledged 3\)"):
            reg.wait_receivers(4, timeout=0.05, lease=60.0)
        assert reg.wait_receivers(4, timeout=5.0, lease=0.05) == {"r1": "dropped"}  # no heartbeat moved
    finally:
        rdzv.store.close()


def test_coalesce_joins_runs_that_continue_each_other():
    a, b, c = object(), object(), object()
    items = [((110, 5, 0), (1010, 5, 0), 0, 0, b), ((100, 10, 0), (1000, 10, 0), 0, 0, a),
             ((115, 5, 0), (2000, 5, 0), 0, 0, c)]  # c continues b remotely, not locally
    assert coalesce(items) == [((100, 15, 0), (1000, 15, 0), [a, b]), ((115, 5, 0), (2000, 5, 0), [c])]
    unknown = [((100, 10, 0), (1000, 10, 0), -1, 0, a), ((110, 5, 0), (1010, 5, 0), -1, 0, b)]
    assert [g[2] for g in coalesce(unknown)] == [[a], [b]]  # region -1 never joins


def _port_taken_once(rank: int, world_size: int, master_port: int, marker: str) -> int:
    """A worker whose first start meets its gloo master port taken (as when another process bound
    the port ``free_port`` found free), then succeeds; returns its port. Every rank that meets it
    leaves the marker: the first failure ends the start, and its other workers may not have run."""
    import os

    if not os.path.exists(marker):
        open(marker, "a").close()
        raise RuntimeError("The server socket has failed to listen on any local network address. "
                           f"port: {master_port}, code: -98, name: EADDRINUSE")
    return master_port


def test_run_workers_starts_again_on_a_new_port_when_its_port_was_taken(tmp_path):
    from megarefit.demo.workers import run_workers

    ports = run_workers(_port_taken_once, world_size=2, args=(str(tmp_path / "marker"),), timeout=120)
    assert len(set(ports)) == 1
    with pytest.raises(RuntimeError, match="EADDRINUSE"):  # a port the caller chose is not changed
        run_workers(_port_taken_once, world_size=2, args=(str(tmp_path / "other"),), master_port=ports[0],
                    timeout=120)


def _report_start(rank: int, world_size: int, master_port: int, env_name: str, as_vllm: bool) -> tuple[str | None, str]:
    """An environment variable and how this process was started; with ``as_vllm`` the job leaves
    ``vllm.distributed`` in ``sys.modules`` first (what starting vLLM's distributed state does)."""
    import multiprocessing
    import sys

    if as_vllm:
        sys.modules.setdefault("vllm.distributed", types.ModuleType("vllm.distributed"))
    return os.environ.get(env_name), multiprocessing.get_start_method()


def test_forkserver_workers_take_the_callers_environment_and_refuse_vllm_jobs(monkeypatch):
    """A forkserver worker sees the starting process's environment as it is at the start (not the
    server's, started earlier), and a job that started vLLM's distributed state there fails naming
    the fix (its shared-memory cleanup runs only at an interpreter's shutdown, which forkserver
    workers skip); spawned, the same job passes. An unknown start method is refused."""
    from megarefit.demo.workers import run_workers

    for method in ("forkserver", "forkserver", "spawn"):  # the second forkserver group: the server is older
        monkeypatch.setenv("MEGAREFIT_TEST_MARK", os.urandom(4).hex())
        got = run_workers(_report_start, world_size=2, args=("MEGAREFIT_TEST_MARK", method == "spawn"),
                          start_method=method, timeout=120)
        assert got == [(os.environ["MEGAREFIT_TEST_MARK"], method)] * 2
    with pytest.raises(RuntimeError, match="start_method='spawn'"):
        run_workers(_report_start, world_size=1, args=("MEGAREFIT_TEST_MARK", True), start_method="forkserver",
                    timeout=120)
    with pytest.raises(ValueError, match="expected one of"):
        run_workers(_report_start, world_size=1, args=("X", False), start_method="fork")


def test_a_node_group_init_that_cannot_hold_is_refused_as_vllm_parses_it():
    """``init_info["node"]`` (and ``init_megarefit(node=)``): a count of workers; staged or streamed, with
    or without direct writes (tests/test_vllm_install.py proves streamed direct writes with node-mates)."""
    from megarefit.integrations.vllm import MegarefitInitInfo

    for kw, match in (({"node": 0}, "node=0"), ({"node": True}, "node=True"), ({"node": "2"}, "node='2'")):
        with pytest.raises(MegarefitError, match=match):
            MegarefitInitInfo("127.0.0.1", 1, **kw)
    assert MegarefitInitInfo("127.0.0.1", 1, node=2, direct=True).node == 2  # staged copies: fine
    assert MegarefitInitInfo("127.0.0.1", 1, node=2, memory_budget=1 << 20).node == 2
    assert MegarefitInitInfo("127.0.0.1", 1, node=2, direct=True, memory_budget=1 << 20).node == 2
