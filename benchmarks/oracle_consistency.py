"""Worst rms-ratio between the chunked and the token-by-token float64 oracle (no GPU needed).

Both gate laws (tiny GLM and Kimi geometries), T in {1, 2, 63, 64, 65, 1000}, chunk 16/32/64,
from a zero and from a random carried state; core, final_out and the final recurrent state.

    PYTHONPATH=. python benchmarks/oracle_consistency.py
"""

import json
import tempfile

from glm_kda.checkpoint import bind_layer
from glm_kda.cli import script_help
from glm_kda.reference import KdaOracle, rms_ratio
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint


def main() -> None:
    worst = {}
    for geometry in ("tiny-glm", "tiny-kimi"):
        with tempfile.TemporaryDirectory() as tmp:
            write_synthetic_checkpoint(tmp, geometry, seed=1234)
            layer = bind_layer(tmp, 0, progress=False)
        oracle = KdaOracle(layer, "float64")
        for tokens in (1, 2, 63, 64, 65, 1000):
            hidden = synthetic_hidden(tokens, layer.config.hidden, seed=tokens)
            for start in (None, KdaState.random(layer.config, seed=1234)):
                walked, walked_state = oracle.prefill(hidden, start)
                for chunk in (16, 32, 64):
                    chunked, chunked_state = oracle.prefill(hidden, start, chunk=chunk)
                    for what, a, b in (("core", chunked["core"], walked["core"]),
                                       ("final_out", chunked["final_out"], walked["final_out"]),
                                       ("recurrent_state", chunked_state.recurrent, walked_state.recurrent)):
                        worst[what] = max(worst.get(what, 0.0), rms_ratio(a, b))
    print(json.dumps({"worst_rms_ratio_chunked_vs_token_by_token": worst}))


if __name__ == "__main__":
    script_help(__doc__)
    main()
