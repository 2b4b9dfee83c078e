"""OrderedTasks: add-teacher's writing thread runs its tasks in order, a few at most waiting, and none after a
failure (a shard's rename must never follow a batch that was not written)."""
from __future__ import annotations

import threading
import time

import pytest

from cxrdr.reinforce.ordered_tasks import OrderedTasks


def test_tasks_run_in_order_on_one_thread_beside_the_caller():
    tasks, done, threads = OrderedTasks(depth=2), [], set()

    def task(i):
        time.sleep(0.002 * (5 - i))  # the first ones slowest: order is kept, not finishing time
        done.append(i)
        threads.add(threading.get_ident())

    for i in range(6):
        tasks.submit(task, i)
    tasks.close()
    assert done == list(range(6))
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert tasks.busy_seconds > 0 and tasks.wait_seconds > 0  # depth 2: the caller waited for the slow first ones


def test_at_most_depth_tasks_are_unfinished():
    tasks, release, started = OrderedTasks(depth=2), threading.Event(), []
    tasks.submit(lambda: (started.append(0), release.wait(5)))
    tasks.submit(started.append, 1)
    blocked = threading.Thread(target=tasks.submit, args=(started.append, 2))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and started == [0]  # the third waits for the first
    release.set()
    blocked.join(5)
    tasks.close()
    assert started == [0, 1, 2]


def test_no_task_runs_after_a_failure_and_the_failure_is_raised():
    tasks, ran = OrderedTasks(depth=8), []

    def fail():
        raise OSError("disk full")

    tasks.submit(ran.append, "batch 1")
    tasks.submit(fail)
    tasks.submit(ran.append, "rename")  # must not run: the shard would lack the failed batch
    with pytest.raises(OSError, match="disk full"):
        tasks.close()
    assert ran == ["batch 1"]
    tasks2 = OrderedTasks(depth=1)
    tasks2.submit(fail)
    with pytest.raises(OSError, match="disk full"):  # the next submit says so, and queues nothing
        tasks2.submit(ran.append, "later")
    tasks2.close()
    assert ran == ["batch 1"]
