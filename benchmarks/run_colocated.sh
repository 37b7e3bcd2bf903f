#!/usr/bin/env bash
# Issue 22 on one GPU (nvidia-h100-x1 / nvidia-h200): trainer processes and the receiver process
# on the same card, the trainers read through CUDA IPC. First the GPU tests (CUDA IPC refits
# bit-identical, writer stress, trainer restart, a mixed IPC + NIXL job, and the earlier GPU
# tests), then the colocated cases against a plain device copy of the same bytes, and one
# against NIXL on the same GPU.
# Usage: [CASES="tests dense dense-vllm moe moe-vllm nixl boxes"] benchmarks/run_colocated.sh OUT_DIR
# Then: python benchmarks/bench_colocated.py --from-json OUT_DIR/colocated.jsonl
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
want() { [[ " ${CASES:-all} " == *" all "* || " ${CASES:-all} " == *" $1 "* ]]; }
quiet() { grep -v "NIXL INFO\|UCX  WARN\|UserWarning\|return func\|CudaIPCTypes\|^$" | tee -a "$out/all.log"; }
want tests && gpu_tests tests/test_cuda_ipc_gpu.py tests/test_device_guard_gpu.py \
  tests/test_streamed_gpu.py tests/test_nixl_gpu.py tests/test_checksums.py
run() { local name=$1; echo "== $1"; shift; timeout 240 python3 benchmarks/bench_colocated.py "$@" --cycles 8 \
  --json "$out/colocated.jsonl" 2>&1 | quiet | grep "^|\|^model\|^machine\|Error\|copies per"; ok "$name"; }
dense=(--config tests/data/configs/Qwen3-8B.json --tp 2)
moe=(--config tests/data/configs/Qwen3-30B-A3B.json --layers 8 --tp 2 --ep 2 --etp 1 --expert-layout te_grouped)
want dense && run dense "${dense[@]}" --label dense-tp2
want dense-vllm && run dense-vllm "${dense[@]}" --vllm-tp 2 --label dense-tp2-vllm
want moe && run moe "${moe[@]}" --label moe-ep2
want moe-vllm && run moe-vllm "${moe[@]}" --vllm-tp 2 --vllm-ep --label moe-ep2-vllm
want nixl && run nixl --config tests/data/configs/Qwen3-8B.json --layers 4 --tp 2 --nixl-cycles 2 --label dense-4-layers-nixl
want boxes && { timeout 120 python3 benchmarks/bench_box_copies.py --json "$out/boxes.jsonl" 2>&1 | quiet; ok boxes; }
exit 0
