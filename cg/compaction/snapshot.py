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

from collections.abc import Iterable
from typing import Any

import attrs
import ujson

from cg.compaction.components import DEFAULT_COMPONENTS
from cg.compaction.pipeline import _DECISION_CHARS, CompactConfig, Memo, _Decision, _DecisionKey, _Step

FORMAT = 1

# A config is written as its fields, its components by name: the ones cg runs are these instances
# (cg.compaction.options), and Offload's and Dedup's parameters are the config's own fields.
_BY_NAME = {component.name: component for component in DEFAULT_COMPONENTS}
_FIELDS = [field.name for field in attrs.fields(CompactConfig) if field.name not in ("components", "configured")]


def dump(memo: Memo, code: str) -> bytes:
    """The memo's decisions, least recently used first, as `restore` reads them."""
    indices: dict[CompactConfig, int | None] = {}
    written: list[dict[str, Any]] = []
    rows = []
    for (digest, tool_name, config, lossy, earlier), decision in memo.decisions.items():
        if config not in indices:
            fields = _config_fields(config)
            indices[config] = None if fields is None else len(written)
            if fields is not None:
                written.append(fields)
        index = indices[config]
        if index is None:
            continue
        rows.append([digest.hex(), tool_name, index, lossy, earlier, decision.result_id, decision.text,
                     [[s.component, s.lossy, s.tokens_before, s.tokens_after] for s in decision.steps],
                     decision.ran, decision.reverted])
    return ujson.dumps({"format": FORMAT, "code": code, "configs": written, "decisions": rows},
                       ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")


def restore(memo: Memo, data: bytes, code: str) -> int:
    """Put the snapshot's decisions in the memo (its budget still bounds it): how many it read.

    0 for a snapshot of other code or another format; ValueError when it is not a snapshot.
    """
    try:
        doc = ujson.loads(data)
        if doc.get("format") != FORMAT or doc.get("code") != code:
            return 0
        configs = [_config(fields) for fields in doc["configs"]]
        entries = list(_entries(doc["decisions"], configs))
    except (KeyError, TypeError, AttributeError, IndexError) as error:
        raise ValueError(f"not a memo snapshot: {error!r}") from error
    for key, decision in entries:
        memo.decisions.put(key, decision, _DECISION_CHARS + len(decision.text or ""))
    return len(entries)


def _entries(rows: Iterable[list[Any]], configs: list[CompactConfig | None]) -> Iterable[tuple[_DecisionKey, _Decision]]:
    for digest, tool_name, index, lossy, earlier, result_id, text, steps, ran, reverted in rows:
        config = configs[index]
        if config is None:
            continue  # written by a cg with a component this one does not have
        key: _DecisionKey = (bytes.fromhex(digest), tool_name, config, bool(lossy), bool(earlier))
        yield key, _Decision(result_id, text, tuple(_Step(c, bool(lo), int(b), int(a)) for c, lo, b, a in steps),
                             tuple(ran), tuple(reverted))


def _config_fields(config: CompactConfig) -> dict[str, Any] | None:
    """What `_config` makes the same config of again; None when names cannot (a component of a
    test's own, say): its decisions are then not written."""
    fields = {name: getattr(config, name) for name in _FIELDS}
    fields["keep_tools"] = sorted(config.keep_tools)
    fields["components"] = [component.name for component in config.components]
    return fields if _config(fields) == config else None


def _config(fields: dict[str, Any]) -> CompactConfig | None:
    if any(name not in _BY_NAME for name in fields["components"]):
        return None
    given = {name: fields[name] for name in _FIELDS}
    return CompactConfig(components=tuple(_BY_NAME[name] for name in fields["components"]), **given)
