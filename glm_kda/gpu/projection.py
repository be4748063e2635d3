"""The decode-side projection (``kernels_src/projection/``): 1..256 token rows times a BF16 weight.

Launch planning and wrappers of the split-k row sweep, its staged forms and the sm_90 bulk-copy sweep; every
plan adds the same products in the same k order, so every plan gives the same bits (docs/design.md, "The row
projection kernel"). The oracle of this stage is :func:`glm_kda.reference.linear` rounded to BF16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import cupy

from ..state import array_module
from . import build
from .ops.checks import _i32, _require_int32, _row_stride, check_scratch, projection_args

# Rows of one launch: the workspaces' row groups are sized by it.
GEMM_ROWS_MAX_ROWS = 256
# Rows of an mma tile: up to this many rows take the one-m-tile (decode) entries.
M_TILE = 16
# Blocks per SM every split-k entry is compiled for (GEMM_ROWS_MIN_BLOCKS of gemm_rows.cuh).
GEMM_ROWS_BLOCKS_PER_SM = 2

# Rows swept together over one read of the weight (GEMM_ROWS_M_GROUP; blockIdx.y picks the group).
_ROWS_PER_SWEEP = 64
# Columns of an mma tile (GEMM_ROWS_N_TILE): the packed layout's unit along n.
_N_TILE = 8
# k of a block of the sweep (GEMM_ROWS_K_BLOCK): two k16 steps, the unit along k of every layout.
_K_BLOCK = 32
# Warps of a split-k block (GEMM_ROWS_WARPS).
_WARPS_PER_BLOCK = 8
# Tiles per warp the split-k entries are compiled for.
_TILES_PER_WARP = (1, 2, 4)
# Tiles per warp the staged entries are compiled for (GEMM_ROWS_STAGED_ENTRY).
_STAGED_TILES_PER_WARP = (1, 2)
# SMs of an H200, for plans made without a device; the wrappers pass the current device's count.
_DEFAULT_SM_COUNT = 132
# Shared memory an sm_90 block may ask for: the staged and bulk plans are sized to fit it.
_SHARED_PER_BLOCK = 227 << 10
# Shared memory an sm_90 SM holds (the driver keeps 1 KB a block): blocks per SM are sized by it.
_SHARED_PER_SM = 228 << 10
# Blocks of 32 k per weight row a programmatic launch asks L2 for before its wait.
_PREFETCH_K_BLOCKS = 16
# Weights above this size take no L2 request: it would queue in front of the step's state loads.
_PREFETCH_MAX_WEIGHT_BYTES = 32 << 20
# The largest stage of a staged block (one column group's weights).
_STAGED_MAX_BYTES = 64 << 10
# Larger weights do not fit the stages of all their blocks at once (3 x 64 KB x 132 SMs).
_STAGED_MAX_WEIGHT_BYTES = 24 << 20
# Blocks per SM the staged entries are compiled for (GEMM_ROWS_STAGED_MIN_BLOCKS).
_STAGED_BLOCKS_PER_SM = 3
# The tail-staged form stages one row only: more rows of x leave too little room for a tail.
_TAIL_STAGED_MAX_ROWS = 1
# Blocks per SM the tail-staged entries are compiled for (GEMM_ROWS_TAIL_MIN_BLOCKS).
_TAIL_BLOCKS_PER_SM = 2
# Groups of 64 columns per SM from which the bulk-copy sweep is worth its copies (not down_proj).
_BULK_MIN_GROUPS_PER_SM = 0.25
# Blocks of 32 k of each operand a ring slot holds (GEMM_BULK_CHUNK of gemm_rows_bulk.cu).
_BULK_CHUNK = 4
# The most slots a bulk ring has: more stop paying once the copies keep ahead of the wgmma.
_BULK_MAX_STAGES = 8
# Bytes of one 4 KB tile of the bulk sweep (64 rows by one block of 32 k).
_BULK_TILE_BYTES = 64 * _K_BLOCK * 2


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] BF16 weight in the packed layout (docs/design.md, "The row projection kernel"), made by
    :func:`pack_weight`: ``data`` [ceil(n / 8), ceil(k / 32), 256] BF16, zeros past n and k. ``tiles`` (None
    unless asked for): the same weight in the tile layout of the bulk-copy sweep (:func:`tile_layout`)."""

    data: Any
    n: int
    k: int
    tiles: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k) of the weight it holds."""
        return (self.n, self.k)

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        """Shape of ``data``: [ceil(n / 8), ceil(k / 32), 256]."""
        return (-(-self.n // _N_TILE), -(-self.k // _K_BLOCK), _N_TILE * _K_BLOCK)


def _padded(w: Any, name: str, rows_multiple: int) -> tuple[Any, int, int, int]:
    """w checked ([n, k] BF16, k % 8 == 0) and padded by zeros to n a multiple of rows_multiple and
    k of _K_BLOCK: (padded, n, k, k_blocks)."""
    xp = array_module(w)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"{name}: w must be [n, k] with n, k >= 1, got {list(w.shape)}")
    if w.dtype.itemsize != 2:
        raise TypeError(f"{name}: w must be BF16 (2-byte elements), got {w.dtype}")
    n, k = (int(v) for v in w.shape)
    if k % 8:
        raise ValueError(f"{name}: k = {k} must be a multiple of 8")
    k_blocks = -(-k // _K_BLOCK)
    padded = xp.zeros((-(-n // rows_multiple) * rows_multiple, k_blocks * _K_BLOCK), w.dtype)
    padded[:n, :k] = w
    return padded, n, k, k_blocks


def pack_weight(w: Any, tiles: bool = False) -> PackedWeight:
    """The packed layout of a [n, k] BF16 weight (a CuPy or NumPy array; the result lives where w
    does). k must be a multiple of 8, like every weight of gemm_rows_bf16. ``tiles``: also the tile
    layout of the bulk-copy sweep (:func:`tile_layout`)."""
    xp = array_module(w)
    padded, n, k, k_blocks = _padded(w, "pack_weight", _N_TILE)
    # [tile, g, kb, t, e] -> [tile, kb, g, t, e]: lane 4 g + t holds row g, k 8 t .. 8 t + 7.
    n_tiles = padded.shape[0] // _N_TILE
    data = padded.reshape(n_tiles, _N_TILE, k_blocks, 4, 8).transpose(0, 2, 1, 3, 4)
    return PackedWeight(xp.ascontiguousarray(data).reshape(n_tiles, k_blocks, _N_TILE * _K_BLOCK), n, k,
                        tile_layout(w, "pack_weight") if tiles else None)


def tile_layout(a: Any, name: str) -> Any:
    """The tile layout (kernels_src/projection/tile_layout.cuh) of a [m, k] BF16 matrix, shape
    [ceil(m / 64), ceil(k / 32), 2048]: for the group of rows 64 G .. 64 G + 63 and block kb of 32 k,
    ``tile[G, kb, 1024 s + 512 h + 8 c + 2 t + e] = a[64 G + c, 32 kb + 8 t + 4 s + 2 h + e]`` (t < 4,
    e < 2; zeros past m and k): the shared-memory image of the k16 steps s = 0, 1 of the block."""
    xp = array_module(a)
    padded, _, _, k_blocks = _padded(a, name, 64)
    groups = padded.shape[0] // 64
    # k = 32 kb + 8 t + 4 s + 2 h + e, row = 64 G + c -> [G, kb, s, h, c, t, e].
    data = padded.reshape(groups, 64, k_blocks, 4, 2, 2, 2).transpose(0, 2, 4, 5, 1, 3, 6)
    return xp.ascontiguousarray(data).reshape(groups, k_blocks, 64 * _K_BLOCK)


@dataclass(frozen=True)
class LaunchPlan:
    """Entry point, grid, block and dynamic shared memory of one call (tail_blocks: the tail-staged
    entry's tail, its ninth argument)."""

    kernel: str
    grid: tuple[int, int]
    block: tuple[int]
    m_tiles: int
    tiles_per_warp: int
    shared_mem: int = 0
    tail_blocks: int = 0


def _k_split(k: int) -> int:
    """Warps that split k (``k_split_for`` in the kernel): a function of k alone, as it fixes the summation order."""
    k_blocks = -(-k // _K_BLOCK)
    split = _WARPS_PER_BLOCK
    while split > 1 and k_blocks < 4 * split:
        split //= 2
    return split


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """The SMs of CUDA device `device_id`."""
    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id))


@functools.lru_cache(maxsize=None)
def shared_memory(device_id: int) -> tuple[int, int]:
    """(bytes of shared memory an SM holds, bytes a block may opt in to) on a device."""
    runtime = cupy.cuda.runtime
    return (int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id)),
            int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)))


def launch_plan(n: int, k: int, rows: int, tiles_per_warp: int | None = None, sm_count: int = _DEFAULT_SM_COUNT,
                blocks: int | None = None, reserved_slots: int = 0) -> LaunchPlan:
    """The split-k launch of one call of `rows` rows of a [n, k] weight (docs/design.md, "The row projection
    kernel", launch plan). ``tiles_per_warp`` (1, 2, 4) and ``blocks`` (grid.x) None: the widest tiles that give
    every SM a block, and up to 16 rows the blocks resident at once less ``reserved_slots``. Changes no bit.
    """
    if tiles_per_warp is not None and tiles_per_warp not in _TILES_PER_WARP:
        raise ValueError(f"tiles_per_warp must be one of {_TILES_PER_WARP}, got {tiles_per_warp}")
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if reserved_slots < 0:
        raise ValueError(f"reserved_slots must be >= 0, got {reserved_slots}")
    group_rows = min(rows, _ROWS_PER_SWEEP)
    m_tiles = 1 if group_rows <= M_TILE else 2 if group_rows <= 2 * M_TILE else 4
    warps_n = _WARPS_PER_BLOCK // _k_split(k)
    n_tiles = -(-n // _N_TILE)
    widest = 2 if m_tiles == 4 else 4

    def column_groups(tiles: int) -> int:
        return -(-n_tiles // (warps_n * tiles))

    if tiles_per_warp is None:
        tiles_per_warp = next((tiles for tiles in (4, 2) if tiles <= widest and column_groups(tiles) >= sm_count), 1)
    tiles_per_warp = min(tiles_per_warp, widest)
    groups = column_groups(tiles_per_warp)
    if blocks is None:
        blocks = max(1, sm_count * GEMM_ROWS_BLOCKS_PER_SM - reserved_slots) if m_tiles == 1 else groups
    return LaunchPlan(kernel=f"kda_gemm_rows_bf16_m{m_tiles}_n{tiles_per_warp}",
                      grid=(min(blocks, groups), -(-rows // _ROWS_PER_SWEEP)), block=(_WARPS_PER_BLOCK * 32,),
                      m_tiles=m_tiles, tiles_per_warp=tiles_per_warp)


def _x_region_bytes(rows: int, k: int, tiles: int) -> int:
    """Shared memory beside a staged block's stage: x's rows (and a zero chunk) or the partial sums, the more."""
    partial_bytes = _WARPS_PER_BLOCK * tiles * 4 * 32 * 4
    return max(16 + rows * -(-k // _K_BLOCK) * _K_BLOCK * 2, partial_bytes)


def _group_a_block_plan(kernel: str, n_tiles: int, group_tiles: int, tiles: int, shared_mem: int,
                        tail_blocks: int = 0) -> LaunchPlan:
    """The plan of a staged entry: one column group of `group_tiles` tiles a block."""
    return LaunchPlan(kernel=kernel, grid=(-(-n_tiles // group_tiles), 1), block=(_WARPS_PER_BLOCK * 32,), m_tiles=1,
                      tiles_per_warp=tiles, shared_mem=shared_mem, tail_blocks=tail_blocks)


def _staged_plan(n: int, k: int, rows: int) -> LaunchPlan | None:
    """The whole-group staged launch for up to 16 rows of a packed [n, k] weight, or None where no group fits."""
    if rows > M_TILE:
        return None
    warps_n = _WARPS_PER_BLOCK // _k_split(k)
    tile_bytes = -(-k // _K_BLOCK) * _K_BLOCK * _N_TILE * 2
    n_tiles = -(-n // _N_TILE)
    for tiles in sorted(_STAGED_TILES_PER_WARP, reverse=True):
        group_tiles = warps_n * tiles
        if group_tiles * tile_bytes > _STAGED_MAX_BYTES:
            continue
        shared_mem = min(group_tiles, n_tiles) * tile_bytes + _x_region_bytes(rows, k, tiles)
        if _STAGED_BLOCKS_PER_SM * (shared_mem + (1 << 10)) > _SHARED_PER_SM:
            return None
        return _group_a_block_plan(f"kda_gemm_rows_staged_awaiting_bf16_m1_n{tiles}", n_tiles, group_tiles, tiles,
                                   shared_mem)
    return None


def _tail_staged_plan(n: int, k: int, rows: int, sm_count: int = _DEFAULT_SM_COUNT, tail_blocks: int | None = None,
                      tiles_per_warp: int | None = None, shared_per_sm: int = _SHARED_PER_SM,
                      shared_per_block: int = _SHARED_PER_BLOCK) -> LaunchPlan | None:
    """The tail-staged launch for up to 16 rows of a packed [n, k] weight (as many k blocks of each warp's
    range as the shared memory allows, at most ``tail_blocks``), or None where no tail fits."""
    if tail_blocks is not None and tail_blocks < 1:
        raise ValueError(f"tail_staged_plan: tail_blocks must be >= 1, got {tail_blocks}")
    if rows > M_TILE:
        return None
    tiles = launch_plan(n, k, rows, tiles_per_warp, sm_count=sm_count).tiles_per_warp
    split = _k_split(k)
    k_blocks = -(-k // _K_BLOCK)
    group_tiles = _WARPS_PER_BLOCK // split * tiles
    x_bytes = _x_region_bytes(rows, k, tiles)
    block_bytes = _WARPS_PER_BLOCK * tiles * _K_BLOCK * _N_TILE * 2  # one k block of every warp's tiles
    room = min(shared_per_sm // _TAIL_BLOCKS_PER_SM - (1 << 10), shared_per_block) - x_bytes
    tail = min(room // block_bytes, -(-k_blocks // split), tail_blocks or k_blocks)
    if tail < 1:
        return None
    return _group_a_block_plan(f"kda_gemm_rows_tail_staged_awaiting_bf16_m1_n{tiles}", -(-n // _N_TILE), group_tiles,
                               tiles, tail * block_bytes + x_bytes, tail)


def staged_applies(w: Any, rows: int) -> bool:
    """Whether gemm_rows_bf16(staged=True, ready=...) takes a staged entry for this weight and row count
    on the current device (see _staged_plan_here)."""
    return _staged_plan_here(w, rows) is not None


def _staged_plan_here(w: Any, rows: int) -> LaunchPlan | None:
    """The staged plan on the current device (sm_90 features on), whole groups or else a tail, or None."""
    if (not isinstance(w, PackedWeight) or rows > M_TILE or not build.hopper_enabled()
            or int(cupy.cuda.Device().compute_capability) < 90):
        return None
    n, k = w.shape
    plan = _staged_plan(n, k, rows) if 2 * n * k <= _STAGED_MAX_WEIGHT_BYTES else None
    if plan is None and rows <= _TAIL_STAGED_MAX_ROWS:
        device_id = cupy.cuda.Device().id
        per_sm, per_block = shared_memory(device_id)
        plan = _tail_staged_plan(n, k, rows, sm_count(device_id), shared_per_sm=per_sm, shared_per_block=per_block)
    return plan


def _prefetch_k_blocks(n: int, k: int, programmatic: bool) -> int:
    """Blocks of 32 k per weight row a programmatic launch asks L2 for before its wait."""
    return _PREFETCH_K_BLOCKS if programmatic and 2 * n * k <= _PREFETCH_MAX_WEIGHT_BYTES else 0


def gemm_rows_bf16(x, w, out, rows: int | None = None, *, tiles_per_warp: int | None = None,
                   blocks: int | None = None, programmatic: bool = False, reserved_slots: int = 0,
                   staged: bool = False, bulk: bool | None = None, x_tiles: Any = None, partial: Any = None,
                   x_tiled: bool = False, ready: Any = None, ready_target: int = 0, sums: Any = None) -> int:
    """out[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..256), FP32 accumulation on tensor cores.

    Shapes:
        x    [>= rows, k] BF16, row stride a multiple of 8, 16-byte aligned (a row slice
             or a column slice of a wider buffer is fine; columns contiguous)
        w    [n, k] BF16, torch Linear layout, C-contiguous, 16-byte aligned; k % 8 == 0;
             or a :class:`PackedWeight` of it (the same bits, the weight read in contiguous runs)
        out  [>= rows, n] BF16, columns contiguous; may be a column slice of a wider
             buffer: only columns < n of rows < rows are written

    Bit contract: out[r] depends only on x[r] and w: for every rows in 1..256 it is, bit for bit,
    what a one-row call on x[r] alone writes (docs/design.md, "The row projection kernel"). None of
    these changes a bit:
        tiles_per_warp, blocks, reserved_slots  the split-k launch (:func:`launch_plan`)
        staged     with ``ready`` where :func:`staged_applies`: weights staged in shared memory before the wait
        bulk       more than 16 rows of a PackedWeight holding the tile layout where :func:`bulk_available`:
                   the bulk-copy sweep, True always, None where :func:`bulk_applies`, False never. Its
                   scratch: ``x_tiles`` (contiguous BF16, at least :func:`x_tiles_size` elements; None: a
                   new one), ``partial`` (contiguous float32, at least :func:`bulk_partial_size`; None: no
                   k split); ``x_tiled``: x_tiles already holds x's rows (the fused decode step wrote them).

    ``programmatic``: a programmatic dependent of the previous kernel in the stream, the one that writes x
    (sm_90 and later): the blocks start while it drains and wait for it before they read x or write out.

    ``ready`` (with ``programmatic``, <= 16 rows of a PackedWeight): a contiguous int32 array of at least 2
    elements in which the previous kernel counts its blocks' outputs (the fused step's ``outputs_ready``):
    the blocks read x once ready[0] reaches ``ready_target`` and the last sets both words back to zero.
    Every block of that kernel must be resident when this one launches.

    ``sums`` (None: none): FP32 [>= rows, n], contiguous columns, receiving each output's FP32 sum (``out``
    holds it rounded to BF16, nearest even): a tensor-parallel rank's partial output. Not with bulk=True.

    Returns the blocks launched (0 for the bulk-copy sweep).
    """
    rows, n, k, ldx, ldy = projection_args("gemm_rows_bf16", x, w, out, rows, GEMM_ROWS_MAX_ROWS)
    packed = isinstance(w, PackedWeight)
    sums_args: tuple = ()
    if sums is not None:
        if bulk:
            raise ValueError("gemm_rows_bf16: sums takes the split-k sweep or its awaiting forms, not bulk=True")
        stride = _row_stride("sums", sums, "f32", rows, n)
        _require_int32("sums row stride", stride)
        sums_args, bulk = (sums, _i32(stride)), False
    if ready is not None:
        check_scratch(ready, cupy.int32, "int32", 2, "ready", "gemm_rows_bf16")
        if not (packed and rows <= M_TILE and programmatic and not bulk):
            raise ValueError("gemm_rows_bf16: ready needs a programmatic launch of <= 16 rows of a PackedWeight, not "
                             f"bulk (packed: {packed}, rows: {rows}, programmatic: {programmatic}, bulk: {bulk})")
        if ready_target < 1:
            raise ValueError(f"gemm_rows_bf16: ready_target must be >= 1 (the blocks counted), got {ready_target}")
    if bulk_applies(w, rows, bulk):
        _gemm_rows_bulk(x, w, out, rows, x_tiles=x_tiles, partial=partial, programmatic=programmatic,
                        x_tiled=x_tiled)
        return 0
    words = (ready, _i32(ready_target)) if ready is not None else ()
    plan = _staged_plan_here(w, rows) if staged and ready is not None else None
    if plan is not None:
        # (The staged entries take no L2 request; the tail entry its tail's k blocks in that place.)
        kernel, last, weight, carveout = plan.kernel, plan.tail_blocks, w.data, 100
    else:
        plan = launch_plan(n, k, rows, tiles_per_warp, sm_count(cupy.cuda.Device().id), blocks, reserved_slots)
        kernel, weight, carveout = plan.kernel, w.data if packed else w, -1
        last = _prefetch_k_blocks(n, k, programmatic)
        if packed:
            kernel = kernel.replace("gemm_rows_", "gemm_rows_packed_awaiting_" if words else "gemm_rows_packed_")
    if sums_args:
        kernel = kernel.replace("bf16_m", "sums_bf16_m")
    build.launch(kernel, plan.grid, plan.block,
                 (x, _i32(ldx), weight, out, _i32(ldy), _i32(rows), _i32(n), _i32(k), _i32(last), *words, *sums_args),
                 plan.shared_mem, programmatic=programmatic, carveout=carveout)
    return plan.grid[0] * plan.grid[1]


def gemm_rows_pair_bf16(x, w, out, x2, w2, out2, rows: int | None = None, *, programmatic: bool = False,
                        reserved_slots: int = 0) -> None:
    """out[r] = bf16(x[r] @ w.T) and out2[r] = bf16(x2[r] @ w2.T) for r < rows (1..16) in one launch,
    each the bits of :func:`gemm_rows_bf16` alone (docs/design.md, "Decode front end").

    Shapes: w and w2 PackedWeights of one shape [n, k]; x, x2 [>= rows, k] and out, out2 [>= rows, n]
    BF16 with equal row strides (column slices of wider buffers are fine), as gemm_rows_bf16 takes
    them. ``programmatic`` and ``reserved_slots`` as there (the plan is that of one [2n, k] weight).
    """
    rows, n, k, ldx, ldy = projection_args("gemm_rows_pair_bf16", x, w, out, rows, M_TILE)
    _, n2, k2, ldx2, ldy2 = projection_args("gemm_rows_pair_bf16", x2, w2, out2, rows, M_TILE)
    for name, weight in (("w", w), ("w2", w2)):
        if not isinstance(weight, PackedWeight):
            raise ValueError(f"gemm_rows_pair_bf16: {name} must be a PackedWeight (pack_weight), got "
                             f"{type(weight).__name__}")
    if (n2, k2, ldx2, ldy2) != (n, k, ldx, ldy):
        raise ValueError("gemm_rows_pair_bf16: the second projection must have the first's shapes and strides: "
                         f"(n, k, x stride, out stride) {(n2, k2, ldx2, ldy2)} against {(n, k, ldx, ldy)}")
    plan = launch_plan(2 * n, k, rows, None, sm_count(cupy.cuda.Device().id), reserved_slots=reserved_slots)
    build.launch(plan.kernel.replace("gemm_rows_", "gemm_rows_packed_pair_"), plan.grid, plan.block,
                 (x, _i32(ldx), w.data, out, _i32(ldy), _i32(rows), _i32(n), _i32(k),
                  _i32(_prefetch_k_blocks(n, k, programmatic)), x2, w2.data, out2), programmatic=programmatic)


def bulk_available() -> bool:
    """Whether the launches being made run the bulk-copy sweep: they may use sm_90 features
    (build.hopper_enabled) and the kernel set in use has the sweep (an sm_90 device)."""
    return build.hopper_enabled() and build.KernelSet.get().has("kda_gemm_rows_bulk_g1")


def _bulk_wide_enough(n: int) -> bool:
    """Whether more than 16 rows of an n-column weight are worth the bulk-copy sweep on the current device."""
    return -(-n // 64) >= _BULK_MIN_GROUPS_PER_SM * sm_count(cupy.cuda.Device().id)


def bulk_takes(n: int) -> bool:
    """Whether more than 16 rows of an n-column packed weight with the tile layout take the bulk-copy
    sweep on the current device: the copies worth making (pack_weight(w, tiles=True))."""
    return bulk_available() and _bulk_wide_enough(n)


def bulk_applies(w: Any, rows: int, bulk: bool | None = None) -> bool:
    """Whether gemm_rows_bf16(x, w, out, rows, bulk=bulk) runs the bulk-copy sweep: more than 16 rows
    of a PackedWeight holding the tile layout where bulk_available, and bulk True, or None with the
    weight wide enough. bulk=True where the sweep cannot run is an error."""
    if rows <= M_TILE or bulk is False:
        return False
    packed = isinstance(w, PackedWeight)
    takes = packed and w.tiles is not None and bulk_available()
    if bulk and not takes:
        raise ValueError("gemm_rows_bf16: bulk=True needs a PackedWeight made with pack_weight(w, tiles=True) on an"
                         f" sm_90 device (packed: {packed}, tile layout: {packed and w.tiles is not None},"
                         f" bulk-copy kernels in use: {bulk_available()})")
    return takes and (bool(bulk) or _bulk_wide_enough(w.shape[0]))


def _k_ranges(k: int) -> int:
    """The k ranges of the summation order that hold blocks of 32 k (_k_split's, less any past k)."""
    k_blocks = -(-k // _K_BLOCK)
    k_range = -(-k_blocks // _k_split(k))
    return -(-k_blocks // k_range)


def _bulk_fill_tiles(groups: int, k: int, rows: int, warpgroups: int, split: bool, sm_count: int) -> int:
    """The 4 KB tiles the busiest SM copies in a bulk sweep of `rows` rows of `groups` groups of 64 columns."""
    k_blocks = -(-k // _K_BLOCK)
    task_blocks = -(-k_blocks // _k_split(k)) if split else k_blocks
    tasks = -(-groups // warpgroups) * (_k_ranges(k) if split else 1) * -(-rows // _ROWS_PER_SWEEP)
    return -(-tasks // sm_count) * (1 + warpgroups) * task_blocks


def _bulk_warpgroups(groups: int, k: int, rows: int, split: bool, sm_count: int) -> int:
    """Warpgroups of a bulk block: the most among those whose busiest SM copies the fewest tiles."""
    return min((3, 2, 1), key=lambda wg: (_bulk_fill_tiles(groups, k, rows, wg, split, sm_count), -wg))


def _bulk_block_chunks(k: int, tasks: int, grid_x: int, split: bool) -> int:
    """Ring chunks the busiest block of a bulk sweep walks: its tasks times a task's chunks."""
    k_blocks = -(-k // _K_BLOCK)
    k_range = -(-k_blocks // _k_split(k))
    chunks = [-(-min(k_range, k_blocks - start) // _BULK_CHUNK) for start in range(0, k_blocks, k_range)]
    return -(-tasks // grid_x) * (max(chunks) if split else sum(chunks))


@dataclass(frozen=True)
class BulkPlan:
    """Entry point, grid, block, ring slots and shared memory of one bulk-copy sweep; `split`: each
    task one k range of a super-group, its FP32 partial sums folded by kda_gemm_rows_bulk_fold_bf16."""

    kernel: str
    grid: tuple[int, int]
    block: tuple[int]
    warpgroups: int
    stages: int
    shared_mem: int
    split: bool = False


def _bulk_plan(n: int, k: int, rows: int, sm_count: int = _DEFAULT_SM_COUNT, warpgroups: int | None = None,
               blocks: int | None = None, stages: int | None = None, split: bool | None = False) -> BulkPlan:
    """The bulk-copy launch for `rows` rows of a [n, k] weight (docs/design.md, "The row projection kernel", bulk
    sweep); None arguments are chosen, split where unsplit tasks keep fewer than half the SMs busy. Changes no bit."""
    groups = -(-n // 64)
    row_groups = -(-rows // _ROWS_PER_SWEEP)
    if split is None:
        whole = warpgroups or _bulk_warpgroups(groups, k, rows, False, sm_count)
        split = -(-groups // whole) * row_groups < sm_count / 2 and _k_ranges(k) > 1
    warpgroups = warpgroups or _bulk_warpgroups(groups, k, rows, bool(split), sm_count)
    if warpgroups not in (1, 2, 3):
        raise ValueError(f"warpgroups must be 1, 2 or 3, got {warpgroups}")
    per_sm = 2 if warpgroups == 1 else 1
    slot = (1 + warpgroups) * _BULK_CHUNK * _BULK_TILE_BYTES
    budget = min(_SHARED_PER_BLOCK, _SHARED_PER_SM // per_sm - 1024)
    tasks = -(-groups // warpgroups) * (_k_ranges(k) if split else 1)
    grid_x = min(blocks or max(1, sm_count * per_sm // row_groups), tasks)
    if stages is None:
        walked = _bulk_block_chunks(k, tasks, grid_x, bool(split))
        stages = max(1, min(_BULK_MAX_STAGES, budget // (slot + 16), walked))
    if not 1 <= stages or stages * (slot + 16) > _SHARED_PER_BLOCK:
        raise ValueError(f"stages must be 1..{_SHARED_PER_BLOCK // (slot + 16)} at {warpgroups} warpgroups, got {stages}")
    return BulkPlan(kernel=f"kda_gemm_rows_bulk_g{warpgroups}", grid=(grid_x, row_groups),
                    block=(warpgroups * 128 + 32,), warpgroups=warpgroups, stages=stages,
                    shared_mem=stages * (slot + 16), split=bool(split))


def bulk_partial_size(n: int, k: int, rows: int) -> int:
    """FP32 elements of a split bulk-copy sweep's partial sums: every k range of rows x n."""
    return _k_ranges(k) * rows * n


def x_tiles_size(rows: int, k: int) -> int:
    """Elements of the tile layout of `rows` rows of x (the bulk-copy sweep's scratch)."""
    return -(-rows // _ROWS_PER_SWEEP) * -(-k // _K_BLOCK) * 64 * _K_BLOCK


def check_x_tiles(x_tiles: Any, dtype: Any, rows: int, k: int, what: str) -> None:
    """Raises ValueError, naming `what`, unless x_tiles is a contiguous array of `dtype` (BF16) with at
    least x_tiles_size(rows, k) elements: room for `rows` rows of a k-wide x in the tile layout."""
    check_scratch(x_tiles, dtype, "BF16", x_tiles_size(rows, k), "x_tiles", what)


def _gemm_rows_bulk(x, w: PackedWeight, out, rows: int | None = None, *, x_tiles: Any = None,
                    warpgroups: int | None = None, blocks: int | None = None, stages: int | None = None,
                    split: bool | None = None, partial: Any = None, programmatic: bool = False,
                    x_tiled: bool = False) -> None:
    """gemm_rows_bf16's bulk-copy sweep (same bits): x laid out in tiles (unless ``x_tiled``), the sweep, and
    for a split sweep the fold of ``partial``'s k-range sums; split None splits only into a large enough partial."""
    rows, n, k, ldx, ldy = projection_args("gemm_rows_bulk", x, w, out, rows, GEMM_ROWS_MAX_ROWS)
    if not isinstance(w, PackedWeight) or w.tiles is None:
        raise ValueError("gemm_rows_bulk: w must be a PackedWeight made with pack_weight(w, tiles=True)")
    if not bulk_available():
        raise RuntimeError(f"gemm_rows_bulk: the bulk-copy kernels run on sm_90 only; device "
                           f"{cupy.cuda.Device().id} is sm_{cupy.cuda.Device().compute_capability}")
    size = x_tiles_size(rows, k)
    if x_tiles is None:
        if x_tiled:
            raise ValueError("gemm_rows_bulk: x_tiled=True needs the x_tiles that hold x")
        x_tiles = cupy.empty((size,), x.dtype)
    else:
        check_x_tiles(x_tiles, x.dtype, rows, k, "gemm_rows_bulk")
    partial_size = bulk_partial_size(n, k, rows)
    if split is None and (partial is None or partial.size < partial_size):
        split = False
    plan = _bulk_plan(n, k, rows, sm_count(cupy.cuda.Device().id), warpgroups, blocks, stages, split)
    if plan.split:
        if partial is None:
            partial = cupy.empty((partial_size,), cupy.float32)
        else:
            check_scratch(partial, cupy.float32, "float32", partial_size, "partial", "gemm_rows_bulk")
    if not x_tiled:
        threads = size // _K_BLOCK  # one per (row group, k block, row of 64): 32 elements each
        build.launch("kda_gemm_rows_tile_x_bf16", (-(-threads // 256),), (256,),
                     (x, _i32(ldx), _i32(rows), _i32(k), x_tiles), programmatic=programmatic)
    build.launch(plan.kernel, plan.grid, plan.block,
                 (x_tiles, w.tiles, out, _i32(ldy), _i32(rows), _i32(n), _i32(k), _i32(plan.stages),
                  partial if plan.split else None),
                 plan.shared_mem, programmatic=programmatic or not x_tiled, carveout=100)
    if plan.split:
        build.launch("kda_gemm_rows_bulk_fold_bf16", (-(-(rows * n) // 256),), (256,),
                     (partial, out, _i32(ldy), _i32(rows), _i32(n), _i32(k)), programmatic=True)
