"""Does wgmma (sm_90a) add the products of a k16 step to the bits mma.sync m16n8k16 gives? One JSON line.

gemm_rows' decode sweeps chain mma.sync m16n8k16 over k blocks of 32, two k16 steps a block, the
k slots of lane (g, t) in step s being physical k 8t + 4s + e (logical 2t + e) and 8t + 4s + 2 + e
(logical 2t + 8 + e). A 64-row sweep on wgmma m64nNk16 could keep that order: w as A from registers
(the same fragments, 16 columns a warp, 64 a warpgroup) and x as B from shared memory, each x row's
k16 step stored with its words in the same logical slots (the 4 x 4 words of a 32-k block transposed:
piece h of step s holds word 2s + h of each 16-byte chunk). If the tensor cores sum a k16 step the
same way in both instructions, the two chains give the same bits and batched decode may run on
wgmma without breaking batch invariance. This measures it: per case x [64, K], w [64, K] (BF16;
plain normal values, values over a wide exponent range, near-cancelling pairs), the same chain
from zero through both instructions, every one of the 4096 outputs compared bit for bit, for N of
64, 32 and 8 rows per wgmma, and both readings of the descriptor's two byte offsets (only the right
one also matches a float64 product, which is reported).

    PYTHONPATH=. python benchmarks/wgmma_forms.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mma_forms import MMA_HELPERS, bf16_bits  # noqa: E402

from glm_kda.cli import script_help  # noqa: E402
from glm_kda.device import exit_unless_gpu  # noqa: E402


def _wgmma_asm(n: int) -> str:
    """The inline asm of one wgmma m64n<n>k16, A from 4 registers, B by descriptor, D += A B."""
    d = ", ".join(f"%{i}" for i in range(n // 2))
    a = ", ".join(f"%{n // 2 + i}" for i in range(4))
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    return (
        f'asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 '
        f'{{{d}}}, {{{a}}}, %{n // 2 + 4}, 1, 1, 1, 0;" : {outputs} '
        f': "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc) : "memory");'
    )


def _source(n: int) -> str:
    return f"#define N {n}\n" + r"""
""" + MMA_HELPERS + r"""
__device__ __forceinline__ void wgmma_step(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc)
{
    WGMMA_ASM
}

// One warpgroup per case: w [64, K] as A (warp w: columns 16 w + g, + 8), x [N, K] as B.
// out_*[column * N + row].
extern "C" __global__ void __launch_bounds__(128) wgmma_forms(const unsigned short* x_all, const unsigned short* w_all,
                                                              int k_total, unsigned lbo, unsigned sbo,
                                                              float* out_mma, float* out_wgmma)
{
    // [step][half][row group][row % 8][word]: core matrices of 8 rows x 16 bytes. Four times the
    // room, so that the wrong reading of the descriptor's offsets reads garbage, not past the end.
    __shared__ __align__(1024) unsigned stage_room[4][2][2][N / 8][8][4];
    auto& stage = stage_room[0];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const unsigned short* x = x_all + static_cast<size_t>(blockIdx.x) * N * k_total;
    const unsigned short* w = w_all + static_cast<size_t>(blockIdx.x) * 64 * k_total;
    float ref[N / 8][4] = {};
    float d[N / 2] = {};
    const int col = 16 * warp + g;
    for (int kb = 0; kb < k_total; kb += 32) {
        unsigned a[2][4];
        for (int s = 0; s < 2; ++s) {
            const int p0 = kb + 8 * t + 4 * s, p1 = p0 + 2;
            a[s][0] = pair_at(w, k_total, col, p0);
            a[s][1] = pair_at(w, k_total, col + 8, p0);
            a[s][2] = pair_at(w, k_total, col, p1);
            a[s][3] = pair_at(w, k_total, col + 8, p1);
            for (int h = 0; h < N / 8; ++h) {
                mma16816(ref[h], a[s][0], a[s][1], a[s][2], a[s][3], pair_at(x, k_total, 8 * h + g, p0),
                         pair_at(x, k_total, 8 * h + g, p1));
            }
        }
        for (int index = tid; index < 2 * 2 * N * 4; index += 128) {
            const int c = index & 3, r = (index >> 2) % N, h = (index / (4 * N)) & 1, s = index / (8 * N);
            stage[s][h][r >> 3][r & 7][c] = pair_at(x, k_total, r, kb + 8 * c + 4 * s + 2 * h);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        for (int s = 0; s < 2; ++s) {
            const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(&stage[s][0][0][0][0]));
            const unsigned long long desc = static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
                                            (static_cast<unsigned long long>(lbo >> 4) << 16) |
                                            (static_cast<unsigned long long>(sbo >> 4) << 32);
            wgmma_step(d, a[s], desc);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncthreads();
    }
    float* o_mma = out_mma + static_cast<size_t>(blockIdx.x) * 64 * N;
    float* o_wgmma = out_wgmma + static_cast<size_t>(blockIdx.x) * 64 * N;
    for (int h = 0; h < N / 8; ++h) {
        for (int e = 0; e < 4; ++e) {
            const int c = col + 8 * (e >> 1), r = 8 * h + 2 * t + (e & 1);
            o_mma[c * N + r] = ref[h][e];
            o_wgmma[c * N + r] = d[4 * h + e];
        }
    }
}
""".replace("WGMMA_ASM", _wgmma_asm(n))


def _kernel(n: int):
    from cupy.cuda import nvrtc

    source = _source(n)
    program = nvrtc.createProgram(source, f"wgmma_forms_{n}.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-std=c++17", "--gpu-architecture=sm_90a"])
    except nvrtc.NVRTCError as error:
        raise RuntimeError(f"{error}\n{nvrtc.getProgramLog(program)}") from None
    path = Path(tempfile.mkdtemp()) / f"wgmma_forms_{n}.cubin"
    path.write_bytes(nvrtc.getCUBIN(program))
    return cupy.RawModule(path=str(path)).get_function("wgmma_forms")


def _operands(rng, name: str, cases: int, rows: int, k_total: int):
    shape_x, shape_w = (cases, rows, k_total), (cases, 64, k_total)
    if name == "normal":
        return rng.standard_normal(shape_x), rng.standard_normal(shape_w)
    if name == "wide_exponents":
        def wide(shape):
            return rng.choice([-1.0, 1.0], shape) * np.exp2(rng.integers(-24, 24, shape)) * rng.uniform(1, 2, shape)
        return wide(shape_x), wide(shape_w)
    x, w = rng.standard_normal(shape_x), rng.standard_normal(shape_w)
    x[..., 1::2] = -x[..., 0::2] * (1 + rng.integers(-4, 5, x[..., 1::2].shape) * 2.0 ** -8)
    w[..., 1::2] = w[..., 0::2]
    x[..., ::7] *= 2.0 ** -20
    return x, w


def main() -> None:
    rng = np.random.default_rng(2027)
    results = {}
    for n in (64, 32, 8):
        kernel = _kernel(n)
        for name, k_total, cases in (("normal", 2048, 256), ("wide_exponents", 2048, 256), ("cancelling", 512, 512)):
            x, w = _operands(rng, name, cases, n, k_total)
            xb, wb = bf16_bits(x), bf16_bits(w)
            exact = np.einsum("crk,cjk->cjr", (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64),
                              (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
            scale = np.abs(exact).max(axis=(1, 2), keepdims=True) + 1e-300
            x_device, w_device = cupy.asarray(xb), cupy.asarray(wb)
            for lbo, sbo in ((n // 8 * 128, 128), (128, n // 8 * 128)):
                out_mma = cupy.empty((cases, 64, n), cupy.float32)
                out_wgmma = cupy.empty((cases, 64, n), cupy.float32)
                kernel((cases,), (128,), (x_device, w_device, np.int32(k_total), np.uint32(lbo), np.uint32(sbo),
                                          out_mma, out_wgmma))
                a, b = out_mma.get(), out_wgmma.get()
                results[f"n{n}_{name}_lbo{lbo}_sbo{sbo}"] = {
                    "outputs": int(a.size),
                    "differing_bits": int((a.view(np.uint32) != b.view(np.uint32)).sum()),
                    "mma_error": float(np.abs(a - exact).max() / scale.max()),
                    "wgmma_error": float(np.nanmax(np.abs(b - exact) / scale)),
                }
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(json.dumps({"device": device["name"].decode(), "cc": f"{device['major']}.{device['minor']}", **results}))


if __name__ == "__main__":
    script_help(__doc__)
    exit_unless_gpu("the warpgroup-MMA forms check")
    main()
