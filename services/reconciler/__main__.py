"""The reconciler: rollout groups and slots in Redis, leased to envs workers and
handed to the trainer as complete groups, exactly once.

Owns: slot and group state (in Redis), leases, the staleness bound, the
published policy version. Start it with
``python -m services.reconciler --config configs/local.toml`` or
``etude serve reconciler --config configs/local.toml``.
"""

from services.config.reconciler import ReconcilerProcessConfig
from services.process import main

if __name__ == "__main__":
    raise SystemExit(main("reconciler", ReconcilerProcessConfig))
