"""The dispatcher turns a failure a command reports into `eqx-zoo COMMAND: error: ...` (status
1), never a traceback: bad input (ValueError, OSError) and a quantized CPU kernel that was never
built (a GGUF on a machine that skipped `make setup`), whose message says how to build it."""

import pytest

import cli.sample
from cli.main import main
from layers.kernels.quantized.cpu import KernelNotBuilt


@pytest.mark.parametrize(
    "error",
    [KernelNotBuilt("the quantized CPU kernel is not built; build it with `python -m "
                    "layers.kernels.quantized.build`"),
     ValueError("--model 'x' is none of: ..."), OSError("No space left on device")],
)  # fmt: skip
def test_a_reported_failure_is_one_line(monkeypatch, error):
    def fails(argv, prog):
        raise error

    monkeypatch.setattr(cli.sample, "main", fails)
    with pytest.raises(SystemExit) as exit_:
        main(["sample", "--model", "x", "--prompt", "1"])
    assert exit_.value.code == f"eqx-zoo sample: error: {error}"
