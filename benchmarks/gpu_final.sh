#!/usr/bin/env bash
# One device call: the GPU correctness suite (core and feature cases) split over parallel
# processes (Triton compiles on the CPU, one kernel variant at a time per process), then a
# short-sequence benchmark refresh and a batch-1 decode re-measurement.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
pids=()
run_check() {  # $1 = index, $2 = regex, $3 = extra flag
  python3 -m flashtile.check --quick $3 --only "$2" > "$OUT/check_$1.txt" 2>&1 &
  pids+=($!)
}
i=0
for f in "^float16-d64-(full|causal)" "^float16-d128-(full|causal)" "^float16-d256-(full|causal)" \
         "^float16-d[0-9]+-(?!full|causal)" "^bfloat16-d64-(full|causal)" "^bfloat16-d128-(full|causal)" \
         "^bfloat16-d256-(full|causal)" "^bfloat16-d[0-9]+-(?!full|causal)|^float32"; do
  run_check $i "$f" ""; i=$((i + 1))
done
for f in "^float16-(dropout|mask)" "^float16-(bias|sparse)" "^bfloat16-(dropout|mask)" "^bfloat16-(bias|sparse)"; do
  run_check $i "$f" "--features"; i=$((i + 1))
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
head -n 1 "$OUT/check_0.txt" > "$OUT/check_all.txt"
cat "$OUT"/check_*.txt | grep -v "^flashtile.check\|^case " >> "$OUT/check_all.txt"
rm -f "$OUT"/check_[0-9]*.txt
echo "cases ok: $(grep -c ' yes$' "$OUT/check_all.txt"), failed: $(grep -c ' NO$' "$OUT/check_all.txt"), any process failed: $fail"
grep " NO$\|Error\|Traceback" "$OUT/check_all.txt" | head -20
timeout ${BENCH_S:-150} python3 -m flashtile.bench --dtype bf16 --d 128 --n 512 1K 2K --out "$OUT/b" \
  --merge-into "$OUT/short.json" --no-plot --no-progress --no-device-ceilings > "$OUT/bench.txt" 2>&1
tail -n 22 "$OUT/bench.txt" | cut -c1-150
timeout 120 python3 -m flashtile.bench decode --out "$OUT/decode_b1.json" --batches 1 8 \
  --cache-lens 16384 65536 --no-flex --sdpa cudnn --skip-check > "$OUT/decode_b1.txt" 2>&1
grep -E "^(flashtile|flashtile_cudagraph|sdpa_cudnn) " "$OUT/decode_b1.txt"
