"""The service's subcommands of ``boxcar``: serve, api, worker, keys create, db upgrade, status.

Settings come from ``BOXCAR_*`` variables (``service.settings``); options given here override them.

Every command that opens the database checks its schema first (``service.migrate.ensure_schema``:
SQLite is migrated, PostgreSQL must be at the code's revision) and refuses with one line naming
``boxcar db upgrade`` instead of a traceback from the first missing table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack, closing
from functools import partial

from cli.database import Refused, open_database


def _refusing(name: str, handler):
    """``handler`` with ``Refused`` turned into one line on stderr and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except Refused as exc:
            print(f"boxcar {name}: {exc}", file=sys.stderr)
            return 1

    return run


def _settings_from(args: argparse.Namespace):
    """The environment's settings, with the engine options given on the command line."""
    from cli.engine_options import engine_config_kwargs
    from service.settings import Settings

    settings = Settings()
    updates: dict = {}
    if getattr(args, "model", None) is not None or hasattr(args, "max_num_seqs"):
        engine = engine_config_kwargs(args)
        model = engine.pop("model", None)
        if model:
            updates["model"] = model
        if engine:
            updates["engine_options"] = {**settings.engine_options, **engine}
    for name in ("database_url", "storage_url", "broker_url"):
        value = getattr(args, name, None)
        if value:
            updates[name] = value
    return settings.model_copy(update=updates) if updates else settings


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    from cli.engine_options import add_engine_arguments

    add_engine_arguments(parser)
    parser.set_defaults(model=None)  # unset: BOXCAR_MODEL decides


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "botocore", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _cmd_serve(args: argparse.Namespace) -> int:
    from cli.embedded import EmbeddedServer
    from worker.process import exit_process

    # Redirected to a file, stdout is block-buffered: the key line would not reach the log.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _logging(args.verbose)
    settings = _settings_from(args)
    server = EmbeddedServer(settings, host=args.host, port=args.port,
                            on_fatal=exit_process).start()
    print(f"boxcar is serving {settings.model} at {server.base_url} "
          f"(docs: {server.base_url}/docs)")
    print(f"API key: {server.api_key}")
    print("Ctrl-C stops it.", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import build_context, create_app
    from service.db import Database
    from service.migrate import upgrade

    _logging(args.verbose)
    settings = _settings_from(args)
    # The API starts on an out-of-date PostgreSQL schema, or one it cannot reach yet: /readyz
    # says why it is not ready and /v1 answers 503 until `boxcar db upgrade` has run.
    if settings.is_sqlite:
        db = open_database(settings.database_url)  # the embedded database migrates itself
    else:
        db = Database(settings.database_url)
    if args.migrate:
        upgrade(db)
    context = build_context(settings, db=db)
    log = logging.getLogger("boxcar.api")
    try:
        problem = context.schema.problem()
    except Exception as exc:
        problem = f"the database cannot be reached ({type(exc).__name__})"
    if problem:
        log.warning("not ready: %s", problem)
    uvicorn.run(create_app(context=context), host=args.host, port=args.port, log_level="info")
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings_from(args)
    if args.healthcheck:
        return _worker_healthcheck(settings, host=args.host)
    if not settings.broker_url:
        print("boxcar worker: set BOXCAR_BROKER_URL (e.g. redis://localhost:6379/0); "
              "`boxcar serve` runs a worker without a broker", file=sys.stderr)
        return 2
    open_database(settings.database_url).dispose()  # the schema, before loading a model
    _logging(args.verbose)
    lower_priority(settings.worker_nice)  # before any thread starts: they inherit it
    from worker.celery_app import build_app

    app = build_app(settings)

    argv = ["worker", "--pool=threads", f"--concurrency={args.concurrency}",
            f"--loglevel={'DEBUG' if args.verbose else 'INFO'}", "--without-gossip",
            "--without-mingle", "--without-heartbeat"]
    if args.hostname:
        argv.append(f"--hostname={args.hostname}")
    app.worker_main(argv)
    return 0


def lower_priority(nice: int, autogroup: str = "/proc/self/autogroup") -> int:
    """Raise this process's niceness to at least ``nice`` (``BOXCAR_WORKER_NICE``); the
    niceness it has after.

    Linux with ``sched_autogroup`` (most desktop and many server kernels) schedules each session
    as one group, and a niceness counts only inside its group: a worker started as a session
    of its own (a daemon, a supervisor's child, ``setsid``) competes with the API at full weight
    whatever its niceness. Such a worker lowers its group's weight too (its ``autogroup``
    file), which only its own session shares; in the session of a shell, with the API beside
    it, its niceness alone does it."""
    current = os.nice(0)
    after = os.nice(nice - current) if nice > current else current
    if hasattr(os, "getsid") and os.getsid(0) == os.getpid() and os.path.exists(autogroup):
        try:
            with open(autogroup) as f:  # "/autogroup-85 nice 0"
                group_nice = int(f.read().split()[-1])
            if nice > group_nice:
                with open(autogroup, "w") as f:
                    f.write(f"{nice}\n")
        except (OSError, ValueError, IndexError) as exc:  # no autogroup now, or refused
            logging.getLogger("boxcar.worker").info("autogroup niceness not set: %s", exc)
    return after


def _worker_healthcheck(settings, *, host: str | None) -> int:
    """Exit 0 when a worker on this host (container) wrote its heartbeat lately, else 1."""
    import socket

    from cli.status import heartbeat_age

    host = host or socket.gethostname()
    max_age = max(3 * settings.worker_metrics_interval, 10.0)
    db = open_database(settings.database_url, check=False)
    try:
        age = heartbeat_age(db, host=host)
    finally:
        db.dispose()
    if age is None:
        print(f"unhealthy: no worker heartbeat from host {host}", file=sys.stderr)
        return 1
    if age > max_age:
        print(f"unhealthy: the last heartbeat from host {host} is {age:.0f}s old "
              f"(more than {max_age:.0f}s)", file=sys.stderr)
        return 1
    print(f"healthy: a worker on {host} beat {age:.1f}s ago")
    return 0


def _cmd_keys_create(args: argparse.Namespace) -> int:
    from service.keys import create_key

    settings = _settings_from(args)
    with open_database(settings.database_url).session() as session:
        created = create_key(session, tenant_name=args.tenant, name=args.name,
                             max_enqueued_tokens=args.max_enqueued_tokens)
    if args.json:
        print(json.dumps({"key": created.key, "key_id": created.key_id,
                          "tenant_id": created.tenant_id, "tenant": created.tenant_name,
                          "webhook_secret": created.webhook_secret,
                          "max_enqueued_tokens": args.max_enqueued_tokens}))
    else:
        print(f"API key (shown once): {created.key}")
        print(f"key id: {created.key_id}")
        print(f"tenant: {created.tenant_name} ({created.tenant_id})")
        print(f"webhook signing secret: {created.webhook_secret}")
        if args.max_enqueued_tokens is not None:
            print(f"enqueued-token limit per model: {args.max_enqueued_tokens:,}")
    return 0


def _cmd_keys_limit(args: argparse.Namespace) -> int:
    from service.keys import set_key_limit

    settings = _settings_from(args)
    limit = None if args.default else args.max_enqueued_tokens
    with open_database(settings.database_url).session() as session:
        found = set_key_limit(session, key_id=args.key_id, max_enqueued_tokens=limit)
    if not found:
        print(f"no such key: {args.key_id}", file=sys.stderr)
        return 1
    print(f"key {args.key_id}: enqueued-token limit per model "
          + ("the deployment's (BOXCAR_MAX_ENQUEUED_TOKENS)" if limit is None else f"{limit:,}"))
    print("API processes that checked this key use its old limit for up to "
          f"{settings.api_key_cache_seconds:g}s (BOXCAR_API_KEY_CACHE_SECONDS)")
    return 0


def _token_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from service.migrate import current, upgrade

    db = open_database(_settings_from(args).database_url, check=False)
    upgrade(db, args.revision)
    print(f"database at revision {current(db)}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import time

    from cli.status import format_status

    settings = _settings_from(args)
    with ExitStack() as stack:
        collect = _status_source(args, settings, stack)
        while True:
            report = collect()
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                if args.watch:
                    print("\033[H\033[J", end="")  # clear the terminal between redraws
                print(format_status(report), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)


def _status_source(args: argparse.Namespace, settings,
                   stack: ExitStack) -> Callable[[], dict]:
    """Where each report comes from: the API (``--api`` or BOXCAR_API_URL, with
    BOXCAR_OPERATOR_KEY), else the database. PostgreSQL: one connection and one round trip a
    report; SQLite, or anything going wrong there: open_database (whose messages say what) and
    api.status.collect. What it holds open is closed with ``stack``."""
    api_url = args.api or settings.api_url
    if api_url:
        from cli.status_client import ApiStatus

        if settings.operator_key is None:
            raise Refused(f"asking the API at {api_url} needs the operator's key: set "
                          "BOXCAR_OPERATOR_KEY (the API's own)")
        return ApiStatus(api_url, settings.operator_key.get_secret_value()).collect
    from cli.status_reader import StatusCommand

    status = stack.enter_context(closing(StatusCommand(settings.database_url)))
    return partial(status.collect, interval=settings.worker_metrics_interval,
                   max_enqueued_tokens=settings.max_enqueued_tokens)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the service's subcommands to ``boxcar``'s parser."""
    serve = subparsers.add_parser(
        "serve", help="API + one worker in one process (SQLite, local folder, no broker)",
        description="Run the whole service on this machine: the OpenAI-compatible API and one "
        "worker, with SQLite and a local folder under .boxcar/ (BOXCAR_* variables override).")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("-v", "--verbose", action="store_true")
    _add_engine_options(serve)
    serve.set_defaults(handler=_refusing("serve", _cmd_serve))

    api = subparsers.add_parser("api", help="the API server (production)")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--migrate", action="store_true", help="apply migrations first")
    api.add_argument("-v", "--verbose", action="store_true")
    api.set_defaults(handler=_refusing("api", _cmd_api))

    worker = subparsers.add_parser("worker", help="a Celery worker holding one engine "
                                   "(production; one per GPU)")
    worker.add_argument("--concurrency", type=int, default=4,
                        help="threads taking broker messages (the engine is one)")
    worker.add_argument("--hostname", default=None, help="Celery node name")
    worker.add_argument("-v", "--verbose", action="store_true")
    worker.add_argument("--healthcheck", action="store_true",
                        help="check instead of run: exit 0 if a worker on this host (container) "
                        "wrote its heartbeat lately, 1 if not (a container healthcheck)")
    worker.add_argument("--host", default=None,
                        help="with --healthcheck: the worker's host name (default: this one)")
    _add_engine_options(worker)
    worker.set_defaults(handler=_refusing("worker", _cmd_worker))

    keys = subparsers.add_parser("keys", help="API keys")
    keys_commands = keys.add_subparsers(dest="keys_command", metavar="COMMAND")
    create = keys_commands.add_parser("create", help="make an API key for a tenant")
    create.add_argument("--tenant", default="default", help="tenant name (made if new)")
    create.add_argument("--name", default=None, help="a label for the key")
    create.add_argument("--max-enqueued-tokens", type=_token_count, default=None,
                        help="this key's enqueued-token limit per model (default: the "
                        "deployment's, BOXCAR_MAX_ENQUEUED_TOKENS)")
    create.add_argument("--json", action="store_true")
    create.set_defaults(handler=_refusing("keys create", _cmd_keys_create))
    limit = keys_commands.add_parser("limit", help="set a key's enqueued-token limit per model")
    limit.add_argument("key_id", help="the key's id (key_…, printed by keys create)")
    which = limit.add_mutually_exclusive_group(required=True)
    which.add_argument("--max-enqueued-tokens", type=_token_count, default=None)
    which.add_argument("--default", action="store_true",
                       help="back to the deployment's limit")
    limit.set_defaults(handler=_refusing("keys limit", _cmd_keys_limit))
    keys.set_defaults(handler=lambda _args: _usage(keys))

    db = subparsers.add_parser("db", help="database schema")
    db_commands = db.add_subparsers(dest="db_command", metavar="COMMAND")
    up = db_commands.add_parser("upgrade", help="apply migrations (Alembic)")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(handler=_refusing("db upgrade", _cmd_db_upgrade))
    db.set_defaults(handler=lambda _args: _usage(db))

    status = subparsers.add_parser("status", help="the queue, the workers and the batches")
    status.add_argument("--json", action="store_true", help="the report as JSON")
    status.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C")
    status.add_argument("--api", default=None, metavar="URL",
                        help="ask the API at URL (GET /v1/status, with BOXCAR_OPERATOR_KEY) "
                             "instead of reading the database; default: BOXCAR_API_URL")
    status.set_defaults(handler=_refusing("status", _cmd_status))
