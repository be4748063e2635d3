"""One line per JSON line of benchmarks/decode_breakdown.py: geometry, the variant's changed
settings, the copy bandwidth, the B=1 graph replay (median replay us and roofline ratio, and the
back-to-back mean where the line has it), verify over decode, B=64 and B=256 (likewise), the public call, and why programmatic launches fell back (if
they did). Lines that are not JSON pass through.

    PYTHONPATH=. python benchmarks/decode_breakdown.py | python benchmarks/summarize_breakdown.py
"""

from __future__ import annotations

import json
import sys

from glm_kda.cli import script_help


def summary(record: dict) -> str:
    def chained(prefix: str) -> str:
        # (the mean of replays launched between two events alone, where the line has it)
        us = record.get(f"{prefix}back_to_back_us")
        return f" [back to back {us:.2f} us]" if us is not None else ""

    def cold(record: dict) -> str:
        us = record.get("graph_replay_cold_l2_us")
        return f" [L2 scrubbed {us:.2f} us ({record['graph_replay_cold_l2_roofline_ratio']:.3f})]" if us else ""

    batches = " ".join(
        f"B{b} {record[f'B{b}_graph_replay_us']:.1f} us ({record[f'B{b}_roofline_ratio']:.3f}){chained(f'B{b}_')}"
        for b in (64, 256) if f"B{b}_graph_replay_us" in record)
    fallback = record.get("programmatic_unavailable")
    return (f"{record['geometry']} {record['changed'] or 'defaults'} | copy {record['copy_bandwidth_GBs']:.0f} GB/s | "
            f"B1 {record['graph_replay_us']:.2f} us ({record['graph_replay_roofline_ratio']:.3f})"
            f"{chained('graph_replay_')}{cold(record)} | verify "
            f"{record['verify_replay_over_decode']} | {batches} | public call {record['public_call_back_to_back_us']:.1f} us"
            + (f" | programmatic launches fell back: {fallback}" if fallback else ""))


def main() -> None:
    for line in sys.stdin:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(line.rstrip()[:300])
            continue
        print(summary(record), flush=True)


if __name__ == "__main__":
    script_help(__doc__)
    main()
