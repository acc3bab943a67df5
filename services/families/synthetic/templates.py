"""Function templates of the synthetic family, by difficulty level.

Each template draws a small Python function from a seeded ``random.Random``: a name, a
one-line description, a short body and a few calls. Bodies are short and patterned on
purpose (the CPU demo's ~13M-parameter model must learn levels 0-1 and some of 2):

* level 0 — return a constant or the argument;
* level 1 — one arithmetic operation;
* level 2 — a loop or a condition over numbers;
* level 3 — strings and dicts.

A spec's ``key`` names its behaviour (template and constants, not the name): the split
of a task is a hash of it, so no behaviour is in both train and heldout.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_VERBS = ("compute", "find", "get", "make", "build", "pick", "count", "sum", "check", "solve")
_NOUNS = ("values", "items", "numbers", "result", "answer", "total", "score", "data", "value")
_WORDS = ("apple", "bob", "cat", "dog", "egg", "fig", "sun", "map", "red", "tea")

NUM_LEVELS = 4


@dataclass(frozen=True)
class FunctionSpec:
    """A function to write: what it does, its reference body and the calls that test it."""

    level: int
    key: str
    name: str
    params: str
    description: str
    body: str  # indented by four spaces, one or more lines
    calls: tuple[str, ...]  # argument lists, as Python source

    @property
    def source(self) -> str:
        """The reference solution: the stub with its body filled in."""
        return (
            f'def {self.name}({self.params}):\n    """Return {self.description}."""\n{self.body}\n'
        )

    @property
    def stub(self) -> str:
        """What the workspace starts with."""
        return f'def {self.name}({self.params}):\n    """Return {self.description}."""\n    pass\n'


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _ints(rng: random.Random, count: int, low: int = -9, high: int = 30) -> tuple[str, ...]:
    return tuple(str(rng.randint(low, high)) for _ in range(count))


def _lists(rng: random.Random, count: int) -> tuple[str, ...]:
    calls = [str([rng.randint(-5, 20) for _ in range(rng.randint(1, 6))]) for _ in range(count)]
    return (*calls[:-1], "[]") if rng.random() < 0.5 else tuple(calls)


def _sentences(rng: random.Random, count: int) -> tuple[str, ...]:
    return tuple(
        repr(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))) for _ in range(count)
    )


# Level 0 ---------------------------------------------------------------------------------
def _constant_number(rng: random.Random) -> FunctionSpec:
    c = rng.randint(0, 99)
    return FunctionSpec(
        0, f"number:{c}", _name(rng), "", f"the number {c}", f"    return {c}", ("",)
    )


def _constant_word(rng: random.Random) -> FunctionSpec:
    word = rng.choice(_WORDS)
    return FunctionSpec(
        0, f"word:{word}", _name(rng), "", f"the string {word!r}", f"    return {word!r}", ("",)
    )


def _echo(rng: random.Random) -> FunctionSpec:
    param = rng.choice(("x", "n", "value"))
    calls = (*_ints(rng, 2), *_sentences(rng, 1))
    return FunctionSpec(
        0, f"echo:{param}", _name(rng), param, f"{param} unchanged", f"    return {param}", calls
    )


# Level 1 ---------------------------------------------------------------------------------
_OPERATIONS = (
    ("+", "x plus {k}", 1),
    ("-", "x minus {k}", 1),
    ("*", "x times {k}", 1),
    ("//", "x divided by {k}, rounded down", 2),
    ("%", "the remainder of x divided by {k}", 2),
)


def _arithmetic(rng: random.Random) -> FunctionSpec:
    symbol, words, low = rng.choice(_OPERATIONS)
    k = rng.randint(low, 12)
    calls = _ints(rng, 4, 0 if low > 1 else -9)
    body = f"    return x {symbol} {k}"
    return FunctionSpec(1, f"op:{symbol}:{k}", _name(rng), "x", words.format(k=k), body, calls)


def _two_arguments(rng: random.Random) -> FunctionSpec:
    symbol, words = rng.choice((("+", "a plus b"), ("-", "a minus b"), ("*", "a times b")))
    calls = tuple(f"{a}, {b}" for a, b in zip(_ints(rng, 4), _ints(rng, 4), strict=True))
    return FunctionSpec(
        1, f"op2:{symbol}", _name(rng), "a, b", words, f"    return a {symbol} b", calls
    )


# Level 2 ---------------------------------------------------------------------------------
def _condition(rng: random.Random) -> tuple[str, str, str]:
    """(key part, words, Python test of v)."""
    k = rng.randint(0, 10)
    return rng.choice(
        (
            ("even", "even", "v % 2 == 0"),
            ("odd", "odd", "v % 2 == 1"),
            (f"gt{k}", f"greater than {k}", f"v > {k}"),
            (f"lt{k}", f"less than {k}", f"v < {k}"),
            (f"div{k + 2}", f"divisible by {k + 2}", f"v % {k + 2} == 0"),
        )
    )


def _sum_if(rng: random.Random) -> FunctionSpec:
    key, words, test = _condition(rng)
    body = (
        "    total = 0\n    for v in values:\n"
        f"        if {test}:\n            total += v\n    return total"
    )
    description = f"the sum of the numbers in values that are {words}"
    return FunctionSpec(2, f"sum:{key}", _name(rng), "values", description, body, _lists(rng, 4))


def _count_if(rng: random.Random) -> FunctionSpec:
    key, words, test = _condition(rng)
    body = (
        "    count = 0\n    for v in values:\n"
        f"        if {test}:\n            count += 1\n    return count"
    )
    description = f"how many numbers in values are {words}"
    return FunctionSpec(2, f"count:{key}", _name(rng), "values", description, body, _lists(rng, 4))


def _filter_if(rng: random.Random) -> FunctionSpec:
    key, words, test = _condition(rng)
    body = f"    return [v for v in values if {test}]"
    description = f"a list of the numbers in values that are {words}, in order"
    return FunctionSpec(2, f"filter:{key}", _name(rng), "values", description, body, _lists(rng, 4))


def _branch(rng: random.Random) -> FunctionSpec:
    t = rng.randint(-5, 10)
    body = (
        f"    if n < {t}:\n        return 'low'\n"
        f"    if n == {t}:\n        return 'equal'\n    return 'high'"
    )
    description = f"'low' if n is less than {t}, 'equal' if n equals {t}, else 'high'"
    calls = (str(t), *_ints(rng, 3, -10, 15))
    return FunctionSpec(2, f"branch:{t}", _name(rng), "n", description, body, calls)


def _largest(rng: random.Random) -> FunctionSpec:
    sign, words = rng.choice(((">", "largest"), ("<", "smallest")))
    body = (
        "    best = values[0]\n    for v in values:\n"
        f"        if v {sign} best:\n            best = v\n    return best"
    )
    calls = tuple(c for c in _lists(rng, 5) if c != "[]")
    description = f"the {words} number in values (values is never empty)"
    return FunctionSpec(2, f"extreme:{sign}", _name(rng), "values", description, body, calls)


# Level 3 ---------------------------------------------------------------------------------
_STRING_BODIES = (
    ("reverse", "s reversed", "    return s[::-1]"),
    ("upper", "s in upper case", "    return s.upper()"),
    ("words", "the number of words in s", "    return len(s.split())"),
    (
        "initials",
        "the first letter of every word in s, joined",
        "    return ''.join(w[0] for w in s.split())",
    ),
    (
        "title",
        "s with every word capitalized",
        "    return ' '.join(w.capitalize() for w in s.split())",
    ),
)


def _string(rng: random.Random) -> FunctionSpec:
    key, description, body = rng.choice(_STRING_BODIES)
    return FunctionSpec(3, f"str:{key}", _name(rng), "s", description, body, _sentences(rng, 4))


def _replace_spaces(rng: random.Random) -> FunctionSpec:
    mark = rng.choice("_-.+*")
    body = f"    return s.replace(' ', {mark!r})"
    description = f"s with every space replaced by {mark!r}"
    return FunctionSpec(
        3, f"replace:{mark}", _name(rng), "s", description, body, _sentences(rng, 4)
    )


def _count_letter(rng: random.Random) -> FunctionSpec:
    letter = rng.choice("abcdefgilmnoprstu")
    body = f"    return s.count({letter!r})"
    description = f"how many times the letter {letter!r} appears in s"
    return FunctionSpec(
        3, f"letter:{letter}", _name(rng), "s", description, body, _sentences(rng, 4)
    )


def _word_dict(rng: random.Random) -> FunctionSpec:
    key, description, line = rng.choice(
        (
            (
                "counts",
                "a dict mapping each word of s to how many times it appears",
                "counts[w] = counts.get(w, 0) + 1",
            ),
            ("lengths", "a dict mapping each word of s to its length", "counts[w] = len(w)"),
        )
    )
    body = f"    counts = {{}}\n    for w in s.split():\n        {line}\n    return counts"
    return FunctionSpec(3, f"dict:{key}", _name(rng), "s", description, body, _sentences(rng, 4))


TEMPLATES: tuple[tuple[Callable[[random.Random], FunctionSpec], ...], ...] = (
    (_constant_number, _constant_word, _echo),
    (_arithmetic, _arithmetic, _two_arguments),
    (_sum_if, _count_if, _filter_if, _branch, _largest),
    (_string, _replace_spaces, _count_letter, _word_dict),
)


def draw(level: int, rng: random.Random) -> FunctionSpec:
    """A function of difficulty `level` (0..NUM_LEVELS-1)."""
    if not 0 <= level < NUM_LEVELS:
        raise ValueError(f"synthetic level must be in [0, {NUM_LEVELS - 1}], got {level}")
    return rng.choice(TEMPLATES[level])(rng)


def expected_values(spec: FunctionSpec) -> list[str]:
    """The repr of what the reference solution returns for each call (our own code only)."""
    namespace: dict[str, object] = {}
    exec(spec.source, namespace)  # trusted: the templates above, never model output
    function = namespace[spec.name]
    return [repr(eval(f"__f({call})", {"__f": function})) for call in spec.calls]
