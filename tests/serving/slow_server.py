"""`specdecode serve` over the tiny models with every batched step slowed and end-of-sequence
tokens ignored, for the shutdown test (test_shutdown.py): a request runs exactly max_tokens steps,
so a long one outlasts the drain. It runs ``serving.server.serve``, so the
signal handling is the real one.

    python slow_server.py TARGET_DIR DRAFT_DIR PORT DRAIN_SECONDS STEP_SECONDS
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specdecode import SpecDecoder
from specdecode.engine import batch
from specdecode.serving.server import ServerOptions, serve
from specdecode.serving.worker import BatchWorker


def main() -> None:
    target, draft, port, drain_seconds, step_seconds = sys.argv[1:6]
    real_verify = batch.BatchEngine._verify

    def slow_verify(self: batch.BatchEngine, running: list, proposals: list) -> list[list[int]]:
        time.sleep(float(step_seconds))
        return real_verify(self, running, proposals)

    batch.BatchEngine._verify = slow_verify
    real_cut = batch.cut_at_stop
    batch.cut_at_stop = lambda row, remaining, eos_ids, ignore_eos: real_cut(row, remaining, eos_ids, True)
    dec = SpecDecoder.from_pretrained(target, draft, draft_confidence=0.0, dtype="fp32", device="cpu",
                                      show_progress=False)
    worker = BatchWorker(dec.batch_engine(max_batch=4, kv_cache_tokens=1024, cost_aware=False))
    serve(dec, "tiny", "127.0.0.1", int(port), worker, log_level="warning",
          options=ServerOptions(drain_timeout=float(drain_seconds)))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # uvicorn re-raises a SIGINT it handled once it has shut down; as the CLI does
        sys.exit(130)
