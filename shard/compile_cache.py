"""XLA's persistent compilation cache for the command-line tools: a program compiled once (the
engine's step programs, a training step) is read back from disk by the next process that builds
the same program, so a second `eqx-zoo chat` or a resumed run starts without compiling.

The cache key is JAX's: the lowered program, the compile options, the backend and JAX's version,
so a changed model, shape, flag or upgrade compiles afresh; nothing stale is ever run. Only
programs that took at least `MIN_COMPILE_SECONDS` to compile are written (the small ones cost
more to store than to rebuild), and the directory is kept under `MAX_BYTES` (JAX evicts the least
recently used entries; to do so it takes a lock every process shares on each read and write and
scans the directory on each write, so a cache that holds thousands of programs pays for a limit).

`EQX_ZOO_COMPILE_CACHE` names the directory (default `~/.cache/eqx-zoo/xla`); `off` turns the
cache off. The library itself never turns it on: a script that imports the zoo chooses, and
`python -m bench` leaves it off because it measures cold compiles. The test suite points it at a
temporary directory of its own for each run (tests/conftest.py).
"""

import os
import warnings
from pathlib import Path

import jax

ENVIRONMENT = "EQX_ZOO_COMPILE_CACHE"
DEFAULT_DIRECTORY = Path("~/.cache/eqx-zoo/xla")
MIN_COMPILE_SECONDS = 1.0
MAX_BYTES = 4 * 2**30


def use_compile_cache(
    *, min_compile_seconds: float = MIN_COMPILE_SECONDS, max_bytes: int | None = MAX_BYTES
) -> Path | None:
    """Turn on the persistent compilation cache in the directory `EQX_ZOO_COMPILE_CACHE` names
    (default `~/.cache/eqx-zoo/xla`), and return it; None when the variable says `off`. Programs
    that took at least `min_compile_seconds` to compile are written; `max_bytes` None: no size
    limit (for a directory someone else removes: no lock, no scan). Call it before the first
    compilation: programs compiled earlier are not written."""
    setting = os.environ.get(ENVIRONMENT, str(DEFAULT_DIRECTORY))
    if setting.strip().lower() in ("off", "0", "false", "no", ""):
        return None
    directory = Path(setting).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        warnings.warn(
            f"the compilation cache is off: cannot create {directory} ({error}); set "
            f"{ENVIRONMENT} to a writable directory, or to off",
            stacklevel=2,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_compilation_cache_max_size", -1 if max_bytes is None else max_bytes)
    return directory
