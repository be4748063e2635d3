"""KdaOptions: the choices a user may make about how a KdaLayer runs, in one frozen object.

Every field is part of every graph key, so new options (``layer.options = dataclasses.replace(...)``)
never replay a graph captured under others. None but ``chunk_impl`` changes a bit of any output or state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

CHUNK_IMPLS = ("auto", "tensor", "fp32")


@dataclass(frozen=True)
class KdaOptions:
    """How a KdaLayer runs.

    chunk_impl: the chunked-prefill kernels. "tensor": TF32 tensor-core kernels, chunk 64 (the fast
        path); "fp32": FP32 kernels, any chunk up to 64 (the reference path); "auto" (default):
        "tensor" where the layer's geometry and device allow it, else "fp32".
    packed_weights: the decode-side projections read packed copies of the projection weights (default
        True; as many bytes again). False reads the row-major weights: the same bits, slower.
    graphs: decode, decode_k and pool decode replay CUDA graphs captured on their second call with the
        same shapes and states (default True). False: eager launches (debugging, profilers).
    hopper: programmatic dependent launches and the bulk-copy projection sweep where the device has
        sm_90 features (default True). False: the portable path, the same bits, slower on Hopper.
    check_finite: every call checks its input rows before the first launch (a NaN or Inf row raises
        FloatingPointError, the state untouched) and its output after the last (raises, the state
        advanced); default False. Each check reads one flag back: the call waits for the GPU
        (README, "Input checks").
    stage_buffers: a prefill writes every stage buffer, for workspace.stages(T). False (default): it
        writes only what a later kernel reads (not conv_out, nor the gate the tensor-core prepare
        forms), the same output and state bits in less time (docs/design.md, "Prefill stage
        buffers").
    """

    chunk_impl: str = "auto"
    packed_weights: bool = True
    graphs: bool = True
    hopper: bool = True
    check_finite: bool = False
    stage_buffers: bool = False

    def __post_init__(self) -> None:
        if self.chunk_impl not in CHUNK_IMPLS:
            raise ValueError(f"KdaOptions.chunk_impl must be one of {CHUNK_IMPLS}, got {self.chunk_impl!r}")
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"KdaOptions.{field.name} must be a bool, got {type(value).__name__} {value!r}")
