"""Is there a CUDA GPU we can use? Answered once, without failing on machines that have none."""

from __future__ import annotations

import functools


class NoGpuError(RuntimeError):
    """A GPU entry point was called on a machine without a usable CUDA device."""


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(available, description): the device name, or why none can be used."""
    try:
        import cupy
    except Exception as exc:  # pragma: no cover - cupy is a dependency
        return False, f"cupy cannot be imported ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA driver or device ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "the CUDA driver reports no device"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return True, f"{name} (sm_{props['major']}{props['minor']})"
    except Exception as exc:
        return False, f"the CUDA device cannot be queried ({type(exc).__name__}: {exc})"


def require_gpu(what: str = "this call") -> None:
    """Raise NoGpuError saying why `what` cannot run here."""
    ok, why = gpu_status()
    if not ok:
        raise NoGpuError(f"{what} needs a CUDA GPU: {why}. The NumPy oracle (glm_kda.reference) runs without one.")
