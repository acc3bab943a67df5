"""A deterministic generator of small Python programs and harness transcripts.

The factory trains its tokenizer on this text, so the vocabulary covers Python
code and the harness format (roles, tool calls, tool results) without any
download. Same seed, same text, on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from services.model_factory.vocabulary import END_OF_TEXT

_VERBS = [
    "compute",
    "count",
    "find",
    "sum",
    "filter",
    "merge",
    "reverse",
    "scale",
    "clamp",
    "normalize",
    "collect",
    "parse",
    "format",
    "build",
    "split",
    "join",
    "rotate",
    "encode",
]
_NOUNS = [
    "values",
    "items",
    "words",
    "numbers",
    "pairs",
    "lines",
    "scores",
    "names",
    "digits",
    "tokens",
    "records",
    "points",
    "chars",
    "weights",
    "keys",
    "rows",
]
_VARS = ["x", "y", "n", "k", "total", "result", "acc", "value", "item", "count", "left", "right"]


@dataclass(frozen=True)
class Snippet:
    """A function, a call that exercises it, and the value that call returns."""

    name: str
    source: str
    call: str
    expected: str


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _arith(rng: random.Random) -> Snippet:
    name, a, b = _name(rng), rng.randint(1, 9), rng.randint(0, 9)
    op, word = rng.choice([("+", "plus"), ("-", "minus"), ("*", "times")])
    source = (
        f'def {name}(x):\n    """Return x times {a}, {word} {b}."""\n    return x * {a} {op} {b}\n'
    )
    x = rng.randint(-20, 20)
    return Snippet(name, source, f"{name}({x})", repr(eval(f"{x} * {a} {op} {b}")))


def _loop_sum(rng: random.Random) -> Snippet:
    name, var = _name(rng), rng.choice(_VARS[:4])
    cond = rng.choice(["% 2 == 0", "% 3 == 0", "> 0", "< 10"])
    source = (
        f"def {name}(values):\n"
        f"    total = 0\n"
        f"    for {var} in values:\n"
        f"        if {var} {cond}:\n"
        f"            total += {var}\n"
        f"    return total\n"
    )
    values = [rng.randint(-5, 15) for _ in range(rng.randint(2, 7))]
    expected = sum(v for v in values if eval(f"{v} {cond}"))
    return Snippet(name, source, f"{name}({values})", repr(expected))


def _strings(rng: random.Random) -> Snippet:
    name = _name(rng)
    body, fn = rng.choice(
        [
            ("return s[::-1]", lambda s: s[::-1]),
            ("return s.upper()", str.upper),
            ("return s.replace(' ', '_')", lambda s: s.replace(" ", "_")),
            ("return ''.join(sorted(s))", lambda s: "".join(sorted(s))),
            ("return s[:1].upper() + s[1:]", lambda s: s[:1].upper() + s[1:]),
            ("return str(len(s.split()))", lambda s: str(len(s.split()))),
        ]
    )
    source = f"def {name}(s):\n    {body}\n"
    arg = " ".join(rng.choice(_NOUNS) for _ in range(rng.randint(1, 3)))
    return Snippet(name, source, f"{name}({arg!r})", repr(fn(arg)))


def _comprehension(rng: random.Random) -> Snippet:
    name, k = _name(rng), rng.randint(2, 5)
    body, fn = rng.choice(
        [
            (f"return [v * {k} for v in values]", lambda vs: [v * k for v in vs]),
            (
                f"return [v for v in values if v % {k} == 0]",
                lambda vs: [v for v in vs if v % k == 0],
            ),
            (f"return [v + {k} for v in values if v > 0]", lambda vs: [v + k for v in vs if v > 0]),
            (
                "return sorted(values)[-1] if values else None",
                lambda vs: sorted(vs)[-1] if vs else None,
            ),
        ]
    )
    source = f"def {name}(values):\n    {body}\n"
    values = [rng.randint(-9, 20) for _ in range(rng.randint(1, 6))]
    return Snippet(name, source, f"{name}({values})", repr(fn(values)))


def _branch(rng: random.Random) -> Snippet:
    name, t = _name(rng), rng.randint(-5, 10)
    source = (
        f"def {name}(n):\n"
        f"    if n < {t}:\n"
        f"        return 'low'\n"
        f"    elif n == {t}:\n"
        f"        return 'equal'\n"
        f"    return 'high'\n"
    )
    n = rng.randint(-10, 15)
    expected = "low" if n < t else "equal" if n == t else "high"
    return Snippet(name, source, f"{name}({n})", repr(expected))


def _dict_count(rng: random.Random) -> Snippet:
    name = _name(rng)
    source = (
        f"def {name}(words):\n"
        f"    counts = {{}}\n"
        f"    for word in words:\n"
        f"        counts[word] = counts.get(word, 0) + 1\n"
        f"    return counts\n"
    )
    words = [rng.choice(["a", "b", "c"]) for _ in range(rng.randint(1, 6))]
    counts: dict[str, int] = {}
    for word in words:
        counts[word] = counts.get(word, 0) + 1
    return Snippet(name, source, f"{name}({words})", repr(counts))


SNIPPET_KINDS: tuple[Callable[[random.Random], Snippet], ...] = (
    _arith,
    _loop_sum,
    _strings,
    _comprehension,
    _branch,
    _dict_count,
)


def snippet(rng: random.Random) -> Snippet:
    """One random snippet of any kind."""
    return rng.choice(SNIPPET_KINDS)(rng)


def _module(rng: random.Random) -> str:
    parts = [snippet(rng) for _ in range(rng.randint(1, 4))]
    tests = "\n".join(f"    assert {p.call} == {p.expected}" for p in parts)
    return "\n\n".join(p.source for p in parts) + f"\n\ndef test_all():\n{tests}\n"


def _transcript(rng: random.Random) -> str:
    target = snippet(rng)
    call = json.dumps(
        {"name": "write_file", "arguments": {"path": "solution.py", "content": target.source}}
    )
    run = json.dumps({"name": "run_tests", "arguments": {}})
    return (
        "<|system|>You are a coding agent. Use the tools to solve the task.<|end_of_turn|>"
        f"<|user|>Write {target.name} so that {target.call} == {target.expected}.<|end_of_turn|>"
        f"<|assistant|><|think|>I will write {target.name}.<|/think|>"
        f"<|tool_call|>{call}<|/tool_call|><|end_of_turn|>"
        "<|tool|><|tool_result|>wrote solution.py<|/tool_result|><|end_of_turn|>"
        f"<|assistant|><|tool_call|>{run}<|/tool_call|><|end_of_turn|>"
        "<|tool|><|tool_result|>1 passed<|/tool_result|><|end_of_turn|>"
        "<|assistant|>Done.<|end_of_turn|>"
    )


def documents(seed: int) -> Iterator[str]:
    """An endless, deterministic stream of corpus documents (modules and transcripts)."""
    rng = random.Random(seed)
    while True:
        text = _transcript(rng) if rng.random() < 0.3 else _module(rng)
        yield text + END_OF_TEXT


def corpus(seed: int, num_bytes: int) -> list[str]:
    """Documents from `documents(seed)` until they hold at least `num_bytes` of text."""
    out, size = [], 0
    for document in documents(seed):
        out.append(document)
        size += len(document)
        if size >= num_bytes:
            return out
    raise AssertionError("documents() is endless")
