"""The memo's decisions as bytes, so that a restarted cg starts with them (cg.web.memofile).

After a restart every conversation's next request is a cold history: parsed whole, and every tool
result in it decided again. The decisions are most of that work (bench/pipeline.py: ~7.5 ms of a
~330 KB history's first rewrite, ~2.5 ms with its decisions known), and each is a pure function
of its key (pipeline.Memo), so the same code makes the same one again: a snapshot written at a
graceful stop and read at the next start saves the work and changes no byte cg forwards.

Pure: bytes in, bytes out. The snapshot names the code that made it (`code`, a fingerprint the
caller computes); one made by other code is ignored whole, since a decision depends on the
components' code as well as on its key. JSON, not pickle: reading a file must not run code.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import ujson

from cg.compaction.components import DEFAULT_COMPONENTS
from cg.compaction.pipeline import CompactConfig, Memo, _Decision, _DecisionKey, _Step
from cg.wire.markers import id_of

FORMAT = 1

# A config is written as its fields, its components by name: the ones cg runs are these instances
# (cg.compaction.options), and Offload's and Dedup's parameters are the config's own fields.
_BY_NAME = {component.name: component for component in DEFAULT_COMPONENTS}
_FIELDS = [field.name for field in attrs.fields(CompactConfig) if field.name not in ("components", "configured")]


def dump(items: list[tuple[_DecisionKey, _Decision]], code: str) -> bytes:
    """`Memo.decisions.items()` (least recently used first), as `restore` reads them.

    ASCII JSON: a tool name may hold a lone surrogate (a name is never encoded elsewhere), which
    UTF-8 cannot carry and a JSON escape can. Encoded `_CHUNK` rows at a time, so that a thread
    writing a checkpoint holds the GIL for a few milliseconds at a time, not for the whole file.
    """
    indices: dict[CompactConfig, int | None] = {}
    written: list[dict[str, Any]] = []
    rows = []
    for (digest, tool_name, config, lossy, earlier), decision in items:
        if config not in indices:
            fields = _config_fields(config)
            indices[config] = None if fields is None else len(written)
            if fields is not None:
                written.append(fields)
        index = indices[config]
        if index is None:
            continue
        rows.append([digest.hex(), tool_name, index, lossy, earlier, decision.text,
                     [[s.component, s.lossy, s.tokens_before, s.tokens_after] for s in decision.steps],
                     decision.ran, decision.reverted])
    head = _header(code) + _encode({"configs": written, "decisions": []})[1:]
    chunks = [_encode(rows[start:start + _CHUNK])[1:-1] for start in range(0, len(rows), _CHUNK)]
    return head[:-2] + b",".join(chunk for chunk in chunks if chunk) + b"]}"


_CHUNK = 500


def _header(code: str) -> bytes:
    """How a snapshot of `code` starts: checked before the rest is parsed."""
    return _encode({"format": FORMAT, "code": code})[:-1] + b","


def _encode(value: object) -> bytes:
    return ujson.dumps(value, escape_forward_slashes=False).encode("ascii")


def restore(memo: Memo, data: bytes, code: str) -> int:
    """Put the snapshot's decisions in the memo (its budget still bounds it): how many it read.

    0 for a snapshot of other code or another format; ValueError, and nothing put, when it is not
    a snapshot: every value is checked, since a file can hold anything.
    """
    if not data.startswith(_header(code)):
        return 0  # another code's (or format's): not parsed (0.3-0.4 s for a full file)
    try:
        doc = ujson.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        if doc.get("format") != FORMAT or doc.get("code") != code:
            return 0
        configs = [_config(fields) for fields in _list(doc["configs"])]
        entries = [entry for row in _list(doc["decisions"]) if (entry := _entry(row, configs)) is not None]
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"not a memo snapshot: {error!r}") from error
    for key, decision in entries:
        memo.remember(key, decision)
    return len(entries)


def _entry(row: object, configs: list[CompactConfig | None]) -> tuple[_DecisionKey, _Decision] | None:
    """A row as its key and decision; None for one of a config this cg cannot make."""
    digest, tool_name, index, lossy, earlier, text, steps, ran, reverted = _list(row)
    if not (isinstance(digest, str) and _DIGEST.fullmatch(digest) and _int(index) < len(configs)):
        raise ValueError(f"a row names no digest or config: {row!r:.200}")
    config = configs[index]
    if config is None:
        return None  # written by a cg with a component this one does not have
    raw = bytes.fromhex(digest)
    key: _DecisionKey = (raw, _str(tool_name, none=True), config, _bool(lossy), _bool(earlier))
    made = tuple(_Step(_str(name), _bool(was_lossy), _int(before), _int(after))
                 for name, was_lossy, before, after in map(_list, _list(steps)))
    return key, _Decision(id_of(raw), _str(text, none=True), made, _strs(ran), _strs(reverted))


def _config_fields(config: CompactConfig) -> dict[str, Any] | None:
    """What `_config` makes the same config of again; None when names cannot (a component of a
    test's own, say): its decisions are then not written."""
    fields = {name: getattr(config, name) for name in _FIELDS}
    fields["keep_tools"] = sorted(config.keep_tools)
    fields["components"] = [component.name for component in config.components]
    return fields if _config(fields) == config else None


def _config(fields: object) -> CompactConfig | None:
    if not isinstance(fields, dict):
        raise ValueError(f"a config is not an object: {fields!r:.200}")
    names = _strs(fields["components"])
    if any(name not in _BY_NAME for name in names):
        return None
    given = {name: _int(fields[name]) for name in _FIELDS if name != "keep_tools"}
    return CompactConfig(components=tuple(_BY_NAME[name] for name in names), keep_tools=_strs(fields["keep_tools"]),
                         **given)


# What a file may hold where: exactly these types, or ValueError.
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _list(value: object) -> list[Any]:
    if type(value) is not list:
        raise ValueError(f"not a list: {value!r:.200}")
    return value


def _int(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"not a count: {value!r:.200}")
    return value


def _bool(value: object) -> bool:
    if type(value) is not bool:
        raise ValueError(f"not true or false: {value!r:.200}")
    return value


def _str(value: object, none: bool = False) -> Any:
    if not (type(value) is str or (none and value is None)):
        raise ValueError(f"not a string: {value!r:.200}")
    return value


def _strs(value: object) -> tuple[str, ...]:
    return tuple(_str(item) for item in _list(value))
