"""The synthetic family: small generated Python functions with hidden unit tests.

Tasks are addressed by (split, position) and made on demand from a seed, so the same
seed gives the same tasks on every machine and ``task_at(position, seed)`` can feed the
reconciler (``[reconciler.feeders] generator = "services.families.synthetic:task_at"``).
The level of a task is ``position % 4`` (levels in ``templates``).

A *behaviour* is what a function does (its template and constants, e.g. "return the
number 76"); a *task* is one instance of it (a name, test calls, an example). A stable
hash of the behaviour key puts 20% of behaviours aside, the same for every seed:

* ``train`` — instances of the other 80% of behaviours;
* ``heldout`` — fresh instances of those same behaviours: new test calls and examples,
  and function names no training task uses (a fifth of names is set aside the same
  way), so a heldout task is never a training task;
* ``novel`` — behaviours no training task has (new constants, and templates such as
  "s in upper case" that training never shows): generalisation beyond what was seen.

A position draws again until its behaviour is on the requested side. A task's
workspace is a stub ``solution.py``; the hidden tests assert a few calls and score by
the fraction that pass. A completion is the whole new ``solution.py``.
"""

from __future__ import annotations

import hashlib
import random

from services.api.v1 import common_pb2
from services.families import (
    CANONICAL_KEY,
    GRADING_DIR,
    RUNNER_PATH,
    TaskFamily,
    solution_file,
)
from services.families.synthetic.templates import (
    NUM_LEVELS,
    FunctionSpec,
    draw,
    expected_values,
)

SOLUTION_PATH = "solution.py"
TEST_PATH = f"{GRADING_DIR}/test_synthetic.py"
SET_ASIDE_PERCENT = 20
TIMEOUT_S = 10.0
_MAX_DRAWS = 1000


def _set_aside(text: str) -> bool:
    """One in five of all values, by a hash of `text` that is the same for every seed."""
    return (
        int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100 < SET_ASIDE_PERCENT
    )


def is_novel(key: str) -> bool:
    """True for a behaviour kept out of training (its key is set aside)."""
    return _set_aside(key)


def is_training_name(name: str) -> bool:
    """Training tasks use four in five function names; heldout and novel tasks the rest."""
    return not _set_aside(f"name:{name}")


def spec_at(split: str, position: int, seed: int) -> FunctionSpec:
    """The function of the task at `position` of `split` (its level: ``position % 4``)."""
    level = position % NUM_LEVELS
    novel, training = split == "novel", split == "train"
    for attempt in range(_MAX_DRAWS):
        # A string seed is hashed (SHA-512) by random.Random: stable across runs. Names
        # training never uses keep a heldout instance from ever being a training task.
        spec = draw(level, random.Random(f"synthetic:{seed}:{split}:{position}:{attempt}"))
        if is_novel(spec.key) == novel and is_training_name(spec.name) == training:
            return spec
    raise AssertionError(f"level {level} has no behaviour in split {split!r}")


def _tests(spec: FunctionSpec) -> str:
    lines = [f"from solution import {spec.name}", ""]
    for index, (call, expected) in enumerate(
        zip(spec.calls, expected_values(spec), strict=True), start=1
    ):
        lines += ["", f"def test_{index}():", f"    assert {spec.name}({call}) == {expected}", ""]
    return "\n".join(lines)


def make_task(split: str, position: int, seed: int) -> common_pb2.Task:
    """The task at `position` of `split` for `seed`."""
    if split not in SyntheticFamily.splits:
        raise ValueError(
            f"synthetic has no split {split!r}; its splits: {', '.join(SyntheticFamily.splits)}"
        )
    if position < 0:
        raise ValueError(f"synthetic task position must be >= 0, got {position}")
    spec = spec_at(split, position, seed)
    example_call, example_value = spec.calls[0], expected_values(spec)[0]
    instruction = (
        f"Write a Python function `{spec.name}({spec.params})` in {SOLUTION_PATH} that "
        f"returns {spec.description}.\nExample: {spec.name}({example_call}) == {example_value}"
    )
    return common_pb2.Task(
        task_id=f"synthetic/{split}/{position:05d}",
        family="synthetic",
        split=split,
        instruction=instruction,
        files=[common_pb2.WorkspaceFile(path=SOLUTION_PATH, content=spec.stub.encode())],
        grading=common_pb2.GradingSpec(
            command=["python3", RUNNER_PATH, TEST_PATH],
            hidden_files=[common_pb2.WorkspaceFile(path=TEST_PATH, content=_tests(spec).encode())],
            timeout_s=TIMEOUT_S,
            reward_mode=common_pb2.REWARD_MODE_PASS_FRACTION,
        ),
        metadata={
            CANONICAL_KEY: spec.source,
            "entry_point": spec.name,
            "level": str(spec.level),
            "behaviour": spec.key,
            "seed": str(seed),
        },
        difficulty=spec.level / (NUM_LEVELS - 1),
    )


def task_at(position: int, seed: int) -> common_pb2.Task | None:
    """The training task at `position` (the reconciler's generator feeder; never ends)."""
    return make_task("train", position, seed)


class SyntheticFamily(TaskFamily):
    """Generated functions; `num_train`, `num_heldout` and `num_novel` fix each split's size."""

    name = "synthetic"
    splits = ("train", "heldout", "novel")

    def __init__(
        self, seed: int = 0, num_train: int = 2000, num_heldout: int = 200, num_novel: int = 200
    ) -> None:
        sizes = {"train": num_train, "heldout": num_heldout, "novel": num_novel}
        for split, size in sizes.items():
            if size < 0:
                raise ValueError(f"num_{split} must be >= 0, got {size}")
        self.seed = seed
        self.sizes = sizes

    def tasks(self, split: str) -> list[common_pb2.Task]:
        self.check_split(split)
        return [make_task(split, position, self.seed) for position in range(self.sizes[split])]

    def task(self, task_id: str) -> common_pb2.Task:
        parts = task_id.split("/")
        if len(parts) != 3 or parts[0] != "synthetic" or not parts[2].isdigit():
            raise KeyError(f"{task_id!r} is not a synthetic task id (synthetic/<split>/<n>)")
        if parts[1] not in self.splits:
            raise KeyError(f"{task_id!r}: synthetic has no split {parts[1]!r}")
        return make_task(parts[1], int(parts[2]), self.seed)

    def solution_files(
        self, task: common_pb2.Task, completion: str
    ) -> list[common_pb2.WorkspaceFile]:
        return solution_file(SOLUTION_PATH, completion)
