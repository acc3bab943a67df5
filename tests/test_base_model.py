"""The base model: its SFT data (transcripts of training tasks from an imperfect teacher)
and how a stage reports progress."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from services.config.envs import FamilyBudgets, HarnessConfig
from services.config.launcher import BaseModelConfig
from services.families import CANONICAL_KEY
from services.families.synthetic import make_task
from services.families.synthetic.templates import NUM_LEVELS, draw, expected_values
from services.launcher import base_model
from services.launcher.base_model import printing_instead_of_returning, sft_records


def _written_solution(record: dict[str, str]) -> str | None:
    """The ``content`` of a ``write_file`` completion, None for any other turn."""
    call = record["completion"].removeprefix("<|tool_call|>").partition("<|/tool_call|>")[0]
    parsed = json.loads(call)
    return parsed["arguments"]["content"] if parsed["name"] == "write_file" else None


@pytest.mark.parametrize("level", range(NUM_LEVELS))
def test_the_flaw_keeps_every_template_runnable_but_wrong(level: int) -> None:
    for draw_index in range(40):
        spec = draw(level, random.Random(f"flaw:{level}:{draw_index}"))
        flawed = printing_instead_of_returning(spec.source)
        assert "return " not in flawed and "print(" in flawed
        namespace: dict[str, object] = {}
        exec(flawed, namespace)  # our own templates, made to print
        function = namespace[spec.name]
        assert callable(function)
        results = [eval(f"__f({call})", {"__f": function}) for call in spec.calls]
        assert results == [None] * len(spec.calls)
        assert expected_values(spec) != ["None"] * len(spec.calls)


def test_source_without_a_return_cannot_be_flawed() -> None:
    with pytest.raises(ValueError, match="no return statement"):
        printing_instead_of_returning('def f():\n    """Return nothing."""\n    pass\n')


def test_the_flawed_fraction_of_transcripts_prints() -> None:
    def printing(fraction: float) -> list[bool]:
        solutions = [_written_solution(r) for r in sft_records(3, 200, fraction)]
        return ["print(" in s for s in solutions if s is not None]

    assert not any(printing(0.0))
    assert all(printing(1.0))
    half = printing(0.5)
    assert len(half) == 200
    assert 70 <= sum(half) <= 130
    assert half == printing(0.5)  # the same teacher for the same seed


def test_a_flawless_teacher_writes_the_reference_solutions() -> None:
    solutions = [_written_solution(r) for r in sft_records(5, 20, 0.0)]
    references = [make_task("train", i, 5).metadata[CANONICAL_KEY] for i in range(20)]
    assert [s for s in solutions if s is not None] == references


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="flawed_fraction"):
        list(sft_records(0, 1, 1.5))


@pytest.mark.parametrize(("every_s", "lines"), [(0.0, 3), (3600.0, 1)])
def test_a_stage_without_a_terminal_prints_plain_progress_lines(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    every_s: float,
    lines: int,
) -> None:
    """A bar without a terminal draws only when it stops: a line every ``every_s`` seconds,
    and one at the last step, say how far a stage is."""
    monkeypatch.setattr(base_model, "PLAIN_PROGRESS_EVERY_S", every_s)
    written = io.StringIO()
    console = Console(file=written, force_terminal=False, width=120)
    settings = BaseModelConfig(tokens_per_step=256, max_seq_len=64, warmup_steps=0)
    data = {"kind": "corpus", "seed": 0, "tokens_per_step": 256, "max_seq_len": 64}
    base_model._train_stage(
        "cpt",
        tiny_model,
        tmp_path / "cpt",
        data,
        steps=3,
        lr=1e-3,
        settings=settings,
        console=console,
    )
    printed = [line for line in written.getvalue().splitlines() if line.startswith("cpt: step")]
    assert len(printed) == lines
    assert printed[-1].startswith("cpt: step 3/3, loss ")


@given(st.integers(0, 60), st.integers(0, 60))
def test_interleaving_keeps_each_order_and_spreads_the_second(first: int, second: int) -> None:
    merged = base_model.interleaved(
        [("a", i) for i in range(first)], [("b", i) for i in range(second)]
    )
    assert [item for item in merged if item[0] == "a"] == [("a", i) for i in range(first)]
    assert [item for item in merged if item[0] == "b"] == [("b", i) for i in range(second)]
    if first and second:
        # Each b comes about as far into the list as its place among the b's.
        for index, item in enumerate(merged):
            if item[0] == "b":
                share = (item[1] + 1) / second
                assert abs((index + 1) / len(merged) - share) <= 1 / (first + 1) + 1 / second


def test_the_sft_data_takes_the_teachers_multifile_contexts(tiny_model: Path) -> None:
    harness = HarnessConfig(
        families={
            "multifile": FamilyBudgets(
                max_turns=12, max_tokens_per_turn=192, max_total_tokens=1024, context_tokens=1536
            )
        }
    )
    settings = BaseModelConfig(sft_multifile_tasks=2, sft_max_seq_len=1536)
    lines = base_model.multifile_lines(settings, tiny_model, harness)
    # Two tasks, each summarized at least once under the family's context: a context per
    # summary and the last.
    assert len(lines) >= 4
    assert all(len(line["token_ids"]) <= 1536 for line in lines)
    short = BaseModelConfig(sft_multifile_tasks=2, sft_max_seq_len=256)
    with pytest.raises(ValueError, match=r"sft_max_seq_len to at least the multifile .*1536"):
        base_model.multifile_lines(short, tiny_model, harness)
