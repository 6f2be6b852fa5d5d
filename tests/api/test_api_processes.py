"""`fusetune serve` with several API processes: they share the port, and any one's /metrics counts them all."""

from __future__ import annotations

import re

import httpx
import psutil

from tests.services import running_service

MISSING_JOB = "/v1/fine_tuning/jobs/ftjob-missing"


def _missing_job_requests(metrics_text: str) -> float:
    pattern = r'fusetune_http_requests_total\{method="GET",route="/v1/fine_tuning/jobs/\{job_id\}",status="404"\} (\S+)'
    found = re.search(pattern, metrics_text)
    return float(found.group(1)) if found else 0.0


def test_two_api_processes_answer_and_report_one_total(tmp_path):
    env = {"FUSETUNE_API_PROCESSES": "2", "FUSETUNE_EMBEDDED_WORKER": "false"}
    with running_service(tmp_path / "data", extra_env=env) as service:
        server = psutil.Process(service.process.pid)
        app_processes = [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(app_processes) == 2
        headers = {"Authorization": f"Bearer {service.api_key}"}
        # A new connection per request, so the kernel spreads them over both processes' accept queues.
        for _ in range(40):
            assert httpx.get(service.base_url + MISSING_JOB, headers=headers).status_code == 404
        scrapes = [httpx.get(service.base_url + "/metrics").text for _ in range(6)]
        assert [_missing_job_requests(text) for text in scrapes] == [40.0] * 6
        assert 'fusetune_jobs{status="queued"} 0.0' in scrapes[0]
