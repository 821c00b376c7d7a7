#!/usr/bin/env bash
# The checks a lent GPU is for, as one command (a few minutes on an H100 or H200), run from the
# repository root on the GPU machine; logs go to $OUT (default /tmp/gpu_checks):
#
#   1. the GPU-only tests: the paged decode kernel (Pallas Triton) compiled and run against
#      the dense form, the slots engine with it against the static sampler (tokens, log-probs,
#      attention masses), cuDNN attention against XLA;
#   2. bf16 decode tokens/s of both engines at 64 and 256 rows on a random Qwen2.5-0.5B-sized
#      model (bench/rollout.py: the static sampler with XLA's dense attention, the slots
#      engine with a slot per row reading its pages through the kernel; it asserts that both
#      sample the same completions).
#
# The machine's Python ($PYTHON, default python3) needs jax with CUDA, flax, optax,
# transformers and torch; the project's other pure-Python dependencies (grain, ml-collections,
# tensorboardX) can travel as wheels.
#
#   bash bench/gpu_checks.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # bench/rollout.py imports the repository

# tests/conftest.py defaults JAX_PLATFORMS to the CPU: name the GPU
JAX_PLATFORMS=cuda,cpu "$PY" -m pytest -q -rA \
    tests/models/test_cached_kernels.py tests/sampling/test_engine.py -k gpu \
    2>&1 | tee "$OUT/tests.log" || status=1
JAX_PLATFORMS=cuda,cpu "$PY" -m pytest -q -rA tests/models/test_attention.py -k "gpu or cudnn" \
    2>&1 | tee -a "$OUT/tests.log" || status=1

for sizes in "8 64" "32 256"; do  # prompts x 8 samples = rows, a slot per row
    set -- $sizes
    JAX_PLATFORMS=cuda "$PY" bench/rollout.py --size medium --dtype bfloat16 \
        --decode-attention gpu --prompts "$1" --samples 8 --slots "$2" --new-tokens 512 \
        --narrow 0 2>&1 | tee -a "$OUT/rollout.log" || status=1
done
exit $status
