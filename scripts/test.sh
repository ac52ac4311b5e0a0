#!/usr/bin/env bash
# The test suite on a fresh machine: creates .venv, installs everything, converts the embedded model once (into
# ~/.cache/token-recycling, outside the repository), runs ruff, then pytest. Extra arguments go to pytest.
#
#   bash scripts/test.sh          the whole suite (CI runs exactly this): installs Debian's Chromium for the browser
#                                 tests when it is missing
#   bash scripts/test.sh --fast   the tier that needs no browser, no launched app and no load test (tests marked
#                                 neither `app`, `load` nor `slow`)
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False NO_PROXY=127.0.0.1,localhost
if [ "$fast" = 1 ]; then
  exec .venv/bin/python -m pytest -q tests -m "not app and not load and not slow" "$@"
fi
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get);" \
         "the browser test will be skipped" >&2
  fi
fi
exec .venv/bin/python -m pytest -q tests "$@"
