"""`etude run`: one machine, the whole deployment, stopped cleanly on Ctrl-C or failure."""

from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.config import SERVICE_NAMES, ServiceName
from services.launcher.processes import ManagedProcess
from services.launcher.redis_server import redis_answers, start_private_redis
from services.run_config import EtudeConfig

log = logging.getLogger(__name__)

# Dependencies first; stopped in reverse.
START_ORDER: tuple[ServiceName, ...] = ("reconciler", "inference", "envs", "trainer", "evals")
assert set(START_ORDER) == set(SERVICE_NAMES)


class _Stop(Exception):
    """SIGTERM reached the launcher."""


@dataclass
class ServiceState:
    """What the launcher last saw of one service."""

    ready: bool = False
    detail: str = "starting"


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


def _table(
    processes: dict[ServiceName, ManagedProcess], states: dict[ServiceName, ServiceState]
) -> Table:
    table = Table(title="etude run", expand=False)
    for column in ("service", "pid", "state", "detail", "uptime"):
        table.add_column(column)
    now = time.time()
    for name in START_ORDER:
        process, state = processes[name], states[name]
        code = process.returncode()
        if code is not None:
            label = f"[red]exited {code}[/red]"
        else:
            label = "[green]ready[/green]" if state.ready else "[yellow]starting[/yellow]"
        table.add_row(
            name, str(process.pid), label, state.detail, f"{now - process.started_at:.0f} s"
        )
    return table


class LocalRun:
    """Brings a deployment up as local processes and takes it down again."""

    def __init__(self, config: EtudeConfig, config_path: Path | None, console: Console) -> None:
        self.config = config
        self.config_path = config_path
        self.console = console
        self.state_dir = config.run.state_dir
        self.redis: ManagedProcess | None = None
        self.processes: dict[ServiceName, ManagedProcess] = {}
        self.child_env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}

    def prepare(self) -> None:
        """Token, Redis, object store directory and model: everything the services need."""
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._prepare_token()
        self._prepare_redis()
        store = self.config.object_store.url
        if store.startswith("file://"):
            Path(store.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        self._prepare_model()

    def _prepare_token(self) -> None:
        if self.config.auth.token is not None:
            return
        token_file = self.state_dir / "auth-token"
        if not token_file.exists():
            token_file.write_text(secrets.token_urlsafe(32))
            token_file.chmod(0o600)
        self.child_env["ETUDE_AUTH__TOKEN"] = token_file.read_text().strip()

    def _prepare_redis(self) -> None:
        url = self.config.redis.url
        if redis_answers(url):
            self.console.print(f"redis: using {url}")
            return
        if not self.config.launcher.start_redis:
            raise RuntimeError(f"no Redis answers at {url} and launcher.start_redis is false")
        self.redis, url = start_private_redis(self.state_dir)
        self.child_env["ETUDE_REDIS__URL"] = url
        self.console.print(f"redis: started a private redis-server at {url} (pid {self.redis.pid})")

    def _prepare_model(self) -> None:
        model_dir = self.config.inference.engine.model_dir
        if (model_dir / "config.json").is_file():
            self.console.print(f"model: {model_dir}")
            return
        from services.model_factory.build import init_model

        preset = self.config.launcher.model_preset
        with self.console.status(f"creating the {preset} model at {model_dir}") as status:
            init_model(preset, model_dir, progress=lambda message: status.update(message))
        self.console.print(f"model: created {preset} model at {model_dir}")

    def start_services(self) -> None:
        """Starts the five service processes, dependencies first."""
        config_args = ["--config", str(self.config_path)] if self.config_path else []
        for name in START_ORDER:
            process = ManagedProcess(
                name=name,
                argv=[sys.executable, "-m", f"services.{name}", *config_args],
                log_path=self.state_dir / "logs" / f"{name}.log",
                env=self.child_env,
            )
            process.start()
            self.processes[name] = process

    def watch(self, exit_when_ready: bool) -> int:
        """Shows the status table until Ctrl-C, a failure, or (optionally) readiness."""
        states = {name: ServiceState() for name in START_ORDER}
        started = time.monotonic()
        deadline = started + self.config.launcher.ready_timeout_s
        announced = False
        with Live(console=self.console, auto_refresh=False) as live:
            while True:
                states = {name: _probe(self.config, name) for name in START_ORDER}
                live.update(_table(self.processes, states), refresh=True)
                exited = {n: p.returncode() for n, p in self.processes.items()}
                if failed := {n: c for n, c in exited.items() if c is not None}:
                    names = ", ".join(f"{n} (exit {c})" for n, c in failed.items())
                    logs = self.state_dir / "logs"
                    self.console.print(f"[red]{names} stopped; logs in {logs}[/red]")
                    return 1
                if not announced and all(s.ready for s in states.values()):
                    announced = True
                    elapsed = time.monotonic() - started
                    self.console.print(f"all {len(states)} services ready in {elapsed:.1f} s")
                    if exit_when_ready:
                        return 0
                if not announced and time.monotonic() > deadline:
                    waiting = ", ".join(n for n, s in states.items() if not s.ready)
                    self.console.print(f"[red]not ready in time: {waiting}[/red]")
                    return 1
                time.sleep(0.5)

    def stop(self) -> bool:
        """Stops every process by PID, dependents first; True when all exited cleanly."""
        clean = True
        grace = self.config.launcher.stop_grace_s
        for name in reversed(START_ORDER):
            process = self.processes.get(name)
            if process is None or process.popen is None:
                continue
            already = process.returncode()
            code = process.stop(grace)
            clean &= already is None and code == 0
            self.console.print(f"stopped {name} (pid {process.pid}): exit {code}")
        if self.redis is not None:
            self.redis.stop(grace)
            self.console.print(f"stopped redis (pid {self.redis.pid})")
        return clean


def run_local(
    config: EtudeConfig, config_path: Path | None, *, exit_when_ready: bool = False
) -> int:
    """`etude run`: returns the exit code (0 when everything came up and went down cleanly)."""
    console = Console(highlight=False)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    run = LocalRun(config, config_path, console)
    code = 1
    try:
        run.prepare()
        run.start_services()
        code = run.watch(exit_when_ready)
    except (KeyboardInterrupt, _Stop):
        console.print("stopping (Ctrl-C)")
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        clean = run.stop()
        signal.signal(signal.SIGTERM, previous)
    if code == 0 and not clean:
        console.print("[red]a service did not exit cleanly[/red]")
        code = 1
    return code
