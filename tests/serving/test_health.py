"""GET /health reflects the engine (serving/health.py): a dead batch worker, or a run of steps
that fail as a whole, turns it into a 503 that says why (Ray Serve's replica health check reads
the same, tests/serving/test_ray.py)."""

import httpx
from server_helpers import MODEL, PROMPT, client, wait_for

from specdecode.serving.health import FAILED_STEPS_UNHEALTHY, engine_problem


def test_health_is_ok_while_the_engine_serves(start_server) -> None:
    with start_server() as (base, state):
        assert engine_problem(state.worker) is None
        assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_a_stopped_worker_makes_health_a_503(start_server) -> None:
    with start_server() as (base, state):
        state.worker.close()
        response = httpx.get(base + "/health")
        assert response.status_code == 503
        assert response.json()["status"] == "unhealthy" and "worker thread has stopped" in response.json()["reason"]


def test_steps_that_keep_failing_make_health_a_503_and_a_good_step_clears_it(start_server, monkeypatch) -> None:
    with start_server() as (base, state):
        engine = state.worker.engine
        real_step = engine.step

        def broken_step():
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine, "step", broken_step)
        for _ in range(FAILED_STEPS_UNHEALTHY):
            # Each request fails with the step (a 500), and each failed step counts.
            response = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert response.status_code == 500
        wait_for(lambda: httpx.get(base + "/health").status_code == 503, "health stayed ok")
        assert "steps failed" in httpx.get(base + "/health").json()["reason"]
        monkeypatch.setattr(engine, "step", real_step)
        client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_no_worker_is_no_problem() -> None:
    assert engine_problem(None) is None
