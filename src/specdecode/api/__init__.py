"""The Python API: ``SpecDecoder.from_pretrained(target, draft).generate(prompt, params)``.

``decoder.py``: ``SpecDecoder`` (loading, ``generate``/``stream``, planning); ``batching.py``: its
batch engine and ``generate_batch``; ``probes.py``: the logits, drafts and pass traces the
audit and the bench read."""

from __future__ import annotations

from specdecode.api.decoder import SpecDecoder

__all__ = ["SpecDecoder"]
