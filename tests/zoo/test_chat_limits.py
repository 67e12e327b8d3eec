"""Untrusted chat templates are bounded (issue 26): a template written to hang or to fill memory
stops with a ValueError naming the bound (time, output, template length, the size of a value it
builds) and how to raise it; `render_limits` sets the bounds for a block of code. Small limits
keep each case fast; the bounds are checked, not the machine's speed."""

import time

import pytest

from zoo.tokenizer import chat
from zoo.tokenizer.chat import RenderLimits, render_limits

MESSAGES = [{"role": "user", "content": "hi"}]


def render(source: str) -> str:
    return chat.render(source, MESSAGES, add_generation_prompt=False, variables={})


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"


@pytest.mark.parametrize("body", ["x", ""], ids=["writing", "silent"])
def test_nested_loops_stop_at_the_time_limit(body):
    start = time.monotonic()
    with (
        render_limits(RenderLimits(seconds=0.2)),
        pytest.raises(ValueError, match=r"took more than 0\.2 s \(RenderLimits\.seconds\)"),
    ):
        render(NESTED.replace("BODY", body))
    # Not a timing assertion: 10**10 iterations would take hours; the check stopped them.
    assert time.monotonic() - start < 60


def test_output_longer_than_the_limit():
    with (
        render_limits(RenderLimits(output_chars=1000)),
        pytest.raises(ValueError, match=r"rendered text is longer than .*output_chars=1,000"),
    ):
        render("{% for i in range(40) %}{% for j in range(40) %}x{% endfor %}{% endfor %}")


def test_template_longer_than_the_limit():
    with (
        render_limits(RenderLimits(template_chars=100)),
        pytest.raises(ValueError, match=r"template is 101 characters long, more than"),
    ):
        render("x" * 101)
    with pytest.raises(ValueError, match=r"RenderLimits\.template_chars=1,000,000"):
        render("x" * 1_000_001)  # the default: a 100 MB template is refused before compiling


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ 'x' * 10**9 }}", r"'\*' got the number 1,000,000,000"),
        ("{% set s = [1] * 10**9 %}", r"'\*' got the number 1,000,000,000"),
        ("{{ 'x'|center(10**9) }}", "the filter center got the number 1,000,000,000"),
        ("{{ 'x'.ljust(10**9) }}", "a method call got the number 1,000,000,000"),
        ("{{ 2 ** (10 ** 12) }}", r"'\*\*' got the number"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            r"'~' built a value of 33,554,432 items",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}",
            r"'\+' built a value of 33,554,432 items",
        ),
    ],
)
def test_values_larger_than_the_output_limit_are_refused_before_memory_fills(source, message):
    with pytest.raises(ValueError, match=f"went past its bounds: {message}"):
        render(source)


def test_endless_recursion():
    with pytest.raises(ValueError, match="recurses without end"):
        render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")


def test_limits_apply_inside_the_block_only():
    source = "{% for i in range(50) %}x{% endfor %}"
    with render_limits(RenderLimits(output_chars=10)), pytest.raises(ValueError):
        render(source)
    assert render(source) == "x" * 50


@pytest.mark.parametrize(
    "kwargs",
    [{"seconds": 0.0}, {"seconds": float("nan")}, {"output_chars": -1}, {"template_chars": 0}],
)
def test_bad_limits(kwargs):
    with pytest.raises(ValueError, match="RenderLimits"):
        RenderLimits(**kwargs)
