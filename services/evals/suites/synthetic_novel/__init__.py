"""synthetic-novel: synthetic behaviours no training task has.

The first ``num_tasks`` tasks of the synthetic family's ``novel`` split: a fifth of all
behaviours (by a hash of the behaviour, the same for every seed) never appear in
training, neither their constants nor, for some, their templates. Where
``synthetic-heldout`` asks whether the policy does better on new instances of what it
practised, this asks whether it does what it was never shown. A tiny model mostly
cannot; the suite says so rather than hiding it.
"""

from __future__ import annotations

from typing import Any

from services.evals.suites import FamilySuite


class SyntheticNovelSuite(FamilySuite):
    """Generated small functions whose behaviours training never shows."""

    name = "synthetic-novel"
    family = "synthetic"
    description = "synthetic behaviours kept out of training (four difficulty levels)"
    split = "novel"

    def family_options(self) -> dict[str, Any]:
        size = self.split_size
        return {"seed": self.settings.seed, "num_train": 0, "num_heldout": 0, "num_novel": size}


SUITE = SyntheticNovelSuite
