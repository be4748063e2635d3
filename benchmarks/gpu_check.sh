#!/usr/bin/env bash
# Everything that needs the GPU: the GPU test suite (figures to figures.json, figures.json.partial while it runs;
# each test phase's seconds, and a failure's message, to durations.txt as it ends, `sort -rn` for the slowest;
# "tests"), every kernel built by NVRTC for each architecture family and checked for its entry points and spills ("compile";
# CPU CI builds them too, here they also build for the chip present),
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over the GPU suite, our kernels alone
# ("sanitize"), then the decode and
# prefill benchmarks, the decode breakdown (defaults, packed_weights=False and hopper=False) against the decode
# targets, the host's part of the decode calls and the import timing ("bench"). Logs and JSON land in ${OUT:-./gpu_check_out}.
# The four parts take about nine, four, one and one minutes on an H200 (measured: tests and 20 of
# compile's checks in 560 s, chunk_tc and compile in 295 s, bench 66 s; sanitize is bounded by $SANITIZE_TIMEOUT); run them as
# separate commands where one command is limited to ten minutes. "block" adds the whole-block timings to "bench". "tp" (not
# part of "all"; two GPUs) runs the tensor-parallel tests, the step timing included. "compare" (not part of "all")
# runs benchmarks/compare_versions.py against the older checkout in $OLD (say `git worktree add /tmp/old 3d65311`):
# decode, verify and prefill timings of both, each in its own process, and whether their bits agree; then
# benchmarks/kernel_versions.py, the prefill's conv pass, gated norm, chunk prepare and scan of both kernel folders.
# With flash-linear-attention importable (benchmarks/carry_fla.sh builds build/fla to carry, then
# PYTHONPATH=.:build/fla) both benchmarks add its rows; its first call compiles Triton kernels for a minute or more.
# "first_use" times a cold and a warm from_pretrained in new processes and decode through a whole stack.
# PER_TEST=1 runs each sanitized test in a process of its own (TESTS=<file of ids> picks them).
# PORTABLE=1 runs the tests with --portable (the path without Hopper-only features); MARKERS selects tests
# by marker (say MARKERS="not slow"). The transformers
# integration's tests skip unless torch and transformers are importable (carry build/fla, PYTHONPATH=.:build/fla).
#   PYTHONPATH=. bash benchmarks/gpu_check.sh [tests|compile|sanitize|first_use|bench|all|tp] [block]
#   OLD=/tmp/old PYTHONPATH=. bash benchmarks/gpu_check.sh compare
set -u -o pipefail
part=${1:-all}
out=${OUT:-./gpu_check_out}; mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/device.txt"
python -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$out/device.txt"
python -c "from cupy.cuda import nccl; print('nccl', nccl.get_version())" 2>&1 | tail -1 | tee -a "$out/device.txt"
if [ "$part" = tests ] || [ "$part" = all ]; then
  # (-k "not cpu": the transformers integration's CPU-model cases are CPU tests, three minutes of a
  # GPU machine's time; they run wherever torch and transformers are installed.)
  GLM_KDA_FIGURES="$out/figures.json" GLM_KDA_DURATIONS="$out/durations.txt" timeout ${SUITE_TIMEOUT:-560} python -m pytest -q -rfE --durations=25 -k "not cpu" tests/test_gpu.py \
    tests/test_bad_calls_gpu.py tests/test_determinism_gpu.py tests/test_stack_gpu.py tests/test_transformers_integration.py \
    tests/test_gemm_rows.py tests/test_chunk_tc.py ${PORTABLE:+--portable} ${MARKERS:+-m "$MARKERS"} --junitxml="$out/junit.xml" 2>&1 \
    | tee "$out/gpu_tests.log" | tail -25
fi
if [ "$part" = compile ] || [ "$part" = all ]; then
  timeout ${COMPILE_TIMEOUT:-560} python -m pytest -q -rfE tests/test_kernels_compile.py --junitxml="$out/junit_compile.xml" \
    2>&1 | tee "$out/compile_tests.log" | tail -25
fi
if [ "$part" = sanitize ] || [ "$part" = all ]; then
  # The tools over the GPU suite but its two long-sequence cases (the same kernels at 16384 and 65536
  # tokens). TOOLS picks some; each tool's tests are dealt round-robin into SHARDS processes, and
  # the processes of two tools run at once (more do not fit one GPU's memory with their
  # instrumentation). memcheck, racecheck and synccheck instrument our kernels alone (every entry
  # point starts with kda_; cuBLAS and CuPy run unchecked at full speed). initcheck instruments every
  # kernel: under a kernel filter the writes of the kernels left out (CuPy's copies that pack a
  # weight) go unseen, and ours reading them are reported as reading uninitialised memory. cuBLAS
  # then gets a zero-filled workspace, or its split-K reduce's reads of workspace bytes it never
  # wrote bury everything else. racecheck, instrumenting ours alone, stopped with an internal error
  # ("failed to handle a hardware exception") at the first cuBLAS kernel and without the filter runs
  # for hours, so the wide projections then run on the test suite's plain tiled GEMM instead
  # (--gemm-without-cublas). The reports are sorted by kernel name, so that nothing of ours could
  # hide among a library's.
  tools=(${TOOLS:-memcheck synccheck racecheck initcheck})
  shards=${SHARDS:-2}
  suite=(tests/test_gpu.py tests/test_bad_calls_gpu.py tests/test_stack_gpu.py)
  # (The tests beside a kernel that holds every SM for seconds go last: under a tool they are the slowest.)
  # (TESTS=<file of test ids> runs those instead, say the ones a run cut short did not reach: -v names
  # each test that passed in the logs.)
  if [ -n "${TESTS:-}" ]; then grep '::' "$TESTS" > "$out/sanitize_tests.txt"; else
  python -m pytest -q --collect-only -p no:cacheprovider -m "not slow" "${suite[@]}" 2>/dev/null | grep '::' \
    | awk '/holding_every_sm/ { last = last $0 "\n"; next } { print } END { printf "%s", last }' > "$out/sanitize_tests.txt"
  fi
  # PER_TEST=1: one process per test instead, $SHARDS at once over every tool, all stopped at the common
  # deadline: a crash or the limit then costs one test, and each log names it (the suite's heaviest
  # tests under racecheck; the GPU is busy throughout, so more processes at once finish no more).
  deadline=$(($(date +%s) + ${SANITIZE_TIMEOUT:-540}))
  sanitize_one() {  # tool, log, then the pytest arguments
    local tool=$1 log=$2 left=$((deadline - $(date +%s))); shift 2
    [ "$left" -gt 10 ] || { echo "not started: the deadline was near" > "$out/$log"; return; }
    local scope=(--kernel-name kns=kda_) extra=(--hang-seconds 1800)
    if [ "$tool" = initcheck ]; then scope=(); extra+=(--zeroed-cublas-workspace); fi
    if [ "$tool" = racecheck ]; then extra+=(--gemm-without-cublas); fi
    timeout "$left" compute-sanitizer --tool "$tool" "${scope[@]}" --print-limit 100000 --show-backtrace no \
      python -m pytest -v -p no:cacheprovider "$@" "${extra[@]}" > "$out/$log" 2>&1
  }
  # GPU and host memory every 10 s: a process the tool ran out of memory shows here, where its log ends
  # with no more than "process didn't terminate successfully".
  (while sleep 10; do echo "$(date +%T) gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used \
    --format=csv,noheader) host_used_mb $(free -m | awk '/^Mem:/ { print $3 }')"; done) > "$out/sanitize_memory.txt" &
  sampler=$!
  logs=()
  if [ -n "${PER_TEST:-}" ]; then
    mapfile -t ids < "$out/sanitize_tests.txt"
    for tool in "${tools[@]}"; do
      for ((i = 0; i < ${#ids[@]}; i++)); do logs+=("$tool.test$i.log"); printf '%s\0%s\0%s\0' "$tool" "$tool.test$i.log" "${ids[i]}"; done
    done > "$out/sanitize_queue"
    export -f sanitize_one; export out deadline
    xargs -0 -n 3 -P "$shards" bash -c 'sanitize_one "$@"' _ < "$out/sanitize_queue"
  else
    for ((s = 0; s < shards; s++)); do awk -v n="$shards" -v s="$s" '(NR - 1) % n == s' "$out/sanitize_tests.txt" > "$out/shard.$s.txt"; done
    for ((i = 0; i < ${#tools[@]}; i += 2)); do
      deadline=$(($(date +%s) + ${SANITIZE_TIMEOUT:-540}))
      for tool in "${tools[@]:i:2}"; do
        for ((s = 0; s < shards; s++)); do
          mapfile -t ids < "$out/shard.$s.txt"
          logs+=("$tool.$s.log")
          sanitize_one "$tool" "$tool.$s.log" "${ids[@]}" &
        done
      done
      wait
    done
  fi
  kill "$sampler"
  python benchmarks/sanitizer_report.py "${logs[@]}" --folder "$out" | tee "$out/sanitizers.json"
fi
if [ "$part" = first_use ] || [ "$part" = all ]; then
  timeout 300 python benchmarks/cold_start.py 2>&1 | tee "$out/cold_start.jsonl"
  timeout 240 python benchmarks/stack.py 2>&1 | tee "$out/stack.jsonl"
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  timeout 120 python benchmarks/decode.py 2>&1 | tee "$out/decode.jsonl" | tail -40
  timeout 170 python benchmarks/decode_breakdown.py --variant hopper=False 2>&1 | tee "$out/decode_breakdown.jsonl"
  python benchmarks/summarize_breakdown.py --targets < "$out/decode_breakdown.jsonl" | tee "$out/decode_targets.txt"
  timeout 90 python benchmarks/host_cost.py 2>&1 | tee "$out/host_cost.jsonl"
  timeout 150 python benchmarks/prefill.py --tokens 1024 16384 65536 2>&1 | tee "$out/prefill.jsonl"
  timeout 90 python benchmarks/projections.py 2>&1 | tee "$out/projections.jsonl"
  if [ "${2:-}" = block ]; then timeout 60 python benchmarks/block.py glm kimi 2>&1 | tee "$out/block.jsonl"; fi
  python -c "import json; from glm_kda.selftest import import_times; print(json.dumps(import_times()))" 2>&1 | tee "$out/import.json"
fi
if [ "$part" = compare ]; then
  timeout 560 python benchmarks/compare_versions.py --old "${OLD:?OLD=<older checkout> is needed}" 2>&1 \
    | tee "$out/compare_versions.jsonl"
  timeout 120 python benchmarks/kernel_versions.py --old "$OLD/kernels_src" 2>&1 | tee "$out/kernel_versions.jsonl"
fi
if [ "$part" = tp ]; then
  GLM_KDA_FIGURES="$out/figures_tp.json" timeout ${SUITE_TIMEOUT:-560} python -m pytest -q -rfE tests/test_tp_gpu.py \
    --junitxml="$out/junit_tp.xml" 2>&1 | tee "$out/tp_tests.log" | tail -25
fi
