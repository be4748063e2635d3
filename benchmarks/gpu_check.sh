#!/usr/bin/env bash
# Everything that needs the GPU, in one go: the GPU test suite, compute-sanitizer memcheck over a
# subset of it, racecheck over the chunk and recurrent kernels, the block timings and the import
# timing. Logs and JSON land in ${OUT:-./gpu_check_out}.
#   PYTHONPATH=. bash benchmarks/gpu_check.sh
set -u -o pipefail
out=${OUT:-./gpu_check_out}; mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/device.txt"
python -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$out/device.txt"
timeout ${SUITE_TIMEOUT:-300} python -m pytest -q -rfE tests/test_gpu.py tests/test_kernels_compile.py --junitxml="$out/junit.xml" 2>&1 | tee "$out/gpu_tests.log" | tail -30
timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k "kimi and (T17 and C16 or T65 and C64 or decode_k or poisoned and nan)" 2>&1 | tee "$out/memcheck.log" | tail -6
timeout 60 compute-sanitizer --tool racecheck --kernel-regex kns=kda_ --print-limit 20 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k "kimi and T65 and C64" 2>&1 | tee "$out/racecheck.log" | tail -6
timeout 100 python benchmarks/block.py glm kimi 2>&1 | tee "$out/block.jsonl" | tail -4
python - <<'PY' 2>&1 | tee "$out/import.json"
import json
from glm_kda.selftest import import_times
print(json.dumps(import_times()))
PY
