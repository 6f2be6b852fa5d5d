"""A small HTTP client of fusetune's API, for the command line's `files` and `jobs` commands.

It speaks to a server as the `openai` SDK does (a base URL ending in /v1, a Bearer key) with httpx, and imports
nothing else of fusetune: the command line reaches a remote server through it, never the server's code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")


class ApiError(Exception):
    """A request the server refused, with its error message (the API's `{"error": {...}}` shape)."""

    def __init__(self, status_code: int, message: str):
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message


def default_base_url() -> str:
    return os.environ.get("FUSETUNE_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL


def default_api_key() -> str | None:
    return os.environ.get("FUSETUNE_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


@dataclass(frozen=True)
class Progress:
    """A job as `follow` last saw it: its object, its latest step's metrics, and its steps in all."""

    job: dict[str, Any]
    step: int | None = None
    total_steps: int | None = None
    train_loss: float | None = None
    tokens_per_second: float | None = None
    eta_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.job["status"] in TERMINAL_STATUSES


class Client:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self._http = httpx.Client(
            base_url=base_url.rstrip("/") + "/",
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise ApiError(response.status_code, message)
        return response.json()

    def upload_file(self, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
        with open(path, "rb") as handle:
            return self._request(
                "POST", "files", files={"file": (path.name, handle)}, data={"purpose": purpose}
            )

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "fine_tuning/jobs", json=body)

    def list_jobs(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._request("GET", "fine_tuning/jobs", params={"limit": limit})["data"]

    def retrieve_job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"fine_tuning/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"fine_tuning/jobs/{job_id}/cancel")

    def message_events(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """The job's newest message events (not the per-step metrics ones), oldest first."""
        params = {"limit": limit, "type": "message"}
        return list(
            reversed(self._request("GET", f"fine_tuning/jobs/{job_id}/events", params=params)["data"])
        )

    def metrics(self, job_id: str, min_step: int = 0) -> list[dict[str, Any]]:
        """Every step's metrics from `min_step` on, oldest first, page after page."""
        points: list[dict[str, Any]] = []
        while True:
            page = self._request("GET", f"fine_tuning/jobs/{job_id}/metrics", params={"min_step": min_step})
            points += page["data"]
            if not page["has_more"] or not page["data"]:
                return points
            min_step = page["data"][-1]["step"] + 1

    def follow(self, job_id: str, poll_s: float = 1.0) -> Iterator[tuple[Progress, list[dict[str, Any]]]]:
        """The job's progress and its message events not yet seen, once now and after each `poll_s`, until the
        job has ended (the last progress yielded is the ended job's).

        Steps in all come from the latest `started` event (a resumed job starts again from its checkpoint's
        step); loss, tokens/s and the time left (`eta_s`, the trainer's measure over its recent steps) from
        the latest step's metrics."""
        seen_events: set[str] = set()
        last_point: dict[str, Any] | None = None
        total_steps: int | None = None
        while True:
            job = self.retrieve_job(job_id)
            new_events = [event for event in self.message_events(job_id) if event["id"] not in seen_events]
            seen_events.update(event["id"] for event in new_events)
            for event in new_events:
                if (event.get("data") or {}).get("event") == "started":
                    total_steps = event["data"].get("total_steps", total_steps)
            points = self.metrics(job_id, min_step=last_point["step"] + 1 if last_point else 0)
            if points:
                last_point = points[-1]
            yield _progress(job, last_point, total_steps), new_events
            if job["status"] in TERMINAL_STATUSES:
                return
            time.sleep(poll_s)


def _progress(job: dict[str, Any], point: dict[str, Any] | None, total_steps: int | None) -> Progress:
    if point is None:
        return Progress(job=job, total_steps=total_steps)
    values = point.get("values") or {}
    return Progress(
        job=job,
        step=point["step"],
        total_steps=total_steps,
        train_loss=point.get("train_loss"),
        tokens_per_second=values.get("tokens_per_second"),
        eta_s=values.get("eta_s", _eta_s(values.get("step_time_s"), point["step"], total_steps)),
    )


def _eta_s(step_time_s: float | None, step: int, total_steps: int | None) -> float | None:
    if step_time_s is None or total_steps is None:
        return None
    return step_time_s * max(0, total_steps - step)
