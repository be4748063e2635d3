"""Sort compute-sanitizer reports by the kernel they name: ours (an entry point of
kernels_src) or a library's (cuBLAS, CuPy), so that a library's reports cannot hide one of ours.

    PYTHONPATH=. python benchmarks/sanitizer_report.py memcheck.log racecheck.log ... > summary.json

Per log: the tool's own total (its SUMMARY line), the reports printed, their count per kernel,
the count in our kernels, and whether every report was printed (if not, raise --print-limit)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from glm_kda.gpu.build import ARCH_ENTRY_POINTS, ENTRY_POINTS

_PREFIX = "========= "
_LOCATION = re.compile(r"\bat (?:0x[0-9a-f]+ in )?(.+?)\+0x[0-9a-f]+")
_TOTAL = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: (\d+) hazard)")
# pytest's closing line ("12 passed, 1 skipped in 3.2s"): a run whose tests failed checked less.
_PYTEST = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*) in [\d.]+s")
_PASSED = re.compile(r"::.* PASSED\s*(\[\s*\d+%\])?$")  # pytest -v: one line a test
# The tool's word that the process under it ended badly (crashed, killed, or pytest failed): not a report.
_ENDED = ("Error: process didn't terminate successfully", "Target application returned an error")


def our_kernels() -> set[str]:
    families = [*ENTRY_POINTS.values(), *(names for _, names in ARCH_ENTRY_POINTS.values())]
    return {name for names in families for name in names}


def summarize(log: Path, ours: set[str]) -> dict:
    reports: list[list[str]] = []
    total, tests, passed, ended_badly = None, None, 0, False
    for line in log.read_text(errors="replace").splitlines():
        closing = _PYTEST.match(line)
        if closing:
            tests = closing.group(1)
        passed += bool(_PASSED.search(line))
        if not line.startswith(_PREFIX):
            continue
        body = line[len(_PREFIX):]
        match = _TOTAL.search(body)
        if body in _ENDED:
            ended_badly = True
        elif match:
            total = (total or 0) + int(match.group(1) or match.group(2))
        elif body and not body.startswith(" ") and body != "COMPUTE-SANITIZER":
            reports.append([body])
        elif reports:
            reports[-1].append(body.strip())
    kernels: Counter[str] = Counter()
    for report in reports:
        found = [m.group(1) for text in report for m in [_LOCATION.search(text)] if m]
        kernels[found[0] if found else "(no kernel named)"] += 1
    mine = {k: n for k, n in kernels.items() if k.split("<")[0].split("(")[0].strip() in ours}
    return {"log": log.name, "tests": tests, "passed_tests": passed, "ended_badly": ended_badly, "tool_total": total,
            "printed": len(reports), "all_printed": total is not None and len(reports) >= total,
            "ours": sum(mine.values()), "our_kernels": mine,
            "library_kernels": {k: n for k, n in kernels.items() if k not in mine}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="compute-sanitizer output, one file per run")
    parser.add_argument("--folder", type=Path, default=Path("."), help="where the logs are (default: here)")
    args = parser.parse_args(argv)
    ours = our_kernels()
    rows = [summarize(args.folder / p, ours) for p in args.logs]
    print(json.dumps(rows, indent=1))
    return 1 if any(r["ours"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
