"""What every benchmark script does before it measures: answer -h, and stop clearly without a GPU."""

from __future__ import annotations

import sys

from glm_kda.device import NoGpuError, require_gpu


def script_help(doc: str, argv: list[str] | None = None) -> None:
    """For a script that reads its arguments by hand: with -h or --help among them (sys.argv's
    when argv is None), print the script's docstring `doc` and exit with status 0."""
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        print(doc.strip())
        raise SystemExit(0)


def exit_unless_gpu(what: str) -> None:
    """Without a usable GPU, print why `what` cannot run here to stderr (as ``error: ...``, the line
    the ``glm-kda`` commands print) and exit with status 2, instead of failing later inside CUDA."""
    try:
        require_gpu(what)
    except NoGpuError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def bench_main(bench, script_doc: str, what: str) -> None:
    """The entry of a script over a lib.bench_* module: its arguments (bench.add_arguments; -h works
    without a GPU), then, on a GPU, bench.run, whose status the process exits with."""
    import argparse

    parser = argparse.ArgumentParser(description=bench.__doc__.splitlines()[0], epilog=script_doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    arguments = parser.parse_args()
    exit_unless_gpu(what)
    sys.exit(bench.run(arguments))
