"""The engine a server drives: add and abort requests, and `step()` one iteration at a time."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from ..core.config import DTYPE_SIZES, EngineConfig
from ..core.errors import InvalidRequestError
from ..core.kv_events import AllBlocksCleared
from ..core.kv_manager import BlockManager
from ..core.load_watch import stage as load_stage
from ..core.messages import RunnerOutput, SchedulerOutput
from ..core.request import Request, RequestStatus
from ..core.sampling_params import SamplingParams
from ..core.scheduler import Scheduler
from ..executors.base import Executor, ExecutorFactory, RunnerDiedError, RunnerUnavailableError
from ..executors.factory import executor_factory_for
from ..grammar import compiler_for, grammar_of
from ..lora import LoRARegistry
from ..runner.spec import RunnerSpec
from .model_setup import ModelSetup
from .outputs import EngineSnapshot, EngineStats, IterationRecord, PreparedRequest, RequestDelta, StepOutput
from .request_rules import RequestRules
from .output_processor import OutputProcessor, error_delta

log = logging.getLogger(__name__)
COMPILE_POLL_SECONDS = 0.05


class LLMEngine:
    """Requests in, deltas out. The scheduler decides each iteration; the executor runs it.

    `executor_factory` makes the executor from the runner's spec, at the start and again
    after the runner died; by default the one `config.parallel.executor` names (the serving layer
    hands in the Triton stages' one, tests hand in fakes)."""

    def __init__(self, config: EngineConfig | None = None,
                 executor_factory: ExecutorFactory | None = None) -> None:
        self.config = config = config or EngineConfig()
        load_stage("preparing the model folder and tokenizer")
        self.rules = RequestRules(config.runner)
        load_stage("checking the model's configuration")
        self.setup = setup = ModelSetup.check(config, self.rules)
        self.runner_spec = RunnerSpec.from_config(
            config, model_path=self.rules.model_path, max_model_len=self.rules.max_model_len,
            num_blocks=config.cache.num_kv_blocks(setup.kv_elements_per_token * DTYPE_SIZES[config.runner.dtype]),
            engine_cache_dir=setup.engine_cache_dir)
        self.executor_factory = executor_factory or executor_factory_for(config.parallel)
        load_stage(f"starting the runner ({config.parallel.executor} executor)")
        self.executor: Executor = self.executor_factory(self.runner_spec)
        load_stage("loading the grammar compiler's tokenizer")
        model = self.rules.model_config
        self.grammars = compiler_for(self.rules.model_path, model.vocab_size, model.eos_token_ids)
        self.loras = LoRARegistry(model, config.scheduler.enable_lora, config.runner.max_lora_rank,
                                  config.scheduler.max_loras)
        self.stats = EngineStats()
        self.kv_events = None  # publishes the K/V cache events of each step (serving/kv_events.py); None: off
        self.reset()

    def reset(self) -> None:
        """Forget every request: a fresh scheduler and K/V pool. The weights stay loaded; a
        runner that died is started again."""
        old = getattr(self, "scheduler", None)
        given_up = getattr(self, "_runner_died", False)  # e.g. as hung, though still alive
        self._fresh_scheduler()
        if self.kv.events:  # AllBlocksCleared now: an idle engine may not step again for a while
            self.kv_events.publish(self.kv.take_events())
        if old is None:
            return
        if given_up or not self._runner_healthy():
            self._restart_runner()
        else:
            self.scheduler.forget_on_runner(old.runner_request_ids())

    def _runner_healthy(self) -> bool:
        try:
            self.executor.check_health()
        except RunnerDiedError:
            return False
        return True

    def _fresh_scheduler(self) -> None:
        cache = self.config.cache
        # A new pool starts with an empty prefix cache: a new runner has no K/V to share.
        self.kv = BlockManager(self.runner_spec.num_blocks, cache.block_size, cache.enable_prefix_caching,
                               namespace=str(self.rules.model_path), stats=self.stats.prefix_cache,
                               window=self.setup.kv_window)
        if self.kv_events is not None:  # an empty pool: routers drop what they knew of the old one
            self.kv.events, self.kv.medium = [AllBlocksCleared()], self.kv_events.medium
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.stats.scheduler)
        self.outputs = OutputProcessor(self.rules, self.config.runner.pooling_normalize, self.stats.speculation,
                                       self._end, cache.block_size)
        # Requests whose structured_outputs grammar is compiling: tracked, not yet scheduled.
        self._compiling: dict[str, Future] = {}
        self._in_flight: dict[int, tuple[SchedulerOutput, Future[RunnerOutput]]] = {}
        # iteration id -> perf_counter() at its submission, then as its result was set
        self._submitted: dict[int, list[float]] = {}
        self._last_returned = 0.0  # perf_counter() as the previous iteration's result was set
        self._runner_died = False  # its requests have been ended; a new runner is due

    def _restart_runner(self) -> None:
        log.warning("starting a new model runner")
        self.executor.shutdown()
        self.executor = self.executor_factory(self.runner_spec)
        self.stats.num_runner_restarts += 1
        self._runner_died = False

    def shutdown(self) -> None:
        """Stop the runner (a child process, with the `process` executor)."""
        self.executor.shutdown()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | PreparedRequest,
                    params: SamplingParams | None = None, track_logprob: bool = False,
                    grammar: Future | None = None, lora_name: str | None = None,
                    arrival_time: float | None = None, track_perf: bool = False, traced: bool = False) -> Request:
        """Validate and queue a request; raises InvalidRequestError naming what is wrong.

        `prompt`: text or token ids, checked here with `params`; or what `prepare` returned
        (a server's tokenizer thread checked it), not checked again (`params` unused).
        `lora_name`: the adapter it runs with (one `add_lora` registered); None: the base model.
        `track_logprob` keeps a cumulative log-probability even when `params.logprobs` is unset;
        `grammar`: the future `compile_grammar` gave for these params (else the compile starts here);
        `arrival_time`: when it arrived by time.monotonic() (None: now), whence its deadline;
        `track_perf`: its deltas carry its timings and cache figures (`RequestDelta.perf`); `traced`:
        its last delta does, with its timeline (a request's trace is built from it).
        """
        if request_id in self.outputs.tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        lora = None if lora_name is None else self.loras.get(lora_name)
        if not isinstance(prompt, PreparedRequest):
            prompt = self.prepare(prompt, params or SamplingParams())
        token_ids, params = prompt.token_ids, prompt.params
        grammar = grammar or self.compile_grammar(params)
        ready = grammar is None or grammar.done()  # read once: it may end at any moment
        if grammar is not None and ready:
            grammar_of(grammar)  # a refused grammar raises its InvalidRequestError here
        req = Request(request_id, token_ids, params, track_logprob=track_logprob, lora=lora,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                      timeline=[("added", time.monotonic(), 0)] if track_perf or traced else None,
                      perf_deltas=track_perf)
        self.outputs.track(req)
        if grammar is not None:
            self.stats.num_structured_requests += 1
        self.loras.count(lora)
        if ready:
            self.scheduler.add(req)
        else:
            self._compiling[request_id] = grammar  # scheduled once it has compiled (step())
        return req

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT adapter in `path` as `name` (checked against the model now; its
        weights are read when a request first uses it). Raises ConfigError."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter; refused (InvalidRequestError) while a request uses it."""
        self.loras.remove_unused(name, (t.request for t in self.outputs.tracked.values()))

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """(the adapters of running requests, those of waiting ones), by name."""
        return self.loras.in_use(self.scheduler.running, (t.request for t in self.outputs.tracked.values()))

    def compile_grammar(self, params: SamplingParams) -> Future | None:
        """Start compiling a request's structured_outputs grammar (None if it has none): the
        future is done at once when the grammar is cached, and fails with an
        InvalidRequestError for a bad spec or one not compiled in time. Any thread."""
        if params.structured_outputs is None:
            return None
        return self.grammars.submit(params.structured_outputs, self.config.runner.grammar_compile_timeout_seconds)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> PreparedRequest:
        """Tokenize and check a request against the model and the K/V pool, and resolve its
        parameters (max_tokens None: up to the context and what the pool holds); raises
        InvalidRequestError. Safe to call from any thread (it reads the tokenizer and limits
        only), so a server can tokenize long prompts without holding up iterations."""
        token_ids = self.rules.prepare(prompt, params)
        num_blocks, block_size = self.runner_spec.num_blocks, self.config.cache.block_size
        params = self.rules.resolved(params, len(token_ids), room=num_blocks * block_size - len(token_ids) + 1)
        need = -(-(len(token_ids) + params.max_tokens - 1) // block_size)
        if need > num_blocks:
            raise InvalidRequestError(f"prompt plus max_tokens needs {need} K/V blocks, the pool has {num_blocks}")
        return PreparedRequest(token_ids, params)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its K/V blocks (when its iteration returns, if one is in
        flight; nothing more of it is reported); False if it is unknown or finished."""
        tracked = self.outputs.tracked.pop(request_id, None)
        if tracked is None:
            return False
        self._end(tracked.request, RequestStatus.FINISHED_ABORTED)
        return True

    def _end(self, req: Request, status: RequestStatus) -> None:
        if self._compiling.pop(req.request_id, None) is not None:
            req.status = status  # never scheduled: nothing to free
        elif not req.status.finished:
            self.scheduler.finish(req, status)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, iterations still to collect, a runner to start again, or ended
        requests the runner still holds state for."""
        return (bool(self.outputs.tracked) or bool(self._in_flight) or self._runner_died
                or self.scheduler.has_news_for_runner)

    @property
    def num_iterations_in_flight(self) -> int:
        """Iterations submitted to the runner and not yet collected by step()."""
        return len(self._in_flight)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.outputs.tracked)

    def snapshot(self) -> EngineSnapshot:
        """The gauges and counters a server reports, as of now (engine thread only)."""
        return EngineSnapshot.of(self)

    # -- iterations -------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Submit iterations until `max_inflight` are out, wait for one to return, and
        return a delta per request that got a token or failed, with the iterations collected.

        A failure that belongs to one request (its sampling, its detokenization) ends that
        request alone, with a delta whose `error` says why. A failed iteration ends its own
        requests. A dead runner ends the requests it held, and is restarted."""
        start = time.perf_counter()
        deltas = StepOutput()
        try:
            if self._runner_died:  # its requests' errors went out with the previous step
                self._restart_runner()
            self.executor.check_health()
            deltas += self._admit_compiled()
            self._submit()
            if not self._in_flight:
                self._await_compiles()
                return deltas
            for message, future in self._returned():
                deltas += self._complete(message, future, deltas.iterations)
        except RunnerDiedError as e:
            deltas += self._recover(e)  # keeping what iterations returned before it died
        if self.kv.events:
            self.kv_events.publish(self.kv.take_events())
        self.stats.step_seconds += time.perf_counter() - start
        return deltas

    def _admit_compiled(self) -> list[RequestDelta]:
        """Schedule the requests whose grammar has compiled; end those it failed for."""
        deltas = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            req = self.outputs.tracked[request_id].request
            if future.exception() is not None:
                deltas.append(self.outputs.fail(req, str(future.exception())))
            else:
                del self._compiling[request_id]
                req.mark("grammar")
                self.scheduler.add(req)
        return deltas

    def _await_compiles(self) -> None:
        """Nothing to run but grammars compiling: wait a moment for one, not a busy loop (a
        server's new requests wait no longer than that)."""
        if self._compiling:
            wait(list(self._compiling.values()), COMPILE_POLL_SECONDS, FIRST_COMPLETED)

    def _submit(self) -> None:
        while len(self._in_flight) < self.config.scheduler.max_inflight:
            message = self.scheduler.schedule()
            if message is None:
                return
            times = self._submitted[message.iteration_id] = [time.perf_counter()]
            try:
                future = self.executor.submit(message)
            except BaseException:
                self._submitted.pop(message.iteration_id, None)
                raise
            self._in_flight[message.iteration_id] = (message, future)
            future.add_done_callback(lambda _, times=times: times.append(time.perf_counter()))

    def _returned(self) -> list[tuple[SchedulerOutput, Future[RunnerOutput]]]:
        """Wait for at least one iteration; every one that has returned, oldest first. A
        runner that returns nothing for `iteration_timeout_seconds` is treated as dead."""
        timeout = self.config.parallel.iteration_timeout_seconds
        wait([future for _, future in self._in_flight.values()], timeout, FIRST_COMPLETED)
        done = sorted(i for i, (_, future) in self._in_flight.items() if future.done())
        if not done:
            raise RunnerDiedError(f"{self.executor.name} returned no iteration in {timeout} s "
                                  f"(iteration {min(self._in_flight)} was due"
                                  f"{self.executor.describe_wait()})")
        return [self._in_flight.pop(i) for i in done]

    def _complete(self, message: SchedulerOutput, future: Future[RunnerOutput],
                  iterations: list[IterationRecord]) -> list[RequestDelta]:
        """The deltas of a returned iteration; its record joins `iterations`."""
        now = time.perf_counter()
        submitted, returned = (*self._submitted.pop(message.iteration_id, [now]), now)[:2]
        seconds, busy = now - submitted, returned - max(submitted, self._last_returned)
        self._last_returned = returned
        try:
            out = future.result()
        except RunnerDiedError:
            raise
        except Exception as e:
            log.error("an iteration of %d requests failed", message.num_requests, exc_info=e)
            updates = self.scheduler.fail_iteration(message.iteration_id,
                                                    f"internal error in the engine's iteration: {e}")
            return self.outputs.deltas(updates, None)
        if out.iteration_id != message.iteration_id:
            raise RunnerDiedError(f"{self.executor.name} answered iteration {message.iteration_id} "
                                  f"with iteration {out.iteration_id}'s output")
        deltas = self.outputs.deltas(self.scheduler.update(out, self.outputs.ends), out)
        if not message.num_requests:
            return deltas  # it only told the runner which requests have ended
        self.stats.num_iterations += 1
        self.stats.forward_seconds += out.forward_seconds
        iterations.append(IterationRecord(
            message.num_requests, message.num_tokens, message.num_prefill_requests,
            message.num_decode_requests, self.kv.num_used_blocks, len(self.scheduler.waiting),
            sum(s.num_computed_tokens for s in message.scheduled), sum(s.sample for s in message.scheduled),
            seconds, out.mask_seconds, max(0.0, busy)))
        return deltas

    def _recover(self, error: RunnerDiedError) -> list[RequestDelta]:
        """The runner died: end every request it held state for now, keep the requests it
        never saw, and start a new runner with the next step (so the errors go out first)."""
        log.error("%s; restarting it", error)
        # Unseen: waiting, or admitted with no tokens yet (request-level batching does that).
        # When no runner can start, they would wait for nothing: they end too.
        unavailable = isinstance(error, RunnerUnavailableError)
        old = self.outputs.tracked
        unseen = [] if unavailable else [t for t in old.values() if not t.request.num_sent_tokens]
        message = f"internal error: {error}" + ("" if unavailable else "; the runner was restarted")
        deltas = [error_delta(t.request, message) for t in old.values()
                  if unavailable or t.request.num_sent_tokens]
        compiling = {} if unavailable else self._compiling
        self._fresh_scheduler()
        self._runner_died = True
        for tracked in unseen:
            request_id = tracked.request.request_id
            self.outputs.tracked[request_id] = tracked
            if request_id in compiling:
                self._compiling[request_id] = compiling[request_id]
            else:
                self.scheduler.readmit(tracked.request)
        return deltas
