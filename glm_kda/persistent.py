"""One-launch decode of one sequence: the task table of ``kernels_src/decode_persistent.cu``.

The kernel runs every projection, the fused step of every head and the output of a decode
step (1..16 tokens of one sequence) as tasks that its blocks take in ticket order. This
module builds that order (a ``[tasks, 8]`` int32 table) and checks it; the layer launches it
(:meth:`glm_kda.layer.KdaLayer.decode`). The bits are those of the separate launches: each
projection task is a column group of ``gemm_rows_bf16`` (or one k range of it, for o_proj)
and each step task two heads of ``kda_decode_fused_bf16``.

Task rows: ``kind, index, aux, wait_counter, wait_target, signal_0, signal_1, signal_2``
(-1: no wait / no signal). Counters: 0 the ticket, 1 the blocks that have left, then
``down`` (f_a|g_a|b groups done), one per pair of heads (its q|k|v and f_b / g_b groups
done), one per k range of o_proj (its pairs' steps done) and one per o_proj column group
(its k ranges arrived).

The order only moves work in time, never a bit: ``step_lag`` (pairs of heads) is how far
behind its q|k|v groups a pair's step is queued (its f_b / g_b groups go half as far, so that
f_a|g_a|b is done when they are taken), ``out_lag`` how far behind the last step of a k range
that range's o_proj tasks are, but never before the last step: the o_proj stream follows the
q|k|v stream and overlaps the steps of the last heads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from glm_kda import gemm_rows
from glm_kda.ops import HEAD_DIM

DOWN, QKV, UP_F, UP_G, STEP, OUT = range(6)
KIND_NAMES = ("down", "qkv", "up_f", "up_g", "step", "out")
TASK_INTS = 8
# DECODE_PERSISTENT_TILES, DECODE_PERSISTENT_OUT_TILES and DECODE_PERSISTENT_THREADS of the kernel.
TILES = 4
OUT_TILES = 2
THREADS = 256
MAX_ROWS = 16
TICKET, EXIT = 0, 1
# Default lags, in pairs of heads (see the module docstring).
STEP_LAG_PAIRS = 12
OUT_LAG_PAIRS = 99


def group_columns(k: int) -> int:
    """Columns of one projection task over k: (8 / k_split(k)) warps of TILES tiles of 8."""
    return gemm_rows.WARPS_PER_BLOCK // gemm_rows.k_split(k) * TILES * gemm_rows.N_TILE


@dataclass(frozen=True)
class Schedule:
    """The task table of one geometry and the sizes the launch needs."""

    tasks: np.ndarray  # [task_count, TASK_INTS] int32
    counter_count: int
    out_split: int  # k ranges of o_proj (k_split of qkv)
    out_groups: int  # o_proj column groups (8 warps of OUT_TILES tiles of 8 columns)
    out_range_k: int  # k of o_proj's longest k range

    def kinds(self) -> dict[str, int]:
        """Tasks per kind."""
        return {name: int((self.tasks[:, 0] == kind).sum()) for kind, name in enumerate(KIND_NAMES)}


def _pair_of_column(column: int, qkv: int) -> int:
    return (column % qkv) // HEAD_DIM // 2


@functools.lru_cache(maxsize=None)
def build_schedule(hidden: int, heads: int, step_lag: int = STEP_LAG_PAIRS, out_lag: int = OUT_LAG_PAIRS,
                   out_tiles: int | None = None) -> Schedule:
    """The ticket order of one decode step at (hidden, heads), head_dim 128. `out_tiles` (None:
    OUT_TILES) must be the kernel's DECODE_PERSISTENT_OUT_TILES.

    Raises ValueError for a geometry the kernel's task layout cannot split by pairs of heads
    (an odd head count, a hidden size that is not a multiple of 8).
    """
    if heads < 2 or heads % 2:
        raise ValueError(f"the persistent decode needs an even number of heads, got {heads}")
    if hidden < 8 or hidden % 8:
        raise ValueError(f"the persistent decode needs hidden % 8 == 0, got {hidden}")
    if step_lag < 0 or out_lag < 0:
        raise ValueError(f"lags must be >= 0, got step_lag={step_lag}, out_lag={out_lag}")
    out_tiles = OUT_TILES if out_tiles is None else out_tiles
    dim = HEAD_DIM
    qkv = heads * dim
    pairs = heads // 2
    down_dim = 2 * dim + heads

    def groups(n: int, k: int) -> int:
        return -(-n // group_columns(k))

    out_split = gemm_rows.k_split(qkv)
    k_blocks = -(-qkv // gemm_rows.K_BLOCK)
    range_k = -(-k_blocks // out_split) * gemm_rows.K_BLOCK
    out_columns = gemm_rows.WARPS_PER_BLOCK * out_tiles * gemm_rows.N_TILE
    out_groups = -(-hidden // out_columns)

    # Counters.
    down_counter = 2
    pair_counter = 3
    range_counter = pair_counter + pairs
    arrival_counter = range_counter + out_split
    counter_count = arrival_counter + out_groups

    def range_span(r: int) -> tuple[int, int]:
        return r * range_k, min((r + 1) * range_k, qkv)

    steps = [(head, 2) for head in range(0, heads, 2)]  # a pair of heads per step task

    def steps_of_range(r: int) -> list[int]:
        """The step tasks whose heads feed k range r of o_proj."""
        begin, end = range_span(r)
        return [i for i, (head, count) in enumerate(steps) if head * dim < end and (head + count) * dim > begin]

    entries: list[tuple[float, int, list[int]]] = []  # (position, order, task)

    def add(position: float, task: list[int]) -> None:
        entries.append((position, len(entries), task))

    down_groups = groups(down_dim, hidden)
    for g in range(down_groups):
        add(-1, [DOWN, g, 0, -1, 0, down_counter, -1, -1])
    qkv_width, up_width = group_columns(hidden), group_columns(dim)
    pair_inputs = [0] * pairs
    for part in range(3):
        for g in range(groups(qkv, hidden)):
            column = part * qkv + g * qkv_width
            p = _pair_of_column(column, qkv)
            if _pair_of_column(column + qkv_width - 1, qkv) != p and column + qkv_width <= 3 * qkv:
                raise ValueError(f"q|k|v group {g} of part {part} spans two pairs of heads")
            pair_inputs[p] += 1
            add(p, [QKV, (part * qkv) // qkv_width + g, 0, -1, 0, pair_counter + p, -1, -1])
    for kind in (UP_F, UP_G):
        for g in range(groups(qkv, dim)):
            p = _pair_of_column(g * up_width, qkv)
            if _pair_of_column(min(qkv, (g + 1) * up_width) - 1, qkv) != p:
                raise ValueError(f"gate group {g} spans two pairs of heads")
            pair_inputs[p] += 1
            add(max(p, step_lag // 2) + 0.5, [kind, g, 0, down_counter, down_groups, pair_counter + p, -1, -1])
    for i, (head, count) in enumerate(steps):
        p = head // 2
        signals = [range_counter + r for r in range(out_split) if i in steps_of_range(r)]
        if len(signals) > 3:
            raise ValueError(f"heads {head}..{head + count - 1} feed {len(signals)} k ranges of o_proj; at most 3")
        signals += [-1] * (3 - len(signals))
        add(p + step_lag + 0.75, [STEP, head, count, pair_counter + p, pair_inputs[p], *signals])
    for r in range(out_split):
        needed = steps_of_range(r)
        last_pair = max(steps[i][0] for i in needed) // 2 if needed else 0
        position = max(last_pair + out_lag, pairs) + step_lag + 0.875 if needed else -0.5
        wait = [range_counter + r, len(needed)] if needed else [-1, 0]
        for c in range(out_groups):
            add(position, [OUT, c, r, *wait, arrival_counter + c, -1, -1])
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    tasks = np.array([task for _, _, task in entries], dtype=np.int32).reshape(-1, TASK_INTS)
    schedule = Schedule(tasks=tasks, counter_count=counter_count, out_split=out_split, out_groups=out_groups,
                        out_range_k=range_k)
    check_schedule(schedule)
    return schedule


def check_schedule(schedule: Schedule) -> None:
    """Every wait is met by signals of earlier tickets alone (so the launch cannot deadlock),
    and every counter ends at the count its waiters expect. Raises AssertionError."""
    counts = np.zeros(schedule.counter_count, np.int64)
    for ticket, (kind, index, aux, wait, target, *signals) in enumerate(schedule.tasks.tolist()):
        if wait >= 0:
            assert counts[wait] >= target, (
                f"ticket {ticket} ({KIND_NAMES[kind]} {index}/{aux}) waits for counter {wait} >= {target}, "
                f"which the earlier tickets bring to {counts[wait]}")
        for counter in signals:
            if counter >= 0:
                assert 2 <= counter < schedule.counter_count, f"ticket {ticket} signals counter {counter}"
                counts[counter] += 1
    arrivals = counts[schedule.counter_count - schedule.out_groups:]
    assert (arrivals == schedule.out_split).all(), f"o_proj groups arrive {arrivals.tolist()} times, not {schedule.out_split}"


def launch(layer, hidden, conv_state, recurrent_state, slots=None, schedule: Schedule | None = None,
           trace=None) -> None:
    """One persistent launch: hidden [rows, hidden] BF16 (rows 1..16, consecutive tokens of one
    sequence) through the whole block into layer.workspace.final_out[:rows], every stage buffer
    written as the separate launches write it, the states (conv_state [3 H D, K] and
    recurrent_state [H, D, D] FP32, or pools with slots [1] device int32) advanced in place.
    `schedule` defaults to the layer geometry's (build_schedule with the module's lags).
    `trace` (a device uint64 array [tasks, 4], or None) receives per ticket the global timer in
    ns when a block took it, when its wait ended and when it was done, and the block."""
    from glm_kda import kernels

    grid, block, args, shared = launch_arguments(layer, hidden, conv_state, recurrent_state, slots, schedule, trace)
    kernels.launch("kda_decode_persistent_bf16", grid, block, args, shared)


def launch_arguments(layer, hidden, conv_state, recurrent_state, slots=None, schedule: Schedule | None = None,
                     trace=None) -> tuple:
    """(grid, block, kernel arguments, dynamic shared bytes: o_proj's x over one k range) of
    :func:`launch`, checked."""
    from glm_kda.ops import _f32, _i32, _require

    ws, c = layer.workspace, layer.config
    rows = hidden.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"persistent decode: 1..{MAX_ROWS} rows of one sequence, got {rows}")
    _require("hidden", hidden, "bf16", (rows, c.hidden), aligned=True)
    if schedule is None:
        schedule = build_schedule(c.hidden, c.heads, STEP_LAG_PAIRS, OUT_LAG_PAIRS)
    if trace is not None and (trace.dtype != np.uint64 or trace.shape != (schedule.tasks.shape[0], 4)):
        raise ValueError(f"trace: expected [{schedule.tasks.shape[0]}, 4] uint64, got {trace.dtype} {list(trace.shape)}")
    tasks, counters, out_partial = buffers(ws, schedule)
    bounded = bool(c.bounded)
    args = (
        counters, _i32(counters.size), tasks, _i32(tasks.shape[0]), _i32(rows),
        hidden, _i32(c.hidden), layer.down_weight, ws.down_proj, _i32(c.down_dim), layer.qkv_weight,
        ws.qkv_proj, layer.f_b, ws.forget_proj, layer.g_b, ws.out_gate, layer.o_proj, out_partial, ws.final_out,
        conv_state, recurrent_state, slots, layer.conv_weight, layer.dt_bias, layer.a_log, layer.o_norm,
        ws.conv_out, ws.query, ws.key, ws.value, ws.gate, ws.beta, ws.core, ws.o_norm_out, _i32(c.heads),
        _i32(c.conv_kernel), _i32(1 if bounded else 0), _f32((c.gate_lower_bound or 0.0) if bounded else 0.0),
        _f32(layer.scale), _f32(c.l2_eps), _f32(c.rms_norm_eps), trace,
    )
    shared = 2 * rows * schedule.out_range_k
    return (_resident_blocks(),), (THREADS,), args, shared


def _resident_blocks() -> int:
    """Blocks of one launch: one per SM of the current device."""
    import cupy

    return gemm_rows._sm_count(cupy.cuda.Device().id)


def buffers(workspace, schedule: Schedule) -> tuple:
    """The device task table, the counters (zero between launches: the kernel resets them)
    and the o_proj partial sums [out_split, MAX_ROWS, hidden] FP32 of a workspace, made on
    first use and kept on it, one set per schedule."""
    import cupy

    cache = workspace.__dict__.setdefault("_persistent", {})
    key = id(schedule)
    if key not in cache:
        hidden = workspace.config.hidden
        cache[key] = (cupy.asarray(schedule.tasks), cupy.zeros(schedule.counter_count, np.int32),
                      cupy.zeros((schedule.out_split, MAX_ROWS, hidden), np.float32), schedule)
    return cache[key][:3]
