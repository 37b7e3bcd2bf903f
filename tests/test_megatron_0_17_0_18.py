"""megatron-core 0.17.1 and 0.18.2 in CI where their layouts differ from both 0.16.1 and 0.19.2:
the MTP layer renamed ``mtp_model_layer`` (0.17), the DSA indexer still ``[nope; rope]`` per head
with the new MTP name (GLM-5 demo on 0.18.2), Nemotron-H's Mamba stack moved to
``models/hybrid`` (0.18); and on both, the optimizer internals delta tracking wraps
(``test_delta_track.py``); the config-flag audit (``test_megatron_flags.py``) runs in both children.
See ``megatron_releases.py`` for how each release is installed."""

from __future__ import annotations

import pytest

from megatron_releases import run_demo, run_tests

pytestmark = pytest.mark.megatron


def test_mtp_tests_pass_on_0_17():  # with the layout Publisher.from_megatron reads (mtp_layout_job)
    summary = run_tests("0.17.1", ["tests/test_megatron_mtp.py", "tests/test_delta_track.py",
                                   "tests/test_megatron_flags.py"])  # and the config-flag audit
    assert " passed" in summary and "failed" not in summary, summary


def test_delta_tracking_passes_on_0_18():  # the distributed optimizer's main-to-model copy, tracked
    summary = run_tests("0.18.2", ["tests/test_delta_track.py", "tests/test_megatron_flags.py"])
    assert " passed" in summary and "failed" not in summary, summary


@pytest.mark.parametrize("config,layout", [("GLM-5.json", ("--tp", "1", "--ep", "2")),
                                           ("NVIDIA-Nemotron-3-Nano-30B-A3B.json", ())])
def test_demo_passes_on_0_18(config, layout):
    run_demo("0.18.2", config, *layout)
