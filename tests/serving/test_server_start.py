"""A worker starts its chat completions server without torch: the engine (torch, transformers) is built at its
first use, so a worker that never serves never imports them in its main process and starts as fast as one
without a server."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, cwd=REPO_ROOT, timeout=300)


def test_the_serving_server_imports_neither_torch_nor_transformers():
    _run("""
        import sys, fusetune.serving.server
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
        assert not loaded, f'{len(loaded)} modules imported: {loaded[:4]}'
    """)


def test_the_worker_process_imports_no_torch_before_it_serves():
    _run("""
        import sys, fusetune.worker.celery_app
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
        assert not loaded, f'{len(loaded)} modules imported: {loaded[:4]}'
    """)


def test_the_engine_is_built_at_its_first_use_paused_when_a_job_trains():
    _run("""
        import sys
        from fusetune.serving.errors import ServingError
        from fusetune.serving.server import LazyEngine
        from fusetune.spec.chat import ChatCompletionCreate

        engine = LazyEngine(idle_s=60, max_batch=4)
        assert engine.loaded_models == []
        engine.pause()  # a job trains: a request is refused as the engine would, without building it
        body = ChatCompletionCreate(model="tiny-llama", messages=[{"role": "user", "content": "hi"}])
        try:
            engine.submit("tiny-llama", lambda: None, body, lambda event: None)
        except ServingError as error:
            assert error.status_code == 503 and error.code == "worker_training", error.message
        else:
            raise AssertionError("a request was taken while a job trains")
        assert "torch" not in sys.modules

        built = engine.get()  # an eval run, say, while the job still trains: the engine it gets is paused
        assert "torch" in sys.modules and built is engine.get()
        try:
            built.submit("tiny-llama", lambda: None, body, lambda event: None)
        except ServingError as error:
            assert error.status_code == 503, error.message
        else:
            raise AssertionError("the engine built during training took a request")
        engine.resume()
        assert not built._paused
        engine.stop()
    """)


def test_a_request_sent_before_the_server_thread_runs_waits_for_it_and_is_answered():
    """The worker advertises the server's URL once it is made; a request that arrives before uvicorn's thread has
    started must wait for it, not be refused (the API skips a refusing worker: a 503 for a server that was up).
    The connection is made, and the request sent, strictly before `start()`."""
    _run("""
        import http.client
        from fusetune.config import Settings
        from fusetune.serving.server import ServingServer

        server = ServingServer(Settings(serving_host="127.0.0.1", serving_port=0), locations=None)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        connection.request("GET", "/healthz")  # refused here unless the socket already listens
        server.start()
        response = connection.getresponse()
        assert response.status == 200, response.status
        server.stop()
    """)
