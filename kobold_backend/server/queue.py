"""The work queue in front of the Generator: one job at a time on one worker thread, a bounded wait list,
genkeys, abort, partial text for /api/extra/generate/check, and client-side waiting with disconnect checks."""

from __future__ import annotations

import collections
import queue as _queue
import threading
from typing import Callable, Deque, Iterator, List, Optional, Tuple

# How often a waiting request thread wakes up to check whether its client went away.
POLL_SECONDS = 0.05
# Finished jobs kept so that a late /generate/check with their genkey still sees the text.
FINISHED_KEEP = 16


class ServiceBusy(Exception):
    """The wait list is full (HTTP 503 service_unavailable)."""


class Job:
    """One unit of work run on the worker thread: a generation (possibly n runs) or a model load."""

    def __init__(self, fn: Callable[[Job], object], genkey: Optional[str] = None, streaming: bool = False) -> None:
        self.fn = fn
        self.genkey = genkey or None
        self.streaming = streaming
        self.abort_event = threading.Event()
        self.done_event = threading.Event()
        self.state = "queued"
        self.result: object = None
        self.error: Optional[BaseException] = None
        self._pieces: List[str] = []
        self._events: _queue.Queue[Tuple[str, Optional[str]]] = _queue.Queue()

    # -- worker side ---------------------------------------------------------------------------
    def new_run(self) -> None:
        """Start the text of a new run (n > 1 runs one after another in the same job)."""
        self._pieces = []

    def emit(self, text: str, finish_reason: Optional[str] = None) -> None:
        """Record a piece of generated text; streaming listeners get it as an event."""
        if text:
            self._pieces.append(text)
        if self.streaming and (text or finish_reason is not None):
            self._events.put((text, finish_reason))

    # -- client side ---------------------------------------------------------------------------
    def partial_text(self) -> str:
        """The text generated so far by the current run."""
        return "".join(list(self._pieces))

    def events(self, disconnected: Callable[[], bool]) -> Iterator[Tuple[str, Optional[str]]]:
        """Yield (text, finish_reason) until the final event; raises the job's error if it failed."""
        while True:
            try:
                item = self._events.get(timeout=POLL_SECONDS)
            except _queue.Empty:
                item = None
            if item is None:
                if disconnected():
                    self.abort_event.set()
                    return
                if self.done_event.is_set() and self._events.empty():
                    if self.error is not None:
                        raise self.error
                    return
                continue
            yield item
            if item[1] is not None:
                return

    def wait(self, disconnected: Callable[[], bool]) -> object:
        """Block until the job is done (aborting it if the client goes away) and return its result."""
        while not self.done_event.wait(POLL_SECONDS):
            if disconnected():
                self.abort_event.set()
        if self.error is not None:
            raise self.error
        return self.result


class WorkQueue:
    """Runs jobs one at a time on a single worker thread; at most `max_waiting` jobs wait behind it."""

    def __init__(self, max_waiting: int = 6) -> None:
        self.max_waiting = max(0, int(max_waiting))
        self._lock = threading.Condition()
        self._pending: Deque[Job] = collections.deque()
        self._running: Optional[Job] = None
        self._finished: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name="kobold-backend-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue a job or raise ServiceBusy when the wait list is full."""
        with self._lock:
            if self._closed:
                raise ServiceBusy("the server is shutting down")
            # Counting the running job with the waiting ones keeps the limit exact while the worker picks up.
            if len(self._pending) + (self._running is not None) > self.max_waiting:
                raise ServiceBusy("the queue is full")
            self._pending.append(job)
            self._lock.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Abort a job: drop it from the wait list, or signal it to stop if it is running."""
        with self._lock:
            if job in self._pending:
                self._pending.remove(job)
                self._finish(job, None, None)
                return
        job.abort_event.set()

    def abort(self, genkey: Optional[str]) -> Tuple[bool, bool]:
        """KoboldCpp's abort: returns (success, done). Without a genkey only a lone running job is aborted."""
        with self._lock:
            running = self._running
            if not genkey:
                if running is not None and not self._pending:
                    running.abort_event.set()
                    return True, True
                return False, False
            if running is not None and running.genkey == genkey:
                running.abort_event.set()
                return True, True
            for job in list(self._pending):
                if job.genkey == genkey:
                    job.abort_event.set()
                    self._pending.remove(job)
                    self._finish(job, None, None)
                    return True, True
        return False, False

    def find(self, genkey: Optional[str]) -> Optional[Job]:
        """The running, queued or recently finished job with this genkey; without one, a lone running job
        that was started without a genkey (KoboldCpp's GET /generate/check rule)."""
        with self._lock:
            running = self._running
            if not genkey:
                if running is not None and running.genkey is None and not self._pending:
                    return running
                return None
            if running is not None and running.genkey == genkey:
                return running
            for job in self._pending:
                if job.genkey == genkey:
                    return job
            return self._finished.get(genkey)

    def queued(self) -> int:
        """Jobs waiting behind the running one."""
        with self._lock:
            return len(self._pending)

    def idle(self) -> bool:
        """True when nothing runs and nothing waits."""
        with self._lock:
            return self._running is None and not self._pending

    def close(self, timeout: float = 10.0) -> None:
        """Abort everything and stop the worker thread."""
        with self._lock:
            self._closed = True
            while self._pending:
                self._finish(self._pending.popleft(), None, None)
            if self._running is not None:
                self._running.abort_event.set()
            self._lock.notify_all()
        self._thread.join(timeout)

    def _finish(self, job: Job, result: object, error: Optional[BaseException]) -> None:
        job.result = result
        job.error = error
        job.state = "done"
        if job.genkey:
            self._finished[job.genkey] = job
            self._finished.move_to_end(job.genkey)
            while len(self._finished) > FINISHED_KEEP:
                self._finished.popitem(last=False)
        job.done_event.set()

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._pending.popleft()
                job.state = "running"
                self._running = job
            result: object = None
            error: Optional[BaseException] = None
            try:
                result = job.fn(job)
            except BaseException as exc:  # noqa: B036 - the error is handed to the waiting request thread
                error = exc
            with self._lock:
                self._running = None
                self._finish(job, result, error)

