"""The transformers integration hands torch's stream to CuPy through the CUDA stream protocol (no torch
or GPU needed: CuPy wraps a handle without calling the driver)."""

from __future__ import annotations

import warnings

from glm_kda.integrations.transformers import cupy_stream


def test_torch_stream_handle_becomes_a_cupy_stream_without_deprecation():
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CuPy 14 deprecates ExternalStream
        stream = cupy_stream(0x1234)
    assert isinstance(stream, cupy.cuda.Stream) and stream.ptr == 0x1234
