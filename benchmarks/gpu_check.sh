#!/usr/bin/env bash
# Issue 33's GPU run as one call of the device tool (under 8 minutes on an H200, leaving room
# for a rerun); every result lands under $OUT (default: ./gpu-check):
#   1. the CUDA tests (tests/test_cuda.py, compiled passes included)       -> $OUT/test_cuda.xml
#   2. bench_device.py --compile: pass curve, engine overhead, compiled plain
#      decoding against eager and transformers' static-cache compile        -> $OUT/bench_device.json
#   3. the demo pair's CPU traces replayed on random weights, eager and
#      compiled (the real acceptance's speedup on this device)             -> $OUT/replay-{eager,compiled}.json
# Run from the repository root on the device machine:
#   bash benchmarks/gpu_check.sh
# It installs the project (no real weights are needed: every model is random, of the demo shapes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check}"
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }

log "install"
python3 -m pip install -q -e ".[test]" >>"$OUT/log.txt" 2>&1 || { log "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.csv" 2>&1

log "1/3 CUDA tests"
timeout 150 python3 -m pytest -q tests/test_cuda.py --junitxml="$OUT/test_cuda.xml" >"$OUT/test_cuda.txt" 2>&1
log "tests exit $?"

log "2/3 bench_device --compile"
timeout 200 python3 benchmarks/bench_device.py --device cuda --compile --repeats 3 --out "$OUT/bench_device.json" \
    >"$OUT/bench_device.txt" 2>&1
log "bench_device exit $?"

log "3/3 trace replays"
for mode in eager compiled; do
    flag=""; [ "$mode" = compiled ] && flag="--compile"
    timeout 90 python3 benchmarks/replay_traces.py --traces benchmarks/traces/demo-llamacpp.json --device cuda \
        $flag --repeats 3 --out "$OUT/replay-$mode.json" >"$OUT/replay-$mode.txt" 2>&1
    log "replay $mode exit $?"
done
log "done"
