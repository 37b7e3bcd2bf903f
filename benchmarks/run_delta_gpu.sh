#!/usr/bin/env bash
# Issue 40 on one host with two GPUs: delta refits after optimizer steps, trainer processes (one per
# tp rank, torch Adam on fp32 main params, bf16 parameters) on GPU 0, the receivers on GPU 1, NIXL
# between them; the last version mirrored and the deltas packed on the trainers' GPU (device), then
# in pinned host memory (host: no extra GPU memory); then no mirror: a ChangeTracker marks the changes
# in the main-to-model copy (--changes tracker), deltas packed on the GPU, then in pinned host memory.
# WHERE / TRACKER_SLOTS pick the runs (empty: none), FP8= skips the FP8 run.
# Usage: benchmarks/run_delta_gpu.sh OUT_DIR ; then python benchmarks/bench_delta.py --from-json OUT_DIR/delta_gpu.jsonl
set -uo pipefail
out=${1:-out}; mkdir -p "$out"
quiet() { grep -v "NIXL INFO\|UCX  WARN\|UserWarning\|return func" | tee -a "$out/all.log"; }
common=(--trainer adam --config tests/data/configs/Qwen3-8B.json --layers "${LAYERS:-8}" --tp 2
        --trainer-device cuda:0 --device cuda:1 --lr 1e-6 1e-5 --steps "${STEPS:-6}" --json "$out/delta_gpu.jsonl")
for where in ${WHERE-device host}; do
  echo "== mirror and slots: $where"
  timeout 280 python3 benchmarks/bench_delta.py "${common[@]}" --slots "$where" --mirror "$where" \
    --label "Qwen3-8B 8 layers tp2, GPU 0 -> GPU 1, mirror + slots on $where" 2>&1 | quiet
done
for slots in ${TRACKER_SLOTS-device host}; do
  echo "== tracker (no mirror), slots: $slots"
  timeout 280 python3 benchmarks/bench_delta.py "${common[@]}" --slots "$slots" --changes tracker \
    --label "Qwen3-8B 8 layers tp2, GPU 0 -> GPU 1, tracker (no mirror) + slots on $slots" 2>&1 | quiet
done
if [[ -n "${FP8-1}" ]]; then
  echo "== block FP8 served, mirror and slots: device"
  timeout 280 python3 benchmarks/bench_delta.py "${common[@]}" --slots device --mirror device --quantization fp8 \
    --label "Qwen3-8B 8 layers tp2 block FP8, GPU 0 -> GPU 1, mirror + slots on device" 2>&1 | quiet
fi
