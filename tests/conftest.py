"""Test set-up: 8 fake CPU devices, float32, no network. Runs before any test imports JAX."""

import os

# LLVM -O0: the suite compiles hundreds of tiny programs, so compile time, not run time, is what
# it spends (measured: 8.0 -> 5.1 min on 2 cores). Every comparison in a test is between programs
# built the same way. The library and bench/ keep XLA's default optimisation.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["EQX_ZOO_COMPILE_CACHE"] = "off"  # tests compile afresh: nothing read back or left in ~

import jax

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import jaxtyping  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop every compiled program after each test module. XLA's CPU executables each hold
    memory mappings of their code; a worker that keeps the suite's thousands of programs alive
    passes Linux's vm.max_map_count (65,530) and dies in a compile with a segmentation fault
    (measured: 65,289 mappings just before the crash). Modules rarely share a program, so this
    costs little recompilation."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def without_runtime_typechecks():
    """The suite runs beartype on every jaxtyping annotation, which refuses an argument of the
    wrong type or shape before a function's own checks run; users run without it and get those
    checks' ValueErrors, which a test asks for with this fixture."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)
