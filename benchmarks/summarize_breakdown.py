"""One line per JSON line of benchmarks/decode_breakdown.py: geometry, the variant's changed
KdaOptions fields, the copy bandwidth, the B=1 graph replay (median replay us and roofline ratio,
and the back-to-back mean where the line has it), verify over decode, B=64 and B=256 (likewise),
the public call, and why programmatic launches fell back (where an older line says so). Lines that
are not JSON pass through. With --targets, each line of the package's defaults is followed by the
decode targets it is judged against (per-replay median roofline ratio of one sequence and of 64,
verify over one-token decode), each marked met or NOT MET.

    PYTHONPATH=. python benchmarks/decode_breakdown.py | PYTHONPATH=. python benchmarks/summarize_breakdown.py [--targets]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.script import script_help  # noqa: E402


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


# The decode targets: the least roofline ratio of one sequence's step and of 64 sequences' (per-replay
# median, graphed), the most a verify of 4 and of 16 tokens may take over one token's step.
TARGETS = {
    "glm": {"B1": 0.85, "B64": 0.75, "K4": 1.4, "K16": 2.5},
    "kimi": {"B1": 0.80, "B64": 0.75, "K4": 1.4, "K16": 2.5},
}


def acceptance(record: dict) -> list[tuple[str, float, str, bool]]:
    """(item, figure, target, met) of a breakdown line against TARGETS for its geometry."""
    target = TARGETS[record["geometry"]]
    verify = record["verify_replay_over_decode"]
    items = [("B=1 roofline", record["graph_replay_roofline_ratio"], target["B1"], True),
             ("B=64 roofline", record.get("B64_roofline_ratio"), target["B64"], True),
             ("verify K4 / B=1", verify.get("K4"), target["K4"], False),
             ("verify K16 / B=1", verify.get("K16"), target["K16"], False)]
    return [(name, figure, f"{'>=' if at_least else '<='} {bound}",
             figure is not None and (figure >= bound if at_least else figure <= bound))
            for name, figure, bound, at_least in items]


def acceptance_line(record: dict) -> str:
    return f"  {record['geometry']} targets: " + " | ".join(
        f"{name} {'-' if figure is None else f'{figure:.3f}'} ({target}) {'met' if met else 'NOT MET'}"
        for name, figure, target, met in acceptance(record))


def main() -> None:
    targets = "--targets" in sys.argv[1:]
    for line in sys.stdin:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(line.rstrip()[:300])
            continue
        print(summary(record), flush=True)
        if targets and record.get("default"):
            print(acceptance_line(record), flush=True)


if __name__ == "__main__":
    script_help(__doc__)
    main()
