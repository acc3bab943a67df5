"""synthetic-heldout: the synthetic family's held-out split.

The first ``num_tasks`` held-out tasks of a fixed seed: fresh instances (new names,
test calls and examples) of the behaviours the policy trains on, drawn from a stream
no training task comes from. The tasks cycle through the four difficulty levels.
Correct means every hidden assert passes (the rollout reward is the pass fraction).
Behaviours never trained are the ``synthetic-novel`` suite's.
"""

from __future__ import annotations

from typing import Any

from services.evals.suites import FamilySuite


class SyntheticHeldoutSuite(FamilySuite):
    """Generated small functions the policy never trained on."""

    name = "synthetic-heldout"
    family = "synthetic"
    description = "the synthetic family's held-out split (four difficulty levels)"

    def family_options(self) -> dict[str, Any]:
        size = self.split_size
        return {"seed": self.settings.seed, "num_train": 0, "num_heldout": size, "num_novel": 0}


SUITE = SyntheticHeldoutSuite
