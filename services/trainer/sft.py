"""Training data of continued pretraining and SFT, read through a resumable cursor.

An example is a token list and, per token, whether it is trained as a target. Text
(the generated code corpus, or ``{"text": ...}`` lines) is trained on every token and
cut into chunks of ``max_seq_len``; a ``{"prompt": ..., "completion": ...}`` pair is
trained on the completion only (the loss mask) and truncated to ``max_seq_len``, and a
``{"token_ids": [...], "loss_mask": [...]}`` transcript (a harness context in the
model's own ids: ``services.launcher.teacher``) where its mask is 1, truncated alike.
Examples come in a fixed order from a source; the cursor is the index of the next
example, so a checkpoint's cursor resumes the stream exactly (re-reading the skipped
examples: O(cursor), cheap next to a training step). Single epoch: a JSON-lines source
ends; the corpus does not.
"""

from __future__ import annotations

import abc
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.config.trainer import DataConfig
from services.trainer.batch import Microbatch, TrainItem, pack_microbatch
from services.trainer.rollouts import SegmentTokens


@dataclass
class Example:
    """Tokens, and for each token whether it is a trained target."""

    tokens: list[int]
    trained: list[bool]


def _chunks(tokens: list[int], size: int) -> Iterator[Example]:
    for start in range(0, len(tokens), size):
        chunk = tokens[start : start + size]
        if len(chunk) >= 2:
            yield Example(chunk, [True] * len(chunk))


class ExampleSource(abc.ABC):
    """A deterministic, ordered stream of examples."""

    def __init__(self, tokenizer: Any, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text are recognized)."""
        ids: list[int] = self.tokenizer.encode(text).ids
        return ids

    @abc.abstractmethod
    def examples(self) -> Iterator[Example]:
        """Every example, from the first."""

    def examples_from(self, position: int) -> Iterator[Example]:
        """The examples from index ``position`` on."""
        return itertools.islice(self.examples(), position, None)


class CorpusSource(ExampleSource):
    """The model factory's generated code corpus (endless)."""

    def __init__(self, tokenizer: Any, max_seq_len: int, seed: int) -> None:
        super().__init__(tokenizer, max_seq_len)
        self.seed = seed

    def examples(self) -> Iterator[Example]:
        from services.model_factory.corpus import documents

        for document in documents(self.seed):
            yield from _chunks(self.encode(document), self.max_seq_len)


class JsonlSource(ExampleSource):
    """``{"text": ...}``, ``{"prompt": ..., "completion": ...}`` or ``{"token_ids": ...,
    "loss_mask": ...}`` per line; ends at EOF."""

    def __init__(self, tokenizer: Any, max_seq_len: int, path: Path) -> None:
        super().__init__(tokenizer, max_seq_len)
        if not path.is_file():
            raise FileNotFoundError(f"data.path {path} does not exist")
        self.path = path

    def examples(self) -> Iterator[Example]:
        with self.path.open() as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if "text" in item:
                    yield from _chunks(self.encode(item["text"]), self.max_seq_len)
                elif "token_ids" in item and "loss_mask" in item:
                    yield from self._transcript(item, number)
                elif "prompt" in item and "completion" in item:
                    prompt, completion = (
                        self.encode(item["prompt"]),
                        self.encode(item["completion"]),
                    )
                    tokens = (prompt + completion)[: self.max_seq_len]
                    trained = ([False] * len(prompt) + [True] * len(completion))[: len(tokens)]
                    if len(tokens) >= 2 and any(trained[1:]):
                        yield Example(tokens, trained)
                else:
                    raise ValueError(
                        f"{self.path}:{number}: a line needs 'text', 'prompt' and 'completion', "
                        "or 'token_ids' and 'loss_mask'"
                    )

    def _transcript(self, item: dict[str, Any], number: int) -> Iterator[Example]:
        """A transcript in token ids, as the harness laid it out (nothing retokenized),
        trained where its loss mask is 1."""
        tokens, mask = item["token_ids"], item["loss_mask"]
        if len(tokens) != len(mask) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(
                f"{self.path}:{number}: token_ids must be integers, as many as loss_mask "
                f"({len(tokens)} token ids, {len(mask)} mask entries)"
            )
        tokens = tokens[: self.max_seq_len]
        trained = [bool(flag) for flag in mask[: len(tokens)]]
        if len(tokens) >= 2 and any(trained[1:]):
            yield Example(tokens, trained)


def open_source(data: DataConfig, model_dir: Path) -> ExampleSource:
    """The source ``data`` names, with the tokenizer of ``model_dir``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if data.kind == "corpus":
        return CorpusSource(tokenizer, data.max_seq_len, data.seed)
    assert data.path is not None
    return JsonlSource(tokenizer, data.max_seq_len, data.path)


class ExampleStream:
    """Batches of about ``tokens_per_step`` tokens from a source, with a resumable cursor."""

    def __init__(self, source: ExampleSource, tokens_per_step: int, cursor: int = 0) -> None:
        self.tokens_per_step = tokens_per_step
        self.cursor = cursor
        self._examples = source.examples_from(cursor)
        self._pending: Example | None = None

    def next_batch(self) -> list[Example]:
        """Whole examples up to the token budget; empty when the source has ended.

        The example that would overflow the budget waits for the next batch without
        advancing the cursor, so a checkpoint taken now resumes with it.
        """
        batch: list[Example] = []
        size = 0
        while True:
            example = self._pending or next(self._examples, None)
            self._pending = None
            if example is None:
                return batch
            if batch and size + len(example.tokens) > self.tokens_per_step:
                self._pending = example
                return batch
            batch.append(example)
            size += len(example.tokens)
            self.cursor += 1


def to_microbatch(examples: list[Example], *, share_prefixes: bool = False) -> Microbatch:
    """Packs examples (inputs ``tokens[:-1]``, targets ``tokens[1:]``) into one microbatch;
    with ``share_prefixes`` as a prefix tree (the system prompt every SFT transcript starts
    with is computed once)."""
    return pack_microbatch(example_items(examples), 0, 0, share_prefixes=share_prefixes)


def example_items(examples: list[Example]) -> list[TrainItem]:
    """CPT/SFT examples as sequences to pack (inputs ``tokens[:-1]``, targets ``tokens[1:]``)."""
    return [
        (
            SegmentTokens(
                input_ids=example.tokens[:-1],
                targets=example.tokens[1:],
                trained=example.trained[1:],
                behaviour_logprobs=[0.0] * (len(example.tokens) - 1),
                replay=None,
            ),
            0.0,
            0.0,
        )
        for example in examples
    ]
