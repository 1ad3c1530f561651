"""The one token estimator cg uses everywhere: thresholds, "is it shorter", savings figures.

A real BPE tokenizer costs a download and a per-piece Python loop; this is a linear model over
counts the C string methods make cheaply: words, case changes, numbers, punctuation, line breaks,
indentation, multi-byte characters, each a count of a short pattern of character classes. The
weights were fitted (non-negative least squares on relative error) against cl100k_base;
docs/design.md ("Token estimator") has the error table and the bound.

The model is defined by `_MODEL`: each UTF-8 byte mapped to a class letter by a table
(bytes.translate), and patterns counted without overlap (bytes.count). That definition decides
which results are offloaded, so its numbers must never change; `_counts` computes the same
numbers faster. `bytes.count` of a two-letter pattern crawls over a string of two or three
letters (about 0.3 GB/s), so every pattern of two different classes is counted at once from one
string of pair codes (16 x the class of a byte + the class of the next, added as big integers:
C speed, no carries), each as the length of that string with the other codes deleted. Such a
pattern cannot overlap itself, so counting positions is counting occurrences. "uu" and "pp" can
overlap themselves ("uuu" holds one), so they are counted as the model says; ".ss" is a pair
code followed by another.
"""

import functools


def _class_table(*classes: tuple[bytes, bytes]) -> bytes:
    """A bytes.translate table sending each byte of a group to its class letter, the rest to '.'."""
    table = bytearray(b"." * 256)
    for members, letter in classes:
        for byte in members:
            table[byte] = ord(letter)
    return bytes(table)


_UPPER, _LOWER = bytes(range(ord("A"), ord("Z") + 1)), bytes(range(ord("a"), ord("z") + 1))
_LETTERS = _UPPER + _LOWER
_DIGITS = b"0123456789"
_PUNCTUATION = bytes(b for b in range(0x21, 0x7F) if b not in _LETTERS + _DIGITS)
_LEADS_2, _LEADS_3, _LEADS_4 = bytes(range(0xC0, 0xE0)), bytes(range(0xE0, 0xF0)), bytes(range(0xF0, 0x100))

# (class table, ((pattern to count, weight), ...)); "." is every byte outside the table's classes.
_MODEL = (
    (_class_table((_LETTERS, b"a")), ((b".a", 0.6649),)),  # words
    (_class_table((_UPPER, b"u"), (_LOWER, b"l")),  # case changes: camelCase, base64
     ((b"lu", 0.6697), (b"uu", 0.4425), (b"ul", 0.9303))),
    (_class_table((_DIGITS, b"0")), ((b".0", 1.8325),)),  # numbers
    (_class_table((_LETTERS, b"a"), (_PUNCTUATION, b"p")), ((b"pa", 0.3655),)),  # "/usr", ".py", "_name"
    (_class_table((_PUNCTUATION, b"p")), ((b".p", 0.3186), (b"pp", 0.3376))),  # punctuation runs, pairs
    (_class_table((b"\n\r", b"n")), ((b".n", 0.1693),)),  # line breaks
    (_class_table((b" ", b"s")), ((b".s", 0.4244), (b".ss", 1.5853))),  # spaces, indentation
    (_class_table((b"\t", b"t"), (_LEADS_2, b"2"), (_LEADS_3, b"3"), (_LEADS_4, b"4")),
     ((b"t", 0.4874), (b"2", 0.4144), (b"3", 0.9236), (b"4", 2.7666))),  # tabs, multi-byte characters
)
_WEIGHTS = [weight for _, patterns in _MODEL for _, weight in patterns]

# Every byte's class, one of few enough for a pair of them to fit in a byte (4 bits each).
_GROUPS = (_UPPER, _LOWER, _DIGITS, _PUNCTUATION, b"\n\r", b" ", b"\t", _LEADS_2, _LEADS_3, _LEADS_4)
_UP, _LOW, _DIGIT, _PUNCT, _BREAK, _SPACE = range(6)
_OTHER = len(_GROUPS)  # control characters, DEL, UTF-8 continuation bytes
_CLASS = bytearray([_OTHER] * 256)
for _index, _members in enumerate(_GROUPS):
    for _byte in _members:
        _CLASS[_byte] = _index
_FIRST, _SECOND = bytes(c << 4 for c in _CLASS), bytes(_CLASS)  # a pair's code: first + second
_ALL = frozenset(range(_OTHER + 1))


def _deleting_all_but(firsts: frozenset[int], seconds: frozenset[int]) -> bytes:
    """The bytes.translate `delete` argument keeping only the pair codes (first, second)."""
    return bytes(code for code in range(256) if not (code >> 4 in firsts and code & 15 in seconds))


def _after_other(*classes: int) -> bytes:
    """Pairs of a byte outside `classes` then one inside: the model's ".x" patterns."""
    return _deleting_all_but(_ALL - set(classes), frozenset(classes))


# The model's patterns of two different classes, as sets of pair codes, in _MODEL order.
_PAIRS = {
    b".a": _after_other(_UP, _LOW),
    b"lu": _deleting_all_but(frozenset({_LOW}), frozenset({_UP})),
    b"ul": _deleting_all_but(frozenset({_UP}), frozenset({_LOW})),
    b".0": _after_other(_DIGIT),
    b"pa": _deleting_all_but(frozenset({_PUNCT}), frozenset({_UP, _LOW})),
    b".p": _after_other(_PUNCT),
    b".n": _after_other(_BREAK),
    b".s": _after_other(_SPACE),
}
# ".ss": a pair (other, space) then a pair (space, space), flagged 1 and 2 (they cannot overlap).
_SPACE_FLAGS = bytes(
    1 if code >> 4 != _SPACE and code & 15 == _SPACE else 2 if code == _SPACE * 17 else 0 for code in range(256)
)
_CASE_TABLE, _PUNCTUATION_TABLE, _CHARACTER_TABLE = _MODEL[1][0], _MODEL[4][0], _MODEL[7][0]
_UP_UP, _PUNCT_PUNCT = bytes([_UP * 17]), bytes([_PUNCT * 17])


def _counts(data: bytes) -> list[int]:
    """The model's features, in _MODEL order: what counting each pattern in its table gives."""
    if len(data) < 3:
        return _model_counts(data)
    pairs = (int.from_bytes(data[:-1].translate(_FIRST), "big")
             + int.from_bytes(data[1:].translate(_SECOND), "big")).to_bytes(len(data) - 1, "big")
    found = {pattern: len(pairs.translate(None, others)) for pattern, others in _PAIRS.items()}
    found[b"uu"] = _run_pairs(pairs, _UP_UP, data, _CASE_TABLE, b"uu")
    found[b"pp"] = _run_pairs(pairs, _PUNCT_PUNCT, data, _PUNCTUATION_TABLE, b"pp")
    found[b".ss"] = pairs.translate(_SPACE_FLAGS).count(b"\x01\x02")
    if data.isascii():  # most tool output: tabs, and no multi-byte characters
        found.update({b"t": data.count(b"\t"), b"2": 0, b"3": 0, b"4": 0})
    else:
        characters = data.translate(_CHARACTER_TABLE)
        found.update((letter, characters.count(letter)) for letter in (b"t", b"2", b"3", b"4"))
    return [found[pattern] for _, patterns in _MODEL for pattern, _ in patterns]


def _run_pairs(pairs: bytes, code: bytes, data: bytes, table: bytes, pattern: bytes) -> int:
    """The model's count of `pattern` (a class twice), from the pair codes where no run of the
    class is longer than 2 (then every pair is one occurrence), else as the model counts it."""
    if code * 2 not in pairs:
        return pairs.count(code)
    return data.translate(table).count(pattern)


def _model_counts(data: bytes) -> list[int]:
    """The model's features as it defines them (see the module docstring)."""
    counts: list[int] = []
    for table, patterns in _MODEL:
        classes = data.translate(table)
        counts += (classes.count(pattern) for pattern, _ in patterns)
    return counts


@functools.lru_cache(maxsize=8)  # components re-estimate the text the pipeline has just estimated
def estimate_tokens(text: str) -> int:
    """Roughly how many tokens text costs (cl100k_base-like; see the module docstring)."""
    if not text:
        return 0
    data = text.encode("utf-8", "surrogatepass")
    return max(1, round(sum(weight * count for weight, count in zip(_WEIGHTS, _counts(data)))))


# Bytes per token of a whole request body, for figures where running the estimator would cost
# too much (about 26 ms per MB on the reactor thread, several times cg's whole warm rewrite).
# The estimator finds 2.8 to 3.5 on long Claude Code sessions (bench/rewrite.py's bodies, where
# tool output dominates) and 5.4 on a fresh session's 77 KB (mostly the system prompt's prose).
BODY_BYTES_PER_TOKEN = 3.0


def estimate_body_tokens(size: int) -> int:
    """Roughly how many tokens a request body of `size` bytes costs, from its length alone."""
    return round(size / BODY_BYTES_PER_TOKEN)
