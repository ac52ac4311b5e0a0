#!/usr/bin/env bash
# Runs the app on the embedded default model (http://127.0.0.1:7860): creates .venv and installs everything first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GRADIO_ANALYTICS_ENABLED=False
exec .venv/bin/python app.py "$@"
