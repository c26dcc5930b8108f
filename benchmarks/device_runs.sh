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
# Round 35's calls: round35_a (round 34's tree: the suite + the few-step cases), then on the final tree round35_b
# (the suite, ~5 min) and round35_c (the offload A/B + the text encoder, ~5 min), back to back. Round 36 got no
# machine (five failed starts, then loans paused): the next session runs round35_b and round35_c on its final tree
# (round35_bc in one call where minutes are short); they name no round-35-only code.
# Earlier rounds' one-off calls are in git history (git log -p benchmarks/device_runs.sh).
#
# The before tree: `git worktree add .devrun/before 69357ce` (an ignored path) before the one_owner call.
# Between calls, copy what comes back into benchmarks/results/ (top level: one_owner_h200.*, journey_h200.*,
# journey_offload_<card>.*, pipeline_<card>.*, gpu_tests_h200.log; pipeline_e2e.py, caches.py and journey_offload.py
# name their files after the card: h200, h100): journey merges the offload keys from
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

suite() {  # the whole GPU suite in 6 pytest-xdist processes on the one GPU (~9 min of tests in ~3.5)
  { echo "# python3 -m pytest -q -m gpu tests -n 6: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout "${1:-330}" python3 -m pytest -q -m gpu tests -p no:cacheprovider --tb=short -rfE -n 6 --dist load
    echo "# exit code $?"; } > "$OUT/gpu_tests_h200.log" 2>&1
  tail -4 "$OUT/gpu_tests_h200.log"
}

round35_a() {  # the whole GPU suite on round 34's final tree (the host-codes default flip, the rotary unpack), then
  # the few-step cases, the VAE and the text encoder for the README's headline table (pipeline_<card>.json)
  local t0=$SECONDS
  suite "${SUITE_S:-260}"
  timeout $((${LIMIT_S:-585} - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 4step,8step \
    --sections vae,te --budget-s $((${LIMIT_S:-585} - 15 - (SECONDS - t0))) > "$OUT/pipeline_1.log" 2>&1
  grep -E "median|done in|te:|vae:" "$OUT/pipeline_1.log" | cut -c1-300 | tail -14
}

round35_b() {  # the whole GPU suite on round 35's final tree (BlockMove, the retired LoRA switches, the text encoder's
  # planned rows and skipped lm_head)
  suite "${SUITE_S:-300}"
}

round35_c() {  # model offload keeping the blocks' decisions across moves (default) against deciding anew at every
  # return (A/B, 60 layers, one process; journey_offload_<card>.json), then the text encoder alone (pipeline_<card>)
  local t0=$SECONDS
  timeout $((${LIMIT_S:-585} - 75)) python3 benchmarks/journey_offload.py --out "$OUT" --runs 3 \
    --sections resident,offload_model,offload_model_redecide --budget-s $((${LIMIT_S:-585} - 90)) \
    > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
  timeout $((${LIMIT_S:-585} - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --sections te \
    --cases "" --num-layers 2 --budget-s 60 > "$OUT/pipeline_te.log" 2>&1
  grep -E "te_encode|te:" "$OUT/pipeline_te.log" | cut -c1-300
}

round35_bc() {  # round35_b and round35_c in one call where minutes are short: the suite, the offload A/B (no resident
  # section), the text encoder if time is left
  local t0=$SECONDS lim=${LIMIT_S:-560}
  suite "${SUITE_S:-240}"
  timeout $((lim - (SECONDS - t0))) python3 benchmarks/journey_offload.py --out "$OUT" --runs 3 \
    --sections offload_model,offload_model_redecide --budget-s $((lim - 60 - (SECONDS - t0))) \
    > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
  if [ $((lim - (SECONDS - t0))) -gt 50 ]; then
    timeout $((lim - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --sections te --cases "" \
      --num-layers 2 --budget-s 40 > "$OUT/pipeline_te.log" 2>&1
    grep -E "te_encode|te:" "$OUT/pipeline_te.log" | cut -c1-300
  fi
}

round35_d() {  # where minutes are short: the GPU files of round 35's changes (moves, LoRA paths, text encoder)
  { echo "# python3 -m pytest -q -n 6 <files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout "${SUITE_S:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 6 --dist load \
      tests/test_offload_gpu.py tests/test_offload_graphs_gpu.py tests/test_text_encoder_gpu.py \
      tests/test_fp8_follows_model_gpu.py tests/test_lora_add_gpu.py tests/test_lora_fold_gpu.py tests/test_lane_gpu.py
    echo "# exit code $?"; } > "$OUT/gpu_tests_round35_d.log" 2>&1
  tail -6 "$OUT/gpu_tests_round35_d.log"
}

"${1:?usage: bash benchmarks/device_runs.sh gpu_tests|suite|round35_a|round35_b|round35_c|round35_bc|round35_d|one_owner|journey_offload|journey|journey_nvfp4|pipeline|pipeline_1|pipeline_2}"
