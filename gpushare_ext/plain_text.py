"""Text that a session or a user wrote, made fit to show to someone else: one rule.

What it is for: a lease's label (a cell's first line), a notebook's name, a user's name
and the note a session writes into its control block reach other people: in
``gpushare status`` (root's too), in ``%gpu status``, in the notebook widget, in the
JupyterLab panel and in the broker's log.  Such text is data.  :func:`plain_text` turns
it into one line of characters that each show as themselves:

* a line feed becomes "␤", a carriage return "␍", a tab "␉", and every other C0
  control character and DEL its Unicode control picture (escape "␛", NUL "␀",
  DEL "␡"), so an escape sequence shows as "␛[2J" and clears nothing;
* every other character that is not shown as itself becomes its code point in angle
  brackets, e.g. "<U+202E>": the C1 controls (U+0080 to U+009F), the format characters
  (Unicode category Cf: the bidi controls U+202A to U+202E, U+2066 to U+2069, U+200E,
  U+200F and U+061C, zero-width characters, tag characters), the line and paragraph
  separators (U+2028, U+2029) and lone surrogates;
* the result has at most ``limit`` characters (:data:`TEXT_LIMIT` unless the caller
  says more); a longer one ends in "…", and a stand-in is never cut in two.

Everything else, "[", "]" and "<" included, stays as it is.  Markup is not a matter of
characters: every viewer shows this text *as text*, never parses it (rich's ``Text`` in
``status_view``, ``textContent`` in ``occupancy.js``).  Applying the rule again, with the
same limit or a larger one, changes nothing, so the broker applies it where text enters
a snapshot and a viewer may apply it again to a snapshot from any broker.

What it must not do: import anything of gpushare (it is the ground floor), drop a
character without a trace, or decide who may see what (``broker/edges/views.py`` does).
"""

from __future__ import annotations

import unicodedata

__all__ = ["ELLIPSIS", "SENTENCE_LIMIT", "TEXT_LIMIT", "plain_text"]

#: The most characters of one field someone wrote (a label, a notebook or user name, a
#: session's note): what the protocol lets a label carry.
TEXT_LIMIT = 256
#: The most characters of the broker's sentence that quotes someone's text (a reason
#: that ends with what the session says).
SENTENCE_LIMIT = 2 * TEXT_LIMIT
ELLIPSIS = "…"

_DEL = 0x7F
_CONTROL_PICTURES = 0x2400  # U+2400 "␀" is NUL's picture, U+241F that of 0x1F
_DEL_PICTURE = "\u2421"  # "␡"
# A line feed says "new line" to people: the symbol for a newline rather than LF's "␊".
_NEWLINE_PICTURE = "\u2424"  # "␤"
# Unicode categories of characters that do not show as themselves: controls, format
# characters (bidi controls among them), lone surrogates, line and paragraph separators.
_NOT_SHOWN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _stand_in(character: str) -> str:
    """What shows in place of ``character``: itself, or a visible stand-in."""
    code = ord(character)
    if character == "\n":
        return _NEWLINE_PICTURE
    if code < 0x20:
        return chr(_CONTROL_PICTURES + code)
    if code == _DEL:
        return _DEL_PICTURE
    if unicodedata.category(character) in _NOT_SHOWN:
        return f"<U+{code:04X}>"
    return character


def plain_text(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` as one line in which every character shows as itself (the rules above),
    at most ``limit`` characters long (``limit`` is at least 1: the ellipsis)."""
    if len(text) <= limit and text.isprintable():
        return text  # the usual case, at C speed: nothing to replace, nothing to cut
    pieces: list[str] = []
    length = 0
    for character in text:
        piece = _stand_in(character)
        if length + len(piece) > limit:
            while pieces and length + len(ELLIPSIS) > limit:
                length -= len(pieces.pop())
            return "".join(pieces) + ELLIPSIS
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)
