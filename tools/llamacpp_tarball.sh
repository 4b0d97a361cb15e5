#!/usr/bin/env bash
# The trimmed llama.cpp source that tools/device_llamacpp.sh builds on the device (which has no internet):
# llama.cpp as vendored by the llama-cpp-python sdist (VERSION, default 0.3.36), without what the llama-bench
# target does not compile (models, docs, tests, examples, the web UI, other GPU backends' sources, media), with
# its commit in LLAMACPP_COMMIT (the source has no .git, so llama-bench's own build_commit reads "unknown").
# Writes .llamacpp/llama.cpp.tar.gz (about 5 MB; carry .llamacpp, which .git/info/exclude keeps out of git).
set -eu
cd "$(dirname "$0")/.."
VERSION=${VERSION:-0.3.36}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SDIST=$WORK/llama_cpp_python-$VERSION
COMMIT=$(cat "$SDIST/.git/modules/vendor/llama.cpp/HEAD")
mv "$SDIST/vendor/llama.cpp" "$WORK/llama.cpp"
cd "$WORK/llama.cpp"
rm -rf .git .github .devops .gemini models docs benches media gguf-py conversion tests examples pocs skills \
  scripts/apple tools/ui tools/mtmd/tests tools/mtmd/test-3.mp4
for backend in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "ggml/src/ggml-$backend"
done
find . \( -name "*.png" -o -name "*.jpg" -o -name "*.gif" -o -name "*.mp4" -o -name "*.gguf" \) -delete
echo "$COMMIT" > LLAMACPP_COMMIT
cd - > /dev/null
mkdir -p .llamacpp
tar czf .llamacpp/llama.cpp.tar.gz -C "$WORK" llama.cpp
echo "llama.cpp $COMMIT: .llamacpp/llama.cpp.tar.gz $(du -h .llamacpp/llama.cpp.tar.gz | cut -f1)"
