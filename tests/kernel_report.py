"""The compiler's report on the kernels, for the tests: each entry's registers, spills and code
size from NVRTC's ptxas log and the cubin, and every kernel family compiled for one architecture.

Test infrastructure only: the package compiles its kernels through glm_kda.gpu.build."""

from __future__ import annotations

import re
import struct

from glm_kda.gpu.build import ARCH_ENTRY_POINTS, ENTRY_POINTS, COMPILE_OPTIONS, CompiledFile, KernelCompileError
from glm_kda.gpu.build import compile_file as _compile_file
from glm_kda.gpu.build import kernel_source


def compile_file(stem: str, arch: str, directory=None) -> CompiledFile:
    """glm_kda.gpu.build.compile_file, its log holding ptxas' resource report even where NVRTC
    answered from its compute cache."""
    compiled = _compile_file(stem, arch, directory)
    if _PTXAS_ENTRY.search(compiled.log):
        return compiled
    options = [*COMPILE_OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    log = _ptxas_log_without_cache(kernel_source(stem, directory), f"{stem}.cu", options)
    return CompiledFile(stem=compiled.stem, arch=arch, cubin=compiled.cubin, log=log)


_UNCACHED_COMPILE_SCRIPT = """
import json, sys
from cupy.cuda import nvrtc
source, name, options = json.load(sys.stdin)
program = nvrtc.createProgram(source, name, [], [])
nvrtc.compileProgram(program, options)
sys.stdout.write(nvrtc.getProgramLog(program).rstrip("\\x00"))
"""


def _ptxas_log_without_cache(source: str, name: str, options: list[str]) -> str:
    """The ptxas report of a compile that bypasses the CUDA compute cache.

    NVRTC 13 reuses ptxas output from the compute cache (~/.nv/ComputeCache) and
    then reports no resource usage. The cache switch (CUDA_CACHE_DISABLE) is read
    once, when the library loads, so the report comes from a child process.
    """
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _UNCACHED_COMPILE_SCRIPT],
        input=json.dumps([source, name, options]),
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_CACHE_DISABLE": "1"},
        check=False,
    )
    if result.returncode != 0:
        raise KernelCompileError(f"uncached recompile of {name} failed:\n{result.stderr}")
    return result.stdout


def source_resources(source: str, name: str, arch: str) -> dict[str, dict[str, int]]:
    """parse_ptxas_log of `source` (a kernel text outside kernels_src/, named `name` in messages)
    compiled for `arch` with the package's options; KernelCompileError if NVRTC rejects it."""
    options = [*COMPILE_OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    return parse_ptxas_log(_ptxas_log_without_cache(source, name, options))


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPERTIES = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SHARED = re.compile(r"(\d+) bytes smem")


def _unparsed() -> dict[str, int]:
    """The resources of a function whose ptxas lines are not (yet) read: stack_frame -1 marks it."""
    return {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack_frame": -1, "shared": 0}


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per entry function: registers, spill_stores, spill_loads, stack_frame, shared.

    ``shared`` is the static shared memory in bytes (dynamic shared memory is a
    launch parameter and does not appear in the log). ``stack_frame`` stays -1 where
    ptxas's frame and spill line was not found, so that a changed log format shows.
    """
    resources: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log.splitlines():
        match = _PTXAS_ENTRY.search(line) or _PTXAS_PROPERTIES.search(line)
        if match:
            current = match.group(1)
            resources.setdefault(current, _unparsed())
            continue
        if current is None:
            continue
        match = _PTXAS_FRAME.search(line)
        if match:
            frame, stores, loads = (int(value) for value in match.groups())
            resources[current].update(stack_frame=frame, spill_stores=stores, spill_loads=loads)
        match = _PTXAS_REGISTERS.search(line)
        if match:
            resources[current]["registers"] = int(match.group(1))
            shared = _PTXAS_SHARED.search(line)
            if shared:
                resources[current]["shared"] = int(shared.group(1))
    return resources


def cubin_function_sizes(cubin: bytes) -> dict[str, int]:
    """Code size in bytes of each function symbol (STT_FUNC) in a cubin's ELF symbol table."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    endian = "<" if cubin[5] == 1 else ">"
    (section_offset,) = struct.unpack_from(endian + "Q", cubin, 0x28)
    section_size, section_count = struct.unpack_from(endian + "HH", cubin, 0x3A)
    sections = [
        struct.unpack_from(endian + "IIQQQQIIQQ", cubin, section_offset + index * section_size)
        for index in range(section_count)
    ]
    sizes: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, entry_size in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings_offset = sections[link][4]
        for position in range(offset, offset + size, entry_size or 24):
            # Elf64_Sym: st_name, st_info, st_other, st_shndx, st_value, st_size.
            name_offset, info, _, _, _, code_size = struct.unpack_from(endian + "IBBHQQ", cubin, position)
            if info & 0xF != 2:  # STT_FUNC
                continue
            start = strings_offset + name_offset
            sizes[cubin[start : cubin.index(b"\x00", start)].decode()] = code_size
    return sizes


def cubin_function_symbols(cubin: bytes) -> list[str]:
    """Names of the function symbols (STT_FUNC) in a cubin's ELF symbol table."""
    return list(cubin_function_sizes(cubin))


def compile_check(arch: str) -> dict[str, dict[str, int]]:
    """Compile every kernel file for ``arch`` with NVRTC (no GPU needed): the portable families, and
    the families of ARCH_ENTRY_POINTS built for ``arch`` itself (e.g. "sm_90a").

    Returns, per kernel entry point, {registers, spill_stores, spill_loads,
    stack_frame, shared} from the ``--ptxas-options=-v`` log. Raises
    KernelCompileError with the compiler log if a file fails, or if an entry
    point of ENTRY_POINTS is missing from its cubin.
    """
    report: dict[str, dict[str, int]] = {}
    families = {**ENTRY_POINTS, **{stem: names for stem, (only, names) in ARCH_ENTRY_POINTS.items() if only == arch}}
    for stem, names in families.items():
        compiled = compile_file(stem, arch)
        symbols = set(cubin_function_symbols(compiled.cubin))
        resources = parse_ptxas_log(compiled.log)
        missing = [name for name in names if name not in symbols]
        if missing:
            raise KernelCompileError(
                f"{stem}.cu compiled for {arch} lacks entry points {missing}:\n{compiled.log}"
            )
        for name in names:
            report[name] = resources.get(name) or _unparsed()
    return report
