"""Trainer: the MoE policy.

Owns: model weights and optimizer state, the RL loop (pull ready groups from the
reconciler, Dr. GRPO step, publish the next policy version), checkpoints.

Start it with ``python -m services.trainer --config configs/local.toml`` or
``etude serve trainer --config configs/local.toml``.
"""

from services.config.trainer import TrainerProcessConfig
from services.process import main

if __name__ == "__main__":
    raise SystemExit(main("trainer", TrainerProcessConfig))
