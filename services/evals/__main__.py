"""Evals: every published policy version scored on held-out suites.

Owns: eval suites, eval scheduling (eval-priority slots), results and reports.

Start it with ``python -m services.evals --config configs/local.toml`` or
``etude serve evals --config configs/local.toml``.
"""

from services.config.evals import EvalsProcessConfig
from services.process import main

if __name__ == "__main__":
    raise SystemExit(main("evals", EvalsProcessConfig))
