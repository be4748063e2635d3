"""Every kernel file compiles with NVRTC for every supported architecture.

Runs without a GPU or driver: it needs only the NVRTC library (the
nvidia-cuda-nvrtc-cu12 wheel). Each (file, architecture) pair is compiled once,
in a module-scoped fixture. Run with ``pytest -s`` to see the register / spill
table.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import kernel_report
from glm_kda.gpu import build as kernels
from glm_kda.gpu import ops

# NVRTC 13 serves repeated compiles from the CUDA compute cache and then prints
# no ptxas report; the switch is read when the library loads, so set it before
# any test compiles (kernel_report.compile_file falls back to a child process otherwise).
os.environ.setdefault("CUDA_CACHE_DISABLE", "1")

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120", "sm_121")

# The chunk kernels keep a D-float state column (scan) or large unrolled loops in
# registers and may spill on some architectures; the table reports it. The tensor-core
# prepare runs two blocks per SM under a 128-register cap (4 to 8 bytes spill on sm_80,
# sm_100 and sm_120 / sm_121; test_chunk_tc requires none on sm_90). Every other kernel must not spill.
SPILL_ALLOWED = frozenset({"kda_chunk_prepare_f32", "kda_chunk_scan_f32", "kda_chunk_tc_prepare_f32",
                           "kda_chunk_tc_prepare_gate_f32"})


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], kernels.CompiledFile]:
    return {
        (stem, arch): kernel_report.compile_file(stem, arch)
        for stem in kernels.ENTRY_POINTS
        for arch in ARCHS
    }


def _resource_table(compiled, arch: str) -> str:
    rows = [f"{'kernel':30s} {'regs':>5s} {'spill st':>9s} {'spill ld':>9s} {'stack':>6s} {'smem':>6s}  ({arch})"]
    for stem, names in kernels.ENTRY_POINTS.items():
        resources = kernel_report.parse_ptxas_log(compiled[(stem, arch)].log)
        for name in names:
            r = resources[name]
            rows.append(
                f"{name:30s} {r['registers']:5d} {r['spill_stores']:9d} {r['spill_loads']:9d} "
                f"{r['stack_frame']:6d} {r['shared']:6d}"
            )
    return "\n".join(rows)


def test_kernel_files_match_entry_points():
    folder = kernels.kernels_dir()
    assert sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*.cu")) == sorted(kernels.KERNEL_FILES)
    families = {**kernels.ENTRY_POINTS, **{stem: names for stem, (_, names) in kernels.ARCH_ENTRY_POINTS.items()}}
    tilings_define = re.search(r"#define GEMM_ROWS_TILINGS\(ENTRY\)(.*?)(?:\n\n|\Z)", (folder / "projection/gemm_rows.cuh").read_text(), re.S)
    tilings = re.findall(r"ENTRY\((\d+), (\d+)\)", tilings_define.group(1))
    for stem, names in families.items():
        text = (folder / f"{stem}.cu").read_text()
        declared = re.findall(r'^extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\s*\(', text, re.M)
        # gemm_rows.cu declares its variants through macros: GEMM_ROWS_ENTRY(m-tiles, tiles) over every pair of
        # GEMM_ROWS_TILINGS (gemm_rows.cuh), one entry per weight layout, gemm_rows_sums.cu GEMM_ROWS_SUMS_ENTRY,
        # their forms writing the sums, ...
        for entry, layouts in (("GEMM_ROWS_ENTRY", ("", "packed_")), ("GEMM_ROWS_SUMS_ENTRY", ("sums_", "packed_sums_"))):
            if re.search(rf"^GEMM_ROWS_TILINGS\({entry}\)", text, re.M):
                declared += [f"kda_gemm_rows_{layout}bf16_m{m}_n{n}" for layout in layouts for m, n in tilings]
        # ... GEMM_ROWS_STAGED_ENTRY(tiles) and GEMM_ROWS_TAIL_STAGED_ENTRY(tiles), the staged awaiting entries
        # (packed, one m-tile), also writing the sums ...
        declared += [f"kda_gemm_rows_{kind}staged_awaiting_{form}bf16_m1_n{n}"
                     for kind, n in re.findall(r"^GEMM_ROWS_(TAIL_)?STAGED_ENTRY\((\d+)\)", text, re.M)
                     for form in ("", "sums_")]
        declared = [name.replace("TAIL_", "tail_") for name in declared]
        # ... and GEMM_ROWS_DECODE_ENTRIES(tiles), the pair and the awaiting entry (also writing the sums).
        declared += [f"kda_gemm_rows_packed_{form}_bf16_m1_n{n}" for n in
                     re.findall(r"^GEMM_ROWS_DECODE_ENTRIES\((\d+)\)", text, re.M)
                     for form in ("pair", "awaiting", "awaiting_sums")]
        # gemm_rows_bulk.cu declares its sweeps through GEMM_BULK_ENTRY(warpgroups).
        declared += [f"kda_gemm_rows_bulk_g{groups}" for groups in re.findall(r"^GEMM_BULK_ENTRY\((\d+)\)", text, re.M)]
        # The chunk_tc*.cu files declare their prepares through CHUNK_TC_PREPARE_ENTRY(name, unbounded)
        # and CHUNK_TC_PREPARE_GATE_ENTRY(name, unbounded).
        declared += re.findall(r"^CHUNK_TC_PREPARE(?:_GATE)?_ENTRY\((\w+), \w+\)", text, re.M)
        assert sorted(declared) == sorted(names) and len(set(declared)) == len(declared), \
            f"{stem}.cu declares {declared}, ENTRY_POINTS says {names}"


def test_every_kernel_file_opens_with_what_it_computes():
    """Each .cu file starts with a comment (what it computes, its launch geometry and why), and every
    header it includes is named by its path under kernels_src."""
    folder = kernels.kernels_dir()
    for name in kernels.KERNEL_FILES:
        text = (folder / name).read_text()
        assert text.startswith("// ") and "Launch" in text.split("#include")[0], f"{name}: no opening comment"
    for path in folder.rglob("*.cu*"):
        for header in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
            assert (folder / header).is_file(), f"{path.name} includes {header}, not a path under {folder}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stem", list(kernels.ENTRY_POINTS))
def test_entry_points_in_cubin(compiled, stem, arch):
    result = compiled[(stem, arch)]
    symbols = kernel_report.cubin_function_symbols(result.cubin)
    for name in kernels.ENTRY_POINTS[stem]:
        assert name in symbols, f"{name} missing from the symbols of {stem}.cu's {arch} cubin"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_spills_outside_chunk_kernels(compiled, arch):
    print("\n" + _resource_table(compiled, arch))
    spilling = []
    for stem, names in kernels.ENTRY_POINTS.items():
        resources = kernel_report.parse_ptxas_log(compiled[(stem, arch)].log)
        for name in names:
            r = resources[name]
            assert r["stack_frame"] >= 0, f"{arch}: ptxas's stack frame and spill line for {name} was not parsed"
            if name not in SPILL_ALLOWED and max(r["spill_stores"], r["spill_loads"]) > 0:
                spilling.append(f"{name}: {r['spill_stores']} B stores, {r['spill_loads']} B loads")
    assert not spilling, f"register spills on {arch}: {spilling}"


# Code size every entry point must stay under. Measured on an H200: the fused-gate prepare at
# 145 KB of SASS spent 6.7 of its 14.5 cycles per instruction waiting for instruction fetch and
# ran 4.84 ms; at 94 KB, 2.10 ms. The plain prepare went from 125 KB (2.16 ms) to 82 KB (1.99).
CODE_SIZE_LIMIT = 112 * 1024


@pytest.mark.parametrize("arch", ARCHS)
def test_code_fits_the_instruction_cache(compiled, arch):
    sizes = {}
    for stem in kernels.ENTRY_POINTS:
        sizes.update(kernel_report.cubin_function_sizes(compiled[(stem, arch)].cubin))
    for names in kernels.ENTRY_POINTS.values():
        for name in names:
            assert sizes.get(name, 0) > 0, f"{name}: no code size in the {arch} cubin"
    too_big = {name: size for name, size in sizes.items() if size > CODE_SIZE_LIMIT}
    assert not too_big, (f"code of {too_big} (bytes) on {arch} exceeds {CODE_SIZE_LIMIT} B: keep loops "
                         f"rolled where they are not on the critical path (see kernels_src/chunk_tc.cu)")


def test_resource_table_report(compiled, tmp_path):
    report = "\n\n".join(_resource_table(compiled, arch) for arch in ARCHS)
    path = tmp_path / "kernel_resources.txt"
    path.write_text(report + "\n")
    print("\n" + report)
    assert path.read_text().count("kda_decode_fused_bf16") == len(ARCHS)
    for arch in ARCHS:
        for stem, names in kernels.ENTRY_POINTS.items():
            resources = kernel_report.parse_ptxas_log(compiled[(stem, arch)].log)
            unparsed = [name for name in names if resources[name]["registers"] <= 0 or resources[name]["stack_frame"] < 0]
            assert not unparsed, f"{arch}, {stem}.cu: no registers or stack frame parsed for {unparsed}"


def test_compile_check_reports_every_entry_point():
    report = kernel_report.compile_check("sm_90")
    expected = {name for names in kernels.ENTRY_POINTS.values() for name in names}
    assert set(report) == expected
    for name, resources in report.items():
        assert resources["registers"] > 0, name
        assert set(resources) == {"registers", "spill_stores", "spill_loads", "stack_frame", "shared"}


def test_kernel_source_inlines_header_with_line_directives():
    source = kernels.kernel_source("norm")
    folder = kernels.kernels_dir().resolve()
    assert source.startswith(f'#line 1 "{folder / "norm.cu"}"')
    for header in ("common/reduce.cuh", "common/head.cuh", "common/math.cuh"):
        assert f'#line 1 "{folder / header}"' in source
        assert f'#include "{header}"' not in source
    assert source.count(f'#line 1 "{folder / "common/head.cuh"}"') == 1  # inlined once, at its first include
    assert "block_sum_f32" in source


def _write_broken_kernel(folder: Path) -> int:
    """A kernel file (in a stage folder) whose error sits after the inlined header; returns its line."""
    (folder / "common").mkdir()
    (folder / "stage").mkdir()
    (folder / kernels.MARKER_HEADER).write_text((kernels.kernels_dir() / kernels.MARKER_HEADER).read_text())
    lines = [
        "// a kernel with a deliberate error",
        f'#include "{kernels.MARKER_HEADER}"',
        "",
        'extern "C" __global__ void broken_f32(float* out)',
        "{",
        "    out[threadIdx.x] = undefined_name;",
        "}",
    ]
    (folder / "stage" / "broken.cu").write_text("\n".join(lines) + "\n")
    return lines.index("    out[threadIdx.x] = undefined_name;") + 1


def test_compile_error_names_real_file_and_line(tmp_path):
    line = _write_broken_kernel(tmp_path)
    with pytest.raises(kernels.KernelCompileError) as error:
        kernel_report.compile_file("stage/broken", "sm_90", directory=tmp_path)
    message = str(error.value)
    assert f"{(tmp_path / 'stage' / 'broken.cu').resolve()}({line})" in message, message
    assert "undefined_name" in message


def test_compile_error_through_kernels_dir(tmp_path, monkeypatch):
    line = _write_broken_kernel(tmp_path)
    monkeypatch.setattr(kernels, "kernels_dir", lambda: tmp_path)
    with pytest.raises(kernels.KernelCompileError, match=rf"broken\.cu\({line}\)"):
        kernel_report.compile_file("stage/broken", "sm_80")


def test_an_include_outside_the_kernel_folder_is_an_error(tmp_path):
    (tmp_path / "broken.cu").write_text('#include "common/missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match="common/missing.cuh"):
        kernels.kernel_source("broken", tmp_path)


@pytest.mark.parametrize("chunk", [1, 16, 32, 64], ids=lambda c: f"C{c}")
def test_chunk_prepare_smem_fits_h200(chunk):
    # H200 (sm_90) allows 227 KiB of opt-in shared memory per block.
    assert ops.chunk_prepare_smem_bytes(chunk) <= 227 * 1024
    assert ops.chunk_prepare_smem_bytes(chunk) == 4 * (3 * chunk * 129 + chunk * chunk + chunk)


def test_import_does_not_touch_gpu():
    # Building a KernelSet needs a GPU; importing and describing the kernels does not.
    assert not kernels.KernelSet._instances
    assert kernels.current_context() == kernels.LaunchContext()


def test_every_build_names_the_options_cupy_adds():
    """The portable families load through cupy.RawModule(code=...), which compiles with -ftz=true
    whatever it is given; the architecture families and compile_check build with NVRTC directly
    from COMPILE_OPTIONS, which must say the same so that every path runs one kind of binary (and
    no fast math: expf, sqrtf and division stay IEEE-rounded)."""
    import inspect

    from cupy.cuda import compiler

    assert "'-ftz=true'" in inspect.getsource(compiler._compile_with_cache_cuda), "CuPy no longer adds -ftz=true"
    assert kernels.COMPILE_OPTIONS == ("-std=c++17", "-ftz=true")


def test_cubin_cache_is_keyed_on_the_compiler_and_kept_private(tmp_path, monkeypatch):
    """The architecture families' cubins are kept under a key of source, options and NVRTC version
    (a new compiler builds anew); the default folder in the shared temporary folder is refused
    unless it is this user's own and not writable by others."""
    import os
    import tempfile
    from types import SimpleNamespace

    from cupy.cuda import nvrtc

    built = []
    monkeypatch.setattr(kernels, "compile_file",
                        lambda stem, arch, directory=None, **options: built.append(arch) or SimpleNamespace(cubin=b"cubin"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("GLM_KDA_CUBIN_CACHE", raising=False)
    stem = "projection/gemm_rows_bulk"
    first = kernels._cached_cubin(stem, "sm_90a", None)
    assert kernels._cached_cubin(stem, "sm_90a", None) == first and len(built) == 1, "the cubin kept was not reused"
    assert first.name.startswith("projection-gemm_rows_bulk-sm_90a-")  # one file, not a folder per stage
    folder = first.parent
    assert folder == tmp_path / f"glm_kda-{os.getuid()}" and folder.stat().st_mode & 0o777 == 0o700
    version = nvrtc.getVersion()
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (version[0], version[1] + 1))
    assert kernels._cached_cubin(stem, "sm_90a", None) != first and len(built) == 2, "another NVRTC's cubin was used"
    folder.chmod(0o777)
    with pytest.raises(RuntimeError, match="not a folder of this user's"):
        kernels._cached_cubin(stem, "sm_90a", None)
    monkeypatch.setenv("GLM_KDA_CUBIN_CACHE", str(folder))  # a folder the user names is theirs to choose
    assert kernels._cached_cubin(stem, "sm_90a", None).parent == folder


@pytest.mark.parametrize("stem", list(kernels.ARCH_ENTRY_POINTS))
def test_architecture_families_compile_for_their_architecture(stem):
    """A family of one architecture's own instructions (gemm_rows_bulk: sm_90a) compiles for it with
    every entry point, no spill and code that fits the instruction cache; compile_check of that
    architecture reports it beside the portable families."""
    arch, names = kernels.ARCH_ENTRY_POINTS[stem]
    compiled = kernel_report.compile_file(stem, arch)
    symbols = kernel_report.cubin_function_symbols(compiled.cubin)
    sizes = kernel_report.cubin_function_sizes(compiled.cubin)
    resources = kernel_report.parse_ptxas_log(compiled.log)
    for name in names:
        assert name in symbols, f"{name} missing from {stem}.cu for {arch}"
        r = resources[name]
        assert max(r["spill_stores"], r["spill_loads"]) == 0, f"{name} spills on {arch}: {r}"
        assert 0 < sizes[name] <= CODE_SIZE_LIMIT, f"{name}: {sizes[name]} bytes of code on {arch}"
    report = kernel_report.compile_check(arch)
    assert set(names) <= set(report)
    assert {name for families in kernels.ENTRY_POINTS.values() for name in families} <= set(report)


def test_kernel_set_builds_every_file_at_once_on_the_layer_device(monkeypatch, tmp_path):
    """KernelSet compiles its files in worker threads, each under the device the set is for (a
    new thread's CuPy device is 0), every file once, and still names every missing entry point."""
    import threading
    from types import SimpleNamespace

    import cupy

    monkeypatch.setattr(kernels, "_COMPILE_THREADS", 2)  # (worker threads on a one-core runner too)
    current = threading.local()
    built: list[tuple[str, int, str]] = []

    class Device:
        def __init__(self, device_id=None):
            self.id = getattr(current, "id", 0) if device_id is None else device_id
            self.compute_capability = "90"

        def __enter__(self):
            self.previous, current.id = getattr(current, "id", 0), self.id
            return self

        def __exit__(self, *exc):
            current.id = self.previous

    class Module:
        def __init__(self, code=None, options=None, path=None):
            self.text = code if code is not None else Path(path).name
            self.compiled = path is not None

        def compile(self):
            built.append((self.text.splitlines()[0], Device().id, threading.current_thread().name))
            self.compiled = True

        def get_function(self, name):
            assert self.compiled, "an entry point was resolved before its file compiled"
            if name == "kda_gemm_rows_bulk_g2":
                raise NotFound(name)
            return SimpleNamespace(name=name)

    class NotFound(Exception):
        pass

    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", NotFound)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy, "RawModule", Module)
    monkeypatch.setattr(kernels, "_cached_cubin", lambda stem, arch, directory: tmp_path / f"{stem.replace('/', '-')}.cubin")
    with Device(3):
        with pytest.raises(RuntimeError, match=r"not found: projection/gemm_rows_bulk.cu:kda_gemm_rows_bulk_g2$"):
            kernels.KernelSet()
    assert len(built) == len(kernels.ENTRY_POINTS), built
    assert {device for _, device, _ in built} == {3}, f"a file compiled on another device: {built}"
    assert all(thread != threading.main_thread().name for _, _, thread in built), f"a file compiled on the main thread: {built}"
