"""One run as several processes, one per host, through JAX's multi-controller runtime
(`jax.distributed`): every process runs train.py with the same flags, holds its own devices and
loads only the rows of each batch they hold; process 0 runs the coordination service, holds the
run directory's lock and writes the run's record, metrics, plots and log; every process writes its
own shards of each checkpoint (orbax).

Health: `jax.distributed`'s coordination service gives every process a heartbeat. A process that
stops sending one for `--heartbeat-timeout` seconds (killed, crashed, its host gone) is declared
dead and the service stops every other process with XLA's message "Terminating process because
the JAX distributed service detected fatal errors ... The following tasks are unhealthy", naming
it, so none hangs in a collective that will never complete; the run then resumes from its last
finalized checkpoint (`--resume`, with any number of processes). A process that loses the
coordinator (process 0) stops the same way. A process that is alive but stuck sends its
heartbeats and is not detected.

Start-up errors are this module's: a coordinator that cannot be reached within
`--init-timeout` seconds (XLA's own message would blame a dead task), and, once every process has
joined, processes that disagree (a `--num-processes` other than the number that joined, other
flags than process 0's, a run directory process 0 refused or that the others do not see) stop
every process with one message naming the numbers (`agree`).
Two processes started with the same `--process-id` cannot be told apart before they join: the
coordination service aborts every process, its message naming the id ("1 unexpectedly tried to
connect with a different incarnation"), which `start` prints a line to explain beforehand.
"""

import dataclasses
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from training.args import Args

# Launchers whose environment jax.distributed reads the process layout from.
LAUNCHER_SIZE_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
# Flags that may differ between the processes of one run (how each joins it).
PER_PROCESS = ("process_id", "coordinator", "num_processes", "init_timeout", "heartbeat_timeout")
# Bytes of one process's report in `agree` (a JSON object, zero-padded).
REPORT_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's `index` among `count`; `primary` (index 0) writes the run's files."""

    index: int = 0
    count: int = 1

    @property
    def primary(self) -> bool:
        return self.index == 0

    def describe(self) -> str:
        return f"process {self.index} of {self.count}"


def wanted(args: Args, environ=os.environ) -> bool:
    """Whether the flags or the environment ask for several processes."""
    flags = args.coordinator is not None or args.process_id is not None
    flags = flags or (args.num_processes or 1) > 1
    launched = any(int(environ.get(name, "1") or 1) > 1 for name in LAUNCHER_SIZE_VARIABLES)
    return flags or "JAX_COORDINATOR_ADDRESS" in environ or launched


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once `address` (HOST:PORT) accepts a TCP connection; a ValueError saying so if it
    does not within `timeout_s` (process 0 not started, a wrong address, a firewall)."""
    host, _, port = address.rpartition(":")
    deadline, why = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as error:
            why = error.strerror or str(error)
        if time.monotonic() >= deadline:
            raise ValueError(
                f"could not reach the coordinator {address} within --init-timeout {timeout_s:g} "
                f"s ({why}): start process 0 (--process-id 0) with --coordinator {address}, or "
                "check the address and port"
            )
        time.sleep(0.25)


def start(args: Args) -> Processes:
    """Join the run's other processes when the flags or the environment ask for several
    (`jax.distributed.initialize`, before anything touches a device); else one process."""
    if not wanted(args):
        return Processes()
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator is not None and args.process_id not in (None, 0):
        wait_for_coordinator(coordinator, args.init_timeout)
    # Before the join: an id that another process already holds makes XLA abort every process
    # ("... tried to connect with a different incarnation"), with no Python error to reword.
    print(
        f"train.py: joining the coordinator {coordinator or '(detected)'} as --process-id "
        f"{'(detected)' if args.process_id is None else args.process_id} of --num-processes "
        f"{args.num_processes or '(detected)'}; two processes given one --process-id stop "
        "with XLA's 'tried to connect with a different incarnation'",
        flush=True,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.init_timeout,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    except RuntimeError as error:
        raise ValueError(
            f"cannot start as one of several processes ({error}): call train.run with "
            "--coordinator / --num-processes / --process-id only in a fresh process, before "
            "anything else uses JAX"
        ) from error
    except ValueError as error:
        raise ValueError(
            f"cannot start as one of several processes: {error}; give --coordinator HOST:PORT, "
            "--num-processes N and --process-id I (or run under SLURM / Open MPI)"
        ) from error
    processes = Processes(jax.process_index(), jax.process_count())
    print(
        f"train.py: {processes.describe()} joined the coordinator; a process silent for "
        f"--heartbeat-timeout {args.heartbeat_timeout} s counts as dead and jax.distributed "
        "then stops the others; resume from the last checkpoint with --resume RUN_DIR",
        flush=True,
    )
    return processes


def stop(processes: Processes) -> None:
    """Leave the coordination service (waits for the other processes to leave too)."""
    if processes.count > 1:
        jax.distributed.shutdown()


def _flags(args: Args) -> dict[str, Any]:
    values = dataclasses.asdict(args)
    return {k: v for k, v in values.items() if k not in PER_PROCESS}


def _same(x):
    """The identity: jitted with replicated output shardings, an all-gather (one function, so
    the run's several gathers compile once)."""
    return x


def _allgather(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's `report` (JSON-ready), in process order.

    Returns once every local device's share of the all-gather has finished, not only the first
    device's (`multihost_utils.process_allgather` reads device 0's copy and returns): a process
    that then stops, its other devices still connecting to the peers', left a peer waiting
    ~150 s for those connections at exit (Gloo's timeout)."""
    data = json.dumps(report).encode()
    if len(data) > REPORT_BYTES:  # flags too long to send whole: compare their digest
        digest = hashlib.sha256(json.dumps(report["flags"]).encode()).hexdigest()
        data = json.dumps({**report, "flags": {"sha256": digest}}).encode()
    buffer = np.zeros((1, REPORT_BYTES), np.uint8)
    buffer[0, : len(data)] = np.frombuffer(data, np.uint8)
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = jax.sharding.Mesh(devices, ("processes", "local"))
    rows = jax.make_array_from_process_local_data(
        jax.NamedSharding(mesh, jax.P("processes")), buffer
    )
    gathered = jax.jit(_same, out_shardings=jax.NamedSharding(mesh, jax.P()))(rows)
    gathered = np.asarray(gathered.block_until_ready().addressable_data(0))
    return [json.loads(bytes(row).rstrip(b"\0")) for row in gathered]


def _on_primary(processes: Processes, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(`fn()`, None) on process 0, or (None, its error's message) if it raised a ValueError
    or OSError (the errors train.py reports); (None, None) on the others."""
    if not processes.primary:
        return None, None
    try:
        return fn(), None
    except (ValueError, OSError) as error:
        return None, str(error)


def agree(processes: Processes, args: Args, run_dir: Path, claim: Callable[[], Any]) -> Any:
    """Process 0 runs `claim()` (it takes the run directory: a `run_dir.Lock`); then every
    process checks that all of them run the same run, and all stop with the same error if not:
    process 0's refusal (its message), a `--num-processes` other than the number that joined,
    flags that differ from process 0's, a process that does not see the run directory process
    0 claimed. Returns the lock on process 0, None elsewhere."""
    if processes.count == 1:
        return claim()
    lock, refusal = _on_primary(processes, claim)
    try:
        reports = _allgather(
            {"refusal": refusal, "num_processes": args.num_processes, "flags": _flags(args)}
        )
        _check_reports(reports, processes)
        # Only now has process 0 written its lock: the others look for it.
        from training.run_dir import lock_holder

        run_id = lock.run_id if lock is not None else None
        found = lock_holder(run_dir)
        sees = {"run_id": None if found is None else found.get("run_id")}
        reports = _allgather({**sees, "claimed": run_id})
        claimed = reports[0]["claimed"]
        blind = [i for i, r in enumerate(reports) if r["run_id"] != claimed]
        if blind:
            raise ValueError(
                f"process(es) {blind} do not see the run directory {str(run_dir)!r} that "
                f"process 0 claimed (lock {claimed}): put --out on a filesystem every host "
                "shares (each process writes its own shards of every checkpoint into it)"
            )
    except ValueError:
        if lock is not None:
            lock.close()
        # Every process raises this same error here, so they leave the coordination service
        # together now rather than each at interpreter exit, where the shutdown barrier waits
        # on the slowest teardown.
        jax.distributed.shutdown()
        raise
    return lock


def _check_reports(reports: list[dict[str, Any]], processes: Processes) -> None:
    if reports[0]["refusal"] is not None:
        raise ValueError(f"process 0 (the coordinator) refused the run: {reports[0]['refusal']}")
    for index, report in enumerate(reports):
        given = report["num_processes"]
        if given is not None and given != processes.count:
            raise ValueError(
                f"process {index} was started with --num-processes {given}, but "
                f"{processes.count} processes joined the coordinator: give every process the "
                "same --num-processes, and each its own --process-id below it"
            )
        ours, theirs = reports[0]["flags"], report["flags"]
        differ = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
        if differ:
            shown = ", ".join(
                f"--{n.replace('_', '-')} {theirs.get(n)!r} (process 0: {ours.get(n)!r})"
                for n in differ[:4]
            )
            raise ValueError(
                f"process {index} is not running the coordinator's run: it was started with "
                f"{shown}; start every process of a run with the same flags (only how each "
                "joins it may differ: --process-id, --coordinator, ...)"
            )


def primary_first(processes: Processes, load: Callable[[], Any]) -> Any:
    """`load()` on process 0, then on the others: it fills caches (the corpus, a trained
    tokenizer) that the others then read rather than write at the same time. Process 0's error
    stops the others too, with its message."""
    if processes.count == 1:
        return load()
    result, failure = _on_primary(processes, load)
    report = _allgather({"failure": failure})[0]
    if report["failure"] is not None:
        raise ValueError(f"process 0 could not load the data: {report['failure']}")
    return result if processes.primary else load()
