#!/usr/bin/env bash
# Warm refits per layout on nvidia-h200-x2 (trainer processes on GPU 0, the receiver process on
# GPU 1), each beside raw NIXL READs of the same bytes (one descriptor per trainer, and cut into
# 256 / 1024 / 4096), an NCCL broadcast GPU0 -> GPU1 of the same bytes and a device copy.
# Usage: [CASES="dense-tp2 moe-seq ... vllm fanout"] [QUANT="none fp8"] benchmarks/run_refit_gpu.sh OUT_DIR
# Then, anywhere with matplotlib: python benchmarks/plot_refit.py OUT_DIR/refit.jsonl docs/refit_gpu.png
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
# Stop at the first failure: a failing GPU test or benchmark ends the script before (more) numbers are recorded.
gpu_tests() { python3 -m pytest -q -p no:cacheprovider -o addopts=-ra "$@" >"$out/tests.log" 2>&1; local rc=$?
  tail -3 "$out/tests.log" | tee -a "$out/all.log"
  [[ $rc == 0 ]] || { echo "GPU tests failed (pytest exit $rc, $out/tests.log): no benchmark run" >&2; exit "$rc"; }; }
ok() { local s=("${PIPESTATUS[@]}"); [[ ${s[0]} == 0 ]] || { echo "$1 failed (exit ${s[0]}): stopping" >&2; exit 1; }; }
moe=(--config tests/data/configs/Qwen3-30B-A3B.json --layers 8 --tp 2)
dense=(--config tests/data/configs/Qwen3-8B.json)
gpu=(--cycles 6 --trainer-device cuda:0 --device cuda:1 --json "$out/refit.jsonl")
run() { name=$1; shift; echo "== $name"; timeout 240 python3 benchmarks/bench_nixl.py --label "$name" "$@" "${gpu[@]}" \
          2>&1 | grep -v "NIXL INFO\|UCX  WARN\|UserWarning\|return func\|ProcessGroupNCCL" | tee -a "$out/all.log" \
          | grep -v "^|---" ; ok "$name"; }
want() { [[ " ${CASES:-all} " == *" all "* || " ${CASES:-all} " == *" $1 "* ]]; }
want tests && gpu_tests tests/test_gather.py tests/test_fp8_gpu.py tests/test_nixl_gpu.py
for q in ${QUANT:-none fp8}; do
  sfx=$([[ $q == fp8 ]] && echo "-fp8" || echo "")
  want dense-tp2 && run "dense-tp2$sfx" "${dense[@]}" --tp 2 --quantization $q
  want dense-tp4 && run "dense-tp4$sfx" "${dense[@]}" --tp 4 --quantization $q
  want moe-seq && run "moe-etp2-sequential$sfx" "${moe[@]}" --expert-layout sequential --quantization $q
  want moe-grouped && run "moe-ep2-te_grouped$sfx" "${moe[@]}" --ep 2 --etp 1 --expert-layout te_grouped --quantization $q
  want moe-legacy && run "moe-ep2-legacy_grouped$sfx" "${moe[@]}" --ep 2 --etp 1 --expert-layout legacy_grouped \
    --quantization $q
done
want vllm && run "dense-tp2-vllm-tp2" "${dense[@]}" --tp 2 --vllm-tp 2
want vllm && run "moe-ep2-te_grouped-vllm-tp2-ep" "${moe[@]}" --ep 2 --etp 1 --expert-layout te_grouped --vllm-tp 2 --vllm-ep
# issue 13's fan-out: trainer GPU 0 -> first tier GPU 1 -> replicas alternating GPU 0 / GPU 1
want fanout && { echo "== fanout"; timeout 400 python3 benchmarks/bench_fanout.py --config tests/data/configs/Qwen3-8B.json \
  --trainer-device cuda:0 --devices cuda:1 cuda:0 --replicas 1 2 4 --fanout 1 --json "$out/fanout.jsonl" 2>&1 \
  | grep -v "NIXL INFO\|UCX  WARN" | tee -a "$out/all.log" | grep "^|\|^model"; ok fanout; }
exit 0

