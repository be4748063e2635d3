"""One thin launch wrapper per kernel family, named after the kernel it launches (each module's docstring says
which); the decode-side projection lives in :mod:`glm_kda.gpu.projection` with its launch planning."""

from .checks import HEAD_DIM, MAX_GRID_Y, projection_args, recurrent_state_heads
from .chunk import chunk_count, chunk_prepare_smem_bytes, kda_chunk_prepare_f32, kda_chunk_scan_f32
from .conv import kda_conv_prefill_silu_l2_bf16
from .cublas import BF16_ROUND_SOURCE, gemm_bf16_cublas, round_to_bf16
from .decode_step import kda_decode_fused_bf16
from .gate import check_gate_sources, kda_gate_beta_f32
from .norm import kda_gated_rmsnorm_sigmoid_bf16

__all__ = ["BF16_ROUND_SOURCE", "HEAD_DIM", "MAX_GRID_Y", "check_gate_sources", "chunk_count",
           "chunk_prepare_smem_bytes", "kda_conv_prefill_silu_l2_bf16", "kda_gate_beta_f32",
           "kda_gated_rmsnorm_sigmoid_bf16", "gemm_bf16_cublas", "kda_chunk_prepare_f32", "kda_chunk_scan_f32",
           "kda_decode_fused_bf16", "projection_args", "recurrent_state_heads", "round_to_bf16"]
