"""The dispatcher turns a failure a command reports into `eqx-zoo COMMAND: error: ...` (status
1), never a traceback: bad input (ValueError, OSError) and a quantized CPU kernel that was never
built (a GGUF on a machine that skipped `make setup`), whose message says how to build it."""

import pytest

import cli.sample
from cli.main import main
from layers.kernels.cpu import KernelNotBuilt


@pytest.mark.parametrize(
    "error",
    [KernelNotBuilt("the CPU kernels are not built; build them with `python -m "
                    "layers.kernels.cpu.build`"),
     ValueError("--model 'x' is none of: ..."), OSError("No space left on device")],
)  # fmt: skip
def test_a_reported_failure_is_one_line(monkeypatch, error):
    def fails(argv, prog):
        raise error

    monkeypatch.setattr(cli.sample, "main", fails)
    # The dispatcher's process set-up is for a fresh process: XLA flags refuse a process whose
    # JAX backend an earlier test of this worker started, and the compile cache would stay on.
    monkeypatch.setattr("shard.xla_flags.set_default_xla_flags", lambda: "")
    monkeypatch.setattr("shard.compile_cache.use_compile_cache", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        main(["sample", "--model", "x", "--prompt", "1"])
    assert exit_.value.code == f"eqx-zoo sample: error: {error}"
