#!/usr/bin/env bash
# Issue 14 on nvidia-h200-x8: trainer processes on GPUs 0-3, the four workers of one vLLM tp=4
# engine on GPUs 4-7, all pulling at once (benchmarks/bench_multi.py), bf16 and FP8, against raw
# NIXL READs and an NCCL broadcast of the same model.
# Usage: [CASES="llama70b qwen30b"] [QUANT="none fp8"] benchmarks/run_refit_8gpu.sh OUT_DIR
# On nvidia-h200-x2 the same script runs as TRAINERS="cuda:0" RECEIVERS="cuda:1" (smaller: LAYERS=8).
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
trainers=(${TRAINERS:-cuda:0 cuda:1 cuda:2 cuda:3})
receivers=(${RECEIVERS:-cuda:4 cuda:5 cuda:6 cuda:7})
vtp=${VLLM_TP:-4}
layers=${LAYERS:-0}
run() { name=$1; shift; echo "== $name"; timeout 900 python3 benchmarks/bench_multi.py "$@" --layers "$layers" \
          --trainer-devices "${trainers[@]}" --receiver-devices "${receivers[@]}" --vllm-tp "$vtp" --cycles 5 \
          --json "$out/multi.jsonl" 2>&1 | grep -v "NIXL INFO\|UCX  WARN\|UserWarning\|return func\|ProcessGroupNCCL" \
          | tee -a "$out/all.log" | grep -v "^|---" ; ok "$name"; }
want() { [[ " ${CASES:-all} " == *" all "* || " ${CASES:-all} " == *" $1 "* ]]; }
for q in ${QUANT:-none fp8}; do
  want llama70b && run "llama70b-tp4-$q" --config tests/data/configs/Llama-3.1-70B.json --tp 4 --quantization "$q"
  want qwen30b && run "qwen30b-tp2-ep2-$q" --config tests/data/configs/Qwen3-30B-A3B.json --tp 2 --ep 2 --etp 1 \
    --expert-layout te_grouped --vllm-ep --quantization "$q"
  want qwen8b && run "qwen8b-tp2-$q" --config tests/data/configs/Qwen3-8B.json --tp 2 --quantization "$q"
done
