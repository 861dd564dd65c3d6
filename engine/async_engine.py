"""AsyncEngine: the step loop on its own thread, per-request async streams for the server.

Only the engine thread touches the scheduler and the KV cache. Coroutines hand it commands (add, abort) through a
queue, and it hands outputs back with `call_soon_threadsafe`, so the event loop never waits on a model step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.llm_engine import LLMEngine, RequestError
from engine.metrics import EngineMetrics
from engine.output import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("tokenweir.engine")
FINISHED_MEMORY = 20_000  # final usage of this many recent requests stays queryable (POST /abort after the fact)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass
class _Abort:
    request_id: str
    done: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or EngineMetrics(engine.model_name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._finished: OrderedDict[str, RequestOutput] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errored: BaseException | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def started(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- called from the event loop ---------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (client gone, timeout) aborts the request."""
        if self.errored is not None:
            raise RuntimeError(f"engine loop died: {self.errored!r}")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already running", code="duplicate_request_id")
        self.engine.validate(prompt_token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(_Add(request_id, prompt_token_ids, params, priority, time.monotonic()))
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            try:
                if not finished:
                    await asyncio.shield(self.abort(request_id))
            finally:  # a second cancel during the shielded abort must still free the id
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort if still running; returns the request's final output (exact token counts) if it is known at all.
        A stream being consumed elsewhere receives that final output and ends."""
        if self.errored is not None or not self.started:
            return self._finished.get(request_id)  # nothing would ever answer the command
        done = self._loop.create_future()
        self._send(_Abort(request_id, done))
        return await done

    def load(self) -> dict:
        return self.engine.load()

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- the engine thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self.metrics.observe_step(self.engine, self.engine.last_stats, time.monotonic())
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:  # a dead loop must fail every waiter, not hang them
            log.exception("engine step loop died")
            self.errored = exc
            for request_id in list(self._streams):
                self._post(request_id, RuntimeError(f"engine failed: {exc!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(
                        cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority, cmd.arrival_time
                    )
                except RequestError as exc:
                    self._post(cmd.request_id, exc)
            else:
                seq = self.engine.sequences.get(cmd.request_id)
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self.metrics.observe_finished(seq, time.monotonic())
                    self._remember(out)
                    self._post(cmd.request_id, out)
                else:
                    out = self._finished.get(cmd.request_id)
                self._loop.call_soon_threadsafe(_resolve, cmd.done, out)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self._remember(out)
        self._post(out.request_id, out)

    def _remember(self, out: RequestOutput) -> None:
        self._finished[out.request_id] = out
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _post(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
