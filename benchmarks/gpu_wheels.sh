#!/usr/bin/env bash
# Downloads, here, the wheels that benchmarks/gpu_check.sh installs on the GPU machine, into ./.whl (git-ignored).
# The GPU image has torch, accelerate, huggingface_hub, tokenizers, safetensors, pandas, pyarrow, xxhash, regex,
# typer, psutil and jinja2, but not trl, and an older transformers (see /work/.library/device/KINDS.md). So: our
# pinned trl and transformers, datasets (which trl imports) with dill and multiprocess, peft at our version, and regex
# (transformers checks its version at import; the image's may be older).
# Pure-Python wheels except multiprocess and regex, fetched for the GPU machine's CPython 3.12 on x86-64. About 17 MB.
# torch stays the image's (2.11.0+cu130 when last read; pyproject.toml pins 2.13.*): a CUDA torch wheel (several
# hundred MB) is far beyond what a device run carries (64 MiB). gpu_check.sh records the versions it ran with
# (benchmarks/gpu_versions.py) and flags those outside the pins.
#
#   bash benchmarks/gpu_wheels.sh            # then carry ".whl" in the device run
#   WITH_PYARROW=1 bash benchmarks/gpu_wheels.sh   # also pyarrow (~45 MB), if the image's is older than 24
#   NO_FLA=1 bash benchmarks/gpu_wheels.sh         # without fla-core (flash-linear-attention's Triton kernels for
#                                                  # qwen3_5's Gated DeltaNet rule and conv, 1.4 MB, pure Python;
#                                                  # the image has Triton and einops, which it needs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
rm -rf .whl
mkdir -p .whl
# tokenizers and safetensors too: transformers 5.23 refuses to import beside older ones.
PKGS=(trl==1.16.0 transformers==5.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 regex==2026.11.19
    tokenizers==0.23.3 safetensors==0.8.0)
if [ "${WITH_PYARROW:-0}" = 1 ]; then PKGS+=(pyarrow==26.0.1); fi
if [ "${NO_FLA:-0}" != 1 ]; then PKGS+=(fla-core==0.6.0); fi
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PKGS[@]}"
ls -la .whl
du -sh .whl
