"""The bench harness: Markdown tables, the roofline columns, and the profiler-trace reading."""

import importlib

import jax
import jax.numpy as jnp
import pytest

from bench import harness, trace_reading
from bench.__main__ import BENCHMARKS


def test_roofline_cells_are_rate_and_fraction_of_the_ceiling():
    cells = harness.roofline_cells(0.5, 2.0, 4e12, 4e12, "TFLOP/s")
    assert cells == {
        "predicted ms": 500.0,
        "measured ms": 2000.0,
        "achieved TFLOP/s": 2.0,
        "% of ceiling": 50.0,
    }


def test_table_markdown_has_a_header_and_one_line_per_row():
    table = harness.Table("t", "Title", ["note"])
    table.add({"a": 1, "b": 0.5})
    table.add({"a": 2, "b": 1234.5})
    lines = table.markdown().splitlines()
    assert lines[:3] == ["### Title", "", "note"]
    assert lines[4:] == ["| a | b |", "|---|---|", "| 1 | 0.5 |", "| 2 | 1,234 |"]


def test_a_cpu_bandwidth_is_measured_past_the_last_level_cache(tmp_path):
    for index, size in [(0, "48K"), (2, "2048K"), (3, "307200K")]:
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert harness.last_level_cache_bytes(tmp_path) == 300 * 2**20
    assert harness.last_level_cache_bytes(tmp_path / "none") == 0


def test_groups():
    assert trace_reading.group("all-reduce.3") == "collective"
    assert trace_reading.group("dot_general_fusion.2") == "matmul/fusion"
    assert trace_reading.group("copy.1") == "other"


def test_trace_reading_finds_the_matmul_of_a_profiled_program(tmp_path):
    a = jnp.ones((256, 256))
    f = jax.jit(lambda a: jnp.tanh(a @ a))
    jax.block_until_ready(f(a))
    with trace_reading.trace(tmp_path):
        for _ in range(3):
            jax.block_until_ready(f(a))
    times = trace_reading.op_times(tmp_path)
    assert times and all(t >= 0 for t in times.values())
    assert any(trace_reading.group(name) == "matmul/fusion" for name in times)
    assert "| matmul/fusion |" in trace_reading.summary(tmp_path)


def test_trace_reading_without_a_trace_says_so(tmp_path):
    with pytest.raises(ValueError, match="the profiler wrote no trace"):
        trace_reading.op_times(tmp_path)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_the_entry_point_names_imports_and_has_a_run(name):
    """`python -m bench NAME` imports BENCHMARKS[NAME] and calls its `run(ceilings)`: a module
    that no longer imports (a moved helper) fails here, not on the next benchmark run."""
    assert callable(importlib.import_module(BENCHMARKS[name]).run)
