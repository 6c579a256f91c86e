#!/usr/bin/env bash
# Build llama.cpp's own command-line tools, the CPU peer of specdecode's benchmarks (llama-bench,
# llama-completion, llama-speculative, llama-speculative-simple, llama-lookup, llama-server), from
# the llama.cpp source that the llama-cpp-python sdist vendors, so the peer runs the same ggml as
# specdecode's llama.cpp backend. About 7-10 minutes on 2 cores for all of them.
#
#   bash scripts/build-llamacpp-tools.sh [OUT_DIR] [TARGET ...]
#
# OUT_DIR defaults to ~/.cache/llamacpp-tools; TARGETs default to all six (e.g. `llama-server`
# alone builds in less). Needs a C++ compiler, CMake and pip. Prints the folder holding the
# binaries (OUT_DIR/build/bin) last: pass it to `specdecode bench --llamacpp-bin`.
set -euo pipefail
out=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/llamacpp-tools}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(llama-bench llama-completion llama-speculative llama-speculative-simple llama-lookup llama-server)
fi
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}  # the version pyproject.toml pins for the llamacpp extra
mkdir -p "$out"
if [ ! -d "$out/src" ]; then
  pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$out/sdist" >/dev/null
  tar xzf "$out"/sdist/llama_cpp_python-*.tar.gz -C "$out/sdist"
  ln -sfn "$(ls -d "$out"/sdist/llama_cpp_python-*/vendor/llama.cpp)" "$out/src"
fi
cmake -S "$out/src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON \
      -DLLAMA_BUILD_TOOLS=ON >"$out/cmake.log" 2>&1 || { tail -20 "$out/cmake.log"; exit 1; }
cmake --build "$out/build" --config Release -j"$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1 \
      || { tail -20 "$out/build.log"; exit 1; }
echo "$out/build/bin"
