// The tile layout of x for the bulk-copy sweep (gemm_rows_bulk.cu), which the fused decode step also
// writes: tile[G][kb][s][h][r][2 t + e] = x[64 G + r, 32 kb + 8 t + 4 s + 2 h + e] (t < 4, e < 2).
#pragma once

// The element index of x[row, column] for k_blocks blocks of 32 a row.
__device__ __forceinline__ size_t bulk_tile_element(size_t row, int column, int k_blocks)
{
    const int kk = column & 31;  // 8 t + 4 s + 2 h + e
    const size_t tile = (row >> 6) * static_cast<size_t>(k_blocks) + static_cast<size_t>(column >> 5);
    return tile * 2048 + ((((kk >> 1) & 3) * 64 + (row & 63)) * 8) + 2 * (kk >> 3) + (kk & 1);
}
