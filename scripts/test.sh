#!/usr/bin/env bash
# The test suite on a fresh machine: creates .venv, installs everything, converts the embedded model once (into
# ~/.cache/token-recycling, outside the repository), runs ruff, then pytest. Extra arguments go to pytest.
#
#   bash scripts/test.sh          the whole suite (CI runs exactly this): installs Debian's Chromium for the browser
#                                 tests when it is missing
#   bash scripts/test.sh --fast   the tier that needs no browser, no launched app and no load test (tests marked
#                                 neither `app`, `load` nor `slow`), on the workers, after `app.py --prepare`
#
# The whole suite runs in two parts. First, one test at a time with the machine to itself, the tests marked `app` or
# `load`: the launched app (whose live runs wait for the machine to be quiet before each timed step), the browser,
# and the comparisons of timings; the first of them measures this machine's kernels into the cache, as a user's first
# start does. Then the rest, which compares tokens and never timings, on several pytest workers (pytest-xdist): one a
# core, at most 4 (each loads the embedded model), and none where there is one core. Their torch threads sleep while
# they wait (OMP_WAIT_POLICY=PASSIVE) instead of spinning, so that two workers do not steal each other's cores: on the
# 2-vCPU Xeon the second part took 231 s on two workers, against 323 s on one and 569 s on two spinning workers.
# The workers run over a copy of the cache (`workers_cache`), so that nothing they time side by side is kept for the
# app. A `-m EXPR` given here narrows both parts.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
marks=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) marks="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
narrowed() {  # the part's own marker expression, narrowed by the caller's -m
  if [ -n "$marks" ]; then echo "($1) and ($marks)"; else echo "$1"; fi
}
cores=$(nproc 2>/dev/null || echo 1)
workers=$(( cores > 4 ? 4 : cores ))
[ "$workers" -gt 1 ] || workers=0
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
export HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False NO_PROXY=127.0.0.1,localhost
copy=""  # the workers' copy of the cache while they run; removed however the script ends (Ctrl-C included)
trap '[ -z "$copy" ] || rm -rf "$copy"' EXIT
rest() {  # the tests that compare no timings, on the workers, over a copy of the cache
  local rc=0
  copy=$(workers_cache)
  XDG_CACHE_HOME="$copy" OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest -q tests -n "$workers" --dist worksteal \
    -m "$(narrowed "$1")" ${args[@]+"${args[@]}"} || rc=$?
  rm -rf "$copy"
  copy=""
  return "$rc"
}
workers_cache() {  # a folder to serve the workers as XDG_CACHE_HOME: they read what was measured with the machine
  # alone (copies of those files; the converted model and the rest linked), and what they measure side by side (a
  # kernel timed while the other worker runs) goes with the copy instead of into the cache the app reads
  local real="${XDG_CACHE_HOME:-$HOME/.cache}/token-recycling" copy item
  copy=$(mktemp -d)
  mkdir "$copy/token-recycling"
  if [ -d "$real" ]; then
    for item in "$real"/*; do
      [ -e "$item" ] || continue
      case "$(basename "$item")" in
        calibration | kernels | native) cp -a "$item" "$copy/token-recycling/" ;;
        *) ln -s "$item" "$copy/token-recycling/" ;;
      esac
    done
  fi
  echo "$copy"
}
if [ "$fast" = 1 ]; then
  # what the tests read from the cache is measured first, with the machine alone (seconds where it is cached): else
  # each worker measured the embedded model on every run, side by side (and chose otherwise: the small operations
  # never shared, where alone chose past 9,215 or 18,431 floats)
  log=$(mktemp)
  .venv/bin/python app.py --prepare >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  rm -f "$log"
  rest "not app and not load and not slow"
  exit
fi
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get);" \
         "the browser test will be skipped" >&2
  fi
fi
# pytest's 5 is "no test selected": a -m that leaves one part empty is not a failure of that part
alone=0
.venv/bin/python -m pytest -q tests -m "$(narrowed "app or load")" ${args[@]+"${args[@]}"} || alone=$?
others=0
rest "not app and not load" || others=$?
[ "$alone" = 5 ] && [ "$others" != 5 ] && alone=0
[ "$others" = 5 ] && [ "$alone" = 0 ] && others=0
[ "$alone" = 0 ] || exit "$alone"
exit "$others"
