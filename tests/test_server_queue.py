"""The work queue on its own: first come first served, a bounded wait list, genkey lookup, abort rules, close."""

from __future__ import annotations

import threading
from typing import Any, List

import pytest

from kobold_backend.server.queue import Job, ServiceBusy, WorkQueue


def blocking_job(order: List[str], name: str, release: threading.Event, genkey: Any = None) -> Job:
    def run(job: Job) -> str:
        order.append(name)
        job.emit(f"{name}-text")
        while not release.wait(0.01):
            if job.abort_event.is_set():
                return f"{name}-aborted"
        return name

    return Job(run, genkey=genkey)


def never(job: Job) -> None:
    raise AssertionError("a cancelled job must not run")


def test_fifo_and_bounded_wait_list() -> None:
    q = WorkQueue(max_waiting=2)
    try:
        order: List[str] = []
        release = threading.Event()
        jobs = [q.submit(blocking_job(order, n, release)) for n in ("a", "b", "c")]
        with pytest.raises(ServiceBusy):
            q.submit(blocking_job(order, "d", release))
        while not order:
            threading.Event().wait(0.01)
        assert q.queued() == 2 and not q.idle()
        release.set()
        assert [j.wait(lambda: False) for j in jobs] == ["a", "b", "c"]
        assert order == ["a", "b", "c"] and q.idle()
    finally:
        q.close()


def test_zero_wait_list_allows_one_job() -> None:
    q = WorkQueue(max_waiting=0)
    try:
        release = threading.Event()
        first = q.submit(blocking_job([], "a", release))
        with pytest.raises(ServiceBusy):
            q.submit(blocking_job([], "b", release))
        release.set()
        assert first.wait(lambda: False) == "a"
    finally:
        q.close()


def test_genkey_abort_find_and_cancel() -> None:
    q = WorkQueue(max_waiting=4)
    try:
        release = threading.Event()
        order: List[str] = []
        running = q.submit(blocking_job(order, "a", release, genkey="KCPP0001"))
        queued = q.submit(Job(never, genkey="KCPP0002"))
        while not order:
            threading.Event().wait(0.01)
        assert q.find("KCPP0001") is running and running.partial_text() == "a-text"
        assert q.find("KCPP0002") is queued and queued.partial_text() == ""
        assert q.find(None) is None  # the running job has a genkey
        assert q.abort(None) == (False, False)  # someone is waiting: no anonymous abort
        assert q.abort("KCPP0002") == (True, True)
        assert queued.done_event.is_set() and queued.result is None
        assert q.abort(None) == (True, True)  # now it is alone
        assert running.wait(lambda: False) == "a-aborted"
        assert q.abort("KCPP9999") == (False, False)
        assert q.find("KCPP0001") is running  # finished jobs stay findable for /generate/check
    finally:
        q.close()


def test_disconnect_while_waiting_aborts() -> None:
    q = WorkQueue()
    try:
        job = q.submit(blocking_job([], "a", threading.Event()))
        calls = []

        def gone() -> bool:
            calls.append(1)
            return len(calls) > 3

        assert job.wait(gone) == "a-aborted"
    finally:
        q.close()


def test_errors_reach_the_waiting_thread() -> None:
    q = WorkQueue()
    try:
        def fail(job: Job) -> None:
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            q.submit(Job(fail)).wait(lambda: False)
    finally:
        q.close()


def test_close_aborts_everything_and_stops_the_worker() -> None:
    q = WorkQueue(max_waiting=3)
    order: List[str] = []
    running = q.submit(blocking_job(order, "a", threading.Event()))
    waiting = q.submit(Job(never))
    while not order:
        threading.Event().wait(0.01)
    q.close()
    assert running.wait(lambda: False) == "a-aborted"
    assert waiting.done_event.is_set()
    assert not q._thread.is_alive()
    with pytest.raises(ServiceBusy):
        q.submit(Job(never))
