"""The per-sequence state a KDA block carries, and its exchange layouts with transformers and vLLM.

Our layout, shared by the GPU kernels and the oracle: conv FP32 [conv_dim, K], the last K conv INPUTS per
channel, oldest first; recurrent FP32 [H, D_k, D_v], K-major. Why, and how the others differ: docs/maths.md,
section 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .config import KdaConfig


def array_module(array: Any):
    """numpy or cupy, whichever owns `array` (cupy is imported only if the array is one)."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    # (Not cupy.get_array_module: its first call imports all of cupyx.scipy, a cost on every first use.)
    return cupy if isinstance(array, cupy.ndarray) else np


def require_device_buffers(what: str, owner: str, conv: Any, recurrent: Any, device_id: int) -> None:
    """The state buffers a kernel is handed: TypeError naming `owner`.conv or `owner`.recurrent
    unless it is a contiguous CuPy float32 array; ValueError unless it starts on a 16-byte boundary
    (the kernels move it in 16-byte vectors) and lives on device `device_id`."""
    import cupy

    for field, buf in (("conv", conv), ("recurrent", recurrent)):
        if not isinstance(buf, cupy.ndarray) or buf.dtype != np.float32 or not buf.flags.c_contiguous:
            raise TypeError(f"{what}: {owner}.{field} must be a contiguous CuPy float32 array")
        if buf.data.ptr % 16:
            raise ValueError(f"{what}: {owner}.{field} must start on a 16-byte boundary (address {buf.data.ptr:#x}); "
                             "the kernels read and write it in 16-byte vectors")
        if buf.device.id != device_id:
            raise ValueError(f"{what}: {owner}.{field} is on device {buf.device.id}, the layer runs on device {device_id}")


def require_state(state: Any, config: KdaConfig, device_id: int, what: str, name: str = "state",
                  shapes: tuple | None = None) -> None:
    """The checks of a state the call `what` takes as argument `name`, before any launch: a KdaState
    whose buffers fit `config` (shapes: its (conv, recurrent) shapes, where the caller has them at
    hand) and are require_device_buffers' arrays on device `device_id`. Every refusal names the
    call, the argument and the buffer."""
    if not isinstance(state, KdaState):
        raise TypeError(f"{what}: {name} must be a KdaState (new_state()), got {type(state).__name__}")
    if shapes is None:
        shapes = (tuple(config.conv_state_shape), tuple(config.recurrent_state_shape))
    if state.conv.shape != shapes[0] or state.recurrent.shape != shapes[1]:
        state.check(config, f"{what}: {name}")  # names the buffer whose shape is wrong
    require_device_buffers(what, name, state.conv, state.recurrent, device_id)


def require_one_row(what: str, hidden: Any) -> None:
    """ValueError unless `hidden` is one row ([1, width] or [width]): the one token a call on a
    single state advances it by (K tokens of one sequence are decode_k's; many sequences, a pool's)."""
    shape = tuple(getattr(hidden, "shape", ()))
    if len(shape) == 2 and shape[0] != 1:
        raise ValueError(f"{what}: {shape[0]} rows for one state; a state advances one token a call ([1, hidden] "
                         "or [hidden]): K tokens of one sequence are a walk (decode_k; the oracle's verify), many "
                         "sequences a StatePool with slots")


@dataclass
class KdaState:
    """State of one sequence: `conv` [conv_dim, K] and `recurrent` [H, D, D], NumPy or CuPy.

    The GPU layer updates both arrays in place; the NumPy oracle returns new ones.
    """

    conv: Any
    recurrent: Any

    @classmethod
    def zeros(cls, config: KdaConfig, xp: Any = np, dtype: Any = np.float32) -> "KdaState":
        """A new sequence: zero history, zero recurrent state."""
        if not isinstance(config, KdaConfig):
            raise TypeError(f"KdaState.zeros: config must be a KdaConfig (glm_kda.KdaConfig.from_pretrained), "
                            f"got {type(config).__name__}")
        return cls(xp.zeros(config.conv_state_shape, dtype), xp.zeros(config.recurrent_state_shape, dtype))

    @classmethod
    def random(cls, config: KdaConfig, seed: int = 0, scale: float = 0.1) -> "KdaState":
        """A carried state with realistic content, for tests: conv history of BF16-representable
        values (they are BF16 projections), recurrent entries ~ N(0, scale)."""
        rng = np.random.default_rng(seed)
        conv = rng.standard_normal(config.conv_state_shape).astype(ml_dtypes.bfloat16).astype(np.float32)
        recurrent = (scale * rng.standard_normal(config.recurrent_state_shape)).astype(np.float32)
        return cls(conv, recurrent)

    def copy(self) -> "KdaState":
        return KdaState(self.conv.copy(), self.recurrent.copy())

    def astype(self, dtype: Any) -> "KdaState":
        return KdaState(self.conv.astype(dtype), self.recurrent.astype(dtype))

    def to_numpy(self) -> "KdaState":
        """Host copies (a CuPy state is copied to the host; a NumPy one is copied)."""
        return KdaState(_host(self.conv), _host(self.recurrent))

    def check(self, config: KdaConfig, name: str = "state") -> None:
        """Raise ValueError naming the buffer whose shape does not fit `config`, TypeError naming one
        that does not hold floating-point values."""
        for field, expected in (("conv", config.conv_state_shape), ("recurrent", config.recurrent_state_shape)):
            buffer = getattr(self, field)
            got = tuple(buffer.shape)
            if got != tuple(expected):
                raise ValueError(f"{name}.{field} has shape {list(got)}, expected {list(expected)} for {config.describe()}")
            if np.dtype(buffer.dtype).kind != "f":
                raise TypeError(f"{name}.{field} must hold floating-point values, got dtype {buffer.dtype}")

    # Exchange layouts ------------------------------------------------------------------
    def to_transformers(self) -> tuple[np.ndarray, np.ndarray]:
        """(conv BF16 [conv_dim, K], recurrent FP32 [H, D, D]): the same slots, BF16 conv."""
        state = self.to_numpy()
        return state.conv.astype(ml_dtypes.bfloat16), state.recurrent.astype(np.float32)

    @classmethod
    def from_transformers(cls, conv: Any, recurrent: Any, config: KdaConfig | None = None) -> "KdaState":
        """From transformers' (conv [conv_dim, K], recurrent [H, D, D]); checked against each other
        and, where given, against `config`."""
        conv, recurrent = _imported("transformers", conv, recurrent, 0, config)
        return cls(conv, recurrent)

    def to_vllm(self) -> tuple[np.ndarray, np.ndarray]:
        """(conv FP32 [conv_dim, K-1], recurrent FP32 [H, D, D]): vLLM keeps the K-1 read slots."""
        state = self.to_numpy()
        return np.ascontiguousarray(state.conv[:, 1:]), state.recurrent

    @classmethod
    def from_vllm(cls, conv: Any, recurrent: Any, config: KdaConfig | None = None) -> "KdaState":
        """From vLLM's (conv [conv_dim, K-1], recurrent [H, D, D]); slot 0 of ours (never read) is
        set to zero. Checked as from_transformers."""
        conv, recurrent = _imported("vLLM", conv, recurrent, 1, config)
        ours = np.zeros((conv.shape[0], conv.shape[1] + 1), np.float32)
        ours[:, 1:] = conv
        return cls(ours, recurrent)


def _imported(source: str, conv: Any, recurrent: Any, missing_slots: int,
              config: KdaConfig | None) -> tuple[np.ndarray, np.ndarray]:
    """Another library's (conv, recurrent) as FP32 host copies: floating point, finite, conv
    [3 * H * D, K - missing_slots] and recurrent [H, D, D] consistent with each other and, where
    given, with `config`; else a ValueError / TypeError naming the buffer and what was expected."""
    conv, recurrent = np.asarray(_host(conv)), np.asarray(_host(recurrent))
    for name, array in (("conv", conv), ("recurrent", recurrent)):
        if not (np.issubdtype(array.dtype, np.floating) or array.dtype == ml_dtypes.bfloat16):
            raise TypeError(f"{source} {name} state must hold floating-point values, got dtype {array.dtype}")
    if recurrent.ndim != 3 or recurrent.shape[1] != recurrent.shape[2]:
        raise ValueError(f"{source} recurrent state must be [H, D, D], got shape {list(recurrent.shape)}")
    heads, dim = recurrent.shape[0], recurrent.shape[1]
    if conv.ndim != 2 or conv.shape[0] != 3 * heads * dim or conv.shape[1] < 1 - missing_slots:
        raise ValueError(f"{source} conv state must be [3 * H * D = {3 * heads * dim}, K{' - 1' * missing_slots}] "
                         f"for the recurrent state's H={heads}, D={dim}, got shape {list(conv.shape)}")
    if config is not None:
        expected = (config.conv_state_shape[0], config.conv_kernel - missing_slots)
        if tuple(conv.shape) != expected or tuple(recurrent.shape) != config.recurrent_state_shape:
            raise ValueError(f"{source} state [{list(conv.shape)}, {list(recurrent.shape)}] does not fit "
                             f"{config.describe()}: expected [{list(expected)}, {list(config.recurrent_state_shape)}]")
    conv, recurrent = conv.astype(np.float32), recurrent.astype(np.float32)
    for name, array in (("conv", conv), ("recurrent", recurrent)):
        if not np.isfinite(array).all():
            raise ValueError(f"{source} {name} state holds NaN or Inf values")
    return conv, recurrent


def _host(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "get"):
        return array.get()
    return np.array(array)


class StatePool:
    """States of N sequences in two arrays, addressed by slot: conv [N, conv_dim, K] and recurrent
    [N, H, D, D], FP32 (CuPy by default). Sequences come and go (reset a slot, reuse it) without a recapture.
    """

    def __init__(self, config: KdaConfig, slots: int, xp: Any = None):
        if xp is None:
            import cupy as xp
        if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool):
            raise TypeError(f"slots (the pool's size) must be an int, got {type(slots).__name__} {slots!r}")
        if slots < 1:
            raise ValueError(f"a pool needs >= 1 slot, got {slots}")
        self.config = config
        self.conv = xp.zeros((slots,) + tuple(config.conv_state_shape), np.float32)
        self.recurrent = xp.zeros((slots,) + tuple(config.recurrent_state_shape), np.float32)

    def __len__(self) -> int:
        return self.conv.shape[0]

    def state(self, slot: int) -> KdaState:
        """Slot `slot` as a KdaState of views: writes go to the pool."""
        self._check_slot(slot)
        return KdaState(self.conv[slot], self.recurrent[slot])

    def reset(self, *slots: int) -> None:
        """Zero the given slots (a new sequence starts there). Every slot is checked before any is
        zeroed: a bad one raises IndexError and leaves the pool as it was."""
        for slot in slots:
            self._check_slot(slot)
        for slot in slots:
            self.conv[slot].fill(0)
            self.recurrent[slot].fill(0)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool):
            raise TypeError(f"slot must be an int, got {type(slot).__name__} {slot!r}")
        if not 0 <= int(slot) < len(self):
            raise IndexError(f"slot {slot} outside this pool of {len(self)} slots")
