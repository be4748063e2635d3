"""Helpers shared by the scripts in benchmarks/ (never imported by glm_kda).

A script puts its own folder first on sys.path and imports ``lib.<module>``:

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lib import timing
"""
