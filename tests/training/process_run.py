"""train.py as one process of a test run, instrumented: `run.json` writes are counted in
`<run>.writes.<process id>`, and with `--kill-after N` this process SIGKILLs itself as soon as
its checkpoint of step N has been handed to the background writer (what a crashed host leaves),
after writing the time of its death to `<run>.killed`.

    python tests/training/process_run.py [--kill-after N] TRAIN_PY_FLAGS...
"""

import os
import signal
import sys
import time
from pathlib import Path

import train
from training import run_dir

if __name__ == "__main__":
    argv, kill_after = sys.argv[1:], None
    if argv[:1] == ["--kill-after"]:
        kill_after, argv = int(argv[1]), argv[2:]
    args = train.parse_args(argv)
    run = Path(args.resume or args.out)
    write_record, save = run_dir.write_record, run_dir.Checkpointer.save

    def counted_write(*a, **k):
        with open(f"{run}.writes.{args.process_id or 0}", "a") as f:
            f.write("run.json\n")
        return write_record(*a, **k)

    def save_then_die(self, **kwargs):
        blocked = save(self, **kwargs)
        if kwargs["step"] == kill_after:
            Path(f"{run}.killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return blocked

    run_dir.write_record = counted_write
    run_dir.Checkpointer.save = save_then_die
    try:
        train.main(argv)
    except (ValueError, FloatingPointError, OSError) as error:
        sys.exit(f"train.py: error: {error}")
