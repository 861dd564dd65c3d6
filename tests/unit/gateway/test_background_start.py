"""Eager start (gateway/request/background.py): work runs its first step in the caller's task; work that never
suspends is done there, work that suspends goes on as a task exactly as a task would have run it (results,
exceptions, cancellation, the shield)."""

from __future__ import annotations

import asyncio

import pytest

from tokenweir.gateway.request.background import BackgroundTasks, Done, start


async def no_suspend(x: int) -> int:
    return x * 2


async def suspends(steps: list[str], fut: asyncio.Future[int]) -> int:
    steps.append("first")
    await asyncio.sleep(0)  # a bare yield
    steps.append("second")
    value = await fut  # a future
    steps.append("third")
    return value + 1


async def test_work_that_never_suspends_is_done_in_the_callers_step() -> None:
    started = start(no_suspend(21))
    assert isinstance(started, Done) and started.value == 42


async def test_first_step_raises_in_the_caller() -> None:
    async def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        start(boom())


async def test_suspending_work_goes_on_as_a_task() -> None:
    steps: list[str] = []
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = start(suspends(steps, fut))
    assert steps == ["first"]  # the first step ran in the caller, before any loop iteration
    assert isinstance(task, asyncio.Task)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert steps == ["first", "second"]
    fut.set_result(9)
    assert await task == 10 and steps == ["first", "second", "third"]


async def test_exception_after_suspension_reaches_the_awaiter() -> None:
    async def late() -> None:
        await asyncio.sleep(0)
        raise KeyError("late")

    task = start(late())
    assert isinstance(task, asyncio.Task)
    with pytest.raises(KeyError):
        await task


async def test_cancel_is_thrown_into_the_work_where_it_waits() -> None:
    seen: list[str] = []

    async def waits() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            raise
        return "never"

    task = start(waits())
    assert isinstance(task, asyncio.Task)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled inside"]


async def test_work_may_catch_a_cancel_and_finish() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)
            return "finished anyway"
        return "slept"

    task = start(stubborn())
    assert isinstance(task, asyncio.Task)
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "finished anyway"


async def test_shielded_work_finishes_though_its_caller_is_cancelled() -> None:
    background = BackgroundTasks()
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    caller = asyncio.ensure_future(background.shielded(suspends(steps, fut)))
    await asyncio.sleep(0)
    assert len(background) == 1  # it suspended: a task shutdown waits for
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    fut.set_result(1)
    await background.wait(timeout_s=1)
    assert steps == ["first", "second", "third"] and len(background) == 0


async def test_shielded_work_that_never_suspends_leaves_no_task() -> None:
    background = BackgroundTasks()
    assert await background.shielded(no_suspend(4)) == 8
    assert len(background) == 0
