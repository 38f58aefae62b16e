#!/usr/bin/env bash
# One device call: correctness on the GPU, then the requested steps.  Usage:
#   bash benchmarks/gpu_session.sh "check tune bench"   (OUT is the folder results go to)
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for step in $1; do
  case $step in
    check) python3 -m flashtile.check --json "$OUT/check.json" 2>&1 | tee "$OUT/check.txt" ;;
    checkq) python3 -m flashtile.check --quick --json "$OUT/check.json" 2>&1 | tee "$OUT/check.txt" ;;
    tune) python3 -m flashtile.tune ${TUNE_ARGS:---peers --d 128} --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.txt" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
