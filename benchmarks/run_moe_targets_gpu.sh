#!/usr/bin/env bash
# Qwen3-30B-A3B (8 layers) refits over NIXL on nvidia-h200-x2: trainer processes on GPU 0,
# the receiver process on GPU 1; full HF tensors vs one vLLM tp=2 worker's own shards.
# Usage: benchmarks/run_moe_targets_gpu.sh OUT_DIR   (results.jsonl + one log per case)
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
cfg=tests/data/configs/Qwen3-30B-A3B.json
common=(--config $cfg --layers 8 --tp 2 --cycles 6 --trainer-device cuda:0 --device cuda:1 --json "$out/results.jsonl")
run() { name=$1; shift; echo "== $name"; python3 benchmarks/bench_nixl.py "${common[@]}" "$@" 2>&1 \
          | grep -v "NIXL INFO\|UCX  WARN" | tee "$out/$name.log" | grep -v "^|---" ; ok "$name"; }
run seq-full       --expert-layout sequential
run seq-vllm2      --expert-layout sequential --vllm-tp 2
run seq-vllm2-ep   --expert-layout sequential --vllm-tp 2 --vllm-ep
run grouped-full   --ep 2 --etp 1 --expert-layout te_grouped
run grouped-vllm2  --ep 2 --etp 1 --expert-layout te_grouped --vllm-tp 2
run grouped-vllm2-ep --ep 2 --etp 1 --expert-layout te_grouped --vllm-tp 2 --vllm-ep
run legacy-vllm2-ep --ep 2 --etp 1 --expert-layout legacy_grouped --vllm-tp 2 --vllm-ep
