#!/usr/bin/env bash
# Block-FP8 refits on nvidia-h200-x2: the GPU tests, the trainer-side kernel vs a device copy,
# and bf16 vs FP8 refits over NIXL (trainer processes on GPU 0, the receiver on GPU 1).
# Usage: [QUANT="none fp8"] benchmarks/run_fp8_gpu.sh OUT_DIR
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
gpu_tests tests/test_fp8_gpu.py tests/test_nixl_gpu.py
timeout 120 python3 benchmarks/bench_fp8.py --json "$out/kernel.jsonl" 2>&1 | tee "$out/kernel.log"; ok bench_fp8
moe=(--config tests/data/configs/Qwen3-30B-A3B.json --layers 8 --tp 2)
dense=(--config tests/data/configs/Qwen3-8B.json --tp 2)
gpu=(--cycles 6 --trainer-device cuda:0 --device cuda:1 --json "$out/refit.jsonl")
run() { name=$1; shift; echo "== $name"; timeout 240 python3 benchmarks/bench_nixl.py "$@" "${gpu[@]}" 2>&1 \
          | grep -v "NIXL INFO\|UCX  WARN" | tee "$out/$name.log" | grep -v "^|---" ; ok "$name"; }
for q in ${QUANT:-none fp8}; do
  run "moe-grouped-$q" "${moe[@]}" --ep 2 --etp 1 --expert-layout te_grouped --quantization $q
  run "moe-seq-$q" "${moe[@]}" --expert-layout sequential --quantization $q
  run "dense-$q" "${dense[@]}" --quantization $q
done
