"""Every example answers --help with its usage and starts nothing (no run, no compile, no
download, nothing written under $HOME)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The runnable examples (a helper module, such as brevity.py's checker, has no main block).
EXAMPLES = sorted(
    p.stem
    for p in (ROOT / "examples").glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)

# Runs `python -m examples.NAME --help` for each NAME in one fresh interpreter (each in its own
# process cost the suite a library import per example: 23 s of 2.5 s imports), counting the
# programs JAX compiles and the entries it adds to $HOME while each runs. Prints one JSON object:
# NAME -> exit code, outputs, compilations, new $HOME entries.
DRIVER = """
import contextlib, io, json, os, runpy, sys
import jax
compiled = [0]
def count(event, *_, **__):
    if event == "/jax/core/compile/backend_compile_duration":
        compiled[0] += 1
jax.monitoring.register_event_duration_secs_listener(count)
results = {}
for name in sys.argv[1:]:
    out, err, code, compiled[0] = io.StringIO(), io.StringIO(), "returned", 0
    sys.argv, home = [f"examples/{name}.py", "--help"], set(os.listdir(os.environ["HOME"]))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(f"examples.{name}", run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:  # recorded: the next examples still answer
            code = f"raised {error!r}"
    results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                     "compiled": compiled[0],
                     "home": sorted(set(os.listdir(os.environ["HOME"])) - home)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """Each example's answer to --help."""
    home = tmp_path_factory.mktemp("home")
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, *EXAMPLES],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HOME": str(home),
             "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_prints_usage_and_runs_nothing(name, answers):
    answer = answers[name]
    assert answer["code"] == 0, answer["stderr"][-2000:]  # argparse's exit after --help
    assert "usage:" in answer["stdout"]
    assert not re.search(r"loss \d|compiling", answer["stdout"])  # nothing trained
    assert answer["compiled"] == 0  # nothing compiled
    assert answer["home"] == []  # nothing written under $HOME (no corpus, no cache)
