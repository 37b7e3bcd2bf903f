#!/usr/bin/env bash
# Issue 26 on one host with two GPUs (nvidia-h100-x2 / nvidia-h200-x2): trainer processes on GPU 0,
# the receiver process on GPU 1 (never made current there), NIXL between them over CUDA IPC.
# Staged vs streamed (1 GiB and auto budgets) into vLLM-layout workers, bf16 and block FP8, each
# beside a raw NIXL READ of the same bytes; then the fan-out trainer GPU 0 -> replica A GPU 1 ->
# replica B GPU 0; first the two-GPU tests (receiver on a non-current device).
# Usage: [CASES="tests dense dense-fp8 moe-seq moe-ep moe-ep-fp8 fanout"] benchmarks/run_two_gpu.sh OUT_DIR
# Then: python benchmarks/bench_streamed_nixl.py --from-json OUT_DIR/streamed.jsonl
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
want() { [[ " ${CASES:-all} " == *" all "* || " ${CASES:-all} " == *" $1 "* ]]; }
quiet() { grep -v "NIXL INFO\|UCX  WARN\|UserWarning\|return func\|ProcessGroupNCCL" | tee -a "$out/all.log"; }
want tests && gpu_tests tests/test_device_guard_gpu.py tests/test_streamed_gpu.py tests/test_nixl_gpu.py
gpu=(--trainer-device cuda:0 --device cuda:1 --budget 1073741824 auto --cycles 8 --json "$out/streamed.jsonl")
dense=(--config tests/data/configs/Qwen3-8B.json --tp 2 --vllm-tp 2)
moe=(--config tests/data/configs/Qwen3-30B-A3B.json --layers 8 --tp 2 --vllm-tp 2)
run() { local name=$1; echo "== $1"; shift; timeout 300 python3 benchmarks/bench_streamed_nixl.py "$@" "${gpu[@]}" 2>&1 | quiet; ok "$name"; }
want dense && run dense "${dense[@]}" --label dense-tp2
want dense-fp8 && run dense-fp8 "${dense[@]}" --quantization fp8 --label dense-tp2-fp8
want moe-seq && run moe-seq "${moe[@]}" --expert-layout sequential --label moe-etp2-sequential
want moe-ep && run moe-ep "${moe[@]}" --ep 2 --etp 1 --expert-layout te_grouped --vllm-ep --label moe-ep2-te_grouped
want moe-ep-fp8 && run moe-ep-fp8 "${moe[@]}" --ep 2 --etp 1 --expert-layout te_grouped --vllm-ep --quantization fp8 \
  --label moe-ep2-te_grouped-fp8
want fanout && { echo "== fanout"; timeout 300 python3 benchmarks/bench_fanout.py --make-current --config tests/data/configs/Qwen3-8B.json \
  --trainer-device cuda:0 --devices cuda:1 cuda:0 --replicas 1 2 --fanout 1 --json "$out/fanout.jsonl" 2>&1 | quiet \
  | grep "^|\|^model\|^machine\|Error"; ok fanout; }
exit 0
