"""Text that came from outside (an HTTP body, a task message, argv) and must be real text.

Python strings can hold lone surrogates: argv bytes that are not UTF-8 arrive that way
(surrogateescape), and JSON may escape half a UTF-16 pair ("\\ud800"). Neither encodes to
UTF-8, so each would fail later and half-way: in a tokenizer, a task message, a database
row. Callers check at the door instead.
"""

from __future__ import annotations

import re


def not_text_at(value, where: str = "") -> str | None:
    """The path ("messages.0.content") of the first string in a decoded JSON value that is
    not encodable text, or None when all are."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and not_text_at(key) is not None:
            return where or "a key"
        found = not_text_at(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def safe_name(name: str) -> str:
    """`name` (a worker's nodename, say "gpu0@node-3") with every character but
    [A-Za-z0-9._-] as '_': what a queue name, a file name and the filesystem broker allow."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def shown(value, limit: int = 60) -> str:
    """`value` as an error message quotes it: its repr, cut to `limit` characters, so a huge
    or hostile value makes one short line, never a copy of itself."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
