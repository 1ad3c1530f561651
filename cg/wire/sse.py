"""An incremental Server-Sent Events parser that keeps every event's original bytes.

cg forwards streams byte for byte: it must know where each event ends (to forward it the moment it
is complete, or hold it) without ever re-serializing it. ``SSEParser`` is fed the upstream's chunks
as they arrive, cut anywhere (mid-line, mid UTF-8 character, between the ``\\r`` and ``\\n`` of a
CRLF), and returns the events each chunk completes. Pure code: bytes in, ``Event`` objects out.

The grammar is the WHATWG one (``text/event-stream``):

- Lines end with CRLF, LF or a lone CR, mixed freely. A blank line ends a *block*.
- ``field: value`` lines; one space after the colon is stripped (once); a line without a colon is a
  field with an empty value (``data`` alone appends an empty data line). ``data`` lines are joined
  with ``\\n``; ``event`` sets the name (last one wins); ``id``, ``retry`` and unknown fields are
  ignored (kept in ``raw``, like everything else). A UTF-8 BOM opening the stream is ignored.
- Lines starting with ``:`` are comments. A comment belongs to the block it is in — the one the
  next blank line ends — so it lands in the ``raw`` of the event it precedes (or of its own
  comment-only block). It never changes ``name`` or ``data``.

Where cg differs from a browser, because it must account for every byte: **every** blank-line
terminated block is an ``Event``, including blocks a browser would not dispatch — a comment-only
keep-alive (``: ping\\n\\n``) and a stray blank line (raw ``b"\\n"``) both come out as
``Event(name=None, data=b"")``. Concatenating the ``raw`` of all events, in order, and then
``close()``'s tail gives back the input exactly, however it was chunked.

The lone-CR corner: when the bytes so far end with ``\\r``, the line is over but its terminator may
still be CRLF. The parser waits for the next byte before it ends an event there (so an event's
``raw`` never depends on where a chunk was cut). Real streams use LF or CRLF, so this only ever
delays a CRLF event until its ``\\n`` arrives; a stream that really uses bare CR can call
``flush()`` at end of input to get its last event.

Cost: each input byte is searched for line terminators at most once (``_nl``/``_cr`` remember where
the last search stopped), consumed bytes are dropped once per ``feed``, so a chunk costs
O(len(chunk)) amortised however large the pending event grows. ``scanned`` counts the bytes searched,
for tests that check it.
"""

from __future__ import annotations

import attrs
import ujson

__all__ = ["Event", "SSEParser"]

_UNPARSED = object()
_BOM = b"\xef\xbb\xbf"
_CR = 13
_LF = 10
_COLON = 58
_SPACE = 32


@attrs.frozen(slots=True)
class Event:
    """One SSE block, as it was on the wire.

    ``raw``: the exact bytes, from the block's first line through its terminating blank line
    (comments and ignored fields included). ``name``: the ``event:`` field (``None`` without one).
    ``data``: the data lines joined with ``\\n`` (``b""`` without any).
    """

    raw: bytes
    name: str | None = None
    data: bytes = b""
    _parsed: object = attrs.field(default=_UNPARSED, init=False, eq=False, hash=False, repr=False)

    def json(self) -> object:
        """``data`` parsed as JSON (parsed once, then cached). Raises ValueError on bad JSON.

        Typed ``object``: the upstream may send any JSON value, so callers check what they got.
        """
        parsed = self._parsed
        if parsed is _UNPARSED:
            try:
                parsed = ujson.loads(self.data)
            except (ValueError, TypeError, OverflowError) as err:
                parsed = ValueError(f"event data is not JSON: {err}")
            object.__setattr__(self, "_parsed", parsed)
        if isinstance(parsed, ValueError):
            raise ValueError(*parsed.args)
        return parsed


class SSEParser:
    """Feed chunks in, get complete ``Event`` objects out. See the module docstring."""

    def __init__(self) -> None:
        self._buf = bytearray()  # the bytes of the event in progress, from its first byte
        self._pos = 0  # start of the first line not parsed yet
        # Next known "\n" / "\r" at or after _pos, or (when < _pos) none in [_pos, _*_from).
        self._nl = -1
        self._nl_from = 0
        self._cr = -1
        self._cr_from = 0
        self._name: str | None = None
        self._data: list[bytes] = []
        self._first_line = True  # a BOM may open the stream's first line
        self._closed = False
        self.scanned = 0  # bytes searched for line terminators, over the parser's life

    @property
    def buffered(self) -> int:
        """Bytes held for the event in progress (what ``close()`` would return now)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that ``chunk`` completes, in order (often none, sometimes many)."""
        if self._closed:
            raise ValueError("feed() after close()")
        if not chunk:
            return []
        if not self._buf and not self._first_line and b"\r" not in chunk:
            return self._feed_lf(chunk)
        self._buf += chunk
        if self._nl < self._pos and self._cr < self._pos and b"\n" not in chunk and b"\r" not in chunk:
            # No line ending pending or arriving (the common case for a long line trickling in):
            # nothing completes, and the chunk has now been searched.
            self._nl_from = self._cr_from = len(self._buf)
            self.scanned += 2 * len(chunk)
            return []
        return self._parse(final=False)

    def _feed_lf(self, chunk: bytes) -> list[Event]:
        """The common case, fast: a chunk that starts on an event boundary and has no CR.

        Whole events are cut at blank lines with bytes.find and split into lines once; the
        bytes after the last complete event go through the general parser.
        """
        events: list[Event] = []
        start = 0
        n = len(chunk)
        while start < n:
            if chunk[start] == _LF:  # a blank line on its own: an empty block
                events.append(Event(chunk[start:start + 1]))
                start += 1
                continue
            end = chunk.find(b"\n\n", start)
            if end < 0:
                break
            name = None
            data: list[bytes] = []
            for line in chunk[start:end].split(b"\n"):
                if not line or line[0] == _COLON:
                    continue
                field, colon, value = line.partition(b":")
                if colon and value[:1] == b" ":
                    value = value[1:]
                if field == b"data":
                    data.append(value)
                elif field == b"event":
                    name = value.decode("utf-8", "replace")
            events.append(Event(chunk[start:end + 2], name, data[0] if len(data) == 1 else b"\n".join(data)))
            start = end + 2
        self.scanned += n
        if start < n:
            self._buf += chunk[start:]
            self._pos = self._nl_from = self._cr_from = 0
            self._nl = self._cr = -1
            events += self._parse(final=False)
        return events

    def flush(self) -> list[Event]:
        """At end of input: the event held only because its last byte was a CR (see above)."""
        if self._closed:
            return []
        return self._parse(final=True)

    def close(self) -> bytes:
        """End of stream: the bytes of the incomplete event, verbatim (``b""`` if none)."""
        tail = bytes(self._buf)
        self._buf = bytearray()
        self._pos = 0
        self._nl = self._cr = -1
        self._nl_from = self._cr_from = 0
        self._name = None
        self._data = []
        self._closed = True
        return tail

    def _parse(self, final: bool) -> list[Event]:
        buf = self._buf
        n = len(buf)
        pos = self._pos
        start = 0  # first byte of the event in progress
        nl, cr = self._nl, self._cr
        events: list[Event] = []
        while True:
            if nl < pos:
                frm = self._nl_from if self._nl_from > pos else pos
                nl = buf.find(b"\n", frm)
                self._nl_from = n if nl < 0 else nl
                self.scanned += self._nl_from - frm
            if cr < pos:
                frm = self._cr_from if self._cr_from > pos else pos
                cr = buf.find(b"\r", frm)
                self._cr_from = n if cr < 0 else cr
                self.scanned += self._cr_from - frm
            if cr < 0 or (0 <= nl < cr):
                if nl < 0:
                    break
                eol = nl
                nxt = nl + 1
            else:
                eol = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1] == _LF else cr + 1
                elif final:
                    nxt = cr + 1
                else:
                    break  # is it CR or CRLF? wait for the next byte
            lstart = pos
            if self._first_line:  # a BOM opening the stream is not part of the line
                self._first_line = False
                if buf.startswith(_BOM, pos, eol):
                    lstart += len(_BOM)
            if eol == lstart:  # a blank line: the block is complete
                data = self._data
                events.append(
                    Event(
                        bytes(buf[start:nxt]),
                        self._name,
                        data[0] if len(data) == 1 else b"\n".join(data),
                    )
                )
                self._name = None
                self._data = []
                start = nxt
            else:
                self._field(buf, lstart, eol)
            pos = nxt
        if start:  # drop the completed events' bytes; shift every position with them
            del buf[:start]
            nl = nl - start if nl >= pos else -1
            cr = cr - start if cr >= pos else -1
            pos -= start
            self._nl_from = max(self._nl_from - start, 0)
            self._cr_from = max(self._cr_from - start, 0)
        self._pos = pos
        self._nl = nl
        self._cr = cr
        return events

    def _field(self, buf: bytearray, pos: int, eol: int) -> None:
        if buf[pos] == _COLON:
            return  # a comment
        colon = buf.find(b":", pos, eol)
        if colon < 0:
            field = buf[pos:eol]
            value = b""
        else:
            field = buf[pos:colon]
            vstart = colon + 1
            if vstart < eol and buf[vstart] == _SPACE:
                vstart += 1
            value = bytes(buf[vstart:eol])
        if field == b"data":
            self._data.append(value)
        elif field == b"event":
            self._name = value.decode("utf-8", "replace")
