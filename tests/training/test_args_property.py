"""A property of the CLI: every numeric flag, given any value (zero, negative, huge, NaN, inf,
not a number), either fails as argparse fails, naming the flag (exit status 2), or is accepted;
and an accepted value trains. Never a traceback from inside JAX or numpy."""

import contextlib
import dataclasses
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.training.conftest import make_argv
from training.args import Args, bounds_of, flag_name, parse_args

NUMERIC = [flag_name(f.name) for f in dataclasses.fields(Args) if bounds_of(f) is not None]
EDGES = ["0", "-0", "-1", "1", "2", "0.5", "1.5", "1e-300", "1e300", "1e400", "-1e400", "nan"]
EDGES += ["inf", "-inf", "", "abc", "0x10", "1_000", " 3 ", str(2**31), str(2**63), str(10**40)]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


def outcome(argv: list[str], run=None):
    """("ok", what `run(argv)` returns) or ("exit", status, stderr), the output captured;
    `run` is `parse_args` unless given."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return "ok", (run or parse_args)(argv)
    except SystemExit as exit_:
        return "exit", exit_.code, err.getvalue()


def flag_args(flag: str, value: str, joined: bool) -> list[str]:
    # `--lr=-inf`: argparse reads a bare `-inf` as an option, and says so, naming the flag too.
    return [f"{flag}={value}"] if joined else [flag, value]


@settings(max_examples=300, deadline=None)
@given(flag=st.sampled_from(NUMERIC), value=VALUES, joined=st.booleans())
def test_parser_fails_cleanly_or_accepts(flag, value, joined):
    base = make_argv(Path("corpus.jsonl"), Path("cache"))(Path("out"))
    result = outcome([*base, *flag_args(flag, value, joined)])
    if result[0] == "exit":
        _, status, err = result
        assert status == 2 and "Traceback" not in err
        assert f"error: argument {flag}" in err or flag in err.splitlines()[-1], err
    else:
        args = result[1]
        field = flag[2:].replace("-", "_")
        bounds = bounds_of(next(f for f in dataclasses.fields(Args) if f.name == field))
        assert bounds.check(getattr(args, field)) == getattr(args, field)


JSON_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(flag=st.sampled_from(NUMERIC), value=JSON_VALUES)
def test_config_values_fail_cleanly_or_are_accepted(flag, value):
    key = flag[2:].replace("-", "_")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "run.json"
        config.write_text(json.dumps({key: value}))
        result = outcome(["--config", str(config)])
    if result[0] == "exit":
        _, status, err = result
        assert status == 2 and "Traceback" not in err
        assert f"{key!r} ({flag})" in err or f"argument {flag}" in err or flag in err, err
    else:
        stored = getattr(result[1], key)
        # A float setting holds the number as a float (an int from the file is converted).
        want = float(value) if isinstance(stored, float) and value is not None else value
        assert stored == want or (key == "warmup" and value is None)


# Small values (so that an accepted one trains in seconds), edges included.
RUN_VALUES = st.one_of(
    st.integers(-2, 6).map(str),
    st.sampled_from(["0.0", "0.5", "0.99", "1.0", "1e-300", "1e-2", "nan", "inf"]),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(flag=st.sampled_from(NUMERIC), value=RUN_VALUES)
@example(flag="--warmup", value="0")  # zeros that mean something: no warm-up, no clipping
@example(flag="--clip", value="0.0")
@example(flag="--seq-len", value="1")  # one device cuts nothing: an odd length trains
def test_an_accepted_value_trains(flag, value, corpus, cache_dir, runs):
    import train

    out = Path(tempfile.mkdtemp(dir=runs))
    base = make_argv(corpus, cache_dir)(out, "--steps", "2", "--checkpoint-every", "2")
    argv = [*base, *flag_args(flag, value, joined=True)]
    try:
        result = outcome(argv, run=train.main)
    except ValueError as error:  # a limit only the data can tell (e.g. too few documents)
        assert flag in str(error), error
        return
    if result[0] == "exit":
        assert result[1] == 2 and f"argument {flag}" in result[2], result[2]
    else:
        assert result[1].step == parse_args(argv).steps
