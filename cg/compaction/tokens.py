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
letters (about 0.3 GB/s), so every pattern of two classes is counted at once from one string of
pair codes (16 x the class of a byte + the class of the next, added as big integers: C speed, no
carries), translated once into the disjoint groups of codes the patterns split into, each group
then counted as one byte (C's tightest loop). Such a pattern cannot overlap itself, so counting
positions is counting occurrences; "uu" and "pp" can ("uuu" holds one), and are counted from
their pairs' runs; ".ss" is one group followed by another.
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


def _group(code: int) -> int:
    """The letter of the one group a pair code belongs to ('.': none the model counts)."""
    first, second = code >> 4, code & 15
    letters = (_UP, _LOW)
    if second in letters:
        if first in letters:
            return {(_LOW, _UP): ord("l"), (_UP, _LOW): ord("u"), (_UP, _UP): ord("U")}.get((first, second), ord("."))
        return ord("P") if first == _PUNCT else ord("A")
    for cls, after_other, twice in ((_DIGIT, "0", "."), (_PUNCT, "p", "Q"), (_BREAK, "n", "."),
                                    (_SPACE, "s", "W")):
        if second == cls:
            return ord(twice if first == cls else after_other)
    return ord(".")


# Every pair code's group: the model's patterns of two classes split into disjoint sets of codes,
# so that one translate and a single-byte count per group (C's tightest loop) count them all.
# ".a" is "A" (a letter after neither a letter nor punctuation) plus "pa" ("P"); "U" and "Q" are
# the pairs of "uu" and "pp"; ".ss" is "s" then "W".
_PAIR_GROUPS = bytes(_group(code) for code in range(256))
_SINGLE_GROUPS = ((b"lu", b"l"), (b"ul", b"u"), (b".0", b"0"), (b"pa", b"P"), (b".p", b"p"), (b".n", b"n"),
                  (b".s", b"s"))
_CHARACTER_TABLE = _MODEL[7][0]


def _counts(data: bytes) -> list[int]:
    """The model's features, in _MODEL order: what counting each pattern in its table gives."""
    if len(data) < 3:
        return _model_counts(data)
    groups = (int.from_bytes(data[:-1].translate(_FIRST), "big")
              + int.from_bytes(data[1:].translate(_SECOND), "big")).to_bytes(len(data) - 1, "big").translate(_PAIR_GROUPS)
    found = {pattern: groups.count(letter) for pattern, letter in _SINGLE_GROUPS}
    found[b".a"] = groups.count(b"A") + found[b"pa"]
    # A run of a class L long is a run of its pairs' group L - 1 long, which holds L // 2 of the
    # model's (non-overlapping) "uu" or "pp": the group's count less its own non-overlapping pairs.
    found[b"uu"] = groups.count(b"U") - groups.count(b"UU")
    found[b"pp"] = groups.count(b"Q") - groups.count(b"QQ")
    found[b".ss"] = groups.count(b"sW")
    if data.isascii():  # most tool output: tabs, and no multi-byte characters
        found.update({b"t": data.count(b"\t"), b"2": 0, b"3": 0, b"4": 0})
    else:
        characters = data.translate(_CHARACTER_TABLE)
        found.update((letter, characters.count(letter)) for letter in (b"t", b"2", b"3", b"4"))
    return [found[pattern] for _, patterns in _MODEL for pattern, _ in patterns]


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
