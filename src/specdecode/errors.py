"""User-facing errors.

Every error a user can cause by what they pass (a model path, a parameter, a prompt) is a
``SpecDecodeError``: the CLI prints its message and exits with a non-zero status instead of
a traceback. Messages say what was wrong and what to do about it.

Library messages speak of parameters as a Python call names them: ``backend="torch"``,
``k_max=40``, ``heads=FOLDER`` (an upper-case placeholder) or ``draft=`` alone. A front end
rewords them in its own terms with ``reword_params``: the CLI as its flags (``--backend
torch``, ``cli/args.py``), the server as its request fields and flags (``serving/protocol.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

# name=value: a quoted string, or a bare word, number or placeholder (possibly empty; a
# sentence's closing period is not part of it).
PARAM = re.compile(r"""(?<![\w.=-])([a-z][a-z0-9_]*)=("[^"]*"|'[^']*'|[\w+-]*(?:\.[\w+-]+)*)""")


class SpecDecodeError(Exception):
    """Base class for errors caused by user input; the message is shown as is."""


class ModelLoadError(SpecDecodeError):
    """A model could not be found, read or understood."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture (or a tensor type in it) is not one specdecode implements."""


class DemoModelsNotInstalledError(ModelLoadError):
    """The embedded demo models were asked for but the ``demo`` extra is not installed."""


class TokenizerMismatchError(SpecDecodeError):
    """Target and draft models do not share a tokenizer."""


class InvalidRequestError(SpecDecodeError):
    """Bad sampling parameters, draft length, or a prompt that does not fit the context."""


def reword_params(message: str, reword: Callable[[str, str], str | None]) -> str:
    """``message`` with each ``name=value`` replaced by ``reword(name, value)`` (the value
    unquoted, "" when none is given); where ``reword`` returns None the text stays."""

    def replace(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if value[:1] in ("'", '"'):
            value = value[1:-1]
        worded = reword(name, value)
        return match.group(0) if worded is None else worded

    return PARAM.sub(replace, message)
