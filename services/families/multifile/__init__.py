"""The multifile family: work spread over several files, more than one context holds.

A task's workspace has ``num_parts`` modules, ``part_1.py`` ... Each starts with a
function stub whose docstring alone says what it must return, followed by a long table
of readings the function does not use (a real module's bulk: what makes reading the
files fill a context). The instruction names the files but not the functions, so the
agent must read every file, and the tool outputs it reads are what push a rollout past
its context: the harness then asks for a summary and continues from it
(``services.envs.harness``), which is the report's long-horizon behaviour this family
exists to exercise and train.

The functions are the synthetic family's (``synthetic.spec_at``), levels 0 and 1 by
default, drawn from the same split, so a multifile training task holds only training
behaviours and a held-out one only held-out instances. The hidden tests import each
part's function and assert its calls; the score is the fraction that pass. A completion
is a JSON object mapping paths to their new content (as the repo family's); the
canonical one fills every stub. ``parts_of(task)`` gives what a teacher needs: each
part's path, function, description and body (``services.launcher.teacher``).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from services.api.v1 import common_pb2
from services.families import CANONICAL_KEY, GRADING_DIR, RUNNER_PATH, TaskFamily, files_from_json
from services.families.synthetic import spec_at
from services.families.synthetic.templates import NUM_LEVELS, FunctionSpec, expected_values

TEST_PATH = f"{GRADING_DIR}/test_multifile.py"
PARTS_KEY = "parts"  # metadata: JSON list of Part
TIMEOUT_S = 20.0
STUB_BODY = "    pass\n"
_WORDS = ("apple", "bob", "cat", "dog", "egg", "fig", "sun", "map", "red", "tea", "owl", "ink")


@dataclass(frozen=True)
class Part:
    """One file of a task: the function it holds and its reference body."""

    path: str
    name: str
    params: str
    description: str
    body: str  # indented by four spaces, replaces STUB_BODY

    @classmethod
    def of(cls, index: int, spec: FunctionSpec) -> Part:
        return cls(f"part_{index}.py", spec.name, spec.params, spec.description, spec.body)


def _module(part: Part, index: int, rng: random.Random, table_rows: int) -> str:
    """A part's file: the stub first (a truncated read still shows it), then the bulk."""
    rows = "".join(
        f'    "{rng.choice(_WORDS)}_{row}": {rng.randint(-999, 999)},\n'
        for row in range(table_rows)
    )
    return (
        f"def {part.name}({part.params}):\n"
        f'    """Return {part.description}."""\n'
        f"{STUB_BODY}"
        "\n\n"
        f"# Readings of part {index}, kept for reference; {part.name} does not use them.\n"
        f"TABLE_{index} = {{\n{rows}}}\n"
    )


def _tests(parts: list[tuple[Part, FunctionSpec]]) -> str:
    lines: list[str] = []
    for part, _ in parts:
        lines.append(f"from {part.path.removesuffix('.py')} import {part.name} as {_alias(part)}")
    for part, spec in parts:
        for index, (call, expected) in enumerate(
            zip(spec.calls, expected_values(spec), strict=True), start=1
        ):
            test = f"test_{part.path.removesuffix('.py')}_{index}"
            lines += ["", "", f"def {test}():", f"    assert {_alias(part)}({call}) == {expected}"]
    return "\n".join(lines) + "\n"


def _alias(part: Part) -> str:
    return f"{part.path.removesuffix('.py')}_{part.name}"


def filled(content: str, part: Part) -> str:
    """`content` (a part's file) with the stub's body replaced by the reference body."""
    if content.count(STUB_BODY) != 1:
        raise ValueError(f"{part.path}: the stub's body must occur exactly once")
    return content.replace(STUB_BODY, part.body + "\n")


def make_task(
    split: str,
    position: int,
    seed: int,
    *,
    num_parts: int = 3,
    levels: tuple[int, ...] = (0, 1),
    table_rows: int = 12,
) -> common_pb2.Task:
    """The task at `position` of `split` for `seed`."""
    if split not in MultiFileFamily.splits:
        raise ValueError(
            f"multifile has no split {split!r}; its splits: {', '.join(MultiFileFamily.splits)}"
        )
    if position < 0:
        raise ValueError(f"multifile task position must be >= 0, got {position}")
    if not levels or any(not 0 <= level < NUM_LEVELS for level in levels):
        raise ValueError(f"levels must be synthetic levels 0-{NUM_LEVELS - 1}, got {levels}")
    rng = random.Random(f"multifile:{seed}:{split}:{position}")
    specs = []
    for index in range(num_parts):
        level = levels[(position + index) % len(levels)]
        # Synthetic positions of this level no other part or task of the split uses.
        specs.append(spec_at(split, NUM_LEVELS * (position * num_parts + index) + level, seed))
    parts = [(Part.of(index, spec), spec) for index, spec in enumerate(specs, start=1)]
    files = {
        part.path: _module(part, index, rng, table_rows)
        for index, (part, _) in enumerate(parts, start=1)
    }
    paths = ", ".join(files)
    instruction = (
        f"The files {paths} each hold a function stub. Read every file and fill in its "
        "function as the docstring says (replace `pass`), then finish."
    )
    canonical = {part.path: filled(files[part.path], part) for part, _ in parts}
    return common_pb2.Task(
        task_id=f"multifile/{split}/{position:05d}",
        family="multifile",
        split=split,
        instruction=instruction,
        files=[
            common_pb2.WorkspaceFile(path=path, content=text.encode())
            for path, text in files.items()
        ],
        grading=common_pb2.GradingSpec(
            command=["python3", RUNNER_PATH, TEST_PATH],
            hidden_files=[common_pb2.WorkspaceFile(path=TEST_PATH, content=_tests(parts).encode())],
            timeout_s=TIMEOUT_S,
            reward_mode=common_pb2.REWARD_MODE_PASS_FRACTION,
        ),
        metadata={
            CANONICAL_KEY: json.dumps(canonical),
            PARTS_KEY: json.dumps([asdict(part) for part, _ in parts]),
            "seed": str(seed),
        },
        difficulty=max(spec.level for spec in specs) / (NUM_LEVELS - 1),
    )


def parts_of(task: common_pb2.Task) -> list[Part]:
    """The parts a multifile task's metadata lists."""
    return [Part(**item) for item in json.loads(task.metadata[PARTS_KEY])]


def task_at(position: int, seed: int) -> common_pb2.Task | None:
    """The training task at `position` (a reconciler generator feeder; never ends)."""
    return make_task("train", position, seed)


class MultiFileFamily(TaskFamily):
    """Several-file tasks; `num_train` and `num_heldout` fix each split's size."""

    name = "multifile"
    splits = ("train", "heldout")

    def __init__(
        self, seed: int = 0, num_train: int = 1000, num_heldout: int = 100, num_parts: int = 3
    ) -> None:
        sizes = {"train": num_train, "heldout": num_heldout}
        for split, size in sizes.items():
            if size < 0:
                raise ValueError(f"num_{split} must be >= 0, got {size}")
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        self.seed = seed
        self.sizes = sizes
        self.num_parts = num_parts

    def tasks(self, split: str) -> list[common_pb2.Task]:
        self.check_split(split)
        return [
            make_task(split, position, self.seed, num_parts=self.num_parts)
            for position in range(self.sizes[split])
        ]

    def task(self, task_id: str) -> common_pb2.Task:
        parts = task_id.split("/")
        if len(parts) != 3 or parts[0] != "multifile" or not parts[2].isdigit():
            raise KeyError(f"{task_id!r} is not a multifile task id (multifile/<split>/<n>)")
        if parts[1] not in self.splits:
            raise KeyError(f"{task_id!r}: multifile has no split {parts[1]!r}")
        return make_task(parts[1], int(parts[2]), self.seed, num_parts=self.num_parts)

    def solution_files(
        self, task: common_pb2.Task, completion: str
    ) -> list[common_pb2.WorkspaceFile]:
        """A completion is a JSON object mapping part paths to their new content."""
        return files_from_json(task, completion)
