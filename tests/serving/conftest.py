"""Servers over the tiny models, as `specdecode serve` runs them: every request decoded by the
batch worker's engine."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from helpers import decoder
from server_helpers import MODEL, running_server

from specdecode import SpecDecoder
from specdecode.serving.server import ServerOptions, create_app
from specdecode.serving.worker import BatchWorker


@pytest.fixture(scope="module")
def tiny_decoder(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


@pytest.fixture(scope="module")
def start_server(tiny_decoder: SpecDecoder) -> Callable[..., AbstractContextManager[tuple[str, object]]]:
    """``with start_server(options, max_batch=4) as (base_url, state):`` a fresh server (its own
    batch engine and worker) over the shared tiny decoder; ``max_batch=1``: one request at a time
    (``specdecode serve --max-batch 1``)."""

    @contextmanager
    def start(options: ServerOptions | None = None, max_batch: int = 4) -> Iterator[tuple[str, object]]:
        worker = BatchWorker(tiny_decoder.batch_engine(max_batch=max_batch, kv_cache_tokens=1024, cost_aware=False))
        app = create_app(tiny_decoder, MODEL, worker=worker, options=options)
        try:
            with running_server(app) as base:
                yield base, app.state.specdecode
        finally:
            worker.close()

    return start


@pytest.fixture(scope="module")
def served(start_server, tiny_decoder: SpecDecoder) -> Iterator[tuple[str, SpecDecoder]]:
    with start_server() as (base, _):
        yield base, tiny_decoder
