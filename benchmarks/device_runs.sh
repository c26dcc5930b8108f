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
# journey_offload_h200.*, pipeline_<card>.*, gpu_tests_h200.log; pipeline_e2e.py and caches.py name their files
# after the card: h200, h100): journey merges the offload keys from
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

round29_a() {  # the GPU suite, then the 4-step FP8 case with its loop cut into segments and one profiled call
  local t0=$SECONDS
  suite 340
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --cases 4step_fp8 \
    --sections none --profile 4step_fp8 --budget-s $((570 - (SECONDS - t0))) > "$OUT/pipeline_1.log" 2>&1
  grep -E "median|done in" "$OUT/pipeline_1.log" | cut -c1-1500 | tail -4
}

round29_b() {  # every prompt-to-image case but the fake-quant 4-step one, the VAE and the text encoder
  timeout 590 python3 benchmarks/pipeline_e2e.py --out "$OUT" --budget-s 560 ${MERGE:+--merge-json "$MERGE"} \
    --cases 4step_bf16_unpatched,4step_bf16,4step_fp8,4step_fp8_newlen,8step,50step --sections vae,te \
    > "$OUT/pipeline.log" 2>&1
  grep -E "median|done in|te:" "$OUT/pipeline.log" | cut -c1-300 | tail -24
}

round29_c() {  # the fixed VAE kernel test and the walks' tests on the device, the 4-step FP8 call profiled
  # (torch.profiler, cProfile, the module walks timed), then the caches with the time left
  local t0=$SECONDS
  { echo "# python3 -m pytest -q <two files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_pipeline_walks.py \
      "tests/test_vae_gpu.py::test_norm_silu_kernel_against_diffusers_expression"; echo "# exit code $?"
  } > "$OUT/gpu_tests_round29_c.log" 2>&1
  tail -2 "$OUT/gpu_tests_round29_c.log"
  mkdir -p "$OUT/p"
  timeout 220 python3 benchmarks/pipeline_e2e.py --out "$OUT/p" --cases 4step_fp8 --sections none \
    --profile 4step_fp8 --budget-s 200 > "$OUT/pipeline_profile.log" 2>&1
  grep -E "median|walks" "$OUT/pipeline_profile.log" | cut -c1-600
  timeout $((575 - (SECONDS - t0))) python3 benchmarks/caches.py --out "$OUT" --budget-s $((550 - (SECONDS - t0))) \
    > "$OUT/caches.log" 2>&1
  tail -14 "$OUT"/caches_h*.md
}

round30_a() {  # next: the 4-step cases again on the final tree, a new prompt length patched and unpatched, profiled
  timeout 590 python3 benchmarks/pipeline_e2e.py --out "$OUT" --budget-s 560 --sections none --profile 4step_fp8 \
    --cases 4step_bf16_unpatched,4step_bf16_unpatched_newlen,4step_bf16,4step_fp8,4step_fp8_newlen,8step \
    > "$OUT/pipeline_4step.log" 2>&1
  grep -E "median|walks" "$OUT/pipeline_4step.log" | cut -c1-400
}

round30_offload() {  # the offload and step-cache GPU tests, then issue 39's offload keys (model offload with graphs by default now)
  { echo "# python3 -m pytest -q <offload files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 180 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 4 tests/test_offload_gpu.py \
      tests/test_offload_graphs_gpu.py tests/test_step_caches_gpu.py \
      tests/test_first_block_cache_graphs_gpu.py tests/test_cuda_graph_gpu.py; echo "# exit code $?"; } > "$OUT/gpu_tests_offload.log" 2>&1
  tail -3 "$OUT/gpu_tests_offload.log"
  timeout 300 python3 benchmarks/journey_offload.py --out "$OUT" --budget-s 260 > "$OUT/journey_offload.log" 2>&1
  grep -E "median|profiled|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
}

round30_caches() {  # PAB on the fused attention and FirstBlockCache's per-block graphs (issue 40 item 4)
  timeout 560 python3 benchmarks/caches.py --out "$OUT" --cases pab_default,pab_fast,fbc_default,fbc_fast \
    --budget-s 530 > "$OUT/caches.log" 2>&1
  tail -14 "$OUT"/caches_h*.md
}

round31_offload() {  # next: the pinned staging's GPU tests, then the offload keys with the pinned A/B
  { echo "# python3 -m pytest -q tests/test_offload_gpu.py: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 3 tests/test_offload_gpu.py
    echo "# exit code $?"; } > "$OUT/gpu_tests_offload.log" 2>&1
  tail -3 "$OUT/gpu_tests_offload.log"
  timeout 420 python3 benchmarks/journey_offload.py --out "$OUT" --budget-s 400 > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
}

round32_a() {  # the whole GPU suite on the final tree of rounds 30-31, then the 4-step cases (5 timed calls each)
  local t0=$SECONDS
  suite 320
  timeout $((585 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --runs 5 --sections none \
    --cases 4step_bf16_unpatched,4step_bf16,4step_fp8 --budget-s $((560 - (SECONDS - t0))) > "$OUT/pipeline_4step.log" 2>&1
  grep -E "median|done in" "$OUT/pipeline_4step.log" | cut -c1-300 | tail -8
}

round32_b() {  # issue 39's offload keys with the pinned-staging A/B (its GPU tests ran in the suite)
  timeout 580 python3 benchmarks/journey_offload.py --out "$OUT" --runs 2 --budget-s 550 > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
}

round32_c() {  # the 8-step LoRA, a new prompt length, and the 50-step true-CFG cases with the cache, merged into round32_a's file
  timeout 590 python3 benchmarks/pipeline_e2e.py --out "$OUT" --sections vae,te --budget-s 560 ${MERGE:+--merge-json "$MERGE"} \
    --cases 4step_fp8_newlen,8step,50step > "$OUT/pipeline_rest.log" 2>&1
  grep -E "median|done in|te:" "$OUT/pipeline_rest.log" | cut -c1-300 | tail -12
}

round32_d() {  # the whole GPU suite on the final tree, then a new prompt length (patched and unpatched) profiled
  local t0=$SECONDS
  suite 190
  timeout $((335 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --runs 3 --sections none \
    --cases 4step_bf16_unpatched_newlen,4step_fp8_newlen --profile 4step_fp8_newlen \
    --budget-s $((320 - (SECONDS - t0))) > "$OUT/pipeline_newlen.log" 2>&1
  grep -E "median|done in" "$OUT/pipeline_newlen.log" | cut -c1-300 | tail -8
}

round32_e() {  # what the device time left allows: the GPU files that reach this round's code changes
  { echo "# python3 -m pytest -q -n 6 <files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout 130 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 6 --dist load tests/test_cuda_graph_gpu.py \
      tests/test_offload_gpu.py tests/test_text_encoder_gpu.py tests/test_vae_gpu.py tests/test_lane_gpu.py \
      tests/test_ops_gpu.py tests/test_qwenimage21_gpu.py tests/test_qwenimage21_fp8_gpu.py
    echo "# exit code $?"; } > "$OUT/gpu_tests_round32_e.log" 2>&1
  tail -4 "$OUT/gpu_tests_round32_e.log"
}

round33_a() {  # round 32's GPU files (round32_e), then a new prompt length and the 4-step FP8 image profiled
  local t0=$SECONDS
  round32_e
  timeout $((590 - (SECONDS - t0))) python3 benchmarks/pipeline_e2e.py --out "$OUT" --runs 5 --sections none \
    --cases 4step_bf16_unpatched_newlen,4step_fp8_newlen,4step_fp8 --profile 4step_fp8_newlen,4step_fp8 \
    --budget-s $((570 - (SECONDS - t0))) > "$OUT/pipeline_profiled.log" 2>&1
  grep -E "median|done in" "$OUT/pipeline_profiled.log" | cut -c1-300 | tail -8
}

round33_b() {  # the whole GPU suite on the final tree, then model offload with the FP8 codes kept on the host (A/B)
  local t0=$SECONDS
  suite "${SUITE_S:-230}"
  timeout $((${LIMIT_S:-585} - (SECONDS - t0))) python3 benchmarks/journey_offload.py --out "$OUT" --runs 2 \
    --sections resident,offload_model,offload_model_rebuild --budget-s $((${LIMIT_S:-585} - 15 - (SECONDS - t0))) \
    > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
}

round33_c() {  # what 7 minutes allow: the GPU files the ops helper's run left out, then the offload A/B at 20 layers
  local t0=$SECONDS
  { echo "# python3 -m pytest -q -n 6 <the GPU files outside ops/>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout "${SUITE_S:-170}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 6 --dist load \
      tests/test_cuda_graph_blocks21_gpu.py tests/test_cuda_graph_gpu.py tests/test_first_block_cache_graphs_gpu.py \
      tests/test_fp8_follows_model_gpu.py tests/test_fp8_hooked_attention_gpu.py tests/test_joint_qkv_gpu.py \
      tests/test_nvfp4_rows_gpu.py tests/test_offload_gpu.py tests/test_offload_graphs_gpu.py \
      tests/test_qwenimage21_attention_gpu.py tests/test_qwenimage21_fp8_gpu.py tests/test_qwenimage21_gpu.py \
      tests/test_step_caches_gpu.py tests/test_text_encoder_gpu.py tests/test_vae_gpu.py
    echo "# exit code $?"; } > "$OUT/gpu_tests_rest.log" 2>&1
  tail -4 "$OUT/gpu_tests_rest.log"
  timeout $((${LIMIT_S:-330} - (SECONDS - t0))) python3 benchmarks/journey_offload.py --out "$OUT" --runs 2 \
    --num-layers 20 --sections resident,offload_model,offload_model_rebuild \
    --budget-s $((${LIMIT_S:-330} - 10 - (SECONDS - t0))) > "$OUT/journey_offload.log" 2>&1
  grep -E "median|SKIP|rror" "$OUT/journey_offload.log" | cut -c1-300
}

round33_d() {  # the last minutes: the GPU files of this round's graph, offload and pipeline-room changes
  { echo "# python3 -m pytest -q -n 6 <files>: $(date -u +%FT%TZ)"; cat "$OUT/env.txt"
    timeout "${SUITE_S:-120}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 6 --dist load \
      tests/test_offload_gpu.py tests/test_cuda_graph_gpu.py tests/test_vae_gpu.py tests/test_text_encoder_gpu.py \
      tests/test_step_caches_gpu.py tests/test_first_block_cache_graphs_gpu.py tests/test_offload_graphs_gpu.py
    echo "# exit code $?"; } > "$OUT/gpu_tests_round33_d.log" 2>&1
  tail -6 "$OUT/gpu_tests_round33_d.log"
}

"${1:?usage: bash benchmarks/device_runs.sh gpu_tests|suite|round29_a|round29_b|round29_c|round30_a|round30_offload|round30_caches|round31_offload|round32_a|round32_b|round32_c|round32_d|round32_e|round33_a|round33_b|round33_c|round33_d|one_owner|journey_offload|journey|journey_nvfp4|pipeline|pipeline_1|pipeline_2}"
