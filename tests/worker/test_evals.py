"""The eval runner (fusetune/worker/evals.py) on a fake engine that answers each prompt from a table, with the
runs in SQL: the counts, the per-criterion results and the output items; an item the engine refuses or whose
prompt cannot be rendered is errored, not the run; a run not queued is left alone; a run whose worker stopped beating is requeued, then failed after max_attempts."""

from __future__ import annotations

from types import SimpleNamespace

from fusetune.capacity import workers_alive_since
from fusetune.config import Settings
from fusetune.db import queries
from fusetune.db.migrate import upgrade
from fusetune.db.models import Eval, EvalRun, EvalRunOutputItem, Worker
from fusetune.db.session import make_engine, make_session_factory
from fusetune.serving.errors import ServingError
from fusetune.spec.evals import DEFAULT_SEED
from fusetune.worker.evals import EvalRunner, reap_lost_eval_runs

ANSWERS = {"one two": "12", "three four": "35", "five six": "56"}


class FakeEngine:
    """Answers a prompt from ANSWERS at once (in the caller's thread); refuses a prompt it has no answer for."""

    device = SimpleNamespace(type="cpu")

    def __init__(self):
        self.bodies = []

    def submit(self, key, load, body, emit):
        self.bodies.append(body)
        prompt = body.messages[-1].content
        if prompt not in ANSWERS:
            raise ServingError(400, f"The messages are too long for {key}.", "messages")
        emit(("delta", 0, ANSWERS[prompt]))
        emit(("finish", 0, "stop"))
        emit(("usage", 3, 2))
        return SimpleNamespace(cancelled=SimpleNamespace(set=lambda: None))

    def load_model(self, location, bases):
        raise AssertionError("the fake engine loads nothing")


def _runner(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    settings.ensure_dirs()
    upgrade(settings.database_url)
    session_factory = make_session_factory(make_engine(settings.database_url))
    locations = SimpleNamespace(location_of=lambda model, tenant: f"/models/{model}",
                                adapter_base_models=lambda tenant, location: {})  # fmt: skip
    engine = FakeEngine()
    runner = EvalRunner(settings, session_factory, None, locations, "test-worker", lambda: engine)
    return runner, session_factory, engine


def _run(session_factory, items, criteria, template="{{ item.question }}", sampling=None) -> str:
    with session_factory() as session:
        evaluation = Eval(tenant="default", name="e", data_source_config={}, testing_criteria=criteria)
        session.add(evaluation)
        session.flush()
        data_source = {
            "type": "completions",
            "model": "tiny",
            "source": {"type": "file_content", "content": [{"item": item} for item in items]},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": template}]},
            "sampling_params": sampling or {"temperature": 0, "max_completion_tokens": 4, "seed": 3},
        }
        run = EvalRun(
            eval_id=evaluation.id, tenant="default", model="tiny", status="queued", data_source=data_source
        )
        session.add(run)
        session.commit()
        return run.id


EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}  # fmt: skip
CONTAINS = {"type": "string_check", "name": "has a 5", "input": "{{ sample.output_text }}", "reference": "5",
            "operation": "like"}  # fmt: skip


def test_a_run_counts_items_and_criteria_and_writes_every_output_item(tmp_path):
    runner, session_factory, engine = _runner(tmp_path)
    items = [
        {"question": "one two", "answer": "12"},  # exact, no 5
        {"question": "three four", "answer": "34"},  # neither... has a 5: "35"
        {"question": "five six", "answer": "56"},  # both
        {"question": "seven eight", "answer": "78"},  # the engine refuses it: errored
        {"answer": "90"},  # no question to render: errored
    ]
    run_id = _run(session_factory, items, [EXACT, CONTAINS])
    assert runner.run(run_id) == "completed"
    assert runner.run(run_id) == "skipped"  # a redelivered message
    with session_factory() as session:
        run = session.get(EvalRun, run_id)
        assert run.status == "completed" and run.error is None
        assert run.result_counts == {"total": 5, "passed": 1, "failed": 2, "errored": 2}
        assert run.per_testing_criteria_results == [
            {"testing_criteria": "exact", "passed": 2, "failed": 1},
            {"testing_criteria": "has a 5", "passed": 2, "failed": 1},
        ]
        assert run.per_model_usage[0]["invocation_count"] == 3
        outputs, _ = queries.page_output_items(
            session, run_id, status=None, after=None, limit=10, order="asc"
        )
    assert [o.status for o in outputs] == ["fail", "fail", "pass", "error", "error"]
    assert [[r["passed"] for r in o.results] for o in outputs[:3]] == [
        [True, False],
        [False, True],
        [True, True],
    ]
    assert outputs[1].sample["output"] == [{"role": "assistant", "content": "35"}]
    assert outputs[1].sample["input"] == [{"role": "user", "content": "three four"}]
    assert "too long" in outputs[3].sample["error"]["message"]
    assert "question" in outputs[4].sample["error"]["message"] and outputs[4].results == []
    assert {(b.temperature, b.max_completion_tokens, b.seed) for b in engine.bodies} == {(0, 4, 3)}


def test_a_canceled_run_is_not_run(tmp_path):
    runner, session_factory, engine = _runner(tmp_path)
    run_id = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    with session_factory() as session:
        queries.cancel_eval_run(session, session.get(EvalRun, run_id))
        session.commit()
    assert runner.run(run_id) == "skipped"
    assert engine.bodies == []


def test_a_model_the_worker_cannot_find_fails_the_run_naming_it(tmp_path):
    runner, session_factory, _ = _runner(tmp_path)
    runner.locations = SimpleNamespace(location_of=lambda model, tenant: None)
    run_id = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    assert runner.run(run_id) == "failed"
    with session_factory() as session:
        run = session.get(EvalRun, run_id)
        assert run.status == "failed" and run.error["code"] == "model_not_found"
        assert "tiny" in run.error["message"]


def test_a_run_without_a_seed_draws_with_the_default_one_and_reports_it(tmp_path):
    """OpenAI's output item reports the sample's seed as an integer: a run whose sampling_params give none draws
    with DEFAULT_SEED (OpenAI's default), and says so."""
    runner, session_factory, engine = _runner(tmp_path)
    run_id = _run(
        session_factory, [{"question": "one two", "answer": "12"}], [EXACT], sampling={"temperature": 1}
    )
    assert runner.run(run_id) == "completed"
    with session_factory() as session:
        (output,), _ = queries.page_output_items(
            session, run_id, status=None, after=None, limit=10, order="asc"
        )
    assert [body.seed for body in engine.bodies] == [DEFAULT_SEED] and output.sample["seed"] == DEFAULT_SEED


def _claimed_by_a_worker_that_stopped_beating(session_factory, settings, run_id: str, worker: str) -> None:
    """The run in progress on `worker`, whose heartbeat row (and the claim) are older than the window in which a
    worker counts as alive: the rows a dead worker leaves, written as they would be that long after."""
    long_ago = workers_alive_since(settings) - 1
    with session_factory() as session:
        assert queries.claim_eval_run(session, run_id, worker) is not None
        queries.record_worker(session, worker, 1)
        session.flush()
        session.get(Worker, worker).heartbeat_at = long_ago
        session.get(EvalRun, run_id).started_at = long_ago
        session.commit()


def test_a_run_whose_worker_died_is_requeued_then_failed_after_max_attempts(tmp_path):
    runner, session_factory, _ = _runner(tmp_path)
    settings = runner.settings
    assert settings.max_attempts == 3
    lost = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    alive = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    recent = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    _claimed_by_a_worker_that_stopped_beating(session_factory, settings, lost, "dead-worker")
    with session_factory() as session:
        # A run on a worker that beats, and one claimed just now by a worker with no row yet: both are left.
        queries.claim_eval_run(session, alive, "live-worker")
        queries.record_worker(session, "live-worker", 1)
        session.get(EvalRun, alive).started_at = workers_alive_since(settings) - 1
        queries.claim_eval_run(session, recent, "new-worker")
        # What the dead attempt wrote before it could record the run's end.
        session.add(EvalRunOutputItem(run_id=lost, datasource_item_id=0, status="pass"))
        session.commit()
    messages = []
    assert reap_lost_eval_runs(settings, session_factory, messages.append) == [lost] and messages == [lost]
    with session_factory() as session:
        run = session.get(EvalRun, lost)
        assert (run.status, run.worker, run.attempts) == ("queued", None, 1)
        assert (
            queries.page_output_items(session, lost, status=None, after=None, limit=10, order="asc")[0] == []
        )
        assert session.get(EvalRun, alive).status == session.get(EvalRun, recent).status == "in_progress"
    assert reap_lost_eval_runs(settings, session_factory, messages.append) == []  # nothing lost now
    # The dead worker, had it only frozen, cannot end the run it no longer holds.
    with session_factory() as session:
        assert not queries.finish_eval_run(session, lost, "completed", "dead-worker")
    # Two more workers claim it and die: the third loss fails it, naming the cause.
    for attempt in (2, 3):
        _claimed_by_a_worker_that_stopped_beating(session_factory, settings, lost, f"dead-worker-{attempt}")
        requeued = reap_lost_eval_runs(settings, session_factory, messages.append)
        assert requeued == ([lost] if attempt < settings.max_attempts else [])
    with session_factory() as session:
        run = session.get(EvalRun, lost)
        assert run.status == "failed" and run.attempts == 3 and run.finished_at is not None
        assert run.error["code"] == "worker_lost" and "dead-worker-3" in run.error["message"]
    assert messages == [lost, lost]
    assert runner.run(alive) == "skipped"  # in progress on another worker: not this one's to run


def test_a_requeued_run_runs_again_and_writes_its_items_once(tmp_path):
    runner, session_factory, engine = _runner(tmp_path)
    run_id = _run(session_factory, [{"question": "one two", "answer": "12"}], [EXACT])
    _claimed_by_a_worker_that_stopped_beating(session_factory, runner.settings, run_id, "dead-worker")
    assert reap_lost_eval_runs(runner.settings, session_factory, lambda _: None) == [run_id]
    assert runner.run(run_id) == "completed"
    with session_factory() as session:
        run = session.get(EvalRun, run_id)
        assert run.result_counts["passed"] == 1 and run.attempts == 2 and run.worker == "test-worker"
        items, _ = queries.page_output_items(session, run_id, status=None, after=None, limit=10, order="asc")
    assert len(items) == 1
