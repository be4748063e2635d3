export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 60 python -m pytest -q tests/test_chunk_tc.py tests/test_gpu.py -k "fused_gate or prefill_matches_oracle and C64 and T65 or decode_stages" 2>&1 | tail -2
timeout 80 python benchmarks/prefill.py --geometry glm kimi-bounded --tokens 16384 --repeats 5 --no-fla > $OUT/prefill.jsonl 2>&1; grep -v '"core_conv"' $OUT/prefill.jsonl | cut -c1-260
