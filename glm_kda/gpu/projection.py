"""Launch wrapper of ``kernels_src/gemm_rows.cu``: the tensor-core projection of 1..256 rows.

The decode, speculative-verify and batched-decode projections of the block
(``qkv_proj``, ``down_proj``, the gate up-projections, ``o_proj``) multiply a few
token rows by a BF16 weight in torch Linear layout. Up to 64 rows that is bound by
reading the weight once, and the kernel is laid out for that stream; see the
comment at the top of the ``.cu`` file for the geometry.

The oracle of this stage is :func:`glm_kda.reference.linear` rounded to BF16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import cupy

from glm_kda import kernels
from glm_kda.ops import _i32, _require_int32, _row_stride, projection_args

GEMM_ROWS_MAX_ROWS = 256
# Rows swept together over one read of the weight (blockIdx.y picks the group).
ROWS_PER_SWEEP = 64
M_TILE = 16
N_TILE = 8
K_BLOCK = 32
WARPS_PER_BLOCK = 8
TILES_PER_WARP = (1, 2, 4)
# Blocks per SM every entry point is compiled for (GEMM_ROWS_MIN_BLOCKS in its
# __launch_bounds__, kernels_src/gemm_rows.cu).
GEMM_ROWS_BLOCKS_PER_SM = 2
# H200; the wrapper passes the current device's count.
DEFAULT_SM_COUNT = 132
# Warps of a block of the serial sweep (GEMM_ROWS_SERIAL_WARPS, kernels_src/gemm_rows.cuh): 33..64
# rows of a weight wide enough that its blocks of SERIAL_WARPS * tiles_per_warp tiles number at
# least SERIAL_MIN_GROUPS_PER_SM per SM (None: never) run as the serial sweep, whose warps walk
# every k range themselves and share x through L1. The same bits either way. Off by default: on an
# H200 it ran GLM's q|k|v at 64 rows alone in 89.8 us against 97.5 for the split-k sweep
# (benchmarks/gemm_rows.py), but the 64-sequence decode graph, where that projection runs beside
# the low-rank chain, took 325.5 us with it (2.0) and 311.7 without (B=256: 1196 against 1222;
# benchmarks/decode_breakdown.py, one process).
SERIAL_WARPS = 4
SERIAL_MIN_GROUPS_PER_SM: float | None = None
# Tiles per warp of the one serial entry (4 m-tiles, gemm_rows_serial_bf16_m4_n2). At 17..32 rows
# the serial sweep ran slower than the split-k one on an H200 (GLM q|k|v 63.6 against 60.6 us), so
# it has no entry there.
SERIAL_TILES_PER_WARP = 2
# 17..64 rows a group of a packed weight on an sm_90 device run on Hopper's warpgroup MMA
# (kernels_src/gemm_rows_wgmma.cu: w as the A operand from registers, x from shared memory, the
# same bits as the mma.sync sweeps) where the weight has at least WGMMA_MIN_GROUPS_PER_SM groups of
# 64 columns per SM (None: never). WGMMA_WARPGROUPS warpgroups of a block share x's stages. Off: on
# an H200 GLM's q|k|v at 64 rows runs 90.5 us against mma.sync's 95.6, but in the 64-sequence decode
# graph the rule on was slower (343 - 359 us against 312; benchmarks/NOTES.md), so it is opt-in.
WGMMA_MIN_GROUPS_PER_SM: float | None = None
WGMMA_WARPGROUPS = 1
WGMMA_COLUMNS = 64
# Blocks of 32 k of x per stage and stages in a block's ring (GEMM_WGMMA_CHUNK, GEMM_WGMMA_STAGES).
WGMMA_CHUNK = 4
WGMMA_STAGES = 3
# Warpgroups per SM the entries are compiled for (__launch_bounds__(WG * 128, 3 / WG)).
WGMMA_WARPGROUPS_PER_SM = 3
# Blocks of 32 k a warp's step multiplies (GEMM_WGMMA_STEP), and the steps of weight each warp keeps
# in flight through a ring of shared memory filled by the bulk copy engine (the kernel's ring_depth;
# 0: the weight is loaded into registers one step ahead). Each slot holds WGMMA_STEP blocks of the
# warp's tile pair (1 KB each) and an 8-byte mbarrier.
WGMMA_STEP = 2
WGMMA_RING = 0
WGMMA_SLOT_BYTES = WGMMA_STEP * 2 * N_TILE * K_BLOCK * 2
# More than 16 rows a group of a packed weight that holds the tile layout (pack_weight(w, tiles=True))
# on an sm_90 device run on the bulk-copy warpgroup-MMA sweep (kernels_src/gemm_rows_bulk.cu: both
# operands copied into shared memory as 4 KB tiles, one copy of x for a block's 1 - 3 groups of 64
# columns; the same bits as the mma.sync sweeps) where the weight has at least BULK_MIN_GROUPS_PER_SM
# groups of 64 columns per SM (None: never). 0.25 takes q|k|v, o_proj and the gate up-projections of
# both geometries, not down_proj. On an H200 (benchmarks/decode_breakdown.py, one process, copy
# bandwidth 4157 GB/s) 64 sequences ran GLM 268.4 us against 315.2 without it (274.3 with 1.0: q|k|v
# alone), Kimi 136.8 against 156.7 (141.3); 256 sequences GLM 949 against 1231, Kimi 449 against 539.
BULK_MIN_GROUPS_PER_SM: float | None = 0.25
# Warpgroups of a bulk block (None: by the shape, see bulk_plan), blocks of 32 k a ring slot holds of
# each operand (GEMM_BULK_CHUNK), and the most slots a ring has.
BULK_WARPGROUPS: int | None = None
BULK_CHUNK = 4
BULK_MAX_STAGES = 8
BULK_TILE_BYTES = 64 * K_BLOCK * 2
# Warpgroups of a split sweep's block (None: as BULK_WARPGROUPS, else by bulk_warpgroups' rule). No
# bit depends on it. Kimi's o_proj at 64 rows with 2 (144 tasks on 132 blocks, each ring holding a
# whole task's x and weight, so a one-task block has all of its weight before the step ends): on an H200
# (benchmarks/decode_breakdown.py, one process, copy bandwidth 4083 GB/s) 64 sequences took 126.8 us
# against 125.2 with the rule's 3 (1: 127.7); the block timeline showed the 12 blocks of two tasks
# ending 4 us after the others.
BULK_SPLIT_WARPGROUPS: int | None = None
# A ring of no more slots than the chunks its block walks (bulk_block_chunks; False: as many as fit):
# a sweep of one chunk a block then leaves the shared memory it would not use to the kernels beside it
# (the gate up-projections at 64 rows: 32 KB, which fits beside q|k|v's 192 KB ring). No bit depends
# on it. On an H200 (benchmarks/decode_breakdown.py, one process, copy bandwidth 4181 GB/s) 64
# sequences took Kimi 124.1 us against 125.4 without it (126.5 against 127.6 in another process), GLM
# 253.6 against 252.0.
BULK_STAGES_BY_CHUNKS = True
# Blocks of all row groups of a bulk sweep (grid.x times the row groups) in at most this many waves
# of resident blocks: the row groups that run at once walk the same columns in step, so a weight comes
# from memory (or L2) once per wave, and in one wave no block waits for a slot. None of it changes a
# bit. On an H200 (every choice timed in one process) GLM's q|k|v (201 MB) at 256 rows took 122.6 us
# on 33 blocks a row group (one wave), 156.9 on 66 (two), 202.0 on 128 (the resident blocks a row
# group: four); at 192 rows 96.1 on 44 against 152.3 on 128; Kimi's q|k|v at 256 rows 45.2 on 33
# against 52.8 on 64. In the decode graph (benchmarks/decode_breakdown.py, copy bandwidth 4177 GB/s)
# 256 sequences took GLM 888.4 us against 924.2 (two waves) and 950.4 (four), Kimi 431.0 against
# 440.4 and 439.4.
BULK_ROW_GROUP_WAVES = 1
# Shared memory an sm_90 block may ask for, and an SM holds (bytes; the driver keeps 1 KB a block).
BULK_SHARED_PER_BLOCK = 227 << 10
BULK_SHARED_PER_SM = 228 << 10

# Blocks of 32 k of each weight row that a programmatic launch asks L2 for before it waits
# (see the kernel; 0: none). benchmarks/decode_breakdown.py compares the choices: on an H200,
# graph replays interleaved in one process, 16 ran GLM 87.7 / Kimi 37.6 us, 4 89.8 / 37.5,
# 0 87.2 / 38.5.
PREFETCH_K_BLOCKS = 16
# ... but only for weights of at most this many bytes (None: any). A large weight's request (GLM's
# o_proj asks for 32 MB at once, beside the step's state) cost GLM 0.5-1.8 us in every run, while
# Kimi's (its o_proj asks for its whole 19 MB) saved it 0.9-1.5 us.
PREFETCH_MAX_WEIGHT_BYTES: int | None = 32 << 20
# gemm_rows_bf16(staged=True): a launch of <= 16 rows of a packed weight of at most
# STAGED_MAX_WEIGHT_BYTES copies each block's weights (at most STAGED_MAX_BYTES) into shared memory
# before its wait (staged_plan). The staged entries are compiled for 3 blocks per SM, so an H200
# holds 3 x 64 KB x 132 SMs (24.75 MB) of stages at once: a larger weight's last blocks would start
# only as others leave.
STAGED_MAX_BYTES = 64 << 10
STAGED_MAX_WEIGHT_BYTES: int | None = 24 << 20
# The staged entries' blocks per SM (GEMM_ROWS_STAGED_MIN_BLOCKS of gemm_rows.cu). An awaiting staged
# launch (ready=) also holds x's rows in shared memory: staged_plan takes it only where that many
# blocks still fit an SM (BULK_SHARED_PER_SM, a KB of it the driver's for each block).
STAGED_BLOCKS_PER_SM = 3
# Where an awaiting staged launch (gemm_rows_bf16(staged=True, ready=...)) of at most
# TAIL_STAGED_MAX_ROWS rows finds a column group too wide for a stage (GLM-5.3-Flash's o_proj: a tile
# of 8 columns is 128 KB), it stages the tail of each warp's k range instead (tail_staged_plan;
# gemm_rows_tail_staged_awaiting_bf16_m1_n<N>): the last k blocks that TAIL_BLOCKS_PER_SM such blocks'
# shared memory holds (at most TAIL_BLOCKS; None: all that fit), copied while the kernel it awaits
# runs; past the wait each warp sweeps the rest of its range from memory at once and its tail from
# shared memory last. No bit depends on it. On an H200 (benchmarks/decode_breakdown.py, copy
# bandwidth 4161 and 4172 GB/s) GLM B=1 78.37 and 78.72 us against 79.27 and 79.10 / 80.43 without;
# the block timeline's step 75.42 / 75.63 against 76.30 / 76.43. Staging the first k blocks instead
# (every warp waiting for its copies before it read anything from memory) gained nothing, and 4 or 16
# rows of a verify took 3 us longer with the tail, hence one row.
TAIL_STAGED_AWAITING = True
TAIL_STAGED_MAX_ROWS = 1
TAIL_BLOCKS_PER_SM = 2
TAIL_BLOCKS: int | None = None
# The counting launch (gemm_rows_bf16(counted=...): one sequence's q|k|v, counted out for the fused
# step) in its ahead form, gemm_rows_packed_counting_ahead_bf16_m1_n<N>: each warp loads the first step
# of its block's next column group before the present group's partial sums and barriers, so that a
# block's loads do not stop between groups (its first group's, before the wait). The same chains and
# sums, so the same bits. Off until measured on a GPU (ptxas sm_90a: 126 - 128 registers, no spill;
# before sm_90, where it would spill, the entry is the counting entry's code).
COUNTING_AHEAD = False


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] BF16 weight in the packed layout of kernels_src/gemm_rows.cuh, made by
    :func:`pack_weight`: ``data[tile, kb, 8 * lane + e] = w[8 tile + lane // 4, 32 kb + 8 (lane % 4) + e]``
    (zeros past n and k), shape [ceil(n / 8), ceil(k / 32), 256]. A warp of the projection
    reads each tile's k range as one run of contiguous bytes; the values it loads, and so the
    bits of every output, are those of the row-major weight.

    ``pairs`` (None unless asked for): the same weight in the pair layout the warpgroup-MMA sweep
    reads (:func:`pack_pairs`), as many bytes again. ``tiles`` (likewise): the tile layout of the
    bulk-copy sweep (:func:`pack_tiles`)."""

    data: Any
    n: int
    k: int
    pairs: Any = None
    tiles: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k) of the weight it holds."""
        return (self.n, self.k)

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        return packed_shape(self.n, self.k)


def packed_shape(n: int, k: int) -> tuple[int, int, int]:
    """Shape of the packed layout of a [n, k] weight: [ceil(n / 8), ceil(k / 32), 256]."""
    return (-(-n // N_TILE), -(-k // K_BLOCK), N_TILE * K_BLOCK)


def _padded(w: Any, name: str, rows_multiple: int) -> tuple[Any, int, int, int]:
    """w checked ([n, k] BF16, k % 8 == 0) and padded by zeros to n a multiple of rows_multiple and
    k of K_BLOCK: (padded, n, k, k_blocks)."""
    xp = cupy.get_array_module(w)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"{name}: w must be [n, k] with n, k >= 1, got {list(w.shape)}")
    if w.dtype.itemsize != 2:
        raise TypeError(f"{name}: w must be BF16 (2-byte elements), got {w.dtype}")
    n, k = (int(v) for v in w.shape)
    if k % 8:
        raise ValueError(f"{name}: k = {k} must be a multiple of 8")
    k_blocks = -(-k // K_BLOCK)
    padded = xp.zeros((-(-n // rows_multiple) * rows_multiple, k_blocks * K_BLOCK), w.dtype)
    padded[:n, :k] = w
    return padded, n, k, k_blocks


def pack_weight(w: Any, pairs: bool = False, tiles: bool = False) -> PackedWeight:
    """The packed layout of a [n, k] BF16 weight (a CuPy or NumPy array; the result lives
    where w does). k must be a multiple of 8, like every weight of gemm_rows_bf16. ``pairs``:
    also the pair layout of the warpgroup-MMA sweep (:func:`pack_pairs`); ``tiles``: also the
    tile layout of the bulk-copy sweep (:func:`pack_tiles`)."""
    xp = cupy.get_array_module(w)
    padded, n, k, _ = _padded(w, "pack_weight", N_TILE)
    n_tiles, k_blocks, _ = packed_shape(n, k)
    # [tile, g, kb, t, e] -> [tile, kb, g, t, e]: lane 4 g + t holds row g, k 8 t .. 8 t + 7.
    data = padded.reshape(n_tiles, N_TILE, k_blocks, 4, 8).transpose(0, 2, 1, 3, 4)
    return PackedWeight(xp.ascontiguousarray(data).reshape(packed_shape(n, k)), n, k,
                        pack_pairs(w) if pairs else None, pack_tiles(w) if tiles else None)


def tile_layout(a: Any, name: str) -> Any:
    """The tile layout (kernels_src/gemm_rows_bulk.cu) of a [m, k] BF16 matrix, shape
    [ceil(m / 64), ceil(k / 32), 2048]: for the group of rows 64 G .. 64 G + 63 and block kb of 32 k,
    ``tile[G, kb, 1024 s + 512 h + 8 c + 2 t + e] = a[64 G + c, 32 kb + 8 t + 4 s + 2 h + e]`` (t < 4,
    e < 2; zeros past m and k): the shared-memory image of the k16 steps s = 0, 1 of the block."""
    xp = cupy.get_array_module(a)
    padded, _, _, k_blocks = _padded(a, name, 64)
    groups = padded.shape[0] // 64
    # k = 32 kb + 8 t + 4 s + 2 h + e, row = 64 G + c -> [G, kb, s, h, c, t, e].
    data = padded.reshape(groups, 64, k_blocks, 4, 2, 2, 2).transpose(0, 2, 4, 5, 1, 3, 6)
    return xp.ascontiguousarray(data).reshape(groups, k_blocks, 64 * K_BLOCK)


def pack_tiles(w: Any) -> Any:
    """The tile layout of a [n, k] BF16 weight for the bulk-copy sweep (:func:`tile_layout`)."""
    return tile_layout(w, "pack_tiles")


def pack_pairs(w: Any) -> Any:
    """The pair layout of a [n, k] BF16 weight (kernels_src/gemm_rows_wgmma.cu), shape
    [ceil(n / 16), ceil(k / 32), 512]: for the tiles 2 p and 2 p + 1 (rows 16 p + g and 16 p + 8 + g),
    block kb, k16 step s and lane 4 g + t, the 8 elements at [p, kb, 256 s + 8 lane] are
    ``w[16p+g, k0+4s : +2], w[16p+8+g, k0+4s : +2], w[16p+g, k0+4s+2 : +2], w[16p+8+g, k0+4s+2 : +2]``
    with k0 = 32 kb + 8 t (zeros past n and k): the A fragment of that step, in the words the
    mma.sync sweep's interleave_pair forms from two loads of :func:`pack_weight`'s layout."""
    xp = cupy.get_array_module(w)
    padded, _, _, k_blocks = _padded(w, "pack_pairs", 2 * N_TILE)
    pairs = padded.shape[0] // (2 * N_TILE)
    # k = 32 kb + 8 t + 4 s + 2 q + e, row = 16 p + 8 h + g -> [p, kb, s, g, t, q, h, e].
    data = padded.reshape(pairs, 2, N_TILE, k_blocks, 4, 2, 2, 2).transpose(0, 3, 5, 2, 4, 6, 1, 7)
    return xp.ascontiguousarray(data).reshape(pairs, k_blocks, 2 * N_TILE * K_BLOCK)


@dataclass(frozen=True)
class LaunchPlan:
    """Entry point, grid and block of one call."""

    kernel: str
    grid: tuple[int, int]
    block: tuple[int]
    m_tiles: int
    tiles_per_warp: int
    shared_mem: int = 0
    ring_depth: int = 0
    tail_blocks: int = 0


def k_split(k: int) -> int:
    """Warps that split the k axis of a block; mirrors ``k_split_for`` in the kernel.

    The most (up to 8) that leaves each warp at least 4 blocks of 32 k. It depends on
    k alone: it fixes the summation order of every output, so it must never depend on
    the row count.
    """
    k_blocks = -(-k // K_BLOCK)
    split = WARPS_PER_BLOCK
    while split > 1 and k_blocks < 4 * split:
        split //= 2
    return split


def m_tiles_for(rows: int) -> int:
    """m-tiles of 16 rows one block sweeps: 1 up to 16 rows, 2 up to 32, else 4 (a group
    of 64). A row group with fewer rows than that leaves the rest predicated off."""
    rows = min(rows, ROWS_PER_SWEEP)
    return 1 if rows <= M_TILE else 2 if rows <= 2 * M_TILE else 4


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id))


@functools.lru_cache(maxsize=None)
def _shared_memory(device_id: int) -> tuple[int, int]:
    """(bytes of shared memory an SM holds, bytes a block may opt in to) on a device."""
    runtime = cupy.cuda.runtime
    return (int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id)),
            int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)))


def launch_plan(
    n: int, k: int, rows: int, tiles_per_warp: int | None = None, sm_count: int = DEFAULT_SM_COUNT,
    blocks: int | None = None, serial: bool | None = None, wgmma: bool | None = False,
    reserved_slots: int = 0,
) -> LaunchPlan:
    """The launch of one call.

    grid.y = row groups of 64; grid.x = `blocks` column groups of (8 / k_split) warps
    times ``tiles_per_warp`` tiles of 8 columns at a time (a block loops over the groups
    blockIdx.x, blockIdx.x + grid.x, ...). Wider tiles reuse each x fragment more and cut
    the number of blocks. Left as None the tiles are the widest (4, 2, else 1; at most 2
    with 4 m-tiles, their register budget) that still give every SM a block, and grid.x
    is the number of groups, capped with one m-tile at the blocks resident at once
    (sm_count times the entry's blocks per SM). On an H200 (benchmarks/gemm_rows.py
    --sweep) the cap took the one-row q|k|v projection from 56.0 to 55.1 us (GLM) and from
    25.7 to 22.9 us (Kimi), and made the 64-row one 4 % slower, hence one m-tile only.
    ``reserved_slots``: of those resident slots, how many such a capped one-m-tile launch leaves
    to kernels that run beside it (at least one block remains; ignored where ``blocks`` is given
    or above 16 rows).
    Above 32 rows, ``serial`` (None: by SERIAL_MIN_GROUPS_PER_SM) picks the serial sweep: blocks of
    SERIAL_WARPS warps side by side along n, each warp walking every k range of its columns (where
    it has no entry for the tiles, True keeps the split-k sweep).
    Above 16 rows, ``wgmma`` picks the warpgroup-MMA sweep of a packed weight on sm_90 (True: always,
    None: where the weight has WGMMA_MIN_GROUPS_PER_SM groups of 64 columns per SM, False: never; the
    caller knows whether the weight is packed and the device has it, see :func:`gemm_rows_bf16`).
    Any choice gives the same bits: it moves work between blocks, never changes the k order.
    """
    m_tiles = m_tiles_for(rows)
    if m_tiles > 1 and wgmma is not False:
        groups = -(-n // (WGMMA_COLUMNS * WGMMA_WARPGROUPS))
        if wgmma or wgmma_wide_enough(n, sm_count):
            n_rows = 32 if m_tiles == 2 else 64
            resident = sm_count * (WGMMA_WARPGROUPS_PER_SM // WGMMA_WARPGROUPS)
            return LaunchPlan(
                kernel=f"gemm_rows_wgmma_n{n_rows}_g{WGMMA_WARPGROUPS}",
                grid=(min(blocks or resident, resident, groups), -(-rows // ROWS_PER_SWEEP)),
                block=(WGMMA_WARPGROUPS * 128,),
                m_tiles=m_tiles,
                tiles_per_warp=2,
                shared_mem=(WGMMA_STAGES * WGMMA_CHUNK * 64 * n_rows
                            + WGMMA_WARPGROUPS * 4 * WGMMA_RING * (WGMMA_SLOT_BYTES + 8)),
                ring_depth=WGMMA_RING,
            )
    if tiles_per_warp is not None and tiles_per_warp not in TILES_PER_WARP:
        raise ValueError(f"tiles_per_warp must be one of {TILES_PER_WARP}, got {tiles_per_warp}")
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if reserved_slots < 0:
        raise ValueError(f"reserved_slots must be >= 0, got {reserved_slots}")
    if serial and m_tiles < 4:
        raise ValueError(f"the serial sweep runs 33..64 rows per group, not {rows}")
    if m_tiles == 4 and serial is not False and tiles_per_warp in (None, SERIAL_TILES_PER_WARP):
        groups = -(-n // (SERIAL_WARPS * SERIAL_TILES_PER_WARP * N_TILE))
        wide_enough = SERIAL_MIN_GROUPS_PER_SM is not None and groups >= SERIAL_MIN_GROUPS_PER_SM * sm_count
        if serial or wide_enough:
            return LaunchPlan(
                kernel=f"gemm_rows_serial_bf16_m{m_tiles}_n{SERIAL_TILES_PER_WARP}",
                grid=(min(blocks or groups, groups), -(-rows // ROWS_PER_SWEEP)),
                block=(SERIAL_WARPS * 32,),
                m_tiles=m_tiles,
                tiles_per_warp=SERIAL_TILES_PER_WARP,
            )
    warps_n = WARPS_PER_BLOCK // k_split(k)
    n_tiles = -(-n // N_TILE)
    widest = 2 if m_tiles == 4 else 4

    def column_groups(tiles: int) -> int:
        return -(-n_tiles // (warps_n * tiles))

    if tiles_per_warp is None:
        tiles_per_warp = next(
            (tiles for tiles in (4, 2) if tiles <= widest and column_groups(tiles) >= sm_count), 1
        )
    tiles_per_warp = min(tiles_per_warp, widest)
    groups = column_groups(tiles_per_warp)
    if blocks is None:
        blocks = max(1, sm_count * GEMM_ROWS_BLOCKS_PER_SM - reserved_slots) if m_tiles == 1 else groups
    return LaunchPlan(
        kernel=f"gemm_rows_bf16_m{m_tiles}_n{tiles_per_warp}",
        grid=(min(blocks, groups), -(-rows // ROWS_PER_SWEEP)),
        block=(WARPS_PER_BLOCK * 32,),
        m_tiles=m_tiles,
        tiles_per_warp=tiles_per_warp,
    )


def _x_region_bytes(rows: int, k: int, tiles: int) -> int:
    """Shared memory an awaiting staged block keeps beside its stage: a 16-byte zero chunk and x's rows
    padded to whole k blocks, or the partial sums written over them (GEMM_ROWS_PARTIAL_FLOATS(1,
    tiles) floats), whichever is more."""
    partial_bytes = WARPS_PER_BLOCK * tiles * 4 * 32 * 4
    return max(16 + rows * -(-k // K_BLOCK) * K_BLOCK * 2, partial_bytes)


def staged_plan(n: int, k: int, rows: int, awaiting: bool = False) -> LaunchPlan | None:
    """The launch of gemm_rows_staged_bf16 for up to 16 rows of a packed [n, k] weight, or None
    where it does not apply: one column group a block, the group's weights (every k block of its
    tiles) copied into STAGED_MAX_BYTES or less of shared memory before the block waits on the
    previous kernel. The widest tiles (2, else 1) whose group fits; the same bits as any plan.

    ``awaiting``: gemm_rows_staged_awaiting_bf16 (gemm_rows_bf16's ``ready``), whose blocks also copy
    x's rows into shared memory after the stage (the partial sums later over them): None unless
    STAGED_BLOCKS_PER_SM such blocks fit an SM."""
    if rows > M_TILE:
        return None
    warps_n = WARPS_PER_BLOCK // k_split(k)
    tile_bytes = -(-k // K_BLOCK) * K_BLOCK * N_TILE * 2
    n_tiles = -(-n // N_TILE)
    for tiles in sorted(kernels.STAGED_TILES_PER_WARP, reverse=True):
        group_tiles = warps_n * tiles
        if group_tiles * tile_bytes > STAGED_MAX_BYTES:
            continue
        shared_mem = min(group_tiles, n_tiles) * tile_bytes
        if awaiting:
            shared_mem += _x_region_bytes(rows, k, tiles)
            if STAGED_BLOCKS_PER_SM * (shared_mem + (1 << 10)) > BULK_SHARED_PER_SM:
                return None
        return _group_a_block_plan(f"gemm_rows_staged_{'awaiting_' if awaiting else ''}bf16_m1_n{tiles}", n_tiles,
                                   group_tiles, tiles, shared_mem)
    return None


def _group_a_block_plan(kernel: str, n_tiles: int, group_tiles: int, tiles: int, shared_mem: int,
                        tail_blocks: int = 0) -> LaunchPlan:
    """The plan of a one-m-tile staged entry: one column group of `group_tiles` tiles a block."""
    return LaunchPlan(kernel=kernel, grid=(-(-n_tiles // group_tiles), 1), block=(WARPS_PER_BLOCK * 32,), m_tiles=1,
                      tiles_per_warp=tiles, shared_mem=shared_mem, tail_blocks=tail_blocks)


def tail_staged_plan(n: int, k: int, rows: int, sm_count: int = DEFAULT_SM_COUNT,
                     tail_blocks: int | None = None, tiles_per_warp: int | None = None,
                     shared_per_sm: int = BULK_SHARED_PER_SM,
                     shared_per_block: int = BULK_SHARED_PER_BLOCK) -> LaunchPlan | None:
    """The launch of gemm_rows_tail_staged_awaiting_bf16 for up to 16 rows of a packed [n, k] weight,
    or None where no tail fits: the tiles and column groups of the one-row sweep (launch_plan), one
    group a block, and each block's tail stage the last ``tail_blocks`` k blocks of every warp's k
    range of each of its tiles, as many as TAIL_BLOCKS_PER_SM blocks' shared memory (each also
    holding x's rows, or the partial sums over them) allows, at most the whole range, and at most
    ``tail_blocks`` where given (>= 1). ``tiles_per_warp`` (1, 2, 4; None: launch_plan's) as there.
    ``shared_per_sm`` / ``shared_per_block``: the device's shared memory an SM holds and a block may
    ask for (an H200's by default; a consumer Blackwell part has about 100 KB). The same bits as any
    plan."""
    if tail_blocks is not None and tail_blocks < 1:
        raise ValueError(f"tail_staged_plan: tail_blocks must be >= 1, got {tail_blocks}")
    if rows > M_TILE:
        return None
    tiles = launch_plan(n, k, rows, tiles_per_warp, sm_count=sm_count).tiles_per_warp
    split = k_split(k)
    k_blocks = -(-k // K_BLOCK)
    n_tiles = -(-n // N_TILE)
    group_tiles = WARPS_PER_BLOCK // split * tiles
    x_bytes = _x_region_bytes(rows, k, tiles)
    block_bytes = WARPS_PER_BLOCK * tiles * K_BLOCK * N_TILE * 2  # one k block of every warp's tiles
    room = min(shared_per_sm // TAIL_BLOCKS_PER_SM - (1 << 10), shared_per_block) - x_bytes
    tail = min(room // block_bytes, -(-k_blocks // split), tail_blocks or k_blocks)
    if tail < 1:
        return None
    return _group_a_block_plan(f"gemm_rows_tail_staged_awaiting_bf16_m1_n{tiles}", n_tiles, group_tiles, tiles,
                               tail * block_bytes + x_bytes, tail)


def staged_applies(w: Any, rows: int, awaiting: bool = False) -> bool:
    """Whether gemm_rows_bf16(staged=True) takes the staged entry for this weight and row count on the
    current device: a PackedWeight of at most STAGED_MAX_WEIGHT_BYTES, <= 16 rows, a plan whose
    stage fits, and sm_90 or later (where a programmatic launch copies while the kernel before it
    runs). ``awaiting``: the same with ``ready`` (staged_plan's awaiting form, x's rows held too), or,
    with TAIL_STAGED_AWAITING and at most TAIL_STAGED_MAX_ROWS rows, where that does not fit,
    tail_staged_plan's (any weight size)."""
    return _staged_plan_here(w, rows, awaiting) is not None


def _staged_plan_here(w: Any, rows: int, awaiting: bool = False) -> LaunchPlan | None:
    """staged_plan for this weight and row count where staged_applies, else None."""
    if not isinstance(w, PackedWeight) or rows > M_TILE:
        return None
    if int(cupy.cuda.Device().compute_capability) < 90:
        return None
    n, k = w.shape
    plan = None
    if STAGED_MAX_WEIGHT_BYTES is None or weight_bytes(n, k) <= STAGED_MAX_WEIGHT_BYTES:
        plan = staged_plan(n, k, rows, awaiting)
    if plan is None and awaiting and TAIL_STAGED_AWAITING and rows <= TAIL_STAGED_MAX_ROWS:
        device_id = cupy.cuda.Device().id
        per_sm, per_block = _shared_memory(device_id)
        plan = tail_staged_plan(n, k, rows, _sm_count(device_id), tail_blocks=TAIL_BLOCKS, shared_per_sm=per_sm,
                                shared_per_block=per_block)
    return plan


def wgmma_wide_enough(n: int, sm_count: int = DEFAULT_SM_COUNT) -> bool:
    """Whether WGMMA_MIN_GROUPS_PER_SM gives 17..64 rows of an n-column weight to the warpgroup-MMA
    sweep (where the weight has the pair layout and the device the kernels)."""
    return WGMMA_MIN_GROUPS_PER_SM is not None and -(-n // WGMMA_COLUMNS) >= WGMMA_MIN_GROUPS_PER_SM * sm_count


def wgmma_takes(n: int) -> bool:
    """Whether 17..64 rows of an n-column packed weight with the pair layout take the warpgroup-MMA
    sweep on the current device: the copies worth making (pack_weight(w, pairs=True))."""
    return (WGMMA_MIN_GROUPS_PER_SM is not None and wgmma_available()
            and wgmma_wide_enough(n, _sm_count(cupy.cuda.Device().id)))


def wgmma_available() -> bool:
    """Whether the current device runs the warpgroup-MMA sweep (sm_90, and the kernel set in use
    has it)."""
    return kernels.KernelSet.get().has(f"gemm_rows_wgmma_n64_g{WGMMA_WARPGROUPS}")


def gemm_rows_bf16(x, w, out, rows: int | None = None, *, tiles_per_warp: int | None = None,
                   blocks: int | None = None, programmatic: bool = False, serial: bool | None = None,
                   wgmma: bool | None = None, reserved_slots: int = 0, staged: bool = False,
                   bulk: bool | None = None, x_tiles: Any = None, partial: Any = None,
                   x_tiled: bool = False, ready: Any = None, ready_target: int = 0,
                   counted: Any = None, sums: Any = None) -> int:
    """out[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..256), FP32 accumulation on tensor cores.

    Shapes:
        x    [>= rows, k] BF16, row stride a multiple of 8, 16-byte aligned (a row slice
             or a column slice of a wider buffer is fine; columns contiguous)
        w    [n, k] BF16, torch Linear layout, C-contiguous, 16-byte aligned; k % 8 == 0
        out  [>= rows, n] BF16, columns contiguous; may be a column slice of a wider
             buffer: only columns < n of rows < rows are written

    Bit contract: out[r] depends only on x[r] and w. For every rows in 1..256 it is,
    bit for bit, what a one-row call on x[r] alone writes: padding rows are zeros that
    are never read, and the k summation order is a function of k alone (see
    kernels_src/gemm_rows.cu). ``tiles_per_warp`` (1, 2, 4, or None to choose from the
    shape) and ``blocks`` (the most blocks along n, None to choose) tune the launch and
    leave every bit unchanged, as does ``serial`` (33..64 rows per group: the serial sweep, or
    not; None to choose from the shape) and ``wgmma`` (17..64 rows per group of a packed weight on
    sm_90: the warpgroup-MMA sweep, or not; None to choose from the shape) and ``reserved_slots``
    (block slots a launch of <= 16 rows leaves free for kernels beside it; see :func:`launch_plan`),
    and ``staged`` (where :func:`staged_applies`: each block copies its weights into shared memory
    before it waits on the previous kernel, see :func:`staged_plan`; elsewhere ignored), and ``bulk``
    (more than 16 rows of a PackedWeight holding the tile layout, on sm_90: the bulk-copy sweep,
    :func:`gemm_rows_bulk`, True always, None where the weight has BULK_MIN_GROUPS_PER_SM groups of
    64 columns per SM, False never; ``x_tiles``, ``partial`` and ``x_tiled`` are then its scratch and
    whether x_tiles already holds x, see there; :func:`bulk_applies` says whether it runs).

    ``w`` may also be a :class:`PackedWeight` of the same weight (:func:`pack_weight`): the
    same bits, the weight read in contiguous runs. The warpgroup-MMA sweep reads its pair layout,
    so it runs only where the PackedWeight has one (``pack_weight(w, pairs=True)``).

    ``programmatic``: launch as a programmatic dependent of the previous kernel in the
    stream (sm_90 and later): the blocks start while that kernel drains, ask L2 for their
    first weight bytes, and wait for it before they read x or write out. For a launch whose
    previous operation in the stream is the kernel that writes x; the bits are the same.

    ``ready`` (with ``programmatic``, <= 16 rows of a PackedWeight): a contiguous int32 array of
    at least 2 elements that the previous kernel counts its blocks' outputs out in (the fused
    decode step's ``outputs_ready``): the blocks read x once ready[0] reaches ``ready_target``, not
    once that kernel ends, the last of them sets both words back to zero, and each block ends only
    after that kernel has. The same bits. Every block of that kernel must be resident when this one
    launches (it waits on them; see ops.kda_decode_fused_bf16). With ``staged`` it takes the staged
    entry's awaiting form where ``staged_applies(w, rows, awaiting=True)`` (each block's weights in
    shared memory before the wait, then x's rows beside them; with TAIL_STAGED_AWAITING, for a weight
    too wide for that, the tail of each warp's k range: tail_staged_plan), else the sweep that reads w
    past the wait.

    ``counted`` (<= 16 rows of a PackedWeight, without ``ready``): a contiguous int32 array of at least
    2 elements: each block adds 1 to counted[0] (release, at GPU scope) once its outputs are written,
    so that a kernel on another stream may read ``out`` once the count reaches the blocks launched
    (the fused step's ``inputs_ready`` and ``inputs_target``) instead of once this launch ends. It
    takes neither the staged nor the bulk sweep. The same bits.

    ``sums`` (None: none): FP32 [>= rows, n] with contiguous columns (a column slice is fine),
    receiving each output's FP32 sum, the value ``out`` holds rounded to BF16 (round to nearest
    even): the partial output of a tensor-parallel rank, which the ranks add before the one
    rounding. The split-k sweep and its awaiting forms write them (with ``ready``, and ``staged``
    where the awaiting staged entries apply); not with ``counted``, and never on the serial, the
    warpgroup-MMA or the bulk sweep, nor the staged entry without ``ready`` (the same bits in
    ``out`` as those would write).

    Returns the blocks launched (the count ``counted`` reaches; 0 for the bulk-copy sweep, which never
    counts).
    """
    rows, n, k, ldx, ldy = projection_args("gemm_rows_bf16", x, w, out, rows, GEMM_ROWS_MAX_ROWS)
    packed = isinstance(w, PackedWeight)
    sums_args: tuple = ()
    if sums is not None:
        sums_args = (sums, _i32(_sums_stride(sums, rows, n, counted, bulk)))
        serial, wgmma, bulk = False, False, False
        staged = staged and ready is not None  # (the staged entries write sums in their awaiting forms)
    if ready is not None:
        _check_ready(ready, ready_target, packed, rows, programmatic, bulk)
    if counted is not None:
        check_scratch(counted, cupy.int32, "int32", 2, "counted", "gemm_rows_bf16")
        if not (packed and rows <= M_TILE and ready is None and not bulk):
            raise ValueError("gemm_rows_bf16: counted needs <= 16 rows of a PackedWeight, without ready or bulk "
                             f"(packed: {packed}, rows: {rows}, ready: {ready is not None}, bulk: {bulk})")
        staged = False
    if not (packed and w.pairs is not None and wgmma_available()):
        if wgmma:
            raise ValueError("gemm_rows_bf16: wgmma=True needs a PackedWeight made with pack_weight(w, pairs=True)"
                             f" on an sm_90 device (packed: {packed}, pair layout: {packed and w.pairs is not None},"
                             f" warpgroup-MMA kernels loaded: {wgmma_available()})")
        wgmma = False
    if bulk_applies(w, rows, bulk):
        gemm_rows_bulk(x, w, out, rows, x_tiles=x_tiles, partial=partial, programmatic=programmatic, x_tiled=x_tiled)
        return 0
    # The words of the awaiting or the counting entry, last.
    words = (ready, _i32(ready_target)) if ready is not None else (counted,) if counted is not None else ()
    plan = _staged_plan_here(w, rows, ready is not None) if staged else None
    if plan is not None:
        # (The staged entries take no L2 request; the tail entry its tail's k blocks in that place.)
        kernel, last, weight, carveout = plan.kernel, plan.tail_blocks, w.data, 100
    else:
        plan = launch_plan(n, k, rows, tiles_per_warp, _sm_count(cupy.cuda.Device().id), blocks, serial, wgmma,
                           reserved_slots)
        kernel = plan.kernel
        on_wgmma = kernel.startswith("gemm_rows_wgmma")
        # The last argument: the L2 request of a programmatic launch, or the warpgroup-MMA sweep's ring.
        last = plan.ring_depth if on_wgmma else prefetch_k_blocks(n, k) if programmatic else 0
        if packed and not on_wgmma:
            form = "awaiting_" if ready is not None else "counting_" if counted is not None else ""
            if counted is not None and COUNTING_AHEAD:
                form = "counting_ahead_"
            kernel = kernel.replace("gemm_rows_", f"gemm_rows_packed_{form}")
        weight = (w.pairs if on_wgmma else w.data) if packed else w
        carveout = 100 if plan.shared_mem else -1
    if sums is not None:
        kernel = kernel.replace("bf16_m", "sums_bf16_m")
    kernels.launch(kernel, plan.grid, plan.block,
                   (x, _i32(ldx), weight, out, _i32(ldy), _i32(rows), _i32(n), _i32(k), _i32(last), *words,
                    *sums_args),
                   plan.shared_mem, programmatic=programmatic, carveout=carveout)
    return plan.grid[0] * plan.grid[1]


def gemm_rows_pair_bf16(x, w, out, x2, w2, out2, rows: int | None = None, *, programmatic: bool = False,
                        reserved_slots: int = 0) -> None:
    """out[r] = bf16(x[r] @ w.T) and out2[r] = bf16(x2[r] @ w2.T) for r < rows (1..16) in one launch:
    each the bits of :func:`gemm_rows_bf16` alone (its column groups swept by the same device code,
    the second projection's after the first's). For two small projections of one kernel's outputs
    (the forget and output gate up-projections of one decode row): one launch and one wait on that
    kernel instead of two of each.

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
    plan = launch_plan(2 * n, k, rows, None, _sm_count(cupy.cuda.Device().id), reserved_slots=reserved_slots)
    kernels.launch(
        plan.kernel.replace("gemm_rows_", "gemm_rows_packed_pair_"),
        plan.grid,
        plan.block,
        (x, _i32(ldx), w.data, out, _i32(ldy), _i32(rows), _i32(n), _i32(k),
         _i32(prefetch_k_blocks(n, k) if programmatic else 0), x2, w2.data, out2),
        plan.shared_mem,
        programmatic=programmatic,
    )


def _sums_stride(sums: Any, rows: int, n: int, counted: Any, bulk: bool | None) -> int:
    """The checks of gemm_rows_bf16's ``sums`` (TypeError / ValueError naming what is wrong); returns
    its row stride in elements."""
    if counted is not None or bulk:
        raise ValueError("gemm_rows_bf16: sums takes the split-k sweep or its awaiting forms, without counted "
                         f"or bulk=True (counted: {counted is not None}, bulk: {bulk})")
    stride = _row_stride("sums", sums, "f32", rows, n)
    _require_int32("sums row stride", stride)
    return stride


def _check_ready(ready: Any, ready_target: int, packed: bool, rows: int, programmatic: bool,
                 bulk: bool | None) -> None:
    """The checks of gemm_rows_bf16's ``ready``: ValueError naming what is wrong."""
    check_scratch(ready, cupy.int32, "int32", 2, "ready", "gemm_rows_bf16")
    if not (packed and rows <= M_TILE and programmatic and not bulk):
        raise ValueError("gemm_rows_bf16: ready needs a programmatic launch of <= 16 rows of a PackedWeight, not "
                         f"bulk (packed: {packed}, rows: {rows}, programmatic: {programmatic}, bulk: {bulk})")
    if ready_target < 1:
        raise ValueError(f"gemm_rows_bf16: ready_target must be >= 1 (the blocks counted), got {ready_target}")


def bulk_applies(w: Any, rows: int, bulk: bool | None = None) -> bool:
    """Whether gemm_rows_bf16(x, w, out, rows, bulk=bulk) runs the bulk-copy sweep: more than 16 rows
    of a PackedWeight holding the tile layout on an sm_90 device, and bulk True, or None with the
    weight wide enough (bulk_wide_enough). bulk=True where the sweep cannot run is an error."""
    if rows <= M_TILE or bulk is False:
        return False
    packed = isinstance(w, PackedWeight)
    takes = packed and w.tiles is not None and bulk_available()
    if bulk and not takes:
        raise ValueError("gemm_rows_bf16: bulk=True needs a PackedWeight made with pack_weight(w, tiles=True) on an"
                         f" sm_90 device (packed: {packed}, tile layout: {packed and w.tiles is not None},"
                         f" bulk-copy kernels loaded: {bulk_available()})")
    return takes and (bool(bulk) or bulk_wide_enough(w.shape[0], _sm_count(cupy.cuda.Device().id)))


def bulk_available() -> bool:
    """Whether the current device runs the bulk-copy sweep (sm_90, and the kernel set in use has it)."""
    return kernels.KernelSet.get().has("gemm_rows_bulk_g1")


def bulk_wide_enough(n: int, sm_count: int = DEFAULT_SM_COUNT) -> bool:
    """Whether BULK_MIN_GROUPS_PER_SM gives more than 16 rows of an n-column weight to the bulk-copy
    sweep (where the weight has the tile layout and the device the kernels)."""
    return BULK_MIN_GROUPS_PER_SM is not None and -(-n // 64) >= BULK_MIN_GROUPS_PER_SM * sm_count


def bulk_takes(n: int) -> bool:
    """Whether more than 16 rows of an n-column packed weight with the tile layout take the bulk-copy
    sweep on the current device: the copies worth making (pack_weight(w, tiles=True))."""
    return bulk_available() and bulk_wide_enough(n, _sm_count(cupy.cuda.Device().id))


def _bulk_blocks_per_sm(warpgroups: int) -> int:
    return 2 if warpgroups == 1 else 1


def bulk_fill_tiles(groups: int, k: int, rows: int, warpgroups: int, split: bool,
                    sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The 4 KB tiles the busiest SM copies into shared memory in a bulk-copy sweep of `rows` rows of
    a weight of `groups` groups of 64 columns: its share of the tasks (every row group's, spread over
    the SMs) times a task's tiles (x's and each warpgroup's weight over the task's blocks of 32 k).
    An SM fills its shared memory at a bounded rate, so this is what bulk_warpgroups minimises."""
    k_blocks = -(-k // K_BLOCK)
    task_blocks = -(-k_blocks // k_split(k)) if split else k_blocks
    tasks = -(-groups // warpgroups) * (k_ranges(k) if split else 1) * -(-rows // ROWS_PER_SWEEP)
    return -(-tasks // sm_count) * (1 + warpgroups) * task_blocks


def bulk_warpgroups(groups: int, k: int, rows: int = ROWS_PER_SWEEP, split: bool = False,
                    sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Warpgroups of a bulk block for `rows` rows of a weight of `groups` groups of 64 columns and k
    inputs, whole or split by k range: BULK_WARPGROUPS, or the most (3, 2, 1) among those whose
    busiest SM copies the fewest tiles (bulk_fill_tiles). On an H200 (a sweep of every choice, one
    process) that picked the fastest or one within 2 % of it for q|k|v, o_proj and the gate
    up-projections of both geometries at 64 and 256 rows; the rule it replaced (fewest groups on the
    busiest SM, x's tiles not counted) gave Kimi's o_proj at 64 rows 2 warpgroups (19.9 us against
    17.0) and its q|k|v at 256 rows 2 (63.5 us against 52.4)."""
    if split and BULK_SPLIT_WARPGROUPS is not None:
        return BULK_SPLIT_WARPGROUPS
    if BULK_WARPGROUPS is not None:
        return BULK_WARPGROUPS
    return min((3, 2, 1), key=lambda wg: (bulk_fill_tiles(groups, k, rows, wg, split, sm_count), -wg))


def k_ranges(k: int) -> int:
    """The k ranges of the summation order that hold blocks of 32 k (k_split's, less any past k)."""
    k_blocks = -(-k // K_BLOCK)
    k_range = -(-k_blocks // k_split(k))
    return -(-k_blocks // k_range)


@dataclass(frozen=True)
class BulkPlan:
    """Entry point, grid, block, ring slots and shared memory of one bulk-copy sweep; `split`: each
    task one k range of a super-group, its FP32 partial sums folded by gemm_rows_bulk_fold_bf16."""

    kernel: str
    grid: tuple[int, int]
    block: tuple[int]
    warpgroups: int
    stages: int
    shared_mem: int
    split: bool = False


def bulk_plan(n: int, k: int, rows: int, sm_count: int = DEFAULT_SM_COUNT, warpgroups: int | None = None,
              blocks: int | None = None, stages: int | None = None, split: bool | None = False) -> BulkPlan:
    """The launch of gemm_rows_bulk_g<warpgroups> for `rows` rows of a [n, k] weight: grid.y the row
    groups of 64, grid.x the tasks (super-groups of `warpgroups` groups of 64 columns, or with `split`
    their k ranges one by one) capped at BULK_ROW_GROUP_WAVES waves of the blocks resident at once over
    all row groups (one wave for one row group), or at `blocks`; as many ring slots
    (each x's and every warpgroup's BULK_CHUNK blocks of 32 k) as fit, up to BULK_MAX_STAGES and to
    the chunks a block walks (bulk_block_chunks).
    warpgroups None: bulk_warpgroups' choice for the sweep, whole or split. split None: where the
    unsplit tasks of all row groups (at the warpgroups given, or chosen for a whole sweep) would keep
    fewer than half the SMs busy and k has more than one range. No choice changes a bit."""
    groups = -(-n // 64)
    row_groups = -(-rows // ROWS_PER_SWEEP)
    if split is None:
        whole = warpgroups or bulk_warpgroups(groups, k, rows, False, sm_count)
        split = -(-groups // whole) * row_groups < sm_count / 2 and k_ranges(k) > 1
    warpgroups = warpgroups or bulk_warpgroups(groups, k, rows, bool(split), sm_count)
    if warpgroups not in (1, 2, 3):
        raise ValueError(f"warpgroups must be 1, 2 or 3, got {warpgroups}")
    per_sm = _bulk_blocks_per_sm(warpgroups)
    slot = (1 + warpgroups) * BULK_CHUNK * BULK_TILE_BYTES
    budget = min(BULK_SHARED_PER_BLOCK, BULK_SHARED_PER_SM // per_sm - 1024)
    super_groups = -(-groups // warpgroups)
    tasks = super_groups * (k_ranges(k) if split else 1)
    resident = sm_count * per_sm
    grid_x = min(blocks or max(1, resident * min(row_groups, BULK_ROW_GROUP_WAVES) // row_groups), tasks)
    if stages is None:
        # No more slots than the chunks a block walks: a sweep of one short chunk a block (the gate
        # up-projections, k = 128) then asks for one slot, and its blocks fit beside a wide sweep's ring.
        walked = bulk_block_chunks(k, tasks, grid_x, bool(split)) if BULK_STAGES_BY_CHUNKS else BULK_MAX_STAGES
        stages = max(1, min(BULK_MAX_STAGES, budget // (slot + 16), walked))
    if not 1 <= stages or stages * (slot + 16) > BULK_SHARED_PER_BLOCK:
        raise ValueError(f"stages must be 1..{BULK_SHARED_PER_BLOCK // (slot + 16)} at {warpgroups} warpgroups, got {stages}")
    return BulkPlan(kernel=f"gemm_rows_bulk_g{warpgroups}", grid=(grid_x, row_groups),
                    block=(warpgroups * 128 + 32,), warpgroups=warpgroups, stages=stages,
                    shared_mem=stages * (slot + 16), split=bool(split))


def bulk_block_chunks(k: int, tasks: int, grid_x: int, split: bool) -> int:
    """Ring chunks (up to BULK_CHUNK blocks of 32 k of each operand) the busiest block of a bulk-copy
    sweep walks: its tasks (blockIdx.x, blockIdx.x + grid_x, ...) times a task's chunks, one k range
    (split) or every range, each range's blocks in chunks from its first."""
    k_blocks = -(-k // K_BLOCK)
    k_range = -(-k_blocks // k_split(k))
    ranges = [min(k_range, k_blocks - start) for start in range(0, k_blocks, k_range)]
    chunks = [-(-blocks // BULK_CHUNK) for blocks in ranges]
    return -(-tasks // grid_x) * (max(chunks) if split else sum(chunks))


def bulk_partial_size(n: int, k: int, rows: int) -> int:
    """FP32 elements of a split bulk-copy sweep's partial sums: every k range of rows x n."""
    return k_ranges(k) * rows * n


def x_tiles_size(rows: int, k: int) -> int:
    """Elements of the tile layout of `rows` rows of x (gemm_rows_bulk's scratch)."""
    return -(-rows // ROWS_PER_SWEEP) * -(-k // K_BLOCK) * 64 * K_BLOCK


def check_scratch(array: Any, dtype: Any, kind: str, size: int, name: str, what: str) -> None:
    """Raises ValueError, naming `what` and the scratch `name`, unless `array` is a contiguous array of
    `dtype` (called `kind` in the message) with at least `size` elements."""
    if array.dtype != dtype or not array.flags.c_contiguous or array.size < size:
        raise ValueError(f"{what}: {name} must be a contiguous {kind} array of at least {size} elements, "
                         f"got {array.dtype} of {array.size} (contiguous: {array.flags.c_contiguous})")


def check_x_tiles(x_tiles: Any, dtype: Any, rows: int, k: int, what: str) -> None:
    """Raises ValueError, naming `what`, unless x_tiles is a contiguous array of `dtype` (BF16) with at
    least x_tiles_size(rows, k) elements: room for `rows` rows of a k-wide x in the tile layout."""
    check_scratch(x_tiles, dtype, "BF16", x_tiles_size(rows, k), "x_tiles", what)


def gemm_rows_bulk(x, w: PackedWeight, out, rows: int | None = None, *, x_tiles: Any = None,
                   warpgroups: int | None = None, blocks: int | None = None, stages: int | None = None,
                   split: bool | None = None, partial: Any = None, programmatic: bool = False,
                   x_tiled: bool = False) -> None:
    """out[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..256) by the bulk-copy sweep: the bits of
    :func:`gemm_rows_bf16` (x, w and out as there; w a PackedWeight made with ``tiles=True``).

    Two or three launches: gemm_rows_tile_x_bf16 lays x out in tiles (into ``x_tiles``, a contiguous
    BF16 array of at least :func:`x_tiles_size` elements; None: a new one), then gemm_rows_bulk_g<WG>
    sweeps as its programmatic dependent (see :func:`bulk_plan` for ``warpgroups``, ``blocks``,
    ``stages`` and ``split``, which change no bit). A split sweep stores each k range's FP32 sums in
    ``partial`` (a contiguous float32 array of at least :func:`bulk_partial_size` elements; None: a
    new one where split is True) and gemm_rows_bulk_fold_bf16 adds them into out in the sweep's order.
    With split None the sweep splits only into a ``partial`` given and large enough. ``programmatic``: the first
    launch is a programmatic dependent of the previous kernel in the stream (the one that writes x).
    ``x_tiled``: x_tiles already holds x's rows in the tile layout (the fused decode step writes it):
    no tiling launch, the sweep is the first; x is then only checked for its shape. Rows past `rows` of
    the last row group may hold anything: they feed only outputs that are never stored."""
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
    sm_count = _sm_count(cupy.cuda.Device().id)
    partial_size = bulk_partial_size(n, k, rows)
    if split is None and (partial is None or partial.size < partial_size):
        split = False
    plan = bulk_plan(n, k, rows, sm_count, warpgroups, blocks, stages, split)
    if plan.split:
        if partial is None:
            partial = cupy.empty((partial_size,), cupy.float32)
        else:
            check_scratch(partial, cupy.float32, "float32", partial_size, "partial", "gemm_rows_bulk")
    if not x_tiled:
        threads = size // K_BLOCK  # one per (row group, k block, row of 64): 32 elements each
        kernels.launch("gemm_rows_tile_x_bf16", (-(-threads // 256),), (256,),
                       (x, _i32(ldx), _i32(rows), _i32(k), x_tiles), programmatic=programmatic)
    kernels.launch(plan.kernel, plan.grid, plan.block,
                   (x_tiles, w.tiles, out, _i32(ldy), _i32(rows), _i32(n), _i32(k), _i32(plan.stages),
                    partial if plan.split else None),
                   plan.shared_mem, programmatic=programmatic or not x_tiled, carveout=100)
    if plan.split:
        kernels.launch("gemm_rows_bulk_fold_bf16", (-(-(rows * n) // 256),), (256,),
                       (partial, out, _i32(ldy), _i32(rows), _i32(n), _i32(k)), programmatic=True)


def prefetch_k_blocks(n: int, k: int) -> int:
    """Blocks of 32 k per weight row a programmatic launch over a [n, k] weight asks L2 for:
    PREFETCH_K_BLOCKS up to PREFETCH_MAX_WEIGHT_BYTES of weight, else 0. Changes no bit."""
    limit = PREFETCH_MAX_WEIGHT_BYTES
    return PREFETCH_K_BLOCKS if limit is None or weight_bytes(n, k) <= limit else 0


def weight_bytes(n: int, k: int) -> int:
    """Bytes of a BF16 [n, k] weight: what one call of up to 64 rows must read."""
    return 2 * n * k
