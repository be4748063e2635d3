"""gemm_rows_bf16 against its contract: the float64 oracle, and row bits independent of the row count.

Promises tested, one test each:
  * out = bf16(x @ w.T) within rms-ratio 1e-3 of the float64 oracle rounded to BF16;
  * row r of an R-row call equals, bit for bit, a one-row call on x[r] alone, for R in
    1..256, also when the other rows change (to random, huge, infinite or NaN values);
  * the launch (entry point, tiles per warp, grid, programmatic or plain) changes no bit;
  * strided x and a column slice of a wider out: only columns < n of rows < rows are written;
  * the GLM-5.3-Flash and Kimi-Linear projection shapes.
The geometry rule (k_split depends on k alone) and the argument checks that need no
device run everywhere; the rest needs a CUDA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_kda.device import gpu_status
from glm_kda.gpu.build import ENTRY_POINTS
from glm_kda.gpu.projection import GEMM_ROWS_BLOCKS_PER_SM, GEMM_ROWS_MAX_ROWS, launch_plan
from glm_kda.gpu.projection import _k_split as k_split

GPU_OK, GPU_WHY = gpu_status()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")

RMS_BOUND = 1e-3
SEED = 1234
BIT_ROWS = (1, 2, 3, 15, 16, 17, 63, 64, 100, 256)
# (n, k): awkward sizes on purpose (n not a multiple of 8, k not a multiple of 32).
SMALL_SHAPES = [(40, 128), (100, 136), (72, 2056), (320, 4096), (288, 2304)]
# The projections of one attention block: qkv, down, f_b / g_b, o_proj.
GLM_SHAPES = [(24576, 4096), (320, 4096), (8192, 128), (4096, 8192)]
KIMI_SHAPES = [(12288, 2304), (288, 2304), (4096, 128), (2304, 4096)]
POISON = 0x7FA5  # a NaN payload the kernel never writes (its NaNs are 0x7FC0 / 0xFFC0)


def _shape_id(shape) -> str:
    return f"N{shape[0]}-K{shape[1]}"


# --------------------------------------------------------------------------------------
# Data, oracle and comparisons
# --------------------------------------------------------------------------------------


def _cp():
    import cupy

    return cupy


def _random_bf16(rng, shape, scale=1.0):
    """Device BF16 bits (uint16) of scaled standard normals."""
    import ml_dtypes

    values = (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16)
    return _cp().asarray(values.view(np.uint16))


def _bits_to_f64(bits):
    """BF16 bits (cupy uint16) -> cupy float64, exact."""
    cp = _cp()
    return (bits.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)


def _oracle(x_bits, w_bits):
    """float64 x @ w.T rounded once to BF16, as float64 (on the device)."""
    from glm_kda.reference import round_bf16

    return round_bf16(_bits_to_f64(x_bits) @ _bits_to_f64(w_bits).T)


def _assert_close(actual_bits, x_bits, w_bits, tag):
    from glm_kda.reference import rms_ratio

    ratio = rms_ratio(_bits_to_f64(actual_bits), _oracle(x_bits, w_bits))
    print(f"{tag}: rms-ratio {ratio:.3e}")
    assert ratio <= RMS_BOUND, f"{tag}: rms-ratio {ratio:.3e} against the float64 oracle (bound {RMS_BOUND:g})"
    return ratio


def _run(x, w, rows, **kwargs):
    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    out = cp.full((rows, w.shape[0]), POISON, dtype=cp.uint16)
    gemm_rows_bf16(x, w, out, rows=rows, **kwargs)
    return out


def _assert_programmatic_bits(x, w, rows, expected, tag, **kwargs):
    """Three programmatic launches, each right behind the kernels that write x (rewritten each
    time), give `expected` bit for bit."""
    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    source = cp.zeros_like(x)
    out = cp.full((rows, w.shape[0]), POISON, dtype=cp.uint16)
    for _ in range(3):
        out.fill(POISON)
        source.fill(0)
        cp.copyto(source, x)
        gemm_rows_bf16(source, w, out, rows=rows, programmatic=True, **kwargs)
        _assert_bits_equal(out, expected, f"{tag}, programmatic")


def _one_row_calls(x, w, rows):
    """Row r of the result is a one-row call on a copy of x[r] alone."""
    cp = _cp()
    return cp.concatenate([_run(cp.ascontiguousarray(x[r : r + 1]), w, 1) for r in range(rows)], axis=0)


def _assert_bits_equal(actual, expected, tag):
    actual, expected = actual.get(), expected.get()
    if not np.array_equal(actual, expected):
        rows, cols = np.nonzero(actual != expected)
        raise AssertionError(
            f"{tag}: {rows.size} elements differ in bits, first at row {rows[0]} column {cols[0]}: "
            f"{actual[rows[0], cols[0]]:#06x} != {expected[rows[0], cols[0]]:#06x}"
        )


# --------------------------------------------------------------------------------------
# Without a device
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [8, 128, 136, 256, 512, 1024, 2304, 4096, 8192])
def test_k_split_depends_on_k_alone(k):
    split = k_split(k)
    assert split in (1, 2, 4, 8)
    k_blocks = -(-k // 32)
    assert split == 1 or k_blocks >= 4 * split
    for rows in (1, 16, 17, 64, 65, 256):
        for n in (4096, 24576):
            plan = launch_plan(n, k, rows)
            assert plan.block == (256,)
            assert plan.grid[1] == -(-rows // 64)
            assert plan.tiles_per_warp in (1, 2, 4) and (rows <= 32 or plan.tiles_per_warp <= 2)
            assert plan.m_tiles == (1 if rows <= 16 else 2 if rows <= 32 else 4)
            assert plan.kernel == f"kda_gemm_rows_bf16_m{plan.m_tiles}_n{plan.tiles_per_warp}"
            assert plan.kernel in ENTRY_POINTS["projection/gemm_rows"]


@pytest.mark.parametrize("shape", GLM_SHAPES + KIMI_SHAPES, ids=_shape_id)
def test_launch_plan_covers_every_column(shape):
    n, k = shape
    for rows in (1, 16, 64, 256):
        for tiles in (None, 1, 2, 4):
            # Uncapped, one block per column group covers every column; by default the grid
            # is capped at the resident blocks and the blocks loop over the groups.
            whole = launch_plan(n, k, rows, tiles_per_warp=tiles, blocks=10**9)
            assert whole.grid[0] * (8 // k_split(k)) * whole.tiles_per_warp * 8 >= n
            assert (whole.grid[0] - 1) * (8 // k_split(k)) * whole.tiles_per_warp * 8 < n
            assert whole.grid[1] * 64 >= rows
            plan = launch_plan(n, k, rows, tiles_per_warp=tiles)
            resident = 132 * GEMM_ROWS_BLOCKS_PER_SM
            assert plan.grid[0] == (min(whole.grid[0], resident) if plan.m_tiles == 1 else whole.grid[0])
            assert plan.grid[1] == whole.grid[1] and plan.kernel == whole.kernel


def test_launch_plan_fills_every_sm_when_it_can():
    # The widest tiles that still give each of 132 SMs a block: GLM qkv_proj takes 4,
    # o_proj 2, a down_proj of 40 tiles cannot fill the SMs and takes 1.
    assert launch_plan(24576, 4096, 1).tiles_per_warp == 4
    assert launch_plan(4096, 8192, 1).tiles_per_warp == 2
    assert launch_plan(320, 4096, 1).tiles_per_warp == 1
    assert launch_plan(24576, 4096, 64).tiles_per_warp == 2
    assert launch_plan(24576, 4096, 1, sm_count=1000).tiles_per_warp == 2
    assert launch_plan(24576, 4096, 1, sm_count=2000).tiles_per_warp == 1


def test_launch_plan_rejects_unknown_tiles():
    with pytest.raises(ValueError, match="tiles_per_warp"):
        launch_plan(64, 128, 1, tiles_per_warp=3)
    with pytest.raises(ValueError, match="blocks"):
        launch_plan(64, 128, 1, blocks=0)
    with pytest.raises(ValueError, match="blocks"):
        launch_plan(64, 128, 40, blocks=0)


def test_launch_plan_blocks_caps_the_grid():
    assert launch_plan(24576, 4096, 1, tiles_per_warp=1, blocks=264).grid == (264, 1)
    assert launch_plan(24576, 4096, 100, tiles_per_warp=1, blocks=10**6).grid == (3072, 2)


def test_every_entry_point_is_in_the_kernel_source():
    from glm_kda.gpu.build import kernel_source

    source = kernel_source("projection/gemm_rows")
    assert "GEMM_ROWS_TILINGS(GEMM_ROWS_ENTRY)" in source
    tilings = source[source.index("#define GEMM_ROWS_TILINGS(ENTRY)"):].split("\n\n")[0]
    for name in ENTRY_POINTS["projection/gemm_rows"]:
        m_tiles, tiles = (int(part[1:]) for part in name.split("_")[-2:])
        assert f"ENTRY({m_tiles}, {tiles})" in tilings, f"gemm_rows.cu has no entry for {name}"
    assert f"#define GEMM_ROWS_MIN_BLOCKS {GEMM_ROWS_BLOCKS_PER_SM}" in source


# --------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 256], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=_shape_id)
def test_matches_float64_oracle(shape, rows):
    n, k = shape
    rng = np.random.default_rng(SEED)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    out = _run(x, w, rows)
    _assert_close(out, x, w, f"{_shape_id(shape)}-R{rows}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", BIT_ROWS, ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [(100, 136), (288, 2304), (320, 4096)], ids=_shape_id)
def test_rows_bit_identical_to_one_row_calls(shape, rows):
    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(SEED + rows)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    full = _run(x, w, rows)
    _assert_bits_equal(full, _one_row_calls(x, w, rows), f"{_shape_id(shape)}-R{rows} vs one-row calls")

    # Change every row but a random few: the kept rows keep their bits.
    kept = rng.choice(rows, size=max(1, rows // 3), replace=False)
    changed = _random_bf16(rng, (rows, k), scale=3.0)
    changed[cp.asarray(kept)] = x[cp.asarray(kept)]
    again = _run(changed, w, rows)
    _assert_bits_equal(again[cp.asarray(kept)], full[cp.asarray(kept)], f"{_shape_id(shape)}-R{rows} other rows changed")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 17, 100], ids=lambda r: f"R{r}")
def test_rows_isolated_from_huge_infinite_and_nan_rows(rows):
    cp = _cp()
    n, k = 200, 520
    rng = np.random.default_rng(SEED)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    full = _run(x, w, rows)
    # Row 0 stays; the others become +-3e38 (overflowing products), +-inf and NaN.
    wild = x.copy()
    patterns = cp.asarray(np.array([0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0], dtype=np.uint16))
    wild[1:] = patterns[cp.asarray(rng.integers(0, patterns.size, size=(rows - 1, k)))]
    again = _run(wild, w, rows)
    _assert_bits_equal(again[:1], full[:1], f"R{rows} row 0 beside inf / NaN rows")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 16, 40, 64, 200], ids=lambda r: f"R{r}")
def test_grid_changes_no_bit(rows):
    n, k = 1000, 1032
    rng = np.random.default_rng(SEED)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    default = _run(x, w, rows)
    for tiles in (1, 2, 4):
        for blocks in (None, 1, 3, 7):
            _assert_bits_equal(_run(x, w, rows, tiles_per_warp=tiles, blocks=blocks), default,
                               f"R{rows} tiles_per_warp={tiles} blocks={blocks}")
    # A programmatic launch (with the L2 prefetch) right behind the kernel that writes x.
    _assert_programmatic_bits(x, w, rows, default, f"R{rows}")


def _order_sensitive(rng, rows, n, k):
    """Device BF16 bits of host_cuda.order_sensitive_inputs: x, w whose fp32 sum over the k ranges
    depends on the order of its additions."""
    from host_cuda import bf16_bits, order_sensitive_inputs

    return tuple(_cp().asarray(bf16_bits(v)) for v in order_sensitive_inputs(rng, rows, n, k, k_split(k)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [GLM_SHAPES[0], GLM_SHAPES[3], KIMI_SHAPES[0]], ids=_shape_id)
def test_split_k_order_kept_by_every_sweep(shape):
    """Order-sensitive data at the model's shapes: 40 and 64 rows through the split-k sweep (row-major
    and packed weights) equal one-row calls bit for bit."""
    from glm_kda.gpu.projection import pack_weight

    n, k = shape
    rows = 64
    x, w = _order_sensitive(np.random.default_rng(SEED + n), rows, n, k)
    one_row = _one_row_calls(x, w, rows)
    packed = pack_weight(w)
    for count in (40, 64):
        for weight, layout in ((w, "row-major"), (packed, "packed")):
            _assert_bits_equal(_run(x, weight, count), one_row[:count],
                               f"{_shape_id(shape)}-R{count} {layout} vs one-row calls")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 130], ids=lambda r: f"R{r}")
def test_strided_x_and_column_slice_out(rows):
    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    n, k = 136, 264
    rng = np.random.default_rng(SEED)
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    # x: columns 16 .. 16+k of a [rows + 3, k + 40] buffer (row stride k + 40, 16-byte aligned).
    x_buffer = _random_bf16(rng, (rows + 3, k + 40))
    x = x_buffer[:, 16 : 16 + k]
    # out: columns 24 .. 24+n of a wider, poisoned buffer with two extra rows.
    out_buffer = cp.full((rows + 2, n + 40), POISON, dtype=cp.uint16)
    out = out_buffer[:, 24 : 24 + n]
    gemm_rows_bf16(x, w, out, rows=rows)

    expected = _run(cp.ascontiguousarray(x[:rows]), w, rows)
    _assert_bits_equal(out[:rows], expected, f"R{rows} strided x / sliced out vs contiguous")
    _assert_close(out[:rows], x[:rows], w, f"R{rows} strided")
    host = out_buffer.get()
    untouched = np.ones(host.shape, dtype=bool)
    untouched[:rows, 24 : 24 + n] = False
    assert (host[untouched] == POISON).all(), f"R{rows}: wrote outside columns 24..{24 + n} / rows < {rows}"


@pytest.mark.gpu
@needs_gpu
def test_bfloat16_dtype_and_rows_below_x_rows():
    import ml_dtypes

    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    try:
        cp.zeros(1, dtype=ml_dtypes.bfloat16)
    except Exception:  # this CuPy has no BF16 dtype; uint16 bits are covered everywhere else
        pytest.skip("this CuPy cannot hold ml_dtypes.bfloat16 arrays")
    rng = np.random.default_rng(SEED)
    x = _random_bf16(rng, (8, 256))
    w = _random_bf16(rng, (64, 256), scale=1 / 16)
    out = cp.full((8, 64), POISON, dtype=cp.uint16)
    gemm_rows_bf16(x.view(ml_dtypes.bfloat16), w.view(ml_dtypes.bfloat16), out.view(ml_dtypes.bfloat16), rows=3)
    _assert_bits_equal(out[:3], _run(x, w, 3), "bfloat16 views vs uint16")
    assert (out[3:].get() == POISON).all(), "rows >= rows were written"


@pytest.mark.gpu
@needs_gpu
def test_argument_errors_name_the_argument():
    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    x = cp.zeros((4, 128), cp.uint16)
    w = cp.zeros((64, 128), cp.uint16)
    out = cp.zeros((4, 64), cp.uint16)
    with pytest.raises(ValueError, match="rows must be 1..256"):
        gemm_rows_bf16(x, w, out, rows=0)
    with pytest.raises(ValueError, match="rows must be 1..256"):
        gemm_rows_bf16(cp.zeros((GEMM_ROWS_MAX_ROWS + 1, 128), cp.uint16), w, out)
    with pytest.raises(TypeError, match="^w: expected BF16"):
        gemm_rows_bf16(x, w.astype(cp.float32), out)
    with pytest.raises(TypeError, match="^out: expected BF16"):
        gemm_rows_bf16(x, w, out.astype(cp.float32))
    with pytest.raises(ValueError, match="^w: k = 124 must be a multiple of 8"):
        gemm_rows_bf16(x[:, :124], cp.zeros((64, 124), cp.uint16), out)
    with pytest.raises(ValueError, match="^x: row stride 132 must be a multiple of 8"):
        gemm_rows_bf16(cp.zeros((4, 132), cp.uint16)[:, :128], w, out)
    with pytest.raises(ValueError, match=r"^x: expected shape \[>= 4, 128\]"):
        gemm_rows_bf16(x[:, :120], w, out)
    with pytest.raises(ValueError, match=r"^out: expected shape \[>= 4, 64\]"):
        gemm_rows_bf16(x, w, out[:, :60])
    with pytest.raises(ValueError, match="^x: data pointer must be 16-byte aligned"):
        gemm_rows_bf16(cp.zeros((4, 136), cp.uint16)[:, 4:132], w, out)
    with pytest.raises(ValueError, match="^w: must be C-contiguous"):
        gemm_rows_bf16(x, cp.zeros((128, 64), cp.uint16).T, out)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 16, 64], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", GLM_SHAPES + KIMI_SHAPES, ids=_shape_id)
def test_model_projection_shapes(shape, rows):
    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(SEED)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    out = _run(x, w, rows)
    _assert_close(out, x, w, f"{_shape_id(shape)}-R{rows}")
    # Bits of the first, a middle and the last row against one-row calls.
    for r in sorted({0, rows // 2, rows - 1}):
        _assert_bits_equal(out[r : r + 1], _run(cp.ascontiguousarray(x[r : r + 1]), w, 1), f"{_shape_id(shape)}-R{rows} row {r}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 9, 40, 64, 200], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [(100, 136), (1000, 1032), (4096, 8192), (2304, 4096)], ids=_shape_id)
def test_sums_launch_gives_the_bits_and_their_sums(shape, rows):
    """gemm_rows_bf16(..., sums=...), a tensor-parallel rank's o_proj: out holds the plain launch's
    bits (row-major and packed weights, a programmatic launch too), the FP32 sums round to them
    (nearest even), they are the float64 dot products within FP32 accumulation, and nothing of a
    wider sums buffer outside rows x n is written. The argument checks name the argument."""
    import ml_dtypes

    from glm_kda.gpu.projection import gemm_rows_bf16, pack_weight

    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(SEED + 3 * n + rows)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    plain = _run(x, w, rows)
    exact = _bits_to_f64(x) @ _bits_to_f64(w).T
    packed = pack_weight(w)
    for weight, programmatic, form in ((w, False, "row-major"), (packed, False, "packed"),
                                       (packed, True, "packed, programmatic")):
        tag = f"{_shape_id(shape)}-R{rows} {form}"
        out = cp.full((rows, n), POISON, cp.uint16)
        wide = cp.full((rows + 1, n + 8), cp.nan, cp.float32)
        gemm_rows_bf16(x, weight, out, rows, sums=wide[:, 4 : 4 + n], programmatic=programmatic)
        _assert_bits_equal(out, plain, f"{tag}: out")
        sums = wide[:rows, 4 : 4 + n]
        rounded = cp.asarray(sums.get().astype(ml_dtypes.bfloat16).view(np.uint16))
        _assert_bits_equal(rounded, plain, f"{tag}: sums rounded to BF16")
        outside = cp.concatenate([wide[rows:].ravel(), wide[:, :4].ravel(), wide[:, 4 + n :].ravel()])
        assert bool(cp.isnan(outside).all()), f"{tag}: sums written outside rows x n"
        # FP32 accumulation inside the tensor cores over up to 8192 k (their internal alignment is
        # not IEEE's): within 1e-4 of the largest output, where a BF16 rounding is about 2e-3.
        error = float(cp.abs(sums - exact).max() / cp.abs(exact).max())
        assert error < 1e-4, f"{tag}: FP32 sums {error:.2e} (relative to the largest) from the float64 dot products"
    out = cp.zeros((rows, n), cp.uint16)
    with pytest.raises(TypeError, match="^sums: expected float32"):
        gemm_rows_bf16(x, w, out, rows, sums=out)
    with pytest.raises(ValueError, match=r"^sums: expected shape \[>= " + str(rows)):
        gemm_rows_bf16(x, w, out, rows, sums=cp.zeros((rows, n - 1), cp.float32))
    with pytest.raises(ValueError, match="sums takes the split-k sweep"):
        gemm_rows_bf16(x, packed, out, rows, sums=cp.zeros((rows, n), cp.float32), bulk=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 65], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [(13, 40), (100, 136), (1000, 1032)] + GLM_SHAPES + KIMI_SHAPES, ids=_shape_id)
def test_packed_weight_gives_the_row_major_bits(shape, rows):
    """gemm_rows.pack_weight's layout: every output bit of the row-major launch, for the
    model's shapes and shapes whose n and k need the zero padding; a programmatic launch
    (its L2 request walks the packed runs) too."""
    from glm_kda.gpu.projection import pack_weight

    n, k = shape
    rng = np.random.default_rng(SEED + n + rows)
    x = _random_bf16(rng, (rows, k))
    w = _random_bf16(rng, (n, k), scale=k**-0.5)
    packed = pack_weight(w)
    row_major = _run(x, w, rows)
    _assert_bits_equal(_run(x, packed, rows), row_major, f"{_shape_id(shape)}-R{rows} packed")
    _assert_bits_equal(_run(x, packed, rows, programmatic=True), row_major,
                       f"{_shape_id(shape)}-R{rows} packed, programmatic")
    assert bool((row_major != POISON).all()), f"{_shape_id(shape)}-R{rows}: outputs left unwritten"
    packed_host = pack_weight(w.get()).data
    assert np.array_equal(packed.data.get(), packed_host), f"{_shape_id(shape)}: device and host packing differ"


# Row counts of the bulk-copy sweep under test.
BULK_ROWS = (17, 24, 32, 33, 40, 64, 65, 100, 256)


def _wide_inputs(shape, seed, **layouts):
    """x [max(BULK_ROWS), k] and a [n, k] weight packed with `layouts` (pack_weight's tiles),
    random from `seed`, and one-row calls on each row of x alone (the bits every sweep must give)."""
    from glm_kda.gpu.projection import pack_weight

    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(seed)
    x = _random_bf16(rng, (max(BULK_ROWS), k))
    packed = pack_weight(_random_bf16(rng, (n, k), scale=k**-0.5), **layouts)
    one_row = cp.concatenate([_run(cp.ascontiguousarray(x[r : r + 1]), packed, 1) for r in range(max(BULK_ROWS))])
    return x, packed, one_row
def _needs_bulk():
    from glm_kda.gpu.projection import bulk_available

    if not bulk_available():
        pytest.skip("the bulk-copy sweep needs an sm_90 device (this one runs the mma.sync sweeps)")


def _run_bulk(x, w, rows, **kwargs):
    from glm_kda.gpu.projection import _gemm_rows_bulk

    out = _cp().full((rows, w.shape[0]), POISON, dtype=_cp().uint16)
    _gemm_rows_bulk(x, w, out, rows=rows, **kwargs)
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(13, 40), (100, 136), (200, 1056), (1000, 1032), (72, 2056)] + GLM_SHAPES
                         + KIMI_SHAPES, ids=_shape_id)
def test_bulk_sweep_gives_the_mma_sync_bits(shape):
    """The bulk-copy sweep (17..256 rows) writes the bits of one-row calls, hence of every sweep:
    awkward n and k (k tails, an empty last k range at k = 1056), the model's shapes; 1, 2 and 3
    warpgroups a block, the resident grid or a few blocks (each walking several tasks), a ring of
    1, 2 or the most slots, whole or split by k range (the ranges' FP32 sums folded by a second
    kernel); its tiles of x in a reused buffer; a programmatic launch behind the kernel that writes x."""
    from glm_kda.gpu.projection import x_tiles_size

    _needs_bulk()
    cp = _cp()
    n, k = shape
    x, packed, one_row = _wide_inputs(shape, SEED + 11 * n + k, tiles=True)
    x_tiles = cp.full((x_tiles_size(max(BULK_ROWS), k),), POISON, dtype=cp.uint16)
    for rows in BULK_ROWS:
        _assert_bits_equal(_run_bulk(x, packed, rows, x_tiles=x_tiles), one_row[:rows],
                           f"{_shape_id(shape)}-R{rows} bulk vs one-row calls")
    # (blocks, ring slots); a few blocks alone walk a model shape's weight slowly: 7 there.
    grids = [(None, 1), (None, 2), (None, None)] + ([(1, 1), (3, 2)] if n * k <= 1 << 22 else [(7, None)])
    for warpgroups in (1, 2, 3):
        for blocks, stages in grids:
            for split in (False, True):
                tag = f"{_shape_id(shape)}-R64 bulk warpgroups={warpgroups} blocks={blocks} stages={stages} split={split}"
                _assert_bits_equal(_run_bulk(x, packed, 64, warpgroups=warpgroups, blocks=blocks, stages=stages,
                                             split=split), one_row[:64], tag)
    for rows in (17, 100, 256):
        _assert_bits_equal(_run_bulk(x, packed, rows, split=True), one_row[:rows],
                           f"{_shape_id(shape)}-R{rows} bulk split")
    _assert_programmatic_bits(x[:40], packed, 40, one_row[:40], f"{_shape_id(shape)}-R40 bulk", bulk=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [GLM_SHAPES[0], GLM_SHAPES[3], KIMI_SHAPES[0], (200, 1056)], ids=_shape_id)
def test_bulk_sweep_keeps_the_split_k_order(shape):
    """Order-sensitive data: the bulk-copy sweep at 24, 40 and 64 rows equals one-row calls bit for bit."""
    from glm_kda.gpu.projection import pack_weight

    _needs_bulk()
    n, k = shape
    x, w = _order_sensitive(np.random.default_rng(SEED + n), 64, n, k)
    packed = pack_weight(w, tiles=True)
    one_row = _one_row_calls(x, packed, 64)
    for rows in (24, 40, 64):
        for split in (False, True):
            _assert_bits_equal(_run_bulk(x, packed, rows, split=split), one_row[:rows],
                               f"{_shape_id(shape)}-R{rows} bulk split={split} vs one-row calls (order-sensitive data)")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 16], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [GLM_SHAPES[2], KIMI_SHAPES[2], (100, 136)], ids=_shape_id)
def test_pair_and_awaiting_launches_give_the_packed_bits(shape, rows):
    """gemm_rows_pair_bf16 (two projections of two column ranges of one x, as f_b and g_b of
    down_proj) writes each projection's own bits; the awaiting entry (gemm_rows_bf16(ready=...),
    its words already at their target, programmatic behind the kernel that writes x) writes the
    packed launch's bits and sets its words back to zero."""
    from glm_kda.gpu.projection import gemm_rows_bf16, gemm_rows_pair_bf16, pack_weight

    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(SEED + n + rows)
    x = _random_bf16(rng, (rows, 2 * k + 8))
    w, w2 = (pack_weight(_random_bf16(rng, (n, k), scale=k**-0.5)) for _ in range(2))
    first, second = x[:, :k], x[:, k : 2 * k]
    out, out2 = (cp.full((rows, n), POISON, dtype=cp.uint16) for _ in range(2))
    gemm_rows_pair_bf16(first, w, out, second, w2, out2, rows=rows)
    _assert_bits_equal(out, _run(first, w, rows), f"{_shape_id(shape)} R{rows}: the pair's first projection")
    _assert_bits_equal(out2, _run(second, w2, rows), f"{_shape_id(shape)} R{rows}: the pair's second projection")
    words = cp.zeros((2,), cp.int32)
    for target in (1, 7):
        words[0] = target
        source = cp.zeros_like(first)
        cp.copyto(source, first)
        awaited = cp.full((rows, n), POISON, dtype=cp.uint16)
        gemm_rows_bf16(source, w, awaited, rows=rows, programmatic=True, ready=words, ready_target=target)
        _assert_bits_equal(awaited, _run(first, w, rows), f"{_shape_id(shape)} R{rows}: the awaiting launch")
        assert words.get().tolist() == [0, 0], f"{_shape_id(shape)} R{rows}: words after the awaiting launch"


def _awaiting_case(shape, rows, seed):
    """x [rows, k] (a column slice of a wider buffer), the packed weight, the packed launch's output
    and a pair of zero words, for a test of the staged awaiting launches."""
    from glm_kda.gpu.projection import pack_weight

    cp = _cp()
    n, k = shape
    rng = np.random.default_rng(seed)
    x = _random_bf16(rng, (rows, k + 8))[:, :k]
    w = pack_weight(_random_bf16(rng, (n, k), scale=k**-0.5))
    return x, w, _run(x, w, rows), cp.zeros((2,), cp.int32)


def _staged_awaiting_launch(x, w, rows, words, target, expected, tag) -> int:
    """gemm_rows_bf16(staged=True, ready=words) with words[0] already at `target`, into a poisoned buffer
    wider and taller than the outputs: asserts the expected bits, nothing written outside them and
    the words back at zero; returns the blocks launched."""
    from glm_kda.gpu.projection import gemm_rows_bf16

    cp = _cp()
    n = w.shape[0]
    words[0] = target
    out = cp.full((rows + 1, n + 8), POISON, dtype=cp.uint16)
    launched = gemm_rows_bf16(x, w, out[:rows, :n], rows=rows, programmatic=True, staged=True, ready=words,
                              ready_target=target)
    _assert_bits_equal(out[:rows, :n], expected, tag)
    outside = out.copy()
    outside[:rows, :n] = POISON
    assert bool((outside == POISON).all()), f"{tag}: written outside the outputs"
    assert words.get().tolist() == [0, 0], f"{tag}: words after the launch {words.get().tolist()}"
    return launched


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 2, 16], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [KIMI_SHAPES[3], KIMI_SHAPES[2], (100, 136)], ids=_shape_id)
def test_staged_awaiting_launch_gives_the_packed_bits(shape, rows):
    """gemm_rows_bf16(staged=True, ready=...): where staged_applies(w, rows) (the Kimi-Linear o_proj
    at one row, the smaller shapes at every row count) the staged awaiting entry, else the awaiting
    sweep; either way the packed launch's bits, the words back at zero, and nothing written outside
    the outputs."""
    from glm_kda.gpu.projection import staged_applies

    x, w, expected, words = _awaiting_case(shape, rows, SEED + 3 * shape[0] + rows)
    tag = f"{_shape_id(shape)} R{rows} staged={staged_applies(w, rows)}"
    for target in (1, 288):
        _staged_awaiting_launch(x, w, rows, words, target, expected, f"{tag} target {target}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("shape", [(4096, 8192), (136, 4104), (100, 136)], ids=_shape_id)
def test_tail_staged_awaiting_launch_gives_the_packed_bits(shape, rows, monkeypatch):
    """gemm_rows_bf16(staged=True, ready=...) where the whole stage does not fit (GLM-5.3-Flash's
    o_proj [4096, 8192], a 4104-deep weight) or the staged plan is turned off (_STAGED_MAX_WEIGHT_BYTES
    0), for 1 and 4 rows (_TAIL_STAGED_MAX_ROWS raised): the tail-staged entry, each warp's last k
    blocks copied into shared memory before the wait. The packed launch's bits, the words back at
    zero, nothing written outside the outputs; and a short tail (one k block) the same."""
    import functools

    from glm_kda.gpu import build
    from glm_kda.gpu import projection as gemm_rows

    if not build.hopper_enabled() or int(_cp().cuda.Device().compute_capability) < 90:
        pytest.skip("the tail-staged entry is a Hopper-only path (bulk copies into shared memory): "
                    "sm_90 features are off or the device lacks them")
    n, k = shape
    x, w, expected, words = _awaiting_case(shape, rows, SEED + 5 * n + rows)
    monkeypatch.setattr(gemm_rows, "_STAGED_MAX_WEIGHT_BYTES", 0)
    monkeypatch.setattr(gemm_rows, "_TAIL_STAGED_MAX_ROWS", 16)
    per_sm, per_block = gemm_rows.shared_memory(_cp().cuda.Device().id)
    full = gemm_rows._tail_staged_plan(n, k, rows, shared_per_sm=per_sm, shared_per_block=per_block)
    assert full is not None, f"{_shape_id(shape)} R{rows}: no tail-staged plan"
    plan_of = gemm_rows._tail_staged_plan
    for tail in (None, 1):
        monkeypatch.setattr(gemm_rows, "_tail_staged_plan", functools.partial(plan_of, tail_blocks=tail))
        plan = gemm_rows._staged_plan_here(w, rows)
        tag = f"{_shape_id(shape)} R{rows} {plan.kernel} tail {plan.tail_blocks}"
        assert plan.kernel.startswith("kda_gemm_rows_tail_staged_") and plan.tail_blocks == (tail or full.tail_blocks), tag
        launched = _staged_awaiting_launch(x, w, rows, words, 3, expected, tag)
        assert launched == plan.grid[0], f"{tag}: {launched} blocks launched, the plan has {plan.grid[0]}"
