"""glm_kda: the KDA (Kimi Delta Attention) block of GLM-5.3-Flash and Kimi-Linear.

CPU side (always importable): KdaConfig, bind_layer, KdaOracle, KdaState, StatePool and KdaOptions.
GPU side (imported on first use, needs a CUDA device): KdaLayer, KdaStack, KdaWorkspace (README, "API").
"""

from .checkpoint import BoundLayer, CheckpointError, bind_layer
from .config import ConfigError, KdaConfig
from .options import KdaOptions
from .reference import STAGE_ORDER, KdaOracle, compare_stages, rms_ratio
from .state import KdaState, StatePool

__version__ = "0.1.0"

_GPU_NAMES = {"KdaLayer": "layer", "KdaStack": "stack", "KdaWorkspace": "workspace"}


def __getattr__(name: str):
    # The GPU side is imported lazily so that `import glm_kda` never imports CuPy.
    if name in _GPU_NAMES:
        import importlib

        return getattr(importlib.import_module(f".gpu.{_GPU_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'glm_kda' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["BoundLayer", "CheckpointError", "ConfigError", "KdaConfig", "KdaLayer", "KdaOptions", "KdaOracle", "KdaStack", "KdaState",
           "KdaWorkspace", "STAGE_ORDER", "StatePool", "bind_layer", "compare_stages", "rms_ratio"]
