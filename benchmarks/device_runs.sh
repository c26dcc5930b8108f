# The final device calls of issues 38-40, one function per call (each well under the 10-minute limit; $OUT gets
# at most 5 files: env.txt, a log, a JSON, its .md, and the part file where there is one). Run from the repo root
# on the device machine, carrying the wheels (and, for one_owner, the before tree):
#
#   run(command="bash benchmarks/device_runs.sh gpu_tests",   carry=[".whl"])                       # ~5 min
#   run(command="bash benchmarks/device_runs.sh one_owner",   carry=[".whl", ".devrun/before"])     # ~5 min
#   run(command="bash benchmarks/device_runs.sh journey_offload", carry=[".whl"])   # journey_offload.py's own time
#   run(command="bash benchmarks/device_runs.sh journey",     carry=[".whl"])                       # ~4 min
#   run(command="bash benchmarks/device_runs.sh journey_nvfp4", carry=[".whl"])                     # ~6 min
#   run(command="bash benchmarks/device_runs.sh pipeline",    carry=[".whl"])                       # ~7 min, or:
#   run(command="bash benchmarks/device_runs.sh pipeline_1",  carry=[".whl"])                       # ~3 min
#   run(command="bash benchmarks/device_runs.sh pipeline_2",  carry=[".whl"])                       # ~5 min
#
# The before tree: `git worktree add .devrun/before 69357ce` (an ignored path) before the one_owner call.
# Between calls, copy what comes back into benchmarks/results/ (top level: one_owner_h200.*, journey_h200.*,
# journey_offload_h200.*, pipeline_h200.*, gpu_tests_h200.log): journey merges the offload keys from
# benchmarks/results/journey_offload_h200.json, journey_nvfp4 and pipeline_2 extend the first part's file there.
# Every script keeps going past a failed step (the error is in its JSON) and writes after every step, so a call
# cut by its time limit still returns what it measured.

set -o pipefail
source benchmarks/device_env.sh  # wheels into /tmp/site, PYTHONPATH, $OUT/env.txt
R=benchmarks/results

gpu_tests() {
  local src
  src=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import harness_io as h; print(h.sources_sha256())")
  { echo "# python3 -m pytest -q -m gpu tests: $(date -u +%FT%TZ), qwen_absorb sources $src"
    cat "$OUT/env.txt"
    timeout 560 python3 -m pytest -q -m gpu tests -p no:cacheprovider; } 2>&1 | tee "$OUT/gpu_tests_h200.log"
}

one_owner() {
  test -f .devrun/before/qwen_absorb/__init__.py || {
    echo "no .devrun/before: git worktree add .devrun/before 69357ce, and carry it"; return 2; }
  python3 benchmarks/one_owner.py --before-root .devrun/before --out "$OUT" --worker-timeout-s 270 2>&1 |
    tee "$OUT/one_owner.log"
}

journey_offload() {
  python3 benchmarks/journey_offload.py --out "$OUT" 2>&1 | tee "$OUT/journey_offload.log"
}

journey() {  # FP8 memory and speed, the resident pipeline
  python3 benchmarks/journey.py --out "$OUT" --sections fp8,pipeline --budget-s 500 \
    --offload-json "$R/journey_offload_h200.json" 2>&1 | tee "$OUT/journey.log"
}

journey_nvfp4() {  # NVFP4: quantize, export, load, emulate; merged into the first part's file
  python3 benchmarks/journey.py --out "$OUT" --sections nvfp4 --budget-s 500 --merge-json "$R/journey_h200.json" \
    --offload-json "$R/journey_offload_h200.json" 2>&1 | tee "$OUT/journey_nvfp4.log"
}

pipeline() {  # every case in one call (~7 min); where it runs out of its budget, use pipeline_1 + pipeline_2
  python3 benchmarks/pipeline_e2e.py --out "$OUT" --budget-s 520 2>&1 | tee "$OUT/pipeline.log"
}

pipeline_1() {  # the few-step cases, the VAE and the text encoder
  python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 4step,8step --sections vae,te --budget-s 520 2>&1 |
    tee "$OUT/pipeline_1.log"
}

pipeline_2() {  # the 50-step true-CFG cases and the cache, merged into the first part's file
  python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 50step --sections none --budget-s 520 \
    --merge-json "$R/pipeline_h200.json" 2>&1 | tee "$OUT/pipeline_2.log"
}

final_a() {  # the GPU suite, then the offload keys with the time left (one 10-minute call)
  local t0=$SECONDS
  gpu_tests
  mkdir -p "$OUT/offload"
  timeout $((570 - (SECONDS - t0))) python3 benchmarks/journey_offload.py --out "$OUT/offload" \
    > "$OUT/offload/journey_offload.log" 2>&1
}

final_c() {  # the few-step pipeline cases (issue 40), where device time is left
  timeout 560 python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 4step,8step --sections vae,te --budget-s 540 \
    > "$OUT/pipeline_1.log" 2>&1
}

final_b() {  # issue 38's side-by-side run, then NVFP4 at 60 layers (one 10-minute call)
  local t0=$SECONDS
  timeout 330 bash -c "$(declare -f one_owner); one_owner"
  mkdir -p "$OUT/nvfp4"
  timeout $((560 - (SECONDS - t0))) python3 benchmarks/journey.py --out "$OUT/nvfp4" --sections nvfp4 \
    --budget-s $((540 - (SECONDS - t0))) --merge-json "$R/journey_h200.json" \
    --offload-json "$R/journey_offload_h200.json" > "$OUT/nvfp4/journey_nvfp4.log" 2>&1
}

final_d() {  # round 26's last call: the GPU tests the crashed suite did not reach (offload ones isolated), NVFP4
  local t0=$SECONDS
  { echo "# python3 -m pytest -q -m gpu <offload files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE \
      tests/test_offload_gpu.py tests/test_offload_graphs_gpu.py; } > "$OUT/gpu_tests_offload_h200.log" 2>&1
  { echo "# python3 -m pytest -q -m gpu <the files after the offload ones>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 270 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line -rfE tests/test_ops_gpu.py \
      tests/test_ops_nvfp4_emit_gpu.py tests/test_qk_norm_rope_gpu.py tests/test_qwenimage21_attention_gpu.py \
      tests/test_qwenimage21_fp8_gpu.py tests/test_qwenimage21_gpu.py tests/test_stream_kernel_variants_gpu.py \
      tests/test_taylorseer_gpu.py tests/test_text_encoder_gpu.py tests/test_vae_gpu.py; } > "$OUT/gpu_tests_rest_h200.log" 2>&1
  mkdir -p "$OUT/nvfp4"
  timeout $((575 - (SECONDS - t0))) python3 benchmarks/journey.py --out "$OUT/nvfp4" --sections nvfp4 \
    --budget-s $((560 - (SECONDS - t0))) --merge-json "$R/journey_h200.json" \
    --offload-json "$R/journey_offload_h200.json" > "$OUT/nvfp4/journey_nvfp4.log" 2>&1
  tail -3 "$OUT/gpu_tests_offload_h200.log" "$OUT/gpu_tests_rest_h200.log" "$OUT/nvfp4/journey_nvfp4.log"
}

offload_diag() {  # round 27: each offload GPU test in its own process, GC off (the round-26 crash came from a
  # destructor run by the GC while pytest formatted a failure), CUDA_LAUNCH_BLOCKING=1
  local d="$OUT/offload_diag" t0=$SECONDS i=0 id rc
  mkdir -p "$d"
  which compute-sanitizer > "$d/sanitizer.txt" 2>&1
  for id in $(python3 -m pytest --collect-only -q -m gpu tests/test_offload_gpu.py tests/test_offload_graphs_gpu.py \
              -p no:cacheprovider 2>/dev/null | grep '::'); do
    i=$((i + 1))
    [ $((SECONDS - t0)) -gt "${1:-230}" ] && { echo "$id: not run (time)" >> "$d/summary.txt"; continue; }
    CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 -c "import gc, sys, pytest; gc.disable(); \
      sys.exit(pytest.main(['-q', '-s', '-x', '--tb=long', '-rA', '-p', 'no:cacheprovider', sys.argv[1]]))" "$id" \
      > "$d/$(printf %02d $i).log" 2>&1
    rc=$?
    echo "$(printf %02d $i) rc=$rc $((SECONDS - t0))s $id $(grep -m1 -oE '(Error|assert)[^\n]{0,160}' "$d/$(printf %02d $i).log" | head -1)" >> "$d/summary.txt"
  done
  cat "$d/summary.txt"
}

final_e() {  # round 27, first call: the offload diagnosis, then the few-step pipeline cases with the time left
  local t0=$SECONDS
  offload_diag 200
  mkdir -p "$OUT/pipeline"
  timeout $((585 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT/pipeline" --cases 4step,8step \
    --sections vae,te --budget-s $((570 - (SECONDS - t0))) > "$OUT/pipeline/pipeline_1.log" 2>&1
  tail -5 "$OUT/pipeline/pipeline_1.log"
}

final_f() {  # round 27's final call 1: the whole GPU suite on the final tree (pytest-xdist, 6 processes on the one
  # GPU: ~9 min of tests in ~3), then the few-step pipeline with the time left. $OUT: env, 2 logs, JSON, md
  local t0=$SECONDS rc
  { echo "# python3 -m pytest -q -m gpu tests: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider --tb=short -rfE -n 6 --dist load; rc=$?
    echo "# exit code $rc"; } > "$OUT/gpu_tests_h200.log" 2>&1
  tail -4 "$OUT/gpu_tests_h200.log"
  timeout $((585 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 4step,8step \
    --sections vae,te --budget-s $((570 - (SECONDS - t0))) > "$OUT/pipeline_1.log" 2>&1
  grep -E "median|done in" "$OUT/pipeline_1.log" | tail -12
}

final_g() {  # round 27's final call 2: issue 38's side-by-side run, then the caches under graphs (issue 40)
  local t0=$SECONDS
  timeout 330 bash -c "$(declare -f one_owner); one_owner" > /dev/null
  tail -25 "$OUT/one_owner_h200.md"
  timeout $((585 - (SECONDS - t0))) python3 benchmarks/caches.py --out "$OUT" --budget-s $((570 - (SECONDS - t0))) \
    > "$OUT/caches.log" 2>&1
  tail -25 "$OUT/caches_h200.md"
}

"${1:?usage: bash benchmarks/device_runs.sh gpu_tests|offload_diag|final_e|final_f|final_g|final_a|final_b|final_c|final_d|one_owner|journey_offload|journey|journey_nvfp4|pipeline|pipeline_1|pipeline_2}"
