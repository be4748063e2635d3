"""glm_kda: the KDA (Kimi Delta Attention) block of GLM-5.3-Flash and Kimi-Linear.

CPU side (always importable): KdaConfig (config.json), bind_layer (one layer's tensors from a
checkpoint), KdaOracle (the float64 / BF16-faithful NumPy oracle), KdaState and StatePool.
GPU side (imported on first use, needs a CUDA device): KdaLayer, KdaWorkspace.
"""

from .checkpoint import BoundLayer, CheckpointError, bind_layer
from .config import ConfigError, KdaConfig
from .reference import STAGE_ORDER, KdaOracle, compare_stages, rms_ratio
from .state import KdaState, StatePool

__version__ = "0.1.0"

_GPU_NAMES = {"KdaLayer", "KdaWorkspace"}


def __getattr__(name: str):
    # The GPU layer is imported lazily so that `import glm_kda` never needs a GPU.
    if name in _GPU_NAMES:
        from . import layer

        return getattr(layer, name)
    raise AttributeError(f"module 'glm_kda' has no attribute {name!r}")


__all__ = ["BoundLayer", "CheckpointError", "ConfigError", "KdaConfig", "KdaLayer", "KdaOracle", "KdaState",
           "KdaWorkspace", "STAGE_ORDER", "StatePool", "bind_layer", "compare_stages", "rms_ratio"]
