"""Fault injection for tests/test_vllm_http.py's vLLM server (this folder goes on the server's
PYTHONPATH; Python imports ``sitecustomize`` in every process it starts, vLLM's engine core included).

With ``MEGAREFIT_TEST_FAULT_FILE`` set, vLLM's unquantized linear layers' ``process_weights_after_loading``
(what vLLM's layerwise reload runs on a layer once all its weights arrived, before writing it into
the live tensors) raises on its N-th call while that file exists, N being the file's content, and
removes the file: one fault per file, midway through an install. The patch is applied when vLLM
imports its linear layers (nothing is imported here: vLLM sets up threads and platforms first)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_FLAG = os.environ.get("MEGAREFIT_TEST_FAULT_FILE")
_TARGET = "vllm.model_executor.layers.linear"


def _patch(module) -> None:
    method = module.UnquantizedLinearMethod
    original = method.process_weights_after_loading
    calls = [0]

    def process(self, layer):
        if os.path.exists(_FLAG):
            calls[0] += 1
            if calls[0] >= int(open(_FLAG).read() or 1):
                calls[0] = 0
                os.remove(_FLAG)
                raise RuntimeError(f"injected fault in vLLM's install ({_FLAG})")
        else:
            calls[0] = 0
        return original(self, layer)

    method.process_weights_after_loading = process


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


if _FLAG:
    sys.meta_path.insert(0, _PatchOnImport())
