"""Text a request may not hold: strings that UTF-8 cannot encode (a lone surrogate, which JSON's
``\\ud800`` escape decodes to), found anywhere in a decoded body and named by their path."""

from __future__ import annotations

import json
import re
from typing import Any

from specdecode.serving.api_errors import APIError

# A key a path names with a dot (``tools[0].function.name``); any other key is quoted in brackets.
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _segment(key: str) -> str:
    if _PLAIN_KEY.match(key):
        return f".{key}"
    return f"[{json.dumps(key, ensure_ascii=True)}]"  # escaped: the key may be the bad string itself


WELL_FORMED = "send well-formed UTF-8 text (a character past U+FFFF escaped as a surrogate pair, or as itself)."
# A place in a request: (parent node, its path segment such as ".name" or "[0]", top-level key).
_PathNode = tuple[Any, str, str | None]


def _path(node: _PathNode) -> str:
    segments = []
    while node is not None:
        node, segment, _ = node
        segments.append(segment)
    return "".join(reversed(segments)).lstrip(".")


def _where(node: _PathNode) -> str:
    path = _path(node)
    return f"'{path}'" if path else "the request body"


def _unencodable_at(text: str) -> int | None:
    """The index of ``text``'s first character that UTF-8 cannot encode (a lone surrogate), or None."""
    if text.isascii():  # the common case, without encoding a copy of a long prompt
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def check_unicode(value: Any, root: str = "", param: str | None = None) -> None:
    """Refuse (400) the first string in ``value``, a decoded JSON value, that UTF-8 cannot
    encode: dict keys and strings at any depth, named by their path (``tools[0].function.
    description``) and the character's index. JSON's ``\\ud800`` escape decodes to a lone
    surrogate, which no tokenizer, chat template or response encoder accepts; walking the whole
    body rather than the fields the server reads today covers fields added later too. Refused,
    not replaced: a lossless server does not change the user's text.

    ``root``: the path of ``value`` in the request (JSON the server decodes out of a request's
    string, such as a tool call's ``arguments``, goes through here again). ``param``: the field
    to name in the error (default: the top-level key the string is under)."""
    # Iterative, not recursive: a body may be nested as deep as the JSON parser allows. A node is
    # (parent node, path segment, top-level key), so a path is built only for a string that fails.
    stack: list[tuple[Any, _PathNode]] = [(value, (None, root, param))]
    while stack:
        item, node = stack.pop()
        if isinstance(item, str):
            at = _unencodable_at(item)
            if at is not None:
                where = _where(node)
                raise APIError(400, f"{where[:1].upper() + where[1:]} holds invalid Unicode (a lone surrogate at "
                                    f"character {at}); {WELL_FORMED}", node[2])
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                # The body's own keys are the fields an error names (escaped, as in any message).
                top = node[2] if node[2] is not None else json.dumps(key)[1:-1]
                at = _unencodable_at(key)
                if at is not None:
                    raise APIError(400, f"A key in {_where(node)} ({json.dumps(key)}) holds invalid Unicode (a lone "
                                        f"surrogate at character {at}); {WELL_FORMED}", top)
                if isinstance(child, str | dict | list):
                    children.append((child, (node, _segment(key), top)))
            stack.extend(reversed(children))  # reversed: the first field is checked first
        elif isinstance(item, list):
            stack.extend((child, (node, f"[{i}]", node[2])) for i, child in reversed(list(enumerate(item)))
                         if isinstance(child, str | dict | list))
