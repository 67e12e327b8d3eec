"""train.py as several processes (jax.distributed on localhost, 4 fake CPU devices each): the
same losses as one process on 8 devices; one process killed after a checkpoint stops the other
within the heartbeat timeout; the run resumes as two processes and as one (on another mesh)
with the same losses; process 0 alone writes run.json and the metrics; each process writes its
own checkpoint shards. And the start-up errors: processes that disagree, an unreachable
coordinator.

Every process is a fresh interpreter (jax.distributed must start before JAX does anything), so
the checks share few launches: two rounds of three processes, and one round of five that all
fail at start-up."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from training import run_dir as runs

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).with_name("process_run.py")
# Another mesh (or another process count) reduces in another order: float32 round-off of a few
# ulps per step on losses of ~6, far inside the 1e-5 relative.
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(argv: list[str], *, devices: int, env: dict | None = None) -> subprocess.Popen:
    """`tests/training/process_run.py argv` on `devices` fake CPU devices."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        # As the suite's conftest: no LLVM optimisation (compile time is what these spend).
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
        "--xla_backend_optimization_level=0",
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, str(LAUNCHER), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[tuple[str, float]]:
    """(output, exit time) of each process; all are killed if one is still running at
    `timeout`."""
    outputs, ended = [None] * len(procs), [None] * len(procs)
    deadline = time.time() + timeout
    try:
        while None in ended and time.time() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if ended[i] is None:
                p.kill()
            outputs[i] = p.communicate()[0]
    assert None not in ended, "a process did not finish:\n" + "\n".join(o[-2000:] for o in outputs)
    return list(zip(outputs, ended, strict=True))


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def test_two_processes_train_stop_together_and_resume_as_two_and_as_one(tiny_argv, tmp_path):
    run, reference = tmp_path / "run", tmp_path / "reference"

    def argv(out, *extra):  # evaluation at the last step only: fewer programs to compile
        return tiny_argv(
            out,
            "--steps",
            "6",
            "--batch-size",
            "8",
            "--eval-every",
            "6",
            "--heartbeat-timeout",
            "5",
            *extra,
        )

    def pair(out, *extra, kill_after=None):
        """Process 0 with --coordinator; process 1 finds it through JAX_COORDINATOR_ADDRESS."""
        port = free_port()
        flags = argv(out, "--mesh", "fsdp=4,data=2", "--num-processes", "2", *extra)
        first = launch(
            [*flags, "--coordinator", f"localhost:{port}", "--process-id", "0"], devices=4
        )
        kill = [] if kill_after is None else ["--kill-after", str(kill_after)]
        second = launch(
            [*kill, *flags, "--process-id", "1"],
            devices=4,
            env={"JAX_COORDINATOR_ADDRESS": f"localhost:{port}"},
        )
        return [first, second]

    # Round 1: a 2-process run whose process 1 dies right after handing its step-4
    # checkpoint to the writer, beside the uninterrupted one-process reference.
    procs = [
        *pair(run, kill_after=4),
        launch(argv(reference, "--mesh", "fsdp=4,data=2"), devices=8),
    ]
    (survivor, ended), (victim, _), (ref_log, _) = finish(procs)
    assert procs[1].returncode == -signal.SIGKILL, victim[-3000:]
    assert procs[2].returncode == 0, ref_log[-3000:]
    # The survivor stopped (did not hang in a collective) within the heartbeat timeout, with
    # jax.distributed's message naming the dead process, after train.py's own start-up note.
    assert procs[0].returncode != 0
    assert ended - float(Path(f"{run}.killed").read_text()) < 60
    assert "process 0 of 2 joined the coordinator" in survivor
    assert (
        "Terminating process because the JAX distributed service detected fatal errors" in survivor
    )
    assert "tasks are unhealthy (stopped sending heartbeats):\n1" in survivor

    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    logged = losses(run)
    assert {1, 2, 3, 4} <= set(logged)
    for step, loss in logged.items():
        np.testing.assert_allclose(loss, expected[step], rtol=RTOL, err_msg=f"step {step}")
    # Step 2 was finalized. Step 4 is finalized only if process 1's background writer wrote its
    # shards and reported them between the hand-off and the SIGKILL (a race: a tiny model's
    # shards take microseconds; the 2026-11-28 suite saw it once); never half of it: every
    # complete checkpoint holds each process's own shards, and both resumes below match the
    # reference.
    complete = runs.checkpoints(run)
    assert runs.latest_step(run) in (2, 4)
    assert {int(p.name.removeprefix("step_")) for p in complete} <= {2, 4}
    for checkpoint in complete:
        shards = {p.name for p in (checkpoint / "params").glob("ocdbt.process_*")}
        assert shards == {"ocdbt.process_0", "ocdbt.process_1"}, checkpoint
    assert Path(f"{run}.writes.0").read_text() == "run.json\n"  # process 0, once
    assert not Path(f"{run}.writes.1").exists()

    # Round 2: resumed as two processes and as one (on another mesh), from the latest step.
    two, one = tmp_path / "two", tmp_path / "one"
    shutil.copytree(run, two)
    shutil.copytree(run, one)
    procs = [*pair(tmp_path / "x", "--resume", str(two))]
    procs.append(launch(argv(tmp_path / "y", "--mesh", "fsdp=8", "--resume", str(one)), devices=8))
    for p, (log, _) in zip(procs, finish(procs), strict=True):
        assert p.returncode == 0, log[-3000:]
    for resumed in (two, one):
        again = losses(resumed)  # each step once: the steps past the checkpoint were dropped
        assert sorted(again) == [1, 2, 3, 4, 5, 6], resumed
        for step, loss in again.items():
            np.testing.assert_allclose(loss, expected[step], rtol=RTOL, err_msg=f"{resumed} {step}")
        assert not list(resumed.parent.glob(f"{resumed.name}.writes.*"))  # a resume writes none


def test_processes_that_disagree_or_cannot_meet_stop_with_one_message(tiny_argv, tmp_path):
    def pair(out: str, first_extra: list[str], second_extra: list[str]) -> list[subprocess.Popen]:
        port = f"localhost:{free_port()}"
        common = ["--mesh", "fsdp=4,data=2", "--batch-size", "8", "--coordinator", port,
                  "--init-timeout", "60"]  # fmt: skip
        return [
            launch([*tiny_argv(tmp_path / out, *common, *extra), "--process-id", str(i)], devices=4)
            for i, extra in enumerate([first_extra, second_extra])
        ]

    procs = [
        # Process 1 believes in 3 processes; the coordinator was told 2.
        *pair("a", ["--num-processes", "2"], ["--num-processes", "3"]),
        # Process 1 was started for another run directory.
        *pair(
            "run", ["--num-processes", "2"], ["--num-processes", "2", "--out", str(tmp_path / "b")]
        ),
        # Nobody listens on the coordinator's port.
        launch(
            [
                *tiny_argv(
                    tmp_path / "c",
                    "--coordinator",
                    f"localhost:{free_port()}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    "1",
                    "--init-timeout",
                    "3",
                )
            ],
            devices=4,
        ),
    ]
    started = time.time()
    results = finish(procs, timeout=300)
    outputs = [log for log, _ in results]
    assert all(p.returncode == 1 for p in procs), [o[-2000:] for o in outputs]
    for log in outputs[:2]:  # both processes stop, with the same message naming the numbers
        assert "process 1 was started with --num-processes 3, but 2 processes joined" in log
    for log in outputs[2:4]:
        assert "process 1 is not running the coordinator's run: it was started with --out" in log
        assert str(tmp_path / "b") in log and str(tmp_path / "run") in log
    assert "could not reach the coordinator localhost:" in outputs[4]
    assert "within --init-timeout 3 s" in outputs[4]
    assert results[4][1] - started < 60  # bounded by --init-timeout, not a hang
    # Nor do the pairs wait at exit: one whose gather had returned before all its devices'
    # shares finished kept its peer waiting ~150 s for their connections (1 run in ~10).
    assert max(ended for _, ended in results[:4]) - started < 60
    assert not (tmp_path / "b").exists()  # nothing was written for the refused run
