"""train.py killed with SIGKILL as soon as its checkpoint of step N has been handed to the
background writer (its files may still be being written): what a crash leaves to --resume.

    python tests/training/killed_run.py N TRAIN_PY_FLAGS...
"""

import os
import signal
import sys

import train
from training import run_dir

if __name__ == "__main__":
    kill_at, argv = int(sys.argv[1]), sys.argv[2:]
    save = run_dir.Checkpointer.save

    def save_then_die(self, **kwargs):
        blocked = save(self, **kwargs)
        if kwargs["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return blocked

    run_dir.Checkpointer.save = save_then_die
    train.main(argv)
