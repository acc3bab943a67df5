"""Eval suites: fixed lists of held-out tasks, scored the same way for every version.

A suite is one folder here whose ``__init__.py`` defines ``SUITE``, a subclass of
``Suite``: a name, the task family its tasks come from, a fixed task list (the same
tasks in the same order every time, so versions are comparable), a default K, and what
counts as a correct sample. Grading is the family's own, run by the envs workers like
any rollout. ``load_suites(configs)`` finds every folder, so a new suite (intent
handling, eager editing, ...) is a new folder and nothing else.
"""

from __future__ import annotations

import abc
import functools
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, ClassVar

from services.api.v1 import common_pb2
from services.config.evals import SuiteConfig
from services.families import load_family


class Suite(abc.ABC):
    """One held-out suite with its settings applied."""

    name: ClassVar[str]
    family: ClassVar[str]
    description: ClassVar[str]
    default_num_samples: ClassVar[int] = 4
    # Whether the watcher scores published versions on it when the config does not say.
    watched_by_default: ClassVar[bool] = True

    def __init__(self, settings: SuiteConfig) -> None:
        self.settings = settings
        self.num_samples = settings.num_samples or self.default_num_samples

    @property
    def enabled(self) -> bool:
        """The watcher scores every published version on it."""
        enabled = self.settings.enabled
        return self.watched_by_default if enabled is None else enabled

    @abc.abstractmethod
    def all_tasks(self) -> list[common_pb2.Task]:
        """The suite's whole task list, always in the same order."""

    @functools.cached_property
    def tasks(self) -> list[common_pb2.Task]:
        """The tasks scored: the first ``num_tasks`` of the list (all when unset)."""
        tasks = self.all_tasks()
        limit = self.settings.num_tasks
        if limit is not None and limit > len(tasks):
            raise ValueError(
                f"suite {self.name} has {len(tasks)} tasks; num_tasks = {limit} is more"
            )
        return tasks[:limit] if limit is not None else tasks

    def first_tasks(self, num_tasks: int) -> list[common_pb2.Task]:
        """The first `num_tasks` tasks of the same list (all of it when it is shorter)."""
        if num_tasks <= len(self.tasks):
            return self.tasks[:num_tasks]
        wider = type(self)(self.settings.model_copy(update={"num_tasks": num_tasks}))
        return wider.all_tasks()[:num_tasks]

    def base_tasks(self, multiplier: int) -> list[common_pb2.Task]:
        """The tasks version 0 is scored on: ``base_num_tasks``, else `multiplier` times
        the tasks later versions are scored on; they come first, in the same order."""
        return self.first_tasks(self.settings.base_num_tasks or len(self.tasks) * multiplier)

    def is_correct(self, rollout: common_pb2.RolloutSummary) -> bool:
        """A sample counts as correct for pass@k when every test of the task passed."""
        return rollout.grade.all_passed


class FamilySuite(Suite):
    """A suite that is one split of a task family (or its first tasks)."""

    # The family's split; None: the one it names for evals (``eval_split``, "heldout").
    split: ClassVar[str | None] = None
    # Tasks a generated family makes for the suite when ``num_tasks`` is unset.
    default_num_tasks: ClassVar[int] = 100

    @property
    def split_size(self) -> int:
        """Tasks to generate: ``num_tasks``, else the suite's default."""
        return self.settings.num_tasks or self.default_num_tasks

    def family_options(self) -> dict[str, Any]:
        """Options the family is loaded with (e.g. a seed)."""
        return {}

    def all_tasks(self) -> list[common_pb2.Task]:
        family = load_family(self.family, **self.family_options())
        return family.tasks(self.split or family.eval_split)


def suite_classes() -> dict[str, type[Suite]]:
    """Every suite folder's class, by suite name."""
    found: dict[str, type[Suite]] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if not module_info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        suite_cls = getattr(module, "SUITE", None)
        if not (isinstance(suite_cls, type) and issubclass(suite_cls, Suite)):
            raise TypeError(f"{module.__name__} must define SUITE, a subclass of Suite")
        if suite_cls.name in found:
            raise TypeError(f"two suite folders are named {suite_cls.name!r}")
        found[suite_cls.name] = suite_cls
    return found


def load_suites(configs: Mapping[str, SuiteConfig]) -> dict[str, Suite]:
    """Every suite, with its overrides applied; ValueError for an override of no suite."""
    classes = suite_classes()
    unknown = sorted(set(configs) - set(classes))
    if unknown:
        raise ValueError(
            f"evals.suites names unknown suites {', '.join(unknown)}; "
            f"known suites: {', '.join(sorted(classes))}"
        )
    return {name: cls(configs.get(name, SuiteConfig())) for name, cls in sorted(classes.items())}
