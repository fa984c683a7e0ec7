#!/usr/bin/env bash
# Every GPU measurement the open work asks for, in one run on one card (about 8 minutes):
#
#     OUT=results bash tools/gpu_session.sh
#
#   card.txt       the card, its driver, torch and triton
#   gpu_1b         tools/bench_gpu.py at Llama-3.2-1B's shape, 4 x 2048, bf16 (as measured before): eager, torch.compile,
#                  picofx and Liger side by side, then 3 traced steps each (device time per pattern, the
#                  SDPA backend of each attention call)
#   gpu_8b         the same at Llama-3.1-8B's layer shape, 1 x 8192, 4 layers (beside the AdamW state):
#                  torch.compile against picofx
#   float8         tools/bench_float8.py at the 8B layer shape: torch.compile bf16, torchao float8 +
#                  torch.compile (where torchao is installed) and picofx float8
#   breakdown      picofx train --profile on the card: the measured step per component
#
# Each step has its own time limit and writes NAME.log (and NAME.json) under $OUT; one that fails or
# runs out of time leaves its log, and the next one runs. The tables go into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PICOFX_CACHE_DIR=/tmp/picofx-cache

step() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (at most ${limit} s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $(($(date +%s) - start)) s"
    tail -n 30 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  date -u +%Y-%m-%dT%H:%MZ; } >"$OUT/card.txt"
cat "$OUT/card.txt"

step gpu_1b 190 $PY tools/bench_gpu.py --shape llama-3.2-1b --precision bf16 --batch 4 --seq 2048 --warmup 2 --steps 6 \
    --profile 3 --no-planner --json "$OUT/gpu_1b.json"
step gpu_8b 110 $PY tools/bench_gpu.py --shape llama-3.1-8b --layers 4 --precision bf16 --batch 1 --seq 8192 \
    --warmup 2 --steps 6 \
    --contenders torch.compile,picofx --no-planner --json "$OUT/gpu_8b.json"
step float8 110 $PY tools/bench_float8.py --mode speed --device cuda --shapes llama-3.1-8b --layers 4 --batch 1 \
    --seq 8192 --warmup 2 --steps 6 --json "$OUT/float8.json"
step breakdown 60 $PY -m picofx train --device cuda --size small --batch 8 --seq 1024 --steps 12 --profile 3 \
    --log-every 4
