"""The C++ CPU kernels, one library called through `jax.ffi`: matmul.cc (products with packed
weights and their dequantize, for layers/kernels/quantized), dense.cc (float32 products of a
few tokens, `dense.py`) and paged.cc (paged attention for decode, `paged.py`). Built by
`python -m layers.kernels.cpu.build` (the Makefile's install step runs it) into `_matmul.so`
beside the sources; loaded and registered with XLA on first use.
A missing library, or one built from other versions of the sources (their hash is recorded
beside it), is an error that says how to build it."""

import ctypes
import functools

import jax

from layers.kernels.cpu.build import LIBRARY, SOURCES, STAMP, source_hash

QUANTIZED_TARGET = "zoo_quantized_matmul"
DEQUANTIZE_TARGET = "zoo_quantized_dequantize"
DENSE_TARGET = "zoo_dense_matmul"
PAGED_TARGET = "zoo_paged_decode"
# The builds of dense.cc's and paged.cc's vector paths a call may ask for, by the number the
# kernels take: the running CPU's fastest (AVX-512, else AVX2 with FMA, else plain C++), the
# AVX2 one (refused on a CPU without AVX2 and FMA) or the plain C++ one, so a test checks each
# on any CPU.
WALKS = ("fastest", "avx2", "portable")


class KernelNotBuilt(RuntimeError):
    """The CPU kernels' library is missing or stale."""


@functools.cache
def _registered(digest: str) -> ctypes.CDLL:
    if not LIBRARY.exists() or not STAMP.exists():
        raise KernelNotBuilt(
            f"the CPU kernels are not built ({LIBRARY} is missing); build them with "
            "`python -m layers.kernels.cpu.build` (make setup runs it)"
        )
    if STAMP.read_text().strip() != digest:
        raise KernelNotBuilt(
            f"{LIBRARY} was built from another version of "
            f"{' and '.join(source.name for source in SOURCES)}; rebuild it with "
            "`python -m layers.kernels.cpu.build`"
        )
    library = ctypes.cdll.LoadLibrary(str(LIBRARY))
    for target, symbol in [(QUANTIZED_TARGET, library.ZooQuantizedMatmul),
                           (DEQUANTIZE_TARGET, library.ZooQuantizedDequantize),
                           (DENSE_TARGET, library.ZooDenseMatmul),
                           (PAGED_TARGET, library.ZooPagedDecode)]:  # fmt: skip
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), "cpu")
    return library


def ensure_built() -> None:
    """Load and register the kernels, or raise `KernelNotBuilt` saying how to build them."""
    _registered(source_hash())


@functools.cache
def fastest_walk() -> str:
    """The build of dense.cc's walks that this CPU runs by default: "avx512", "avx2" (with FMA)
    or "portable" (plain C++). `KernelNotBuilt` as `ensure_built`."""
    function = _registered(source_hash()).ZooDenseFastestWalk
    function.restype = ctypes.c_char_p
    return function().decode()


@functools.cache
def integer_products() -> bool:
    """Whether this CPU's packed products multiply codes in integers with int8 activations
    (AVX-512 VNNI: layers/kernels/cpu/matmul.cc); elsewhere int8 activations only round x before
    the float walks. `KernelNotBuilt` as `ensure_built`."""
    function = _registered(source_hash()).ZooQuantizedIntegerProducts
    function.restype = ctypes.c_bool
    return bool(function())
