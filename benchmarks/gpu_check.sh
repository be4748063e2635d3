#!/usr/bin/env bash
# Everything that needs the GPU, in one go: the GPU test suite (figures to figures.json),
# compute-sanitizer memcheck over a subset of it, racecheck over the chunk and recurrent
# kernels, the decode benchmark and the import timing. Logs and JSON land in
# ${OUT:-./gpu_check_out}. Pass "block" as first argument to add the whole-block timings.
#   PYTHONPATH=. bash benchmarks/gpu_check.sh [block]
set -u -o pipefail
out=${OUT:-./gpu_check_out}; mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 GLM_KDA_FIGURES="$out/figures.json"
nvidia-smi -L | tee "$out/device.txt"
python -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$out/device.txt"
python -c "from cupy.cuda import nccl; print('nccl', nccl.get_version())" 2>&1 | tail -1 | tee -a "$out/device.txt"
timeout ${SUITE_TIMEOUT:-360} python -m pytest -q -rfE tests/test_gpu.py tests/test_gemm_rows.py tests/test_chunk_tc.py tests/test_kernels_compile.py \
  --junitxml="$out/junit.xml" 2>&1 | tee "$out/gpu_tests.log" | tail -25
unset GLM_KDA_FIGURES
timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k "kimi and (T17 and C16 or T65 and C64 or poisoned and nan or graph_replay)" 2>&1 | tee "$out/memcheck.log" | tail -4
timeout 45 compute-sanitizer --tool racecheck --kernel-name kns=kda_ --print-limit 20 python -m pytest -q -p no:cacheprovider \
  tests/test_gpu.py -k "kimi and T15 and C16 or kimi and decode_stages" 2>&1 | tee "$out/racecheck.log" | tail -4
timeout 80 python benchmarks/decode.py 2>&1 | tee "$out/decode.jsonl" | tail -40
timeout 40 python benchmarks/decode_breakdown.py 2>&1 | tee "$out/decode_breakdown.jsonl"
if [ "${1:-}" = block ]; then timeout 60 python benchmarks/block.py glm kimi 2>&1 | tee "$out/block.jsonl"; fi
python -c "import json; from glm_kda.selftest import import_times; print(json.dumps(import_times()))" 2>&1 | tee "$out/import.json"
