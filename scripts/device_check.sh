#!/usr/bin/env bash
# The prepared device check: one call on a machine with a device (CUDA GPU or
# Ascend NPU), each step under a timeout, everything written to $OUT (default
# /tmp/npu-shim-device-check) and a summary printed (summary.txt):
#
#   1. machine.txt     what the machine is (nvidia-smi / npu-smi, python, torch)
#   2. selftest        `python -m npu_shim selftest` (text and --json); without sglang (a CUDA
#                      machine) its dual-stream step alone (--patch dual_stream_experts); on an
#                      NPU its dual-stream line ends with the crossover measured there
#   3. overlap         scripts/bench_dual_stream.py --graph: serial vs overlapped shared+routed
#                      experts on the synthetic MoE block (masked routed path) at 512 / 2048 / 8192
#                      tokens, eager and under device graphs (each arm captured once, timed by
#                      replays: the production mode), side by side; each mode's crossover (the
#                      smallest size from which two streams win); target >= 90 % of the ideal saving
#   4. sweep           the same, eager and graph, for the per-expert routed path (eager only: a
#                      capture refuses its host reads) and the GLM-4.5-Air shape at 1024 / 4096 /
#                      8192 tokens: where on this device the side stream can pay at all
#   5. mla_function    scripts/bench_hot_path.py --mla-only: the shim's npu_mla_preprocess
#                      function's added ns per call on a layer it has seen (this host's CPU)
#   6. mla_replay      scripts/bench_dual_stream.py --mla-replay: a graph captured through that
#                      function beside one captured through the function it replaces, replays
#                      timed side by side (expected equal: a replay runs no Python)
#   7. moe_wrapper     scripts/bench_dual_stream.py --wrapper-cost: the dual-stream wrapper's host
#                      time per MoE layer call on the device (extend: dual stream; decode: calls through)
#
# Step 7 uses a bundle's wrapt (BUNDLE, default .device-bundle/npu-shim): a device machine
# reaches no package index, so build it here and carry it --
#   echo /.device-bundle/ >> .git/info/exclude; python3 -m npu_shim bundle .device-bundle/npu-shim
#   then copy the checkout, .device-bundle/ with it, to the device machine and run this script there.
# Without it that step says "not measured: no bundle".
#
# --dry-run: on this machine's CPU, no device: every step's plumbing with tiny sizes (the
# overlap, sweep and mla_replay steps on the simulated NPU of dev/shimdev/simnpu, whose graphs
# really capture and replay but time nothing; the wrapper on `--device cpu`, where streams are
# no-ops; the selftest as it runs here), the bundle built if missing; nothing it prints is a
# device measurement and summary.txt says so.
# Needs a python with torch (PYTHON=..., default python3).
set -u
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^# Needs a python/p' "$0"; exit 0 ;;
    *) echo "device_check.sh: unknown argument $arg (--dry-run, --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/npu-shim-device-check}
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-.device-bundle/npu-shim}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the shim first, as on a server
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
# step NAME TIMEOUT CMD...: runs CMD under the timeout, output in $OUT/NAME.txt, its exit in the summary
step() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  note "$name: exit $rc$([ $rc -eq 124 ] && echo " (timed out after ${limit}s)")"
  cat "$OUT/$name.txt"
  return 0
}

if [ $DRY -eq 1 ]; then
  note "DRY RUN on $(hostname): CPU only, tiny sizes -- the plumbing of each step, no device measurement"
  DEVICE=(--device cpu)
  GRAPH_DEVICE=(--simnpu)
  OVERLAP_SIZES=(--hidden 64 --shared-inter 64 --expert-inter 32 --experts 4 --samples 2 --reps 1)
  WRAPPER_SIZES=(--tokens 8 --hidden 64 --shared-inter 64 --expert-inter 32 --experts 4 --calls 5 --rounds 3)
  HOT_SIZES=(--rounds 3 --calls 2000)
  SWEEP_TOKENS=16,32
  AIR_TOKENS=16
  SWEEP_SIZES=(--hidden 64 --shared-inter 64 --expert-inter 32 --experts 4 --samples 2 --reps 1)
  if [ ! -d "$BUNDLE/npu_shim/_vendor/wrapt" ]; then
    note "building the bundle $BUNDLE (pip: wrapt wheels)"
    "$PY" -m npu_shim bundle "$BUNDLE" > "$OUT/bundle.txt" 2>&1 || note "bundle: build failed (see bundle.txt)"
  fi
else
  DEVICE=()
  GRAPH_DEVICE=()
  OVERLAP_SIZES=()
  WRAPPER_SIZES=()
  HOT_SIZES=(--rounds 9 --calls 100000)
  SWEEP_TOKENS=512,2048,8192
  AIR_TOKENS=1024,4096,8192
  SWEEP_SIZES=()
fi

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi -L 2>/dev/null || true
  npu-smi info 2>/dev/null | head -20 || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

ARGS=()
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" 2>/dev/null; then
  ARGS=(--patch dual_stream_experts)
fi
step selftest 120 "$PY" -m npu_shim selftest "${ARGS[@]}"
timeout 120 "$PY" -m npu_shim selftest --json "${ARGS[@]}" > "$OUT/selftest.json" 2>> "$OUT/selftest.txt"
note "selftest --json: exit $?"

step overlap 300 "$PY" scripts/bench_dual_stream.py --graph "${GRAPH_DEVICE[@]}" --sizes "$SWEEP_TOKENS" "${OVERLAP_SIZES[@]}"

# sweep_rows ARGS...: one shape of the sweep, eager and graph over its sizes, each mode's crossover
sweep_rows() {
  echo "== $*"
  timeout 240 "$PY" scripts/bench_dual_stream.py --graph "${GRAPH_DEVICE[@]}" "$@" 2>&1 \
    | grep -E "^(how|size|crossover|ok|note|not measured)"
}
sweep() {
  local air=(--hidden 4096 --shared-inter 1408 --experts 16 --topk 8 --expert-inter 1408)
  [ $DRY -eq 1 ] && air=("${SWEEP_SIZES[@]}")
  sweep_rows --routed per-expert --sizes "$SWEEP_TOKENS" "${SWEEP_SIZES[@]}"
  sweep_rows --routed masked --sizes "$AIR_TOKENS" "${air[@]}"
}
# a shell function, so not through step's timeout: each of its shapes has its own
sweep > "$OUT/sweep.txt" 2>&1
note "sweep: $(grep -c '^size:' "$OUT/sweep.txt") sizes measured"
cat "$OUT/sweep.txt"

step mla_function 180 "$PY" scripts/bench_hot_path.py --mla-only "${HOT_SIZES[@]}"
step mla_replay 180 "$PY" scripts/bench_dual_stream.py --mla-replay "${GRAPH_DEVICE[@]}"
if [ -d "$BUNDLE/npu_shim/_vendor/wrapt" ]; then
  step moe_wrapper 180 "$PY" scripts/bench_dual_stream.py --wrapper-cost --bundle "$BUNDLE" "${DEVICE[@]}" "${WRAPPER_SIZES[@]}"
else
  note "moe_wrapper: not measured: no bundle at $BUNDLE (build it and carry it: see the head of this script)"
fi

echo
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
grep -h "^crossover\|^ok:" "$OUT/overlap.txt" 2>/dev/null | sed 's/^/overlap /'
grep -h "^== \|^crossover" "$OUT/sweep.txt" 2>/dev/null | sed 's/^/sweep /'
grep -h "crossover" "$OUT/selftest.txt" 2>/dev/null | sed 's/^/selftest /'
grep -h "^measured:\|^ok:" "$OUT/mla_replay.txt" "$OUT/moe_wrapper.txt" 2>/dev/null
grep -h -A1 "added ns/call" "$OUT/mla_function.txt" 2>/dev/null
[ $DRY -eq 1 ] && echo "DRY RUN: nothing above was measured on a device"
exit 0
