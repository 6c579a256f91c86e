"""specdecode: lossless speculative decoding for Llama-family models.

    from specdecode import SpecDecoder, SamplingParams
    decoder = SpecDecoder.from_pretrained()  # the demo pair, or (target, draft) names
    result = decoder.generate("Write a quicksort in Python", SamplingParams(max_new_tokens=64), chat=True)
    print(result.text, result.stats.tau)
"""

from specdecode.api import SpecDecoder
from specdecode.config import DecoderConfig, SamplingParams, SchedulerConfig, StructuredOutput
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.stream import GenerationResult, GenerationStream
from specdecode.errors import SpecDecodeError

__all__ = [
    "DecoderConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "SamplingParams",
    "SchedulerConfig",
    "SpecDecodeError",
    "SpecDecoder",
    "StructuredOutput",
]
__version__ = "0.1.0"
