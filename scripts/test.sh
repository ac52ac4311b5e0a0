#!/usr/bin/env bash
# The whole test suite on a fresh machine: creates .venv, installs everything, converts the embedded model once
# (into ~/.cache/token-recycling, outside the repository), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False NO_PROXY=127.0.0.1,localhost
exec .venv/bin/python -m pytest -q tests "$@"
