#!/usr/bin/env bash
# benchmarks/stream.py for two installs of logitstore, alternating on one machine (these machines are
# noisy: compare pairs run back to back, not runs of different days), printing each pair's read ratio.
#   BEFORE_PYTHON=/path/to/venv-of-the-old-commit/bin/python bash benchmarks/stream_ab.sh [OUT_DIR]
# AFTER_PYTHON defaults to `python`. Each run writes OUT_DIR/stream-decode-<case>-{before,after}.json.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(realpath "${1:-$here/results}")"
before="${BEFORE_PYTHON:?set BEFORE_PYTHON to the python of the install to compare against}"
after="${AFTER_PYTHON:-python}"
cd "$(mktemp -d)"  # away from a checkout, so each python imports its own install
pair() { # case, then benchmarks/stream.py's arguments
  local case=$1; shift
  for variant in before after; do
    local py=$before; [ $variant = after ] && py=$after
    "$py" "$here/stream.py" "$@" --json --label $variant --out "$out/stream-decode-$case-$variant.json" >/dev/null
  done
  python - "$out/stream-decode-$case-before.json" "$out/stream-decode-$case-after.json" "$case" <<'PY'
import json, sys
b, a = (json.load(open(f)) for f in sys.argv[1:3])
print(f"{sys.argv[3]}: read {b['read_tokens_per_second']:,.0f} -> {a['read_tokens_per_second']:,.0f} tokens/s "
      f"({a['read_tokens_per_second'] / b['read_tokens_per_second']:.2f}x); decode floor "
      f"{b['decode_tokens_per_second']:,.0f} -> {a['decode_tokens_per_second']:,.0f}")
PY
}
pair top64-1 --mode topk --k 64 --vocab 151936
pair top64-2 --mode topk --k 64 --vocab 151936
pair s16-local
pair s3-50 --store s3://bench/stream --latency-ms 50
