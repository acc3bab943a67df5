"""multifile-heldout: the multifile family's held-out split, work longer than a context.

The first ``num_tasks`` held-out multifile tasks of a fixed seed: several files to read
and fill, whose reads outgrow one context, so the harness has the policy summarize and go
on from its own summary (under ``envs.harness.families.multifile``'s budgets, as in
training). Correct means every part's hidden test passes; the record's mean task reward
(the fraction of parts done) and mean summaries per rollout say how far a policy gets and
whether it summarizes, which pass@1 alone would hide at a tiny model's scale.

Its rollouts are long (a dozen turns), so the watcher scores it only where a config turns
it on (``[evals.suites.multifile-heldout] enabled = true``); RunEval always can.
"""

from __future__ import annotations

from typing import Any

from services.evals.suites import FamilySuite


class MultifileHeldoutSuite(FamilySuite):
    """Several-file tasks the policy never trained on."""

    name = "multifile-heldout"
    family = "multifile"
    description = "the multifile family's held-out split (work that must be summarized)"
    default_num_samples = 2
    watched_by_default = False

    def family_options(self) -> dict[str, Any]:
        size = self.split_size
        return {"seed": self.settings.seed, "num_train": 0, "num_heldout": size}


SUITE = MultifileHeldoutSuite
