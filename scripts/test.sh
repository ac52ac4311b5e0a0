#!/usr/bin/env bash
# The whole test suite on a fresh machine: creates .venv, installs everything, converts the embedded model once
# (into ~/.cache/token-recycling, outside the repository), installs Debian's Chromium for the app's browser test
# when it is missing, then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get);" \
         "the browser test will be skipped" >&2
  fi
fi
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False NO_PROXY=127.0.0.1,localhost
exec .venv/bin/python -m pytest -q tests "$@"
