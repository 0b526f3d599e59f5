#!/usr/bin/env bash
# llama.cpp's own tools for the peer benchmarks (bench/peers.py, bench/user_models.py, bench/perplexity.py):
# llama-server, llama-quantize, llama-perplexity and convert_hf_to_gguf.py, from the llama.cpp vendored in the
# llama-cpp-python sdist the worker's ENGINE=llamacpp is built from, with the instruction sets this CPU grants named
# one by one (worker/llamacpp/cmake_args.py; a native build can enable AMX it may not use). About 8 minutes on 2
# cores; the result is kept in $LLAMA_TOOLS (default ~/.cache/llmserve/llama.cpp-<version>-<flag set>), and the
# script prints that folder's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
args=$(python3 worker/llamacpp/cmake_args.py)
dest=${LLAMA_TOOLS:-$HOME/.cache/llmserve/llama.cpp-$version-$(echo "$args" | cksum | cut -d' ' -f1)}
if [ ! -x "$dest/build/bin/llama-quantize" ] || [ ! -x "$dest/build/bin/llama-server" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-binary :all: --no-deps -d "$work" "llama-cpp-python==$version" >&2
  tar -xzf "$work"/llama_cpp_python-$version.tar.gz -C "$work"
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest"
  mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$dest"
  # shellcheck disable=SC2086  # the flags are words
  cmake -S "$dest" -B "$dest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF $args >&2
  cmake --build "$dest/build" -j "$(nproc)" --target llama-server llama-quantize llama-perplexity >&2
fi
echo "$dest"
