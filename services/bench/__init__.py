"""Benchmarks: ``etude bench <name> [--quick] --json``.

Each benchmark measures its figures and a baseline in the same run and reports
ratios against it, so the figures mean the same on a laptop and on CI. Output is
one JSON object: ``{"bench": name, "figures": {...}, "baseline": {...}, "ok": bool}``;
``ok`` says whether the figures meet the benchmark's documented target.
Benchmarks are never timing assertions in tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# name -> "module:function"; imported only when run, so `etude --help` stays fast.
BENCHMARKS: dict[str, str] = {
    "e2e": "services.bench.e2e:run",
    "envs": "services.bench.envs:run",
    "grpc": "services.bench.grpc_overhead:run",
    "inference": "services.bench.inference:run",
    "packing": "services.bench.packing:run",
    "prefix-sharing": "services.bench.prefix_sharing:run",
    "quant": "services.bench.quant:run",
    "reconciler": "services.bench.reconciler:run",
    "replay": "services.bench.replay:run",
    "trainer": "services.bench.trainer:run",
    "weight-sync": "services.bench.weight_sync:run",
}


class BenchSettingError(ValueError):
    """A benchmark's setting (an environment variable) is wrong; the message names it."""


@dataclass
class BenchResult:
    """Figures, the same-run baseline, whether the target is met, and what the target is."""

    figures: dict[str, float]
    baseline: dict[str, float]
    ok: bool
    target: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self, name: str) -> dict[str, Any]:
        """The benchmarks contract's JSON object."""
        return {
            "bench": name,
            "figures": self.figures,
            "baseline": self.baseline,
            "ok": self.ok,
            "target": self.target,
            **({"details": self.details} if self.details else {}),
        }


def load(name: str) -> Callable[[bool], BenchResult]:
    """The run function of benchmark `name`."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHMARKS))}")
    module, _, function = BENCHMARKS[name].partition(":")
    run: Callable[[bool], BenchResult] = getattr(importlib.import_module(module), function)
    return run
