"""`etude run`: the whole deployment on one machine, and the main job through it.

``prepare`` sets up what the services need (auth token, Redis, the object store
directory, the base model, built by CPT + SFT when missing). With a trainer job in the
config the run then goes through its phases:

1. ``baseline``: every service but the trainer starts; the base model is published as
   policy version 0 and scored by the evals service on every enabled suite;
2. ``training``: the trainer starts and trains (asynchronously: inference, envs and
   the trainer all run at once, bounded by the reconciler's staleness settings);
   the evals service scores versions as they are published;
3. ``final eval``: when the trainer reports its job done, the last published version
   is scored on every enabled suite;
4. the report (HTML + plots) and a summary are written and printed, and everything
   stops.

Throughout, a service process that exits is restarted (with backoff, up to
``launcher.max_restarts`` times each): the trainer resumes from its last checkpoint,
leases of a dead envs worker expire and its slots run again, a restarted inference
replica loads the newest version. Ctrl-C stops everything; ``etude run`` again resumes
the run where its state (Redis, checkpoints, the store) left it, unless ``--fresh``.
Without a trainer job it brings the services up and shows their state until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr
from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.config import SERVICE_NAMES, ServiceName
from services.config.deployment import EtudeConfig
from services.launcher.processes import ManagedProcess
from services.launcher.redis_server import redis_answers, start_private_redis

log = logging.getLogger(__name__)

# Dependencies first; stopped in reverse.
START_ORDER: tuple[ServiceName, ...] = ("reconciler", "inference", "envs", "trainer", "evals")
assert set(START_ORDER) == set(SERVICE_NAMES)


class _Stop(Exception):
    """SIGTERM reached the launcher."""


class RunFailed(Exception):
    """The run cannot go on (a service keeps dying, a phase timed out)."""


@dataclass
class RunOptions:
    """Command-line choices of `etude run`."""

    fresh: bool = False
    sync: bool = False
    exit_when_ready: bool = False
    rebuild_model: bool = False


@dataclass
class ServiceState:
    """What the launcher last saw of one service."""

    ready: bool = False
    detail: str = "starting"


@dataclass
class Supervised:
    """A service process and its restarts."""

    process: ManagedProcess
    restarts: int = 0
    restart_at: float | None = None
    exits: list[int] = field(default_factory=list)


def _probe(config: EtudeConfig, service: ServiceName) -> ServiceState:
    """Readiness over gRPC health; the human-readable detail from the HTTP side."""
    with grpc.insecure_channel(config.endpoints.target(service)) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1.0
            )
            ready = answer.status == health_pb2.HealthCheckResponse.SERVING
            detail = "ready" if ready else "not ready"
        except grpc.RpcError as error:
            return ServiceState(False, f"gRPC {error.code().name}")
    http_port = getattr(config, service).http.port
    if http_port:
        try:
            url = f"http://127.0.0.1:{http_port}/readyz"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                detail = json.load(response)["detail"]
        except urllib.error.HTTPError as error:
            detail = json.load(error)["detail"]
        except (OSError, ValueError, KeyError):
            pass
    return ServiceState(ready, detail)


def log_tail(path: Path, lines: int = 20, line_chars: int = 400) -> str:
    """The last `lines` lines of a service's log, each cut to `line_chars` (the resolved
    config a service logs at start is one long line): why it exited, where a run failed
    and only its message is kept (CI)."""
    try:
        with path.open("rb") as log_file:
            log_file.seek(max(0, log_file.seek(0, os.SEEK_END) - 64 * 1024))
            text = log_file.read().decode(errors="replace")
    except OSError as error:
        return f"(unreadable: {error.strerror})"
    kept = text.splitlines()[-lines:]
    return "\n".join(line if len(line) <= line_chars else line[:line_chars] + " …" for line in kept)


def enabled_suites(config: EtudeConfig) -> list[str]:
    """The eval suites the evals service scores every version on."""
    from services.evals.suites import load_suites

    return sorted(n for n, suite in load_suites(config.evals.suites).items() if suite.enabled)


class LocalRun:
    """Brings a deployment up as local processes, supervises it, takes it down again."""

    def __init__(
        self,
        config: EtudeConfig,
        config_path: Path | None,
        console: Console,
        options: RunOptions | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.console = console
        self.options = options or RunOptions()
        self.state_dir = config.run.state_dir
        self.redis: ManagedProcess | None = None
        self.services: dict[ServiceName, Supervised] = {}
        self.states: dict[ServiceName, ServiceState] = {n: ServiceState() for n in START_ORDER}
        self.child_env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        self.phase = "starting"
        self._store: Any = None
        self.known_evals: dict[str, Any] = {}  # eval records read so far, by key
        self.printed_step = 0  # the last step printed as a plain line (console not a terminal)

    # -- preparation ----------------------------------------------------------------

    def prepare(self) -> None:
        """Token, Redis, object store directory and model: everything the services need."""
        if self.options.rebuild_model and not self.options.fresh:
            raise RunFailed(
                "--rebuild-model needs --fresh: a run trained from the old base model cannot "
                "go on from a new one"
            )
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._prepare_token()
        self._prepare_redis()
        if self.options.fresh:
            self._forget_run()
        else:
            self._check_resumable()
        store = self.config.object_store.url
        if store.startswith("file://"):
            Path(store.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        if self.options.sync:
            self._make_synchronous()
        self._check_cpu_affinity()
        if self.options.rebuild_model:
            self._remove_model()
        self._prepare_model()

    def _check_cpu_affinity(self) -> None:
        available = os.sched_getaffinity(0)
        for name, cpus in self.config.launcher.cpu_affinity.items():
            missing = sorted(set(cpus) - available)
            if missing:
                raise RunFailed(
                    f"launcher.cpu_affinity.{name}: CPU {missing} not available here "
                    f"(this process may use {sorted(available)})"
                )

    @property
    def store(self) -> Any:
        """The run's object store (opened on first use)."""
        if self._store is None:
            from services.objectstore.factory import open_store

            self._store = open_store(self.config.object_store)
        return self._store

    def _prepare_token(self) -> None:
        if self.config.auth.token is not None:
            return
        token_file = self.state_dir / "auth-token"
        if not token_file.exists():
            token_file.write_text(secrets.token_urlsafe(32))
            token_file.chmod(0o600)
        token = token_file.read_text().strip()
        self.child_env["ETUDE_AUTH__TOKEN"] = token
        self.config = self.config.model_copy(
            update={"auth": self.config.auth.model_copy(update={"token": SecretStr(token)})}
        )

    def _prepare_redis(self) -> None:
        url = self.config.redis.url
        if redis_answers(url):
            self.console.print(f"redis: using {url}")
            return
        if not self.config.launcher.start_redis:
            raise RuntimeError(f"no Redis answers at {url} and launcher.start_redis is false")
        self.redis, url = start_private_redis(self.state_dir)
        self.child_env["ETUDE_REDIS__URL"] = url
        self.config = self.config.model_copy(
            update={"redis": self.config.redis.model_copy(update={"url": url})}
        )
        self.console.print(f"redis: started a private redis-server at {url} (pid {self.redis.pid})")

    def _forget_run(self) -> None:
        """``--fresh``: the run's Redis keys, checkpoints, store objects and logs go."""
        import redis

        from services.reconciler.store import run_prefix
        from services.trainer.paths import checkpoint_prefix, checkpoint_root

        run = self.config.run.name
        client = redis.Redis.from_url(self.config.redis.url)
        try:
            keys = list(
                client.scan_iter(
                    match=run_prefix(run).replace("{", "\\{").replace("}", "\\}") + "*"
                )
            )
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
        finally:
            client.close()
        shutil.rmtree(checkpoint_root(self.config), ignore_errors=True)
        stored = (f"weights/{run}/", f"evals/{run}/", f"rollouts/{run}/")
        for prefix in (*stored, f"{checkpoint_prefix(self.config)}/"):
            self.store.delete(self.store.list(prefix))
        job = self.config.trainer.job
        if job is not None and job.metrics_file is not None:
            job.metrics_file.unlink(missing_ok=True)
        shutil.rmtree(self.state_dir / "report", ignore_errors=True)
        self.console.print(
            f"fresh: forgot run {run!r} ({len(keys)} Redis keys, checkpoints, weights, evals)"
        )

    def _check_resumable(self) -> None:
        """Refuses a run that Redis remembers as trained when its trainer checkpoints are gone.

        Resuming needs both halves: the reconciler's commits (in Redis) and the trainer's
        checkpoint they were made after. With the state directory deleted and Redis kept,
        the trainer would start at step 0 and its first commit fail as already committed.
        """
        import redis

        from services.reconciler.store import run_prefix
        from services.trainer.paths import (
            checkpoint_dirs,
            checkpoint_prefix,
            checkpoint_root,
            checkpoints_in_store,
            manifest_names,
        )

        job = self.config.trainer.job
        if job is None or job.phase != "rl":
            return
        run = self.config.run.name
        client = redis.Redis.from_url(self.config.redis.url)
        try:
            committed = client.hget(
                f"{run_prefix(run)}:consumer:{job.rl.consumer_id}", "committed_step"
            )
        finally:
            client.close()
        root = checkpoint_root(self.config)
        if committed is None or checkpoint_dirs(root):
            return
        where = str(root)
        if checkpoints_in_store(self.config):
            prefix = checkpoint_prefix(self.config)
            if manifest_names(self.store.list(f"{prefix}/"), prefix):
                return
            where = f"{self.store.url}/{prefix}"
        raise RunFailed(
            f"Redis at {self.config.redis.url} holds run {run!r} trained through step "
            f"{int(committed)}, but there is no trainer checkpoint in {where} to resume from "
            "(was the state directory deleted?): `etude run --fresh` starts the run over"
        )

    def _make_synchronous(self) -> None:
        """``--sync``: one batch generated per policy version, trained before the next."""
        job = self.config.trainer.job
        if job is None:
            raise RunFailed("--sync needs a trainer job ([trainer.job])")
        self.child_env["ETUDE_RECONCILER__MAX_STALENESS"] = "0"
        self.child_env["ETUDE_RECONCILER__MAX_GROUPS_PER_VERSION"] = str(job.rl.groups_per_step)
        self.console.print(
            f"sync: max_staleness 0, {job.rl.groups_per_step} groups generated per version"
        )

    def _remove_model(self) -> None:
        """``--rebuild-model``: the base model and its stages go, if ``etude run`` built them.

        A model directory without the launcher's stages beside it is someone's own model
        (``inference.engine.model_dir`` pointed at it): it is refused, never deleted.
        """
        from services.launcher.base_model import remove_base_model, stages_dir

        model_dir = self.config.inference.engine.model_dir
        stages = stages_dir(model_dir)
        if model_dir.exists() and not stages.is_dir():
            raise RunFailed(
                f"--rebuild-model: inference.engine.model_dir {model_dir} was not built by "
                f"`etude run` (no {stages}); delete it yourself to build a base model there"
            )
        remove_base_model(model_dir)
        self.console.print(f"model: removed {model_dir} and {stages} (--rebuild-model)")

    def _prepare_model(self) -> None:
        model_dir = self.config.inference.engine.model_dir
        if (model_dir / "config.json").is_file():
            self.console.print(f"model: {model_dir}")
            return
        from services.launcher.base_model import build_base_model

        preset = self.config.launcher.model_preset
        self.console.print(f"model: building the {preset} base model at {model_dir} (CPT + SFT)")
        build_base_model(
            preset,
            model_dir,
            self.config.launcher.base_model,
            self.console,
            harness=self.config.envs.harness,
        )

    # -- processes ------------------------------------------------------------------

    def start_service(self, name: ServiceName) -> None:
        """Starts one service process (again, when it was running before)."""
        config_args = ["--config", str(self.config_path)] if self.config_path else []
        cpus = tuple(self.config.launcher.cpu_affinity.get(name, ()))
        env = dict(self.child_env)
        if cpus and name == "inference" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's CPU worker binds its OpenMP threads itself ("auto" keeps a core of
            # the allowed set for its scheduler): give it the same cores explicitly.
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        process = ManagedProcess(
            name=name,
            argv=[sys.executable, "-m", f"services.{name}", *config_args],
            log_path=self.state_dir / "logs" / f"{name}.log",
            env=env,
            cpus=cpus,
        )
        process.start()
        if name in self.services:
            self.services[name].process = process
        else:
            self.services[name] = Supervised(process)

    def start_services(self, names: tuple[ServiceName, ...] = START_ORDER) -> None:
        """Starts service processes, dependencies first."""
        for name in START_ORDER:
            if name in names and name not in self.services:
                self.start_service(name)

    def supervise(self) -> None:
        """Restarts services that exited, with backoff; RunFailed past max_restarts."""
        settings = self.config.launcher
        now = time.monotonic()
        for name, supervised in self.services.items():
            if supervised.restart_at is not None:
                if now >= supervised.restart_at:
                    supervised.restart_at = None
                    self.start_service(name)
                continue
            code = supervised.process.returncode()
            if code is None:
                continue
            supervised.exits.append(code)
            if supervised.restarts >= settings.max_restarts:
                logs = self.state_dir / "logs" / f"{name}.log"
                raise RunFailed(
                    f"{name} exited {code} after {supervised.restarts} restarts; see {logs}, "
                    f"which ends:\n{log_tail(logs)}"
                )
            supervised.restarts += 1
            delay = min(settings.restart_backoff_s * 2 ** (supervised.restarts - 1), 30.0)
            supervised.restart_at = now + delay
            self.console.print(
                f"[yellow]{name} exited {code}; restart {supervised.restarts}/"
                f"{settings.max_restarts} in {delay:.0f} s[/yellow]"
            )

    def probe(self) -> None:
        """Reads every running service's readiness."""
        for name in self.services:
            self.states[name] = _probe(self.config, name)

    def services_table(self) -> Table:
        """The services part of the live view."""
        table = Table(title=f"etude run: {self.config.run.name} ({self.phase})", expand=False)
        for column in ("service", "pid", "state", "detail", "restarts", "uptime"):
            table.add_column(column)
        now = time.time()
        for name in START_ORDER:
            supervised = self.services.get(name)
            if supervised is None:
                table.add_row(name, "-", "[dim]waiting[/dim]", "", "", "")
                continue
            process, state = supervised.process, self.states[name]
            code = process.returncode()
            if supervised.restart_at is not None or code is not None:
                label = f"[red]exited {supervised.exits[-1] if supervised.exits else code}[/red]"
            else:
                label = "[green]ready[/green]" if state.ready else "[yellow]starting[/yellow]"
            table.add_row(
                name,
                str(process.pid),
                label,
                state.detail,
                str(supervised.restarts),
                f"{now - process.started_at:.0f} s",
            )
        return table

    def all_ready(self, names: tuple[ServiceName, ...]) -> bool:
        """Whether each of ``names`` is running and ready."""
        return all(
            name in self.services
            and self.services[name].process.returncode() is None
            and self.services[name].restart_at is None
            and self.states[name].ready
            for name in names
        )

    def stop(self) -> bool:
        """Stops every process by PID, dependents first; True when all exited cleanly."""
        clean = True
        grace = self.config.launcher.stop_grace_s
        for name in reversed(START_ORDER):
            supervised = self.services.get(name)
            if supervised is None or supervised.process.popen is None:
                continue
            process = supervised.process
            already = process.returncode()
            code = process.stop(grace)
            clean &= already is None and code == 0
            self.console.print(f"stopped {name} (pid {process.pid}): exit {code}")
        if self.redis is not None:
            self.redis.stop(grace)
            self.console.print(f"stopped redis (pid {self.redis.pid})")
        return clean


def _wait(
    run: LocalRun,
    live: Live,
    until: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    render: Callable[[], Any] | None = None,
    interval_s: float = 1.0,
) -> None:
    """Supervises and redraws until ``until()``; RunFailed after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        run.supervise()
        run.probe()
        live.update(render() if render else run.services_table(), refresh=True)
        if until():
            return
        if time.monotonic() > deadline:
            raise RunFailed(f"{what}: not done in {timeout_s:.0f} s")
        time.sleep(interval_s)


def _serve_only(run: LocalRun, live: Live) -> int:
    """No trainer job: bring the services up and show them until Ctrl-C."""
    run.start_services()
    run.phase = "serving"
    started = time.monotonic()
    _wait(
        run,
        live,
        lambda: run.all_ready(START_ORDER),
        timeout_s=run.config.launcher.ready_timeout_s,
        what="services ready",
    )
    run.console.print(
        f"all {len(START_ORDER)} services ready in {time.monotonic() - started:.1f} s"
    )
    if run.options.exit_when_ready:
        return 0
    _wait(run, live, lambda: False, timeout_s=float("inf"), what="serving", interval_s=0.5)
    return 0


def _eval_versions(run: LocalRun, version: int, suites: list[str]) -> None:
    """Scores ``version`` on ``suites`` through the evals service (idempotent)."""
    from services.api.v1 import evals_pb2, evals_pb2_grpc
    from services.wire.client import Channels

    async def score() -> None:
        channels = Channels(run.config)
        try:
            stub = evals_pb2_grpc.EvalsServiceStub(channels.get("evals"))
            await asyncio.gather(
                *(
                    stub.RunEval(
                        evals_pb2.RunEvalRequest(policy_version=version, suite=suite, wait=True),
                        timeout=run.config.evals.eval_timeout_s,
                    )
                    for suite in suites
                )
            )
        finally:
            await channels.close()

    asyncio.run(score())


def _scored(run: LocalRun, version: int, suites: list[str]) -> bool:
    from services.evals.results import discover

    found = discover(run.store, run.config.run.name)
    return all(version in found.get(suite, {}) for suite in suites)


def _request_evals(run: LocalRun, live: Live, version: int, suites: list[str]) -> None:
    """Asks for the evals of ``version`` (retrying while evals restarts) and waits for them."""
    import threading

    failures: list[BaseException] = []

    def ask() -> None:
        for attempt in range(run.config.launcher.max_restarts + 1):
            try:
                _eval_versions(run, version, suites)
                return
            except grpc.RpcError as error:
                failures.append(error)
                log.warning("RunEval of version %d, try %d: %s", version, attempt + 1, error)
                time.sleep(5.0)

    asker = threading.Thread(target=ask, name="evals-request", daemon=True)
    asker.start()
    _wait(
        run,
        live,
        lambda: _scored(run, version, suites) or not asker.is_alive(),
        timeout_s=run.config.evals.eval_timeout_s,
        what=f"evals of version {version}",
        render=lambda: _training_view(run),
    )
    if not _scored(run, version, suites):
        raise RunFailed(f"evals of version {version} did not finish: {failures[-1:]}")


def _training_view(run: LocalRun) -> Any:
    """The live panel; without a terminal, which draws no panel until it stops, also a
    plain line for each new step."""
    from services.launcher.observe import snapshot, step_lines, view

    job = run.config.trainer.job
    max_steps = job.max_steps if job is not None else 0
    shot = snapshot(run.config, run.store, run.known_evals)
    if not run.console.is_terminal and shot.steps:
        for line in step_lines(shot.steps, run.printed_step, max_steps):
            run.console.print(line)
        run.printed_step = shot.steps[-1]["step"]
    return view(shot, run.phase, run.services_table(), max_steps)


def _trainer_done(run: LocalRun) -> bool:
    state = run.states["trainer"]
    if not state.ready and state.detail.startswith("training job failed"):
        raise RunFailed(f"trainer: {state.detail}")
    return state.ready and state.detail == "job done"


def _train(run: LocalRun, live: Live) -> int:
    """The main job: baseline eval, RL, final eval, report."""
    from services.launcher.baseline import publish_initial
    from services.launcher.observe import snapshot
    from services.launcher.summary import print_summary, summarize, write_report
    from services.weights.manifest import Layout, read_latest

    settings = run.config.launcher
    suites = enabled_suites(run.config)
    others = tuple(n for n in START_ORDER if n != "trainer")
    run.phase = "starting services"
    run.start_services(others)
    _wait(
        run,
        live,
        lambda: run.all_ready(others),
        timeout_s=settings.ready_timeout_s,
        what="services ready",
    )
    model_dir = run.config.inference.engine.model_dir
    if publish_initial(run.config, run.store, model_dir):
        run.console.print("published the base model as policy version 0")
    if suites and not _scored(run, 0, suites):
        run.phase = "baseline eval (version 0)"
        _request_evals(run, live, 0, suites)
    run.phase = "training"
    run.start_services(("trainer",))
    _wait(
        run,
        live,
        lambda: _trainer_done(run),
        timeout_s=settings.train_timeout_s,
        what="training",
        render=lambda: _training_view(run),
        # Each redraw reads the run's state (metrics file, evals, Redis): ~10% of a core
        # redrawn every second on the 2-core machine, taken from the pinned services.
        interval_s=2.0,
    )
    final = read_latest(run.store, Layout(run.config.run.name)) or 0
    if suites:
        run.phase = f"final eval (version {final})"
        _request_evals(run, live, final, suites)
    run.phase = "report"
    shot = snapshot(run.config, run.store, run.known_evals)
    summary = summarize(run.config.run.name, shot, run.store)
    records = {suite: [v[k] for k in sorted(v)] for suite, v in shot.evals.items()}
    live.stop()
    report = write_report(run.state_dir / "report", summary, shot, records)
    print_summary(run.console, summary, report)
    return 0


def run_local(
    config: EtudeConfig,
    config_path: Path | None,
    *,
    exit_when_ready: bool = False,
    fresh: bool = False,
    sync: bool = False,
    rebuild_model: bool = False,
) -> int:
    """`etude run`: returns the exit code (0 when the run finished and stopped cleanly)."""
    console = Console(highlight=False)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    options = RunOptions(
        fresh=fresh, sync=sync, exit_when_ready=exit_when_ready, rebuild_model=rebuild_model
    )
    run = LocalRun(config, config_path, console, options)
    code = 1
    try:
        run.prepare()
        with Live(console=console, auto_refresh=False) as live:
            if config.trainer.job is None or exit_when_ready:
                code = _serve_only(run, live)
            else:
                code = _train(run, live)
    except (KeyboardInterrupt, _Stop):
        console.print("stopping (Ctrl-C); `etude run` again resumes this run")
        code = 0
    except RunFailed as error:
        console.print(f"[red]run failed: {error}[/red]")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        clean = run.stop()
        signal.signal(signal.SIGTERM, previous)
    if code == 0 and not clean:
        console.print("[red]a service did not exit cleanly[/red]")
        code = 1
    return code
