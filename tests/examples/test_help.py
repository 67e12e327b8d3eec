"""Every example answers --help with its usage and starts nothing (no run, no download)."""

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


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_prints_usage_and_runs_nothing(name, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", f"examples.{name}", "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HOME": str(tmp_path),
             "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    assert not re.search(r"loss \d|compiling", result.stdout)  # nothing trained or compiled
    assert not list(tmp_path.iterdir())  # nothing written under $HOME (no corpus, no cache)
