#!/usr/bin/env bash
# One call on a machine with a device (CUDA GPU or Ascend NPU): `python -m npu_shim selftest` and the
# benchmark's dual-stream row, each under a timeout, everything written to $OUT (default
# /tmp/npu-shim-device-check) and its summary printed.  Needs a python with torch (PYTHON=...);
# without sglang (a CUDA machine) the selftest runs the dual-stream step alone (--patch).
#
#   run(command="bash scripts/device_check.sh", timeout_s=420)      # the device tool: $OUT comes back
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/npu-shim-device-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the shim first, as on a server

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi -L 2>/dev/null || true
  npu-smi info 2>/dev/null | head -20 || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

ARGS=()
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" 2>/dev/null; then
  ARGS=(--patch dual_stream_experts)
fi
timeout 120 "$PY" -m npu_shim selftest "${ARGS[@]}" > "$OUT/selftest.txt" 2> "$OUT/selftest.stderr"
echo "selftest exit $?" | tee "$OUT/selftest.exit"
cat "$OUT/selftest.txt"
timeout 120 "$PY" -m npu_shim selftest --json "${ARGS[@]}" > "$OUT/selftest.json" 2>> "$OUT/selftest.stderr"
echo "selftest --json exit $?" >> "$OUT/selftest.exit"

timeout 240 "$PY" scripts/bench_dual_stream.py > "$OUT/bench_dual_stream.txt" 2>&1
echo "bench_dual_stream exit $?" | tee "$OUT/bench.exit"
cat "$OUT/bench_dual_stream.txt"

# The table row as scripts/bench.py writes it (it needs torch and wrapt in this python).
if "$PY" -c "import torch, wrapt" 2>/dev/null; then
  timeout 240 "$PY" scripts/bench.py --only bench_dual_stream > "$OUT/bench_row.txt" 2>&1
  echo "bench.py --only bench_dual_stream exit $?" | tee -a "$OUT/bench.exit"
  tail -3 "$OUT/bench_row.txt"
fi
