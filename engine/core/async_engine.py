"""AsyncEngine: the step loop on its own thread, and one `RequestStream` of outputs per request for the server.

Only the engine thread touches the LLMEngine (scheduler, KV cache). Coroutines hand it commands (add, abort) through
a queue; it hands back outputs, abort answers and stats snapshots, outputs and answers via `call_soon_threadsafe` in
the order they happened, so the event loop never waits on a model step. Request streams live on the event loop only.

A request's own failure (its grammar cannot be followed, its text handling raised) ends that request's stream with
its error; the loop goes on for everyone else. If the step loop itself dies, every pending stream ends with
EngineDeadError and every pending abort is answered, so no client waits on a loop that will never answer; later
requests are refused with the same error, and `on_dead` is called (the server exits, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.core.errors import RequestError, RequestFailed
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.core.metrics import EngineMetrics
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.stats import SchedulerStats

log = logging.getLogger("tokenweir.engine")
FINISHED_MEMORY = 20_000  # final usage of this many recent requests stays queryable (POST /abort after the fact)
# An abort that finds no request leaves the id barred this long: a request whose bytes were still on the wire when
# its sender gave up and aborted it is refused on arrival, so "unknown" means nothing was made and nothing will be.
ABORTED_UNSEEN_S = 60.0


class EngineDeadError(RuntimeError):
    """The step loop died: nothing will be served any more (a server fault, not the client's). `in_flight`: the
    request was in the engine when it died (it may be the cause), rather than refused afterwards."""

    def __init__(self, cause: BaseException, in_flight: bool = True) -> None:
        super().__init__(f"the engine loop died ({cause!r})")
        self.cause = cause
        self.in_flight = in_flight


class RequestStream:
    """One request's outputs, in order (vLLM's RequestOutputCollector). Iterate it once; it ends after the finished
    output, or raises EngineDeadError. `close()` it when done: if it has not finished, that aborts the request."""

    def __init__(self, request_id: str, num_prompt_tokens: int, on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.final: RequestOutput | None = None  # the finished output, once read
        self.failed = False
        self._items: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._on_close = on_close
        self._closed = False

    @property
    def ended(self) -> bool:
        return self.final is not None or self.failed

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.ended:
            item = await self._items.get()
            if isinstance(item, BaseException):
                self.failed = True
                raise item
            if item.error is not None:  # this request failed in the engine; the engine goes on
                self.failed = True
                if item.finished:
                    self.final = item
                raise item.error
            if item.finished:
                self.final = item
            yield item

    def close(self) -> None:
        """Synchronous on purpose: it runs in the `finally` of a cancelled response, where an await would be cut
        short. Idempotent."""
        if not self._closed:
            self._closed = True
            self._on_close(self)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    fairness_id: str | None = None


@dataclass
class _Abort:
    request_id: str
    reply: Callable[[RequestOutput | None], object]  # runs on the event loop with the final output, if known


class EngineThread:
    """One daemon thread that runs what it is given, in order: build the LLMEngine on it (`call(LLMEngine, config)`),
    then hand it to AsyncEngine, which runs the step loop on it.

    The OpenMP runtime keeps a worker pool per thread that starts parallel work. Two such threads (the model loaded on
    the main thread, steps on another) mean more workers than cores, and then libgomp stops spin-waiting between
    parallel regions: every op of a step pays a futex wake-up. Measured on 2 cores, batch-1 decode with 2 threads:
    ~70 tok/s stepping on the thread that loaded the model, 30-50 on another one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable, tuple] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="engine-step-loop", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable, *args):
        """Run fn(*args) on the thread and return its result (or raise its exception) here."""
        return self.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller of result() gets it
                    future.set_exception(exc)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        thread: EngineThread | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`thread`: the EngineThread that built `engine`, to run the step loop on; by default a new one. `on_dead`:
        called on the event loop once the step loop has died and every waiter has its error."""
        self.on_dead = on_dead
        self.engine = engine
        self.metrics = metrics or EngineMetrics(engine.model_name, max_model_len=engine.max_model_len)
        self.stats: SchedulerStats = engine.make_stats()  # the latest snapshot, published by the engine thread
        self.errored: BaseException | None = None  # why the step loop died; set on the event loop
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._finished: OrderedDict[str, RequestOutput] = OrderedDict()  # engine thread writes
        self._aborted_unseen: OrderedDict[str, float] = OrderedDict()  # engine thread only: id -> when aborted
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread
        self._running: Future | None = None
        self._stopping = False
        engine.on_transfer_event = self._wakeup.set  # a pin fetched or a fetch done: free or run them now

    # --- what the server may know about the engine ------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    # --- lifecycle --------------------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._running is not None and not self._running.done()

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop start() ran on, where streams live and replies go."""
        assert self._loop is not None, "not started"
        return self._loop

    def start(self) -> None:
        assert self._running is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._thread = self._thread or EngineThread()
        self._running = self._thread.submit(self._run)

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._running is not None:
            with contextlib.suppress(TimeoutError):
                self._running.result(timeout=10)
            assert self._thread is not None  # start() set it with _running
            self._thread.shutdown()
        self.engine.close()  # its KV transfer threads, if any

    # --- called on the event loop -----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        fairness_id: str | None = None,
    ) -> RequestStream:
        """Check the request against the engine's limits (RequestError) and queue it; its outputs arrive on the
        returned stream. Not async, so a bad request fails before a streaming response sends its first byte.
        `fairness_id`: its tenant for token fairness (the caller bounds its length)."""
        if self.errored is not None:
            raise EngineDeadError(self.errored, in_flight=False)
        self.engine.validate(prompt_token_ids, params)  # reads only fixed limits: safe off the engine thread
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already running", code="duplicate_request_id")
        stream = RequestStream(request_id, len(prompt_token_ids), self._close_stream)
        self._streams[request_id] = stream
        self._send(_Add(request_id, prompt_token_ids, params, priority, time.monotonic(), fairness_id))
        return stream

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort if still running; returns the request's final output (exact token counts) if it is known at all.
        Its stream, if someone is reading it, receives that final output and ends. None: it never reached this
        engine, and should it arrive within ABORTED_UNSEEN_S it ends at once, unserved."""
        if self.errored is not None or not self.started:
            return self._finished.get(request_id)  # nothing would ever answer the command
        done = self._event_loop.create_future()
        self._send(_Abort(request_id, partial(_set_result, done)))
        return await done

    def _close_stream(self, stream: RequestStream) -> None:
        if stream.ended or self.errored is not None:
            self._streams.pop(stream.request_id, None)
            return
        # Ended early (client gone): abort it. The id stays taken until the engine answers, so outputs it sent
        # before the abort can never land in a new request that reuses the id.
        self._send(_Abort(stream.request_id, lambda _out: self._streams.pop(stream.request_id, None)))

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, cause: BaseException) -> None:
        """The step loop died. Run on the event loop, where streams are registered, so none can slip past."""
        self.errored = cause
        for stream in self._streams.values():
            stream.put(EngineDeadError(cause))
        while True:  # commands the dead thread will never read: answer the aborts from memory
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Abort):
                command.reply(self._finished.get(command.request_id))
        if self.on_dead is not None:
            self.on_dead(cause)

    # --- the engine thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.config.num_threads:  # torch's thread count is per thread under OpenMP: set it where steps run
            torch.set_num_threads(self.engine.config.num_threads)
        try:
            while not self._stopping:
                if self._run_commands():
                    self._publish_stats()
                if not self.engine.has_unfinished_requests():
                    if self.engine.collect_transfers():
                        self._publish_stats()
                    self._wakeup.wait(timeout=self.engine.idle_wait_s())
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    if out.finished:
                        self._remember(out)
                self.metrics.observe_step(self.engine.last_stats, time.monotonic())
                # stats first: whoever reads /metrics after getting an answer sees the step that made it
                self._publish_stats()
                self._event_loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # a dead loop must fail every waiter, not hang them
            log.exception("engine step loop died")
            self._event_loop.call_soon_threadsafe(self._fail_all, exc)

    def _run_commands(self) -> bool:
        """Apply the queued commands; False if there were none."""
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if isinstance(command, _Add):
                self._add(command)
                continue
            # its sequences are kept for their timings: metrics observe them
            running = [seq for seq in self.engine.output_processor.choices(command.request_id) if not seq.is_finished]
            outputs = self.engine.abort_request(command.request_id)
            if not outputs:
                out = self._finished.get(command.request_id)
                if out is None:
                    self._bar(command.request_id)
            else:
                now = time.monotonic()
                for seq in running:
                    self.metrics.observe_finished(seq, now)
                out = outputs[-1]
                self._remember(out)
                self._event_loop.call_soon_threadsafe(self._deliver, outputs)
            self._event_loop.call_soon_threadsafe(command.reply, out)

    def _add(self, command: _Add) -> None:
        barred_at = self._aborted_unseen.pop(command.request_id, None)
        if barred_at is not None and barred_at >= time.monotonic() - ABORTED_UNSEEN_S:
            # aborted before it arrived: it ends at once, having made nothing (its sender was told so)
            out = RequestOutput(command.request_id, [], "", True, "abort", 0, 0, 0)
            self._event_loop.call_soon_threadsafe(self._deliver, [out])
            return
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                command.priority,
                command.arrival_time,
                fairness_id=command.fairness_id,
            )
        except Exception as exc:  # this request cannot start: it fails, the loop goes on
            log.exception("request %s failed to start", command.request_id)
            error = RequestFailed(f"the engine failed to start this request: {exc!r}")
            outputs = self.engine.fail_request(command.request_id, error) or [
                RequestOutput(command.request_id, [], "", True, "error", len(command.prompt_token_ids), 0, 0)
            ]
            outputs[-1].error = error
            self._remember(outputs[-1])
            self._event_loop.call_soon_threadsafe(self._deliver, outputs)

    def _publish_stats(self) -> None:
        self.stats = self.engine.make_stats()
        self.metrics.observe_scheduler(self.stats)

    def _bar(self, request_id: str) -> None:
        now = time.monotonic()
        barred = self._aborted_unseen
        barred[request_id] = now
        barred.move_to_end(request_id)
        while barred and (len(barred) > FINISHED_MEMORY or next(iter(barred.values())) < now - ABORTED_UNSEEN_S):
            barred.popitem(last=False)

    def _remember(self, out: RequestOutput) -> None:
        self._finished[out.request_id] = out
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():  # its awaiter may have been cancelled
        future.set_result(value)
