#!/usr/bin/env bash
# The device check (issue 45): on a machine with a CUDA GPU and no network, within 8 minutes. Runs the tests marked
# `cuda`, then prints t(N)/t(1) for N = 1..128, the host work a step, and for plain, pld, tr, tr-paper, tr-context:
# identical to plain decoding, tokens per pass, speedup (scripts/device_check.py says where each figure comes from).
# Uses the python3 on PATH (torch with CUDA there); extra arguments go to device_check.py (e.g. --device cpu).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
start=$(date +%s)
"$PY" - <<'PY'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")
PY
echo "== tests marked cuda =="
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_torch_backend.py 2>&1 | tail -15
echo "== figures =="
timeout $((480 - ($(date +%s) - start))) "$PY" scripts/device_check.py "$@"
echo "device check took $(( $(date +%s) - start )) s"
