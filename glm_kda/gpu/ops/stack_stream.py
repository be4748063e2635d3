"""One token of one sequence through every layer of a stack in one persistent launch
(kernels_src/decode/stack_stream.cu, sm_90 and later): the plan of its shared-memory ring, the table of
device pointers it reads, and its launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy

from .. import build
from ..projection import PackedWeight, _k_split
from .checks import HEAD_DIM, _f32, _i32, check_scratch
from .gate import gate_law_args

# Threads of a block (KDA_STREAM_THREADS: the row projection's eight warps).
THREADS = 256
# Counted phases a layer (KdaStreamPhase), and the one word after them: the blocks out.
PHASES = 5
# The workspace rows the table starts with (KdaStreamRows), in its order.
ROW_NAMES = ("down_proj", "qkv_proj", "forget_proj", "out_gate", "final_out", "conv_out", "query", "key", "value",
             "gate", "beta", "core", "o_norm_out")
# A layer's projections in the order a block uses them (KdaStreamProjection), as KdaLayer names them.
PROJECTIONS = ("down_weight", "qkv_weight", "f_b", "g_b", "o_proj")
# Bytes of gemm_rows_group's partial sums (GEMM_ROWS_PARTIAL_FLOATS(1, 1)) and of a KdaStepShared.
_PARTIAL_BYTES = 8 * 4 * 32 * 4
_STEP_SHARED_BYTES = 48 + 3 * HEAD_DIM * 4
# Bytes of a packed (8 columns, 32 k) block.
_PACKED_BLOCK_BYTES = 8 * 32 * 2
# Fewer slots than this leave no copy in flight while a block computes from a slot.
_MIN_SLOTS = 2
# More slots only hold weights further ahead than any wait of the launch lasts.
_MAX_SLOTS = 8


@dataclass(frozen=True)
class StreamPlan:
    """The ring of a launch: `slots` slots of `slot_bytes`, `shared_bytes` of dynamic shared memory a block."""

    slots: int
    slot_bytes: int
    shared_bytes: int


def projection_shapes(hidden: int, heads: int, down_dim: int) -> tuple[tuple[int, int], ...]:
    """(n, k) of each projection of PROJECTIONS."""
    width = heads * HEAD_DIM
    return ((down_dim, hidden), (3 * width, hidden), (width, HEAD_DIM), (width, HEAD_DIM), (hidden, width))


def group_bytes(n: int, k: int) -> int:
    """Bytes of the packed weight of one column group of gemm_rows_group with one tile a warp."""
    tiles = min(8 // _k_split(k), -(-n // 8))
    return tiles * -(-k // 32) * _PACKED_BLOCK_BYTES


def shared_bytes(hidden: int, heads: int, slots: int, slot_bytes: int) -> int:
    """Dynamic shared memory of a block (the kernel's layout): the ring, the partial sums, two heads'
    step memory, the mbarriers (16 bytes a pair of slots), x's copy (a 16-byte zero chunk and the widest
    k padded to whole k blocks)."""
    widest = max(hidden, heads * HEAD_DIM)
    return (slots * slot_bytes + _PARTIAL_BYTES + 2 * _STEP_SHARED_BYTES + 16 * -(-slots // 2) + 16
            + 2 * 32 * -(-widest // 32))


def plan(hidden: int, heads: int, down_dim: int, shared_limit: int) -> StreamPlan | None:
    """The ring for a block of at most `shared_limit` bytes of shared memory, or None where fewer than two
    slots of the largest column group fit (GLM-5.3-Flash's o_proj: 128 KB a group)."""
    slot_bytes = max(group_bytes(n, k) for n, k in projection_shapes(hidden, heads, down_dim))
    slot_bytes = -(-slot_bytes // 128) * 128
    slots = _MAX_SLOTS
    while slots >= _MIN_SLOTS and shared_bytes(hidden, heads, slots, slot_bytes) > shared_limit:
        slots -= 1
    if slots < _MIN_SLOTS:
        return None
    return StreamPlan(slots, slot_bytes, shared_bytes(hidden, heads, slots, slot_bytes))


def call_table(rows: dict[str, Any], layers: Sequence[dict[str, Any]]) -> numpy.ndarray:
    """The kernel's table of device addresses (uint64): the workspace rows of ROW_NAMES, then per layer its
    packed weights (PROJECTIONS), conv_w, dt_bias, a_log, norm_w, conv_state and state. Every entry is a
    CuPy array or a PackedWeight; upload the result before the launch."""
    def address(value: Any) -> int:
        return (value.data if isinstance(value, PackedWeight) else value).data.ptr

    entries = [address(rows[name]) for name in ROW_NAMES]
    for layer in layers:
        entries += [address(layer[name]) for name in (*PROJECTIONS, "conv_w", "dt_bias", "a_log", "norm_w",
                                                       "conv_state", "state")]
    return numpy.asarray(entries, numpy.uint64)


def kda_stack_stream_bf16(x, table, layers: int, counters, stream_plan: StreamPlan, *, hidden: int, heads: int,
                          down_dim: int, kernel_size: int, bounded: bool, lower_bound: float, scale: float,
                          l2_eps: float, norm_eps: float, sm_count: int) -> None:
    """One token through `layers` layers in one cooperative launch of sm_count blocks: x [hidden] BF16 (the
    first layer's input, contiguous), table: call_table's uint64 entries on the device, counters: int32 of at
    least layers * PHASES + 1 elements, all zero (zero again after the launch). The last layer's stage rows
    and its output (final_out's row) are written where the table points, the states in place."""
    if heads % 2 or heads // 2 > sm_count:
        raise ValueError(f"kda_stack_stream_bf16: {heads} heads need an even count and heads / 2 <= {sm_count} blocks")
    if x.dtype.itemsize != 2 or x.size != hidden or not x.flags.c_contiguous or x.data.ptr % 16:
        raise ValueError(f"kda_stack_stream_bf16: x must be a contiguous, 16-byte aligned BF16 row of {hidden}, "
                         f"got {x.dtype} {list(x.shape)}")
    if table.dtype != numpy.uint64 or table.size != len(ROW_NAMES) + layers * (len(PROJECTIONS) + 6):
        raise ValueError(f"kda_stack_stream_bf16: the table must be call_table's for {layers} layers")
    check_scratch(counters, numpy.int32, "int32", layers * PHASES + 1, "counters", "kda_stack_stream_bf16")
    build.launch("kda_stack_stream_bf16", (sm_count,), (THREADS,),
                 (x, table, _i32(layers), _i32(hidden), _i32(heads), _i32(down_dim), _i32(kernel_size),
                  *gate_law_args(bounded, lower_bound), _f32(scale), _f32(l2_eps), _f32(norm_eps), counters,
                  _i32(stream_plan.slots), _i32(stream_plan.slot_bytes)),
                 stream_plan.shared_bytes, cooperative=True)
