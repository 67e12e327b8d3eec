"""Compile the CPU kernels (matmul.cc: packed weights; dense.cc: float32 products of a few
tokens; paged.cc: paged attention for decode) into `_matmul.so` beside them: what `make setup`
runs after installing the package (the Makefile's kernel target), and what to run by hand after
editing the C++ or on a machine set up without make:

    python -m layers.kernels.cpu.build

The headers come from jaxlib (`jax.ffi.include_dir()`), so the library matches the installed
JAX's FFI. The code is built for the baseline of the machine's architecture; the AVX-512 paths
inside are compiled for AVX-512 alone and chosen at run time when the CPU has it (paged.cc's by
GCC's function clones), so a library built here runs on any x86-64 CPU.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul.cc", "dense.cc", "paged.cc"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("avx512.h", "dense.h", "parallel.h"))
LIBRARY = Path(__file__).with_name("_matmul.so")
STAMP = LIBRARY.with_suffix(".so.sha256")


def source_hash() -> str:
    """SHA-256 of the sources and headers: recorded beside the library, so a stale build is
    detected."""
    return hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)).hexdigest()


def compiler() -> str:
    """The C++ compiler: $CXX, else g++ or clang++ from the PATH."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (set CXX, or install g++): the CPU kernels need one")


def build(*, verbose: bool = False) -> Path:
    """Compile the sources into `_matmul.so` (written beside a temporary name first, then
    renamed, so a failed build never leaves a broken library behind). Returns its path."""
    import jax.ffi

    partial = LIBRARY.with_suffix(".so.partial")
    command = [
        compiler(),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-Wno-return-type",  # XLA's own headers trip it
        # No a * b + c fused into one rounding unless written as an FMA: the dequantize target
        # must round as PackedWeight.dequantize does (bit for bit).
        "-ffp-contract=off",
        f"-I{jax.ffi.include_dir()}",
        *map(str, SOURCES),
        "-o",
        str(partial),
    ]
    if verbose:
        print(" ".join(command))
    subprocess.run(command, check=True)
    partial.replace(LIBRARY)
    STAMP.write_text(source_hash() + "\n")
    return LIBRARY


if __name__ == "__main__":
    print(f"built {build(verbose='-v' in sys.argv[1:])}")
