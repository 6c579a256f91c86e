"""User-facing errors.

Every error a user can cause by what they pass (a model path, a flag, a prompt) is a
``SpecDecodeError``: the CLI prints its message and exits with a non-zero status instead of
a traceback. Messages say what was wrong and what to do about it.
"""


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
