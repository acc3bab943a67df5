"""The harness's special tokens. Their order fixes their ids (0, 1, 2, ...) in every
tokenizer the factory trains, so code and checkpoints agree on them."""

from __future__ import annotations

from typing import Final

# name -> what it marks; ids follow this order.
SPECIAL_TOKENS: Final[dict[str, str]] = {
    "<|endoftext|>": "end of a document; end of sequence",
    "<|pad|>": "padding",
    "<|system|>": "starts a system turn",
    "<|user|>": "starts a user turn",
    "<|assistant|>": "starts an assistant turn",
    "<|tool|>": "starts a tool turn (tool output shown to the model)",
    "<|end_of_turn|>": "ends a turn",
    "<|think|>": "starts private reasoning",
    "<|/think|>": "ends private reasoning",
    "<|tool_call|>": "starts a tool call (JSON: name, arguments)",
    "<|/tool_call|>": "ends a tool call",
    "<|tool_result|>": "starts a tool result",
    "<|/tool_result|>": "ends a tool result",
    "<|summarize|>": "asks the model to summarize its context",
    "<|summary|>": "starts a summary of earlier context",
    "<|/summary|>": "ends a summary",
}

END_OF_TEXT: Final = "<|endoftext|>"
PAD: Final = "<|pad|>"
END_OF_TURN: Final = "<|end_of_turn|>"


def special_token_ids() -> dict[str, int]:
    """Special token -> id, as every factory-made tokenizer assigns them."""
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}
