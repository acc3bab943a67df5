"""`etude bench e2e`: what asynchrony buys, on the same RL work, measured in one run.

The main job (``etude run``) runs twice from the same base model, the same task stream
(the feeder's seed, from a fresh cursor) and the same number of RL steps:

* **async**: the config as it is (``max_staleness`` 2 in configs/local.toml):
  generation goes on while the trainer trains, bounded by staleness;
* **sync** (the baseline): ``etude run --sync``: ``max_staleness`` 0 and one batch
  generated per policy version, so generation and training alternate.

Figures: ``seconds_per_step`` of each (wall clock between the trainer's first and last
step records), ``async_speedup`` = sync / async (target >= 1.5; AReaL reports 2.77x and
verl 2.35-2.67x at cluster scale), and each mode's ``trainer_idle_fraction`` (time the
trainer spent waiting for data / its wait + compute). Evals are switched off: they would
compete for the same two cores in both modes.

``async_efficiency`` says how much of what overlap can buy the async run got:
``async_speedup`` / the ideal speedup, where the ideal is the sync run's seconds per step
over the larger of its generation time (the trainer's wait for its batch) and its training
time (the rest of the step: compute, publish, checkpoint, commit), both per step from the
sync run's own records (``ideal_speedup``). Overlapping generation with training
perfectly would make a step as long as the longer of the two: 1.0. It can exceed 1: the
ideal takes generation to last as long as in the sync run, and async also overlaps one
batch's slow last rollouts with the next batch's generation (a quick run measured 1.22).

``--quick`` runs 4 steps on the tiny model (a smoke run); the full benchmark runs 12 on
the config's model (built first if missing, as ``etude run`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from services.bench import BenchResult
from services.config import SERVICE_NAMES
from services.config.loading import dumps_toml
from services.evals.suites import suite_classes
from services.wire.ports import service_ports

TARGET_SPEEDUP = 1.5
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local.toml"


def _mode_config(base: dict[str, Any], state: Path, run: str, steps: int) -> dict[str, Any]:
    data = json.loads(json.dumps(base))  # a deep copy
    data["run"] = {**data.get("run", {}), "name": run, "state_dir": str(state)}
    data["object_store"] = {"url": f"file://{state}/store"}
    data.setdefault("endpoints", {})
    for name, (grpc_port, http_port) in service_ports(SERVICE_NAMES).items():
        section = data.setdefault(name, {})
        section["grpc"] = {"host": "127.0.0.1", "port": grpc_port}
        section["http"] = {"host": "127.0.0.1", "port": http_port}
        data["endpoints"][name] = f"127.0.0.1:{grpc_port}"
    job = data["trainer"]["job"]
    job["max_steps"] = steps
    job["metrics_file"] = str(state / "trainer-metrics.jsonl")
    suites = data.setdefault("evals", {}).setdefault("suites", {})
    for suite in suite_classes():
        suites[suite] = {**suites.get(suite, {}), "enabled": False}
    data["evals"]["watch"] = False
    return data


def _quick(data: dict[str, Any], model_dir: Path) -> None:
    """The tiny model and short rollouts: minutes, not tens of minutes."""
    data["model"]["dir"] = str(model_dir)
    data["inference"]["engine"].update({"max_model_len": 512, "cpu_kv_cache_gib": 0.25})
    data["launcher"]["model_preset"] = "tiny"
    data["launcher"]["base_model"] = {
        "cpt_steps": 2,
        "sft_steps": 8,
        "sft_tasks": 200,
        "tokens_per_step": 2048,
    }
    data["envs"]["harness"].update({"max_tokens_per_turn": 64, "max_total_tokens": 160})
    data["trainer"]["job"]["rl"]["generation_budget_tokens"] = 160


def _run_mode(config: Path, sync: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", "services.cli", "run", "--config", str(config), "--fresh"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETUDE_")}
    done = subprocess.run(
        [*argv, *(["--sync"] if sync else [])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=7200,
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"etude run ({'sync' if sync else 'async'}) failed:\n{tail}")
    state = Path(tomllib.loads(config.read_text())["run"]["state_dir"])
    summary: dict[str, Any] = json.loads((state / "report" / "summary.json").read_text())
    return summary


def ideal_speedup(records: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(generation, training, ideal speedup) per step of a sync run's trainer records.

    The steps after the first, as ``seconds_per_step`` counts them (wall clock from the
    first record to the last): generation is the mean wait for a batch, training the rest
    of the step; the ideal is the step's seconds over the larger of the two.
    """
    steps = sorted(records, key=lambda record: int(record["step"]))
    if len(steps) < 2:
        raise ValueError(f"an ideal speedup needs at least 2 step records, got {len(steps)}")
    seconds_per_step = (float(steps[-1]["time"]) - float(steps[0]["time"])) / (len(steps) - 1)
    later = steps[1:]
    generation = sum(float(record["time_wait_s"]) for record in later) / len(later)
    training = max(seconds_per_step - generation, 0.0)
    longer = max(generation, training)
    return generation, training, seconds_per_step / longer if longer > 0 else 0.0


def async_efficiency(async_speedup: float, ideal: float) -> float:
    """The share of the ideal speedup the async run got (0 when there is no ideal)."""
    return async_speedup / ideal if ideal > 0 else 0.0


def _records(metrics_file: Path) -> list[dict[str, Any]]:
    lines = metrics_file.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def run(quick: bool) -> BenchResult:
    """Runs the main job async and sync on the same work; compares seconds per step."""
    base = tomllib.loads(CONFIG.read_text())
    steps = 4 if quick else 12
    summaries: dict[str, dict[str, Any]] = {}
    generation_s = training_s = ideal = 0.0
    with tempfile.TemporaryDirectory(prefix="etude-bench-e2e-") as tmp:
        root = Path(tmp)
        model_dir = root / "models" / "tiny" if quick else (REPO / base["model"]["dir"]).resolve()
        for mode in ("async", "sync"):
            state = root / mode
            data = _mode_config(base, state, f"bench-e2e-{mode}", steps)
            if quick:
                _quick(data, model_dir)
            else:
                data["model"]["dir"] = str(model_dir)
            config = root / f"{mode}.toml"
            config.write_text(dumps_toml(data))
            summaries[mode] = _run_mode(config, sync=mode == "sync")
            if mode == "sync":
                generation_s, training_s, ideal = ideal_speedup(
                    _records(Path(data["trainer"]["job"]["metrics_file"]))
                )
    async_s = summaries["async"]["seconds_per_step"]
    sync_s = summaries["sync"]["seconds_per_step"]
    speedup = sync_s / async_s if async_s else 0.0
    return BenchResult(
        figures={
            "async_speedup": speedup,
            "async_efficiency": async_efficiency(speedup, ideal),
            "ideal_speedup": ideal,
            "seconds_per_step_async": async_s,
            "trainer_idle_fraction_async": summaries["async"]["trainer_wait_fraction"],
            "staleness_mean_async": _mean_staleness(summaries["async"]),
        },
        baseline={
            "seconds_per_step_sync": sync_s,
            "generation_seconds_per_step_sync": generation_s,
            "training_seconds_per_step_sync": training_s,
            "trainer_idle_fraction_sync": summaries["sync"]["trainer_wait_fraction"],
            "staleness_mean_sync": _mean_staleness(summaries["sync"]),
        },
        ok=speedup >= TARGET_SPEEDUP,
        target=f"async_speedup >= {TARGET_SPEEDUP} (sync / async seconds per RL step)",
        details={"steps": steps, "quick": quick},
    )


def _mean_staleness(summary: dict[str, Any]) -> float:
    counts = {int(k): v for k, v in summary["staleness"].items()}
    total = sum(counts.values())
    return sum(k * v for k, v in counts.items()) / total if total else 0.0
