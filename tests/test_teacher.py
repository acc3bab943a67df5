"""The teacher's multifile transcripts, made through the real harness and tools: the
contexts a summary splits, the summary in them, and what SFT reads of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.config.envs import HarnessConfig
from services.families.multifile import make_task, parts_of
from services.launcher.teacher import TeacherError, multifile_sft_records, transcript
from services.model_factory.vocabulary import special_token_ids
from services.trainer.sft import JsonlSource

# A context holds two parts' reads and edits with the tiny model's tokenizer, not three.
HARNESS = HarnessConfig(
    max_turns=12, max_tokens_per_turn=192, max_total_tokens=1024, context_tokens=1536
)
SPECIAL = special_token_ids()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_a_transcript_summarizes_and_goes_on_from_its_summary(tokenizer: Any) -> None:
    task = make_task("train", 3, seed=0)
    parts = parts_of(task)
    made = transcript(task, tokenizer, HARNESS)
    assert made.finish_reason == "finished" and made.num_summaries >= 1
    assert len(made.lines) == made.num_summaries + 1  # a context per summary, and the last
    texts = []
    for line in made.lines:
        ids, mask = line["token_ids"], line["loss_mask"]
        assert len(ids) == len(mask) and mask[0] == 0
        assert len(ids) <= HARNESS.context_tokens
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
        trained = tokenizer.decode(
            [t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
        )
        assert "<|tool_result|>" not in trained and "TABLE_" not in trained  # tool output
    first, *later = texts
    # The first context reads and fills parts, then is asked for a summary and writes it.
    assert first.startswith("<|system|>") and '"name": "read_file"' in first
    assert first.endswith("<|/summary|>")
    summary = first[first.rindex("<|summary|>") + len("<|summary|>") : -len("<|/summary|>")]
    assert "Done: part_1.py" in summary
    # The part read but not filled is carried by the summary alone: its function and
    # what it must return, which the next context no longer shows.
    pending = next(p for p in parts if f"{p.path}: {p.name}(" in summary)
    assert pending.description in summary
    last = later[-1]
    assert f"Progress so far:<|summary|>{summary}<|/summary|>" in later[0]
    assert f"def {pending.name}(" not in later[0]
    assert f'"path": "{pending.path}", "old"' in later[0]  # filled from the summary
    assert last.endswith(
        '"name": "finish", "arguments": {"message": "done"}}<|/tool_call|><|end_of_turn|>'
    )


def test_budgets_too_small_for_the_teacher_are_refused(tokenizer: Any) -> None:
    task = make_task("train", 0, seed=0)
    cramped = HARNESS.model_copy(update={"context_tokens": 1024, "max_summaries": 1})
    with pytest.raises(TeacherError, match="ended 'context_full'"):
        transcript(task, tokenizer, cramped)
    short = HARNESS.model_copy(update={"summary_tokens": 8})
    with pytest.raises(TeacherError, match="exceeds the harness's budget of 8"):
        transcript(task, tokenizer, short)


def test_sft_reads_the_transcripts_ids_and_mask(tokenizer: Any, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    lines = list(multifile_sft_records(0, 2, tokenizer, HARNESS))
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    examples = list(JsonlSource(raw, 4096, path).examples())
    assert [e.tokens for e in examples] == [line["token_ids"] for line in lines]
    assert [e.trained for e in examples] == [[bool(m) for m in line["loss_mask"]] for line in lines]
    end = SPECIAL["<|/summary|>"]
    asked = [e for e in examples if e.tokens[-1] == end]  # contexts that end in a summary
    assert len(asked) == 2 and all(e.trained[-1] for e in asked)  # the summary is trained
    carried = [e for e in examples if e.tokens[-1] != end]  # contexts that start from one
    assert all(not e.trained[e.tokens.index(end)] for e in carried)
    short = list(JsonlSource(raw, 64, path).examples())
    assert all(len(e.tokens) == 64 for e in short)
    path.write_text(json.dumps({"token_ids": [1, 2, 3], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match="as many as loss_mask"):
        list(JsonlSource(raw, 4096, path).examples())
