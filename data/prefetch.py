"""Overlapped data loading: a background thread makes the next batches and puts them on the
device while the current step runs ("lay track faster than the train"), so the step loop only
waits when the host falls behind. `wait_s` adds up that waiting, the number to watch.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Prefetcher:
    """Iterate `batches` on a thread, apply `place` (host -> device), keep `depth` ready."""

    def __init__(self, batches: Iterator[Any], place: Callable[[Any], Any], depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._fill, args=(batches, place), daemon=True)
        self._thread.start()

    def _fill(self, batches: Iterator[Any], place: Callable[[Any], Any]) -> None:
        try:
            for batch in batches:
                item = ("batch", place(batch))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(("end", None))
        except Exception as error:  # hand it to the consumer, which re-raises it in its thread
            self._queue.put(("error", error))

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        kind, value = self._queue.get()
        self.wait_s += time.perf_counter() - start
        if kind == "error":
            raise value
        if kind == "end":
            raise StopIteration
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
