"""Envs: rollout workers and sandboxed workspaces.

Owns: workspaces (create, fork, snapshot, exec, grade), the agent harness and
rewards, and the workers that claim slots from the reconciler.

Start it with ``python -m services.envs --config configs/local.toml`` or
``etude serve envs --config configs/local.toml``.
"""

from services.config.envs import EnvsProcessConfig
from services.process import main

if __name__ == "__main__":
    raise SystemExit(main("envs", EnvsProcessConfig))
