"""The text of a config or policy file made into a TOML document, or one line saying why not.

Before any key is read (:mod:`gpushare_ext.broker.settings.schema` does that), the bytes must be
UTF-8 text without NUL bytes, valid TOML, and nested no deeper than any real config
goes: a file of thousands of nested arrays would otherwise end the broker (or a
``set_policy`` request) in a ``RecursionError`` rather than in an ``invalid`` line.
This module reads no file and knows no key.
"""

from __future__ import annotations

import sys

from gpushare_ext.broker.settings.schema import PolicyError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


#: How deep tables and arrays may nest in the file.  The deepest a valid file goes is
#: four ([users.NAME] with a key holding an array); the cap keeps every reader of the
#: document (and of a refusal that shows a value) far from Python's recursion limit.
MAX_NESTING = 16


def parse_document(data: str | bytes, source: str) -> dict[str, object]:
    """The TOML document in ``data``; PolicyError (one line) if it is not UTF-8 text, not
    TOML, or nests deeper than :data:`MAX_NESTING`."""
    text = _text_of(data, source)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source} is not valid TOML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        # The parser recurses once per nesting level; far past any config's depth.
        raise PolicyError(_too_deep(source)) from None
    if _nesting(document) > MAX_NESTING:
        raise PolicyError(_too_deep(source))
    return document


def _too_deep(source: str) -> str:
    return f"{source} nests tables or arrays more than {MAX_NESTING} levels deep"


def _text_of(data: str | bytes, source: str) -> str:
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(
                f"{source} is not a text file (byte {exc.start} is not UTF-8)"
            ) from None
    # tomllib would name the NUL as an invalid character; a file with one is not a
    # config file that got a typo but something else put in its place.
    if "\0" in data:
        raise PolicyError(f"{source} is not a text file (it holds NUL bytes)")
    return data


def _nesting(document: object) -> int:
    """How deep lists and tables nest in ``document`` (a scalar: 0), found without
    recursion, stopping once past :data:`MAX_NESTING`."""
    deepest = 0
    pending: list[tuple[object, int]] = [(document, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            children: list[object] | object = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            return deepest
        pending.extend((child, depth) for child in children)  # type: ignore[union-attr]
    return deepest
