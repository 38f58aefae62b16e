#!/usr/bin/env bash
# One device call running the requested steps (OUT is the folder results go to):
#   bash benchmarks/gpu_final.sh "check variants decode"
# check:    the GPU correctness suite (core and feature cases) split over parallel processes
#           (Triton compiles on the CPU, one kernel variant at a time per process), and the
#           bitwise comparison of direct launches with kernel[grid] launches
# variants: python -m flashtile.bench variants (block-sparse density, window, varlen)
# decode:   python -m flashtile.bench decode (batch 1/8/64, caches 4K..128K, all peers)
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_COMPILE_THREADS=1
status=0
for step in $1; do
  case $step in
    check)
      pids=()
      i=0
      run_check() {  # $1 = regex, $2 = extra flag
        python3 -m flashtile.check --quick $2 --only "$1" > "$OUT/check_$i.txt" 2>&1 &
        pids+=($!); i=$((i + 1))
      }
      for f in "^float16-d64-(full|causal)" "^float16-d128-(full|causal)" "^float16-d256-(full|causal)" \
               "^float16-d[0-9]+-(?!full|causal)" "^bfloat16-d64-(full|causal)" "^bfloat16-d128-(full|causal)" \
               "^bfloat16-d256-(full|causal)" "^bfloat16-d[0-9]+-(?!full|causal)|^float32"; do
        run_check "$f" ""
      done
      for f in "^float16-(dropout|mask)" "^float16-(bias|sparse|paged)" "^bfloat16-(dropout|mask)" \
               "^bfloat16-(bias|sparse|paged)"; do
        run_check "$f" "--features"
      done
      fail=0
      for p in "${pids[@]}"; do wait "$p" || fail=1; done
      head -n 1 "$OUT/check_0.txt" > "$OUT/check_all.txt"
      cat "$OUT"/check_[0-9]*.txt | grep -v "^flashtile.check\|^case " >> "$OUT/check_all.txt"
      rm -f "$OUT"/check_[0-9]*.txt
      python3 -m flashtile.check --direct-launch >> "$OUT/check_all.txt" 2>&1 || fail=1
      echo "cases ok: $(grep -cE ' yes( |$)' "$OUT/check_all.txt"), failed: $(grep -cE ' NO( |$)' "$OUT/check_all.txt"), any process failed: $fail"
      grep " NO$\|Error\|Traceback\|direct launches" "$OUT/check_all.txt" | head -20
      [ $fail = 0 ] || status=1 ;;
    variants)
      timeout ${VARIANTS_S:-240} python3 -m flashtile.bench variants --out "$OUT/variants" --no-progress \
        > "$OUT/variants.txt" 2>&1 || status=1
      tail -n 40 "$OUT/variants.txt" | cut -c1-160 ;;
    decode)
      timeout ${DECODE_S:-420} python3 -m flashtile.bench decode --out "$OUT/decode.json" \
        > "$OUT/decode.txt" 2>&1 || status=1
      grep -E "^ +(flashtile_cudagraph|read_same_bytes|sdpa_cudnn|flex|flashtile_layers|read_same_bytes_layers|sdpa_cudnn_layers) |copy b|^batch" "$OUT/decode.txt" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
