"""One worker process: an engine and the threads around it.

- engine thread (``Drainer``): keeps the engine full and steps it;
- writer thread (``ResultWriter``): finished lines to the database;
- lease thread (``LeaseKeeper``): claims, heartbeats, drops, reaps;
- housekeeping thread (``Housekeeper``): prepares and finalizes batches;
- webhook thread (``WebhookSender``).

The same class runs under Celery (``boxcar worker``) and beside the API (``boxcar serve``).

A broken engine (``step()`` raised: a CUDA error, out of memory, a bug) or an engine thread that
ended for any reason stops the whole worker: it stops claiming, writes the results already
finished, hands its shards back at once (their open lines go back to pending, so another worker
runs them now rather than after the lease expires, and no line is failed for the engine's
fault), then calls ``on_fatal`` -- ``exit_process`` under ``boxcar worker`` and ``boxcar serve``:
exit code 70, for the supervisor to restart it. Exactly once still holds: a result is written
only while its line is open, and a shard that keeps breaking engines is failed after
``max_shard_attempts`` claims (``LeaseKeeper.claim``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sqlalchemy import select

from engine.protocol import Engine
from metrics.publisher import MetricsPublisher
from metrics.recorder import EngineRecorder, MeteredEngine, engine_config, worker_registry
from metrics.step_history import StepHistoryStore, history_key
from openai_format.ids import new_id
from service import ids
from service.db import Database
from service.models import IN_PROGRESS, Shard
from service.queue import CeleryQueue, EmbeddedQueue, TaskQueue, make_queue
from service.served_models import (
    CROSS_ENCODER,
    EMBEDDING,
    GENERATION,
    model_id,
    setting_aliases,
)
from service.settings import Settings
from service.storage import ObjectStorage, make_storage
from worker import claims
from worker.drain import Drainer
from worker.forecaster import Forecaster
from worker.housekeeper import Housekeeper
from worker.items import HeldShards
from worker.lease_keeper import LeaseKeeper
from worker.lora_files import local_lora_modules
from worker.result_writer import ResultWriter
from worker.webhook_sender import WebhookSender

log = logging.getLogger(__name__)

# The worker's exit status when its engine broke (EX_SOFTWARE): restart me.
EXIT_ENGINE_FAILED = 70


def exit_process(exc: BaseException) -> None:
    """``on_fatal`` of a worker process: the leases are already handed back; exit now, from
    whichever thread, without waiting for Celery's or uvicorn's threads."""
    log.critical("exiting with status %d: %s", EXIT_ENGINE_FAILED, exc)
    logging.shutdown()
    os._exit(EXIT_ENGINE_FAILED)


def model_kind(engine: Engine) -> str:
    """The kind of model the engine serves, as its worker announces it."""
    if not engine.is_embedding:
        return GENERATION
    spec = engine.embedding
    return CROSS_ENCODER if spec is not None and spec.cross_encoder else EMBEDDING


def new_worker_id() -> str:
    return new_id(f"{socket.gethostname()}:{os.getpid()}:", nbytes=3)


def build_engine(settings: Settings, storage: ObjectStorage | None = None) -> Engine:
    """The engine the settings describe (imported here: torch is heavy). LoRA adapters named
    by an object-storage key are downloaded (once) from ``storage`` first."""
    from engine import EngineConfig, LLMEngine

    options = dict(settings.engine_options)
    if options.get("lora_modules") and storage is not None:
        options["lora_modules"] = local_lora_modules(list(options["lora_modules"]), storage)
    return LLMEngine(EngineConfig(model=settings.model, **options))


class _EngineThread(threading.Thread):
    """The one thread that touches the engine: it builds it, then runs the drain loop.

    libgomp keeps one OpenMP thread team per calling thread. An engine built on one thread
    (loading and packing weights run parallel regions) and stepped on another leaves two teams,
    more OpenMP threads than CPUs, and libgomp then cuts its spin-wait to almost nothing: the
    workers sleep between parallel regions and every one of a step's ~1,000 regions pays a
    futex wake-up. Measured on 2 cores: decode steps 15-25% slower than the same engine on one
    thread (``boxcar run``).
    """

    def __init__(self) -> None:
        super().__init__(name="boxcar-engine", daemon=True)
        self._jobs: queue.Queue[tuple[Callable[[], None], bool]] = queue.Queue()

    def run(self) -> None:
        while True:
            job, last = self._jobs.get()
            try:
                job()
            except Exception:
                log.exception("engine thread job failed")
            if last:
                return

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on this thread and return its result (or raise its exception)."""
        future: Future[Any] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self._jobs.put((job, False))
        return future.result()

    def run_forever(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the drain loop) as this thread's last job."""
        self._jobs.put((fn, True))

    def finish(self) -> None:
        """End the thread once the jobs before this one are done (a no-op if it already ends)."""
        self._jobs.put((lambda: None, True))


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        db: Database | None = None,
        storage: ObjectStorage | None = None,
        queue: TaskQueue | None = None,
        worker_id: str | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.settings = settings
        self.db = db or Database(settings.database_url)
        self.storage = storage or make_storage(
            settings.storage_url, endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region, create_bucket=settings.s3_create_bucket,
        )
        self.queue = queue or make_queue(settings.broker_url, namespace=settings.queue_namespace,
                                         transport_options=settings.broker_transport_options)
        self.worker_id = worker_id or new_worker_id()
        self.model_id = model_id(settings.model, settings.served_model_name)
        self.engine = engine
        self.held = HeldShards()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._engine_thread: _EngineThread | None = None
        self._started = threading.Event()
        self.drainer: Drainer | None = None
        self.writer: ResultWriter | None = None
        self.webhooks: WebhookSender | None = None
        self.leases: LeaseKeeper | None = None
        self.housekeeper: Housekeeper | None = None
        self.recorder: EngineRecorder | None = None
        self.publisher: MetricsPublisher | None = None
        self.step_history: StepHistoryStore | None = None
        self._on_fatal = on_fatal
        self.failure: BaseException | None = None  # what broke the engine, once it did
        self.failed = threading.Event()  # set when the shutdown after a failure is done
        self._failing = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> WorkerService:
        """Build the engine on its own thread and the parts around it, then start them."""
        engine_thread = self._start_engine_thread()
        engine = self._engine_on(engine_thread)
        # Answers carry the model's id, the name /v1/models lists and requests are routed by.
        model_name = self.model_id
        webhooks, housekeeper, writer = self._build_writer_and_housekeepers()
        self.recorder = EngineRecorder(engine_config(engine))
        self.drainer = self._build_drainer(engine, model_name, self.recorder, writer)
        step_history = self._restore_step_history(engine, self.recorder)
        forecaster = self._build_forecaster(engine, self.drainer, self.recorder)
        self.publisher = self._build_publisher(model_name, self.recorder, forecaster,
                                               step_history)
        self.leases = self._build_lease_keeper(engine, model_name, self.drainer, housekeeper,
                                               self.recorder, engine_thread)
        self._announce_model(self.leases, model_name)
        self._start_threads(writer, webhooks, self.recorder, engine_thread)
        self._started.set()
        log.info("worker %s started (model %s)", self.worker_id, model_name)
        if engine.startup_seconds:
            log.info("engine start-up: %s", ", ".join(
                f"{phase} {seconds:.2f} s" for phase, seconds in engine.startup_seconds.items()))
        return self

    def _start_engine_thread(self) -> _EngineThread:
        """The engine thread exists first: it builds the engine, then steps it (see
        ``_EngineThread``)."""
        engine_thread = self._engine_thread = _EngineThread()
        engine_thread.start()
        return engine_thread

    def _engine_on(self, engine_thread: _EngineThread) -> Engine:
        """The engine given, or one the settings describe, built on the engine thread (which
        ends if that fails)."""
        if self.engine is None:
            settings = self.settings
            try:
                self.engine = engine_thread.call(lambda: build_engine(settings, self.storage))
            except BaseException:
                engine_thread.finish()
                raise
        return self.engine

    def _build_writer_and_housekeepers(
        self,
    ) -> tuple[WebhookSender, Housekeeper, ResultWriter]:
        """The webhook sender, the housekeeper and the result writer (set on the service as
        each is built), which hand each other their wake-ups."""
        settings = self.settings
        webhooks = self.webhooks = WebhookSender(
            self.db, allow_private=settings.webhook_allow_private,
            retry_delays=settings.webhook_retry_delays, timeout=settings.webhook_timeout,
            interval=min(settings.poll_interval, 1.0),
            idle_interval=settings.idle_poll_interval,
        )
        housekeeper = self.housekeeper = Housekeeper(
            self.db, self.storage, settings, worker_id=self.worker_id,
            on_prepared=self._announce_shards, on_finalized=webhooks.wake)
        writer = self.writer = ResultWriter(self.db, self.held, worker_id=self.worker_id,
                                            on_batches_drained=housekeeper.batches_touched,
                                            on_jobs_settled=webhooks.wake)
        return webhooks, housekeeper, writer

    def _build_drainer(self, engine: Engine, model_name: str, recorder: EngineRecorder,
                       writer: ResultWriter) -> Drainer:
        """The drain loop over the engine, each step recorded (``MeteredEngine``); it asks the
        lease thread (built after it) for more lines when it runs low."""
        return Drainer(
            MeteredEngine(engine, recorder), submit=writer.submit,
            model_name=model_name,
            max_num_seqs=engine.config.max_num_seqs,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            job_collect_window=self.settings.job_collect_window,
            low_water=max(2 * engine.config.max_num_seqs, self.settings.shard_size),
            on_hungry=lambda: self.leases.wake_hungry(),
        )

    def _restore_step_history(self, engine: Engine,
                              recorder: EngineRecorder) -> StepHistoryStore:
        """The forecast starts from this engine's own earlier steps (metrics.step_history);
        the store is set on the service before it is read, and saved at ``stop``."""
        step_history = self.step_history = StepHistoryStore(
            self.storage, history_key(model_name=engine.model_name,
                                      engine_config=dataclasses.asdict(engine.config)),
            recorder.step_cost)
        restored = step_history.load()
        if restored:
            log.info("step cost: %d steps of this engine's earlier runs restored", restored)
        return step_history

    def _build_forecaster(self, engine: Engine, drainer: Drainer,
                          recorder: EngineRecorder) -> Forecaster:
        """The forecast, gathered after each step and at once when lines enter an idle engine;
        the drainer asks it which batches' deadlines are at risk."""
        forecaster = Forecaster(drainer, recorder.step_cost,
                                seats=drainer.max_num_seqs,
                                max_model_len=engine.max_model_len,
                                interval=min(self.settings.worker_metrics_interval / 2, 0.5))
        drainer.on_step = forecaster.gather

        def admitted() -> None:  # new lines in an idle engine: forecast and publish them now
            forecaster.gather(force=True)
            if self.publisher is not None:
                self.publisher.wake()  # out of an idle heartbeat's back-off

        drainer.on_admit = admitted
        drainer.at_risk = forecaster.at_risk
        return forecaster

    def _build_publisher(self, model_name: str, recorder: EngineRecorder,
                         forecaster: Forecaster,
                         step_history: StepHistoryStore) -> MetricsPublisher:
        return MetricsPublisher(self.db, recorder, worker_id=self.worker_id, model=model_name,
                                interval=self.settings.worker_metrics_interval,
                                forecast=forecaster.snapshot, history=step_history)

    def _build_lease_keeper(self, engine: Engine, model_name: str, drainer: Drainer,
                            housekeeper: Housekeeper, recorder: EngineRecorder,
                            engine_thread: _EngineThread) -> LeaseKeeper:
        """The lease thread's keeper: it claims lines of the model by its id and its aliases."""
        aliases = setting_aliases(self.settings.model, self.settings.served_model_name)
        if engine.model_name != model_name:  # e.g. the GGUF file's stem
            aliases.append(engine.model_name)
        return LeaseKeeper(self.db, self.settings, worker_id=self.worker_id, held=self.held,
                           drainer=drainer, announce_shards=self._announce_shards,
                           on_batches_touched=housekeeper.batches_touched,
                           model=model_name, aliases=aliases,
                           kind=model_kind(engine),
                           engine_alive=engine_thread.is_alive,
                           on_engine_dead=self._engine_thread_died,
                           on_claims=recorder.observe_claims)

    def _announce_model(self, leases: LeaseKeeper, model_name: str) -> None:
        """Served from now on (before the first claim), and kept so by the lease thread (which
        retries at once if the database is not there yet)."""
        try:
            leases.announce()
        except Exception:
            log.exception("could not announce model %s; the lease thread will retry", model_name)

    def _start_threads(self, writer: ResultWriter, webhooks: WebhookSender,
                       recorder: EngineRecorder, engine_thread: _EngineThread) -> None:
        """The writer and webhook threads, the metrics endpoint, the drain loop on the engine
        thread, then the lease, housekeeping and metrics threads."""
        writer.start()
        webhooks.start()
        if self.settings.worker_metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.settings.worker_metrics_port,
                              registry=worker_registry(recorder))
        engine_thread.run_forever(self._drain)
        self._spawn("leases", lambda: self.leases.run(self._stop))
        self._spawn("housekeeping", lambda: self.housekeeper.run(self._stop))
        self._spawn("metrics", lambda: self.publisher.run(self._stop))
        if isinstance(self.queue, EmbeddedQueue):
            self.queue.subscribe(self.wake)

    def _drain(self) -> None:
        """The engine thread's last job: the drain loop; however it ends short of ``stop()``,
        the worker stops (``fail``)."""
        try:
            self.drainer.run()
        except BaseException as exc:
            self.fail(exc)
            return
        if not self._stop.is_set():
            self.fail(RuntimeError("the drain loop ended on its own"))

    def _engine_thread_died(self) -> None:
        self.fail(RuntimeError("the engine thread is gone"))

    def fail(self, exc: BaseException) -> None:
        """The engine broke: shut down in a thread of its own (it joins the others), once."""
        with self._failing:
            if self.failure is not None:
                return
            self.failure = exc
        log.critical("worker %s: the engine failed, handing its shards back and stopping",
                     self.worker_id, exc_info=exc)
        self._stop.set()  # the lease thread stops claiming and heartbeating at once
        threading.Thread(target=self._shut_down_after_failure, args=(exc,),
                         name="boxcar-fatal", daemon=True).start()

    def _shut_down_after_failure(self, exc: BaseException) -> None:
        try:
            self.stop(release=True)
        except Exception:
            log.exception("stopping after the engine failed")
        finally:
            self.failed.set()
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        def run() -> None:
            try:
                target()
            except Exception:
                log.exception("worker thread %s died", name)
                raise

        thread = threading.Thread(target=run, name=f"boxcar-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, *, release: bool = True, timeout: float = 30.0) -> None:
        """Stop the threads; ``release`` hands held shards back at once (a clean shutdown)."""
        self._stop.set()
        self.wake()
        if self.publisher is not None:
            self.publisher.wake()  # out of its sleep: it sees the stop
        if self.drainer is not None:
            self.drainer.stop()
        if self._engine_thread is not None:
            self._engine_thread.finish()  # the drain loop ends on drainer.stop(); else this does
        for thread in [*self._threads, self._engine_thread]:
            if (thread is not None and thread.is_alive()
                    and thread is not threading.current_thread()):
                thread.join(timeout)
        if self.writer is not None:
            self.writer.flush(timeout)
            self.writer.stop(timeout)
        if release:
            held = self.held.ids()
            if held:
                with self.db.session() as session:
                    claims.release(session, held, worker_id=self.worker_id)
        if self.webhooks is not None:
            self.webhooks.stop()
        if self.publisher is not None:
            self.publisher.remove()
        if self.step_history is not None:
            self.step_history.save()
        log.info("worker %s stopped", self.worker_id)

    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def wake(self) -> None:
        """Something changed (a new batch, a cancel, new shards): look now, not at the next poll."""
        for part in (self.housekeeper, self.webhooks):
            if part is not None:
                part.wake()
        if self.leases is not None:
            self.leases.wake(check=True)

    # -- entry points for broker messages ----------------------------------------------------

    def offer_shard(self, shard_id: str) -> bool:
        """A shard is ready (``shard_id``): wake this worker's claim loop if it has room for
        it; True when it does. The claim itself is the lease keeper's (``claim_some``): it reads
        what is claimable first, so a message for a shard that another worker has taken
        meanwhile runs no claim statement when nothing else is left (an attempt that could only
        lose), and takes the next claimable shard when something is."""
        self.wait_started()
        if self._stop.is_set() or shard_id in self.held:
            return False
        room = self.leases.has_room(is_job=ids.is_job_shard(shard_id))
        self.leases.wake()
        return room

    def handle_batch(self, batch_id: str) -> str | None:
        """Prepare or finalize ``batch_id`` as its state asks; notice a cancel at once."""
        self.wait_started()
        self.leases.wake(check=True)
        if self.housekeeper.prepare(batch_id) is not None:
            return IN_PROGRESS
        return self.housekeeper.finalize(batch_id)

    def _announce_shards(self, shard_ids: list[str]) -> None:
        """New or freed shards: tell their model's workers (Celery) and this one."""
        if isinstance(self.queue, CeleryQueue) and shard_ids:
            with self.db.read_session() as session:
                rows = session.execute(
                    select(Shard.id, Shard.model, Shard.job_id).where(Shard.id.in_(shard_ids))
                ).all()
            by_queue: dict[tuple[str | None, bool], list[str]] = {}
            for row in rows:
                by_queue.setdefault((row.model, row.job_id is not None), []).append(row.id)
            for (model, jobs), ids_ in by_queue.items():
                self.queue.shards_ready(ids_, model=model, jobs=jobs)
        self.leases.wake()
