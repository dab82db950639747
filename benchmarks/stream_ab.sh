#!/usr/bin/env bash
# benchmarks/stream.py for two installs of logitstore, alternating on one machine (these machines are
# noisy: compare pairs run back to back, not runs of different days), printing each pair's read ratio.
#   BEFORE_PYTHON=/path/to/venv-of-the-baseline/bin/python BEFORE_LABEL=... AFTER_LABEL=... bash benchmarks/stream_ab.sh [OUT_DIR]
# AFTER_PYTHON defaults to `python`. The labels name the two code variants (default `before` and `after`);
# each run writes OUT_DIR/stream-<case>-<label>.json, so the file says what it measured.
#   bash benchmarks/stream_ab.sh --smoke [OUT_DIR]
# runs one pair of `stream.py --smoke` (BEFORE_PYTHON defaults to AFTER_PYTHON: the install against itself)
# into OUT_DIR, by default a temporary folder removed at exit (benchmarks/results keeps the real runs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
smoke=""
if [ "${1:-}" = "--smoke" ]; then
  smoke="--smoke"
  shift
fi
after="${AFTER_PYTHON:-python}"
if [ -n "$smoke" ]; then
  out="$(realpath "${1:-$work}")"
  before="${BEFORE_PYTHON:-$after}"
else
  out="$(realpath "${1:-$here/results}")"
  before="${BEFORE_PYTHON:?set BEFORE_PYTHON to the python of the install to compare against}"
fi
before_label="${BEFORE_LABEL:-before}"
after_label="${AFTER_LABEL:-after}"
cd "$work"  # away from a checkout, so each python imports its own install
pair() { # case, then benchmarks/stream.py's arguments
  local case=$1; shift
  "$before" "$here/stream.py" $smoke "$@" --json --label "$before_label" --out "$out/stream-$case-$before_label.json" >/dev/null
  "$after" "$here/stream.py" $smoke "$@" --json --label "$after_label" --out "$out/stream-$case-$after_label.json" >/dev/null
  "$after" - "$out/stream-$case-$before_label.json" "$out/stream-$case-$after_label.json" "$case" <<'PY'
import json, sys
b, a = (json.load(open(f)) for f in sys.argv[1:3])
print(f"{sys.argv[3]}: read {b['read_tokens_per_second']:,.0f} -> {a['read_tokens_per_second']:,.0f} tokens/s "
      f"({a['read_tokens_per_second'] / b['read_tokens_per_second']:.2f}x); decode floor "
      f"{b['decode_tokens_per_second']:,.0f} -> {a['decode_tokens_per_second']:,.0f}")
PY
}
if [ -n "$smoke" ]; then
  pair local-sampled16
  exit
fi
pair local-top64-run1 --mode topk --k 64 --vocab 151936
pair local-top64-run2 --mode topk --k 64 --vocab 151936
pair local-sampled16
pair s3-latency50-sampled16 --store s3://bench/stream --latency-ms 50
