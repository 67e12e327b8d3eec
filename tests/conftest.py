"""Test set-up: 8 fake CPU devices, float32, no network. Runs before any test imports JAX."""

import atexit
import collections
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Bytecode caches are written whatever PYTHONDONTWRITEBYTECODE says. The suite starts many
# Python processes (CLI runs, training processes, examples), each importing the library, and
# pytest rewrites every test module in each worker; from a fresh clone with the variable set,
# each of them compiled every module from source again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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
# One XLA compilation cache per test run (shard/compile_cache.py's, in a new temporary directory
# removed when the run ends: nothing is read from or left in ~): a program another test, worker
# or test-started process already compiled (the same tiny model's engine step, a CLI run's
# training step) is read back instead of compiled again. The first process (pytest-xdist's
# controller, or a plain run) creates it; the workers and the processes tests start inherit it.
_RUN_CACHE = "EQX_ZOO_TEST_RUN_CACHE"
if _RUN_CACHE not in os.environ:
    os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="eqx-zoo-tests-xla-")
    atexit.register(shutil.rmtree, os.environ[_RUN_CACHE], ignore_errors=True)
os.environ["EQX_ZOO_COMPILE_CACHE"] = os.environ[_RUN_CACHE]


def _mimalloc() -> str | None:
    """The path of the mimalloc shared library the test extra installs, None where it is not."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name == "libmimalloc.so"), None)


# The processes the run starts (pytest-xdist's workers, the CLI runs and training processes tests
# start) allocate with mimalloc instead of glibc's malloc: compiling a program allocates and frees
# millions of small MLIR and LLVM objects, and glibc's malloc was a fifth of a worker's CPU
# (perf); with mimalloc the suite took 12% less CPU, a worker about half the memory
# (bench/RESULTS.md).
# Only a process's start reads LD_PRELOAD, so the one that loads this first (the controller, or
# a plain run) does not get it. What the tests compute is unchanged: the allocator holds no
# numbers.
# mimalloc 3 asks for transparent huge pages by default: the kernel then zeroes 2 MiB for each
# page a worker's short-lived allocations touch again after mimalloc returned it (6% of a
# worker's CPU in `perf`, `clear_page_erms`); without them a module took 4-5% less CPU.
_PRELOAD = _mimalloc()
if _PRELOAD and _PRELOAD not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = " ".join(filter(None, (os.environ.get("LD_PRELOAD"), _PRELOAD)))
    os.environ.setdefault("MIMALLOC_ALLOW_THP", "0")

import jax  # noqa: E402

from shard.compile_cache import use_compile_cache  # noqa: E402

# The run's cache is removed when the run ends, so it needs no size limit, and without one every
# program is worth writing, however fast it compiled (tests/training and the first-day tests:
# 295 -> 258 s wall, 523 -> 450 s CPU; with the limit, writing every program took 583 s). Without
# the limit's lock a read can meet a write of the same program: JAX then warns and compiles it
# (an unreadable entry is a miss, as with its default, unlimited cache). Processes the tests
# start keep the library's settings.
use_compile_cache(min_compile_seconds=0.0, max_bytes=None)

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

# Tracing a program allocates millions of short-lived objects, and Python's collector at its
# default thresholds (700, 10, 10) walked the worker's large heap for them thousands of times a
# module. Rarer collections keep the same peak memory (bench/RESULTS.md); the worker's memory
# check below still runs a full collection when it drops the compiled programs.
gc.set_threshold(50_000, 20, 100)

import jaxtyping  # noqa: E402
import pytest  # noqa: E402


def _xdist_group(item) -> str:
    """The item's `xdist_group` name (joined as pytest-xdist joins several), else its module's."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) if names else item.module.__name__


def pytest_collection_finish(session):
    """What collection built (modules, test items) lives as long as the run: the collector need
    not walk it again."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config, items):
    """`make test` runs `-n 2 --dist loadgroup`: one worker runs each group whole. A test's
    group is its `xdist_group` mark's, else its module: a worker then builds what a module's
    tests share (module-scoped models and engines, programs an earlier test compiled) once, not
    once per worker (tests/infer/test_cache.py split over both workers: 160 CPU-s; whole: 112).

    pytest-xdist marks a test's group by appending `@group` to its node id in the worker; since
    pytest 9.2 keeps node ids in `Node._id` (a NodeId), its write to `_nodeid` is lost and every
    group was silently ignored, so the suffix is written here where it takes effect."""
    if not getattr(config.option, "loadgroup", False):
        return
    groups: dict[str, list] = {}
    for item in items:
        group = _xdist_group(item)
        groups.setdefault(group, []).append(item)
        if item.nodeid.endswith(f"@{group}"):
            continue  # a pytest-xdist that works with this pytest wrote it already
        nodeid = f"{item.nodeid}@{group}"
        if hasattr(item, "_id"):  # pytest >= 9.2
            item._id = type(item._id).parse(nodeid)
        else:
            item._nodeid = nodeid
    items[:] = _longest_first(groups)


# Seconds each group took in a recorded run. pytest-xdist hands groups out in the order of their
# test counts, which put the few-test long groups (the multi-process and pipelined training runs,
# 35-45 s each) last: one worker ran them alone while the other had finished (39-44 s apart).
# Longest first, the groups left at the end are short. Rewritten by
# `pytest -n 2 --dist loadgroup --record-group-seconds`; a group not in it counts its tests times
# the recorded seconds per test, so a stale file costs only balance.
GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")


def _longest_first(groups: dict[str, list]) -> list:
    """The tests of `groups` (name: its tests), the groups ordered by their expected seconds,
    longest first; the tests of a group keep their order."""
    recorded = json.loads(GROUP_SECONDS.read_text()) if GROUP_SECONDS.exists() else {}
    known = [g for g in groups if g in recorded]
    per_test = sum(recorded[g] for g in known) / max(1, sum(len(groups[g]) for g in known))
    expected = {g: recorded.get(g, len(tests) * per_test) for g, tests in groups.items()}
    return [item for g in sorted(groups, key=lambda g: -expected[g]) for item in groups[g]]


def pytest_addoption(parser):
    parser.addoption(
        "--record-group-seconds",
        action="store_true",
        help=f"write each test group's seconds to tests/{GROUP_SECONDS.name} (-n 2 --dist "
        "loadgroup)",
    )


def pytest_configure(config):
    """The controller hands the groups out in the order the workers collected them (longest
    first), not by their test counts."""
    if config.getoption("dist", None) == "loadgroup":
        config.option.loadscopereorder = False


_GROUP_SECONDS = collections.Counter()


def pytest_runtest_logreport(report):
    """Each group's seconds (set-up, call and tear-down), as the controller receives them."""
    if "@" in report.nodeid:
        _GROUP_SECONDS[report.nodeid.rpartition("@")[2]] += report.duration


def pytest_sessionfinish(session):
    """With --record-group-seconds, the controller (it saw every group) writes them."""
    worker = hasattr(session.config, "workerinput")
    if session.config.getoption("record_group_seconds") and _GROUP_SECONDS and not worker:
        seconds = {g: round(t, 1) for g, t in sorted(_GROUP_SECONDS.items())}
        GROUP_SECONDS.write_text(json.dumps(seconds, indent=0) + "\n")


# Compiled programs are dropped when a worker holds more than this many memory mappings (of
# Linux's vm.max_map_count, 65,530) or this much memory, else kept for the next tests.
MAX_MAPPINGS = 40_000
MAX_RESIDENT_BYTES = 6 * 2**30


def _mappings_and_resident_bytes() -> tuple[int, int] | None:
    """This process's memory mappings and resident bytes (Linux's /proc), None elsewhere."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            mappings = sum(1 for _ in maps)
        with open("/proc/self/status") as status:
            rss = next(line for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return mappings, int(rss.split()[1]) * 1024


_COMPILED = [0]  # programs compiled since the mappings were last counted


def _count_compilations(event: str, *_, **__) -> None:
    # A program read back from the compilation cache maps its code as a compiled one does.
    if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
        _COMPILED[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilations)
jax.monitoring.register_event_listener(_count_compilations)


@pytest.fixture(autouse=True)
def release_compiled_programs():
    """Drop every compiled program after a test once the worker holds too many. XLA's CPU
    executables each hold memory mappings of their code (an engine's step program ~400); a
    worker that keeps the suite's thousands of programs alive passes Linux's vm.max_map_count
    (65,530) and dies in a compile with a segmentation fault (measured: 65,289 mappings just
    before the crash). Counted after every test that compiled something (reading the mappings
    costs ~1 ms per 1,000): one module alone can add 25,000 (tests/infer/test_engine.py after
    tests/infer/test_speculative.py crashed a worker checked after each module). Dropping them
    after every module instead cost the suite a recompilation of what modules share (the eager
    ops of model initialisation, the families' forwards): compilation was 62% of the suite's
    in-process time (1,731 s of 2,778, 18,231 programs, 2026-11-28)."""
    yield
    if _COMPILED[0] == 0:
        return
    _COMPILED[0] = 0
    usage = _mappings_and_resident_bytes()
    if usage is None or usage[0] > MAX_MAPPINGS or usage[1] > MAX_RESIDENT_BYTES:
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
