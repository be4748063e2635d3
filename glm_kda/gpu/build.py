"""Loader of the CUDA kernels in ``kernels_src/`` and the one place that launches them.

Importing this module does not touch the GPU: :class:`KernelSet` compiles and loads the modules when first
built; :func:`compile_file` needs NVRTC alone. How the sources are laid out: docs/design.md, "Kernel files".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os
import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

# (m-tiles, n-tiles) of the row projection's general entries: GEMM_ROWS_TILINGS in gemm_rows.cuh.
_GEMM_ROWS_TILINGS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2))

# file stem (its path under kernels_src, less ".cu") -> kernel entry points, in the pipeline order.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "projection/gemm_rows":
        tuple(f"kda_gemm_rows_{layout}bf16_m{m}_n{n}" for layout in ("", "packed_") for m, n in _GEMM_ROWS_TILINGS),
    "projection/gemm_rows_sums":
        tuple(f"kda_gemm_rows_{layout}bf16_m{m}_n{n}" for layout in ("sums_", "packed_sums_")
              for m, n in _GEMM_ROWS_TILINGS),
    "projection/gemm_rows_decode":
        tuple(f"kda_gemm_rows_packed_{form}_bf16_m1_n{n}" for form in ("pair", "awaiting", "awaiting_sums")
              for n in (1, 2, 4)),
    "projection/gemm_rows_staged":
        tuple(f"kda_gemm_rows_staged_awaiting_{form}bf16_m1_n{n}" for form in ("", "sums_") for n in (1, 2))
        + tuple(f"kda_gemm_rows_tail_staged_awaiting_{form}bf16_m1_n{n}" for form in ("", "sums_") for n in (1, 2, 4)),
    "conv": ("kda_conv_prefill_silu_l2_bf16",),
    "gate": ("kda_gate_beta_f32",),
    "decode/decode": ("kda_decode_fused_bf16",),
    "chunk/chunk": ("kda_chunk_prepare_f32", "kda_chunk_scan_f32"),
    "chunk/chunk_tc": ("kda_chunk_tc_prepare_f32", "kda_chunk_tc_prepare_unbounded_f32", "kda_chunk_tc_scan_f32"),
    "chunk/chunk_tc_gate": ("kda_chunk_tc_prepare_gate_f32",),
    "chunk/chunk_tc_gate_unbounded": ("kda_chunk_tc_prepare_unbounded_gate_f32",),
    "norm": ("kda_gated_rmsnorm_sigmoid_bf16",),
}

# file stem -> (architecture, entry points): families that use one architecture's own instructions
# (sm_90a: Hopper's warpgroup MMA). They are compiled for that architecture alone and loaded only on a
# device of it; the wrappers fall back to the portable kernels elsewhere (KernelSet.has).
ARCH_ENTRY_POINTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "projection/gemm_rows_bulk": ("sm_90a", ("kda_gemm_rows_tile_x_bf16",) + tuple(f"kda_gemm_rows_bulk_g{g}" for g in (1, 2, 3))
                                  + ("kda_gemm_rows_bulk_fold_bf16",)),
}

# The kernel source files, one per family (the keys of ENTRY_POINTS and ARCH_ENTRY_POINTS plus ".cu").
KERNEL_FILES: tuple[str, ...] = tuple(f"{stem}.cu" for stem in (*ENTRY_POINTS, *ARCH_ENTRY_POINTS))

# Threads compiling kernel files at once: every file at once where the cores allow (docs/design.md, "Kernel files").
_COMPILE_THREADS = max(1, min(16, os.cpu_count() or 1))

# A header every kernel folder holds: how kernels_dir recognises one.
MARKER_HEADER = "common/head.cuh"

# Precise math, and -ftz=true as in CuPy's own builds (docs/design.md, "Kernel files").
COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-ftz=true")

# `#include "dir/name.cuh"` of a header under the kernel folder (inlined; any other include is an
# error for NVRTC, which has no include path).
_INCLUDE_HEADER = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]((?:[A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.cuh)[>"]')


def kernels_dir() -> Path:
    """The folder holding the kernel sources (the one with MARKER_HEADER).

    ``<package>/kernels_src`` in an installed wheel, else ``<repository>/kernels_src`` in a
    source checkout (the package is ``glm_kda``, this module ``glm_kda/gpu/build.py``).
    """
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "kernels_src", package.parent / "kernels_src"):
        if (candidate / MARKER_HEADER).is_file():
            return candidate
    raise FileNotFoundError(f"kernel sources not found: neither {package / 'kernels_src'} nor "
                            f"{package.parent / 'kernels_src'} holds {MARKER_HEADER}")


def _line_directive(line: int, path: Path) -> str:
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line {line} "{quoted}"'


def kernel_source(stem: str, directory: Path | str | None = None) -> str:
    """The text of ``<stem>.cu`` with its headers (included by their path under the kernel folder,
    ``"common/bf16.cuh"``) inlined at their first include, recursively; later includes are dropped.
    ``#line`` directives before each part and after each inlined header keep every line's real file
    and number for the compiler's messages.
    """
    folder = Path(directory) if directory is not None else kernels_dir()
    parts: list[str] = []
    inlined: set[Path] = set()

    def inline(path: Path) -> None:
        parts.append(_line_directive(1, path))
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            match = _INCLUDE_HEADER.match(line)
            if match is None:
                parts.append(line)
                continue
            header = (folder / match.group(1)).resolve()
            if not header.is_file():
                raise FileNotFoundError(f"{path.name}:{number} includes {match.group(1)}, which is not in {folder}")
            if header not in inlined:
                inlined.add(header)
                inline(header)
            parts.append(_line_directive(number + 1, path))

    inline((folder / f"{stem}.cu").resolve())
    return "\n".join(parts) + "\n"


# Compilation without a GPU (NVRTC only) -----------------------------------------------------------


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel file; the message carries the compiler log."""


@dataclass(frozen=True)
class CompiledFile:
    """One kernel file compiled for one architecture."""

    stem: str
    arch: str
    cubin: bytes
    log: str


def compile_file(stem: str, arch: str, directory: Path | str | None = None) -> CompiledFile:
    """Compile ``<stem>.cu`` to a cubin for ``arch`` (e.g. "sm_90") with NVRTC.

    Needs the NVRTC library only (the nvidia-cuda-nvrtc-cu12 wheel), no driver. Raises
    KernelCompileError with the full compiler log on failure. The log holds ptxas' report of each
    entry's resources unless NVRTC answered from its compute cache.
    """
    from cupy.cuda import nvrtc

    source = kernel_source(stem, directory)
    options = [*COMPILE_OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    program = nvrtc.createProgram(source, f"{stem}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program).rstrip("\x00")
            raise KernelCompileError(f"NVRTC failed to compile {stem}.cu for {arch} ({error}):\n{log}") from None
        log = nvrtc.getProgramLog(program).rstrip("\x00")
        return CompiledFile(stem=stem, arch=arch, cubin=nvrtc.getCUBIN(program), log=log)
    finally:
        nvrtc.destroyProgram(program)


# Loading on a GPU ---------------------------------------------------------------------------------


def _private_folder(folder: Path) -> None:
    """Make `folder` (the default cubin cache, in the shared temporary folder) this user's own, or
    refuse it: a folder there that another user made, or may write to, could hold a cubin of theirs
    under the name this process would load."""
    import stat

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(f"the kernel cache folder {folder} is not a folder of this user's that only they may write "
                           "to; remove it, or name another in GLM_KDA_CUBIN_CACHE")


def _cached_cubin(stem: str, arch: str, directory: Path | str | None) -> Path:
    """The cubin of ``<stem>.cu`` for ``arch``, compiled by NVRTC once and kept in a file named by
    the hash of its source and options (CuPy's own cache compiles for the device's portable
    architecture only, not for an "a" architecture)."""
    import hashlib
    import tempfile

    from cupy.cuda import nvrtc

    source = kernel_source(stem, directory)
    # (The compiler's version too: a cubin of another NVRTC is not this one's.)
    parts = [source, arch, *COMPILE_OPTIONS, repr(nvrtc.getVersion())]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    chosen = os.environ.get("GLM_KDA_CUBIN_CACHE")
    folder = Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"glm_kda-{os.getuid()}"
    if not chosen:
        _private_folder(folder)
    path = folder / f"{stem.replace('/', '-')}-{arch}-{key}.cubin"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(compile_file(stem, arch, directory).cubin)
        partial.replace(path)
    return path


class KernelSet:
    """Every entry point of ENTRY_POINTS (and ARCH_ENTRY_POINTS of the device's architecture) compiled
    and loaded on one device, one module per file; a missing entry point is an error naming all missing
    ones. :meth:`get` gives the current device's instance. ``directory``: the sources (:func:`kernels_dir`).
    """

    _instances: dict[int, "KernelSet"] = {}

    def __init__(self, directory: Path | str | None = None) -> None:
        import cupy

        self.device_id: int = cupy.cuda.Device().id
        self.modules: dict[str, Any] = {}
        self.functions: dict[str, Any] = {}
        # Largest dynamic shared memory each kernel has been opted in to.
        self._dynamic_shared_limit: dict[str, int] = {}
        self._carveout: dict[str, int] = {}
        device_arch = f"sm_{cupy.cuda.Device().compute_capability}a"
        folder = Path(directory) if directory is not None else kernels_dir()
        # (stem, entry points, architecture of its own cubin or None for CuPy's portable build).
        families = [(stem, names, None) for stem, names in ENTRY_POINTS.items()]
        # Another version of the sources may predate an architecture's family: its set runs the portable kernels.
        families += [(stem, names, arch) for stem, (arch, names) in ARCH_ENTRY_POINTS.items()
                     if arch == device_arch and (folder / f"{stem}.cu").is_file()]

        sources = {stem: kernel_source(stem, directory) for stem, _, _ in families}

        def load(family: tuple) -> Any:
            stem, _, arch = family
            with cupy.cuda.Device(self.device_id):  # (a worker thread starts on device 0)
                if arch is not None:
                    return cupy.RawModule(path=str(_cached_cubin(stem, arch, directory)))
                module = cupy.RawModule(code=sources[stem], options=COMPILE_OPTIONS)
                module.compile()  # now, in this thread: NVRTC runs without the GIL
                return module

        # The longest sources first (docs/design.md, "Kernel files").
        families.sort(key=lambda family: -len(sources[family[0]]))
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(families), _COMPILE_THREADS)) as pool:
            modules = list(pool.map(load, families))
        missing: list[str] = []
        for (stem, names, _), module in zip(families, modules):
            self.modules[stem] = module
            for name in names:
                try:
                    self.functions[name] = module.get_function(name)
                except cupy.cuda.driver.CUDADriverError:
                    missing.append(f"{stem}.cu:{name}")
        if missing:
            raise RuntimeError(f"kernel entry points not found: {', '.join(missing)}")

    @classmethod
    def get(cls) -> "KernelSet":
        """The KernelSet of the current CUDA device, built on first use."""
        import cupy

        device_id = cupy.cuda.Device().id
        instance = cls._instances.get(device_id)
        if instance is None:
            instance = cls._instances[device_id] = cls()
        return instance

    @classmethod
    def install(cls, kernel_set: "KernelSet") -> "KernelSet":
        """Launch the kernels of ``kernel_set`` (built on the current device, say from another
        version of the sources) from now on; returns the set that was in use. For same-process
        comparisons: graphs captured before keep the kernels they were captured with, so a
        layer must drop its graphs after the switch."""
        import cupy

        device_id = cupy.cuda.Device().id
        if kernel_set.device_id != device_id:
            raise ValueError(f"the kernel set was built on device {kernel_set.device_id}, not on the current "
                             f"device {device_id}")
        previous = cls.get()
        cls._instances[device_id] = kernel_set
        return previous

    def has(self, name: str) -> bool:
        """Whether this set holds entry point ``name`` (an architecture's own family is loaded only
        on a device of that architecture)."""
        return name in self.functions

    def function(self, name: str) -> Any:
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"unknown kernel {name!r}; known: {sorted(self.functions)}") from None

    def ensure_dynamic_shared(self, name: str, shared_mem: int) -> None:
        """Opt ``name`` in to ``shared_mem`` bytes of dynamic shared memory (above 48 KiB
        a kernel must ask for it explicitly)."""
        # Opted in on first use whatever the size: 48 KiB of dynamic memory may be refused when
        # the kernel declares static shared memory as well.
        if shared_mem <= self._dynamic_shared_limit.get(name, 0):
            return
        import cupy

        runtime = cupy.cuda.runtime
        device_limit = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, self.device_id)
        if shared_mem > device_limit:
            raise ValueError(f"{name} needs {shared_mem} bytes of shared memory per block; this device allows "
                             f"{device_limit} (use a smaller chunk)")
        self.function(name).max_dynamic_shared_size_bytes = shared_mem
        self._dynamic_shared_limit[name] = shared_mem

    def prefer_shared_carveout(self, name: str, percent: int) -> None:
        """Ask that an SM running ``name`` split its L1 / shared memory as ``percent`` % shared
        (-1: the driver's choice). A hint, set once per value. Kernels that are to share SMs
        (a programmatic dependent starting beside the kernel before it) must ask for the same
        split: an SM runs blocks of one split at a time."""
        if self._carveout.get(name, -1) == percent:
            return
        self.function(name).preferred_shared_memory_carveout = percent
        self._carveout[name] = percent


# Timing and the launch point ----------------------------------------------------------------------


@dataclass
class StageTimer:
    """Per-kernel GPU time, measured with a pair of CUDA events around each launch (see
    :func:`launching`)."""

    _pending: list[tuple[str, Any, Any]] = field(default_factory=list)
    totals_ms: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, start: Any, end: Any) -> None:
        self._pending.append((name, start, end))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the launches inside the block under ``name`` (nothing where the block raises)."""
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        yield
        end.record()
        self.record(name, start, end)

    def synchronize(self) -> None:
        """Wait for the recorded launches and fold their times into the totals."""
        import cupy

        for name, start, end in self._pending:
            end.synchronize()
            self.totals_ms[name] = self.totals_ms.get(name, 0.0) + cupy.cuda.get_elapsed_time(start, end)
            self.calls[name] = self.calls.get(name, 0) + 1
        self._pending.clear()

    def summary(self) -> dict[str, float]:
        """Total milliseconds per kernel or stage name, largest first (after synchronize)."""
        return dict(sorted(self.totals_ms.items(), key=lambda item: -item[1]))

    def table(self) -> str:
        """The summary as aligned text: name, calls, total ms."""
        rows = [f"{'kernel':32s} {'calls':>7s} {'total ms':>10s}"]
        for name, total in self.summary().items():
            rows.append(f"{name:32s} {self.calls[name]:7d} {total:10.3f}")
        return "\n".join(rows)


@dataclass(frozen=True)
class LaunchContext:
    """How the launches of one call are made, set by the layer from its options for the call (:func:`launching`).

    hopper: programmatic dependent launches and the sm_90a kernel families where the device has them
    (False: the portable path). timer: per-launch CUDA events are recorded there (launches run eagerly)."""

    hopper: bool = True
    timer: StageTimer | None = None


_CONTEXT: contextvars.ContextVar[LaunchContext] = contextvars.ContextVar("glm_kda_launch_context",
                                                                         default=LaunchContext())


def current_context() -> LaunchContext:
    """The LaunchContext of the launches being made now."""
    return _CONTEXT.get()


@contextlib.contextmanager
def launching(context: LaunchContext) -> Iterator[LaunchContext]:
    """Make the launches inside the block under ``context``."""
    token = enter_context(context)
    try:
        yield context
    finally:
        exit_context(token)


@contextlib.contextmanager
def timing(hopper: bool = True) -> Iterator[StageTimer]:
    """Time every launch inside the block: ``with timing() as t: ...`` then ``t.summary()``.
    The totals are complete once the block has exited."""
    timer = StageTimer()
    try:
        with launching(LaunchContext(hopper=hopper, timer=timer)):
            yield timer
    finally:
        timer.synchronize()


def enter_context(context: LaunchContext) -> contextvars.Token:
    """Make the launches from now on under ``context`` until :func:`exit_context` (the layer's
    per-call form of :func:`launching`, without a generator's cost on the decode path)."""
    return _CONTEXT.set(context)


def exit_context(token: contextvars.Token) -> None:
    _CONTEXT.reset(token)


def hopper_enabled() -> bool:
    """Whether the launches being made may use sm_90 features (the device must have them too)."""
    return _CONTEXT.get().hopper


# Programmatic dependent launch (sm_90 and later, through cuLaunchKernelEx) ------------------------

# cuLaunchAttributeID CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]


@dataclass
class _ProgrammaticLauncher:
    """cuLaunchKernelEx of the driver, or why programmatic launches fall back to plain ones."""

    launch_ex: Any = None
    unavailable: str | None = None
    devices: dict[int, bool] = field(default_factory=dict)

    def usable(self, device_id: int) -> bool:
        if self.launch_ex is None and self.unavailable is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
                self.launch_ex = driver.cuLaunchKernelEx
                self.launch_ex.restype = ctypes.c_int
                self.launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            except (OSError, AttributeError) as exc:
                self.unavailable = f"no cuLaunchKernelEx in the driver: {exc}"
        if self.launch_ex is None:
            return False
        if device_id not in self.devices:
            import cupy

            self.devices[device_id] = int(cupy.cuda.Device(device_id).compute_capability) >= 90
        return self.devices[device_id]

    def launch(self, function: Any, grid: tuple, block: tuple, args: Sequence[Any], shared_mem: int,
               stream: int) -> int:
        """cuLaunchKernelEx of a cupy RawKernel (its CUfunction) on `stream` (a CUstream handle)
        with programmatic serialization; returns the CUresult."""
        values = kernel_parameters(args)
        params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1
        config = _LaunchConfig(*(grid + (1,) * (3 - len(grid))), *(block + (1,) * (3 - len(block))), shared_mem,
                               stream, ctypes.pointer(attribute), 1)
        handle = function.kernel.ptr if hasattr(function, "kernel") else function.ptr
        return self.launch_ex(ctypes.byref(config), handle, params, None)


def kernel_parameters(args: Sequence[Any]) -> list:
    """ctypes values of a launch's arguments: device arrays (anything with .data.ptr) as
    pointers, None as a null pointer, numpy int32 / int64 / float32 scalars as themselves."""
    import numpy

    scalars = {numpy.int32: ctypes.c_int32, numpy.int64: ctypes.c_int64, numpy.float32: ctypes.c_float}
    values: list = []
    for index, arg in enumerate(args):
        if arg is None:
            values.append(ctypes.c_void_p(None))
        elif hasattr(arg, "data") and hasattr(arg.data, "ptr"):
            values.append(ctypes.c_void_p(arg.data.ptr))
        elif type(arg) in scalars:
            values.append(scalars[type(arg)](arg.item()))
        else:
            raise TypeError(f"kernel argument {index}: unsupported type {type(arg).__name__} "
                            "(a device array, None, or a numpy int32 / int64 / float32)")
    return values


_PROGRAMMATIC = _ProgrammaticLauncher()


def launch(name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0, *,
           programmatic: bool = False, carveout: int = -1) -> None:
    """Launch kernel ``name`` on the current stream.

    ``args`` are cupy arrays (passed as device pointers), None (a null pointer) and numpy.int32 /
    numpy.float32 scalars, in the kernel's parameter order; the wrappers in :mod:`glm_kda.gpu.ops`
    build them. ``programmatic``: a programmatic dependent launch (see kda_grid_dependency_wait
    in common/sync.cuh: the kernel must wait before it touches anything the previous kernel writes);
    a plain launch where the device or driver cannot, or where the current LaunchContext says so
    (portable path, timing). ``carveout``: the preferred shared-memory split in percent (see
    :meth:`KernelSet.prefer_shared_carveout`; -1 the driver's choice).
    """
    kernel_set = KernelSet.get()
    function = kernel_set.function(name)
    if shared_mem > 0:
        kernel_set.ensure_dynamic_shared(name, shared_mem)
    kernel_set.prefer_shared_carveout(name, carveout)
    grid = tuple(int(value) for value in grid)
    block = tuple(int(value) for value in block)
    context = _CONTEXT.get()
    if programmatic and context.hopper and context.timer is None and _PROGRAMMATIC.usable(kernel_set.device_id):
        import cupy

        result = _PROGRAMMATIC.launch(function, grid, block, args, shared_mem, cupy.cuda.get_current_stream().ptr)
        if result == 0:
            return
        # Refused (an older driver, a capture mode that cannot hold the edge): plain launches from now on.
        _PROGRAMMATIC.unavailable = f"cuLaunchKernelEx returned CUresult {result}"
        _PROGRAMMATIC.launch_ex = None
    if context.timer is None:
        function(grid, block, tuple(args), shared_mem=shared_mem)
    else:
        with context.timer.span(name):
            function(grid, block, tuple(args), shared_mem=shared_mem)
