"""The dashboard's files and routes, and the API filters it reads through (in-process; the browser tests are in
test_dashboard.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from fastapi.testclient import TestClient

from fusetune.api.app import create_app
from fusetune.api.routes.jobs import JobStatusName
from fusetune.api.routes.options import job_options
from fusetune.api.routes.ui import UI_DIR
from fusetune.db import queries
from fusetune.db.models import JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.spec.precision import AUTO

REPO = Path(__file__).resolve().parents[2]
LINE = '{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}\n'


def test_root_and_ui_redirect_to_the_dashboard(settings):
    client = TestClient(create_app(settings))  # no key: the files hold no data
    for path in ("/", "/ui"):
        response = client.get(path, follow_redirects=False)
        assert response.status_code == 307 and response.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert (
        client.get("/ui/js/app.js")
        .headers["content-type"]
        .startswith(("text/javascript", "application/javascript"))
    )
    assert "/ui" not in client.get("/openapi.json").json()["paths"]
    assert 'route="/ui/{path:path}",status="200"' in client.get("/metrics").text


def test_every_file_the_pages_load_exists_and_is_package_data():
    """index.html's scripts and styles and every module import resolve to a file, and the package-data globs in
    pyproject.toml take every dashboard file into the wheel."""
    referenced = {
        UI_DIR / ref for ref in re.findall(r'(?:src|href)="([^"#]+)"', (UI_DIR / "index.html").read_text())
    }
    for module in UI_DIR.glob("js/**/*.js"):
        for ref in re.findall(r'from "(\.[^"]+)"', module.read_text()):
            referenced.add((module.parent / ref).resolve())
    assert referenced and all(path.is_file() for path in referenced), [
        p for p in referenced if not p.is_file()
    ]

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "fusetune"
    ]
    package = REPO / "fusetune"
    packaged = {path for pattern in patterns for path in package.glob(pattern)}
    on_disk = {path for path in UI_DIR.rglob("*") if path.is_file()}
    assert on_disk and on_disk <= packaged, sorted(str(p) for p in on_disk - packaged)
    assert (UI_DIR / "vendor" / "uplot" / "LICENSE").read_text().startswith("The MIT License")


def test_the_new_job_form_copies_nothing_of_the_job_specification():
    """The form's fields, defaults, bounds and choices come from /v1/fine_tuning/options (checked against the spec
    by test_options.py), not from a copy in its scripts: no number or string is written as an input's bound or
    value (but the seed's, a JobCreate field outside the spec), and no method, precision mode or choice is named."""
    script = "\n".join((UI_DIR / "js" / path).read_text() for path in ("views/new_job.js", "fields.js"))
    written = re.compile(r"\b(min|max|value|step)\s*:\s*(\d|\"[^\"])")
    assert [line for line in script.splitlines() if written.search(line) and '"seed"' not in line] == []
    options = job_options()
    every_option = [*options.hyperparameters.values(), *options.hyperparameters["lora"].fields.values()]
    every_option += [option for method in options.methods.values() for option in method.settings.values()]
    named = {
        *options.methods,
        *options.precisions,
        *(c for option in every_option for c in option.choices or ()),
    }
    assert [name for name in named - {AUTO} if f'"{name}"' in script] == []


def test_job_list_filters_by_status_and_model(client, settings):
    (settings.models_dir / "other").mkdir()
    (settings.models_dir / "other" / "config.json").write_text("{}")
    file_id = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE * 4)}, data={"purpose": "fine-tune"}
    ).json()["id"]
    ids = {model: client.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": file_id}).json()["id"]
           for model in ("tiny", "other")}  # fmt: skip
    assert client.post(f"/v1/fine_tuning/jobs/{ids['other']}/cancel").status_code == 200

    def listed(**params) -> list[str]:
        return [job["id"] for job in client.get("/v1/fine_tuning/jobs", params=params).json()["data"]]

    assert listed(status="queued") == [ids["tiny"]] and listed(status="cancelled") == [ids["other"]]
    assert listed(model="other") == [ids["other"]] and listed(model="tiny", status="cancelled") == []
    assert sorted(listed()) == sorted(ids.values())
    refused = client.get("/v1/fine_tuning/jobs", params={"status": "done"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "status"
    job = client.get(f"/v1/fine_tuning/jobs/{ids['tiny']}").json()
    assert job["started_at"] is None and job["created_at"] > 0
    # Every status a job can be in can be asked for.
    statuses = {value for name, value in vars(JobStatus).items() if name.isupper() and isinstance(value, str)}
    assert set(JobStatusName.__args__) == statuses


def test_events_filter_by_type(client, settings):
    with make_session_factory(make_engine(settings.database_url))() as session:
        queries.record_worker(session, "worker-1", gpus=1)  # a worker is up: the job does not wait for one
        session.commit()
    file_id = client.post(
        "/v1/files", files={"file": ("t.jsonl", LINE * 4)}, data={"purpose": "fine-tune"}
    ).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id}).json()[
        "id"
    ]
    with make_session_factory(make_engine(settings.database_url))() as session:
        for step in range(1, 4):
            queries.add_metric(session, job_id, step, {"train_loss": 1.0 / step})
        queries.add_event(session, job_id, "Training started", data={"event": "started"})
        session.commit()

    def messages(**params) -> list[str]:
        page = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100, **params}).json()
        return [event["message"] for event in page["data"]]

    assert messages(type="message") == ["Training started", f"Created fine-tuning job: {job_id}"]
    assert [m.split(":")[0] for m in messages(type="metrics")] == ["Step 3", "Step 2", "Step 1"]
    assert len(messages()) == 5
    newest, *_ = client.get(
        f"/v1/fine_tuning/jobs/{job_id}/events", params={"type": "message", "limit": 1}
    ).json()["data"]
    older = messages(type="message", after=newest["id"])
    assert older == [f"Created fine-tuning job: {job_id}"]
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"type": "other"}).status_code == 400
