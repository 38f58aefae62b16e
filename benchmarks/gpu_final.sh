#!/usr/bin/env bash
# One device call: the GPU correctness suite split over parallel processes (Triton compiles on
# the CPU, one kernel variant at a time per process), then a short-sequence benchmark refresh.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
pids=()
for f in "^float16-d64-(full|causal)" "^float16-d128-(full|causal)" "^float16-d256-(full|causal)" "^float16-d[0-9]+-(?!full|causal)" "^bfloat16-d64-(full|causal)" "^bfloat16-d128-(full|causal)" "^bfloat16-d256-(full|causal)" "^bfloat16-d[0-9]+-(?!full|causal)|^float32"; do
  i=${#pids[@]}
  python3 -m flashtile.check --quick --only "$f" --json "$OUT/check_$i.json" > "$OUT/check_$i.txt" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
cat "$OUT"/check_*.txt | grep -v "^case\|^flashtile.check" > "$OUT/check_all.txt"
rm -f "$OUT"/check_*.txt "$OUT"/check_*.json
grep -c " yes$" "$OUT/check_all.txt"; grep " NO$\|Error" "$OUT/check_all.txt"; echo "check failures: $fail"
[ -n "${FEATURES:-}" ] && python3 -m flashtile.check --features > "$OUT/features.txt" 2>&1; tail -n 30 "$OUT/features.txt" 2>/dev/null
timeout ${BENCH_S:-200} python3 -m flashtile.bench --dtype bf16 --d 128 --n 512 1K 2K --out "$OUT/b" \
  --merge-into "$OUT/short.json" --no-plot --no-progress --no-device-ceilings > "$OUT/bench.txt" 2>&1
tail -n 22 "$OUT/bench.txt" | cut -c1-150
