"""Starting a real reconciler process for tests, and cleaning its run out of Redis."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from services.wire.ports import free_ports
from tests.conftest import REDIS_URL, REPO, TOKEN, service_env, stop_process, wait_ready


@dataclass
class ReconcilerProcess:
    """A reconciler process and what a test needs to reach it."""

    target: str
    http: str
    run_name: str
    config_path: Path
    log_path: Path
    redis_url: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.reconciler", "--config", str(self.config_path)],
                cwd=REPO,
                env=service_env(TOKEN),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_ready(self.target, 60, self.process, self.log_path)

    def stop(self) -> int:
        assert self.process is not None
        return stop_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def write_reconciler_config(
    path: Path, *, run_name: str, redis_url: str, extra: str = "", store_url: str | None = None
) -> tuple[int, int]:
    """A config for one reconciler on free ports; `extra` is appended to [reconciler]."""
    grpc_port, http_port = free_ports(2)
    path.write_text(
        f'[run]\nname = "{run_name}"\n'
        f'[redis]\nurl = "{redis_url}"\n'
        + (f'[object_store]\nurl = "{store_url}"\n' if store_url else "")
        + "[reconciler]\n"
        "readiness_interval_s = 0.5\n"
        "reap_interval_s = 0.2\n"
        f"{extra}\n"
        f'grpc = {{ host = "127.0.0.1", port = {grpc_port}, shutdown_grace_s = 2 }}\n'
        f'http = {{ host = "127.0.0.1", port = {http_port} }}\n'
    )
    return grpc_port, http_port


@contextlib.contextmanager
def reconciler(
    tmp_path: Path,
    *,
    redis_url: str = REDIS_URL,
    extra: str = "",
    run_name: str | None = None,
    store_url: str | None = None,
) -> Iterator[ReconcilerProcess]:
    """A started reconciler on its own run; the run's keys are deleted afterwards."""
    run_name = run_name or f"test-{uuid.uuid4().hex[:10]}"
    config_path = tmp_path / f"reconciler-{run_name}.toml"
    grpc_port, http_port = write_reconciler_config(
        config_path, run_name=run_name, redis_url=redis_url, extra=extra, store_url=store_url
    )
    server = ReconcilerProcess(
        target=f"127.0.0.1:{grpc_port}",
        http=f"http://127.0.0.1:{http_port}",
        run_name=run_name,
        config_path=config_path,
        log_path=tmp_path / f"reconciler-{run_name}.log",
        redis_url=redis_url,
    )
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.stop()
        drop_run(redis_url, run_name)


def drop_run(redis_url: str, run_name: str) -> None:
    """Deletes every key of a run (tests share the CI Redis)."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"etude:{{{run_name}}}*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.ConnectionError:
        pass
    finally:
        client.close()
