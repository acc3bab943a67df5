"""The HTTP side of every service: /metrics, /healthz, /readyz, /status.json and /, plus
whatever pages the service adds (``Service.http_routes``, e.g. the evals report)."""

from __future__ import annotations

import asyncio
import contextlib
import html
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import services
from services.wire.service import Service


def _status(service: Service) -> dict[str, object]:
    return {
        "service": service.name,
        "instance_id": service.instance_id,
        "version": services.__version__,
        "ready": service.readiness.ready,
        "ready_detail": service.readiness.detail,
        "uptime_s": round(time.time() - service.started_at, 1),
        "dependencies": [
            {"name": d.name, "target": d.target, "ready": d.ready, "detail": d.detail}
            for d in service.dependency_status
        ],
        "fields": service.status_fields(),
    }


def _status_page(status: dict[str, object]) -> str:
    rows = [
        ("ready", f"{status['ready']} ({status['ready_detail']})"),
        ("instance", status["instance_id"]),
        ("version", status["version"]),
        ("uptime", f"{status['uptime_s']} s"),
    ]
    deps = status["dependencies"]
    assert isinstance(deps, list)
    rows += [
        (f"dependency {d['name']}", f"{d['ready']} ({d['detail']}) at {d['target']}") for d in deps
    ]
    fields = status["fields"]
    assert isinstance(fields, dict)
    rows += list(fields.items())
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    name = html.escape(str(status["service"]))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>etude {name}</title>"
        "<style>body{font-family:sans-serif;margin:2em}th{text-align:left;padding-right:2em}"
        "</style></head>"
        f"<body><h1>etude {name}</h1><table>{body}</table>"
        "<p><a href='/metrics'>metrics</a> · <a href='/status.json'>status.json</a></p>"
        "</body></html>"
    )


def build_app(service: Service) -> FastAPI:
    """The FastAPI app of `service`'s HTTP side."""
    app = FastAPI(title=f"etude {service.name}", docs_url=None, redoc_url=None)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"live": True}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ready = service.readiness
        return JSONResponse(
            {"ready": ready.ready, "detail": ready.detail}, status_code=200 if ready.ready else 503
        )

    @app.get("/status.json")
    def status_json() -> dict[str, object]:
        return _status(service)

    @app.get("/", response_class=HTMLResponse)
    def status_page() -> str:
        return _status_page(_status(service))

    service.http_routes(app)
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that handles its own signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(service: Service, host: str, port: int, stop: asyncio.Event) -> None:
    """Serves the HTTP side until `stop` is set."""
    config = uvicorn.Config(
        build_app(service), host=host, port=port, log_level="warning", lifespan="off"
    )
    server = _EmbeddedServer(config)
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
    if serving in done and not stop.is_set():
        raise RuntimeError(f"HTTP server on {host}:{port} stopped on its own")
