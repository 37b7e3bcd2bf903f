"""Imported once by the forkserver that tests/bridge_lora.py's gloo workers fork from (added to
``megarefit.demo.workers.PRELOAD`` there): Megatron-Bridge's import, about 10 s of CPU, is then paid
once for both ranks instead of once per rank. Runs no torch op (the forkserver must not start a
thread pool its children would inherit)."""

from megarefit.demo.megatron_cpu import apply_cpu_patches
from megarefit.integrations.bridge import _import_bridge

apply_cpu_patches()
_import_bridge()
