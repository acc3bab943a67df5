"""A private redis-server for `etude run` when none answers at the configured URL."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import redis

from services.launcher.processes import ManagedProcess
from services.wire.ports import free_port


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis at `url` answers PING."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def start_private_redis(state_dir: Path, timeout_s: float = 10.0) -> tuple[ManagedProcess, str]:
    """Starts redis-server on a free port with AOF in `state_dir`; returns it and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "no Redis answers and redis-server is not installed "
            "(sudo apt-get install redis-server, or set redis.url)"
        )
    data_dir = state_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    process = ManagedProcess(
        name="redis",
        argv=[
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(data_dir.resolve()),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
        ],
        log_path=state_dir / "logs" / "redis.log",
    )
    process.start()
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while not redis_answers(url, 0.2):
        if process.returncode() is not None or time.monotonic() > deadline:
            process.stop(1.0)
            raise RuntimeError(f"redis-server did not come up; see {process.log_path}")
        time.sleep(0.05)
    return process, url
