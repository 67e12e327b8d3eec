"""The persistent compilation cache of the command-line tools: a second process reads the program
back instead of compiling it; `off` leaves it off. Each process is a fresh interpreter: JAX
decides whether to use the cache once, at its first compilation."""

import os
import subprocess
import sys
import textwrap
import warnings

from shard.compile_cache import ENVIRONMENT, use_compile_cache

# Compiles one program with the cache `use_compile_cache` sets (every program written: the
# threshold lowered from a second to zero, so a tiny program counts) and prints how many
# programs were read back from the cache.
PROGRAM = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from shard.compile_cache import use_compile_cache
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None
    )
    print("directory", use_compile_cache(min_compile_seconds=0.0))
    jax.jit(lambda x: jnp.sin(x) @ x.T).lower(jnp.ones((8, 8))).compile()
    print("read back", len(hits))
    """
)


def run(setting: str) -> tuple[str, int]:
    """The directory the process used, and how many programs it read back."""
    env = {**os.environ, ENVIRONMENT: setting, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    return lines["directory"], int(lines["read"].removeprefix("back "))


def test_a_second_process_reads_the_programs_back(tmp_path):
    assert run(str(tmp_path)) == (str(tmp_path), 0)
    assert any(tmp_path.iterdir()), "the first process wrote nothing"
    directory, read_back = run(str(tmp_path))
    assert directory == str(tmp_path) and read_back > 0  # the program, and jnp.ones'


def test_off_turns_it_off():
    assert run("off") == ("None", 0)


def test_an_unwritable_directory_warns_and_leaves_it_off(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(ENVIRONMENT, str(blocked / "xla"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert use_compile_cache() is None
    assert ENVIRONMENT in str(caught[0].message)
