"""What a tenant may read of a failure: its messages without the server's paths.

A trainer's or a worker's error often quotes a path on the server (an exception's filename, a log line's
traceback). The job's error and events show the last part only; the worker logs the whole message under the
job's id for the operator.
"""

from __future__ import annotations

import re

# An absolute path of two or more parts (not inside a relative path or a web URL), or an object store's URL: the
# parts before the last go.
_ABSOLUTE_PATH = re.compile(
    r"(?:\b(?:s3|file)://|(?<![\w.:/~-])/)(?:[^\s'\"/:,;()\[\]<>]+/)+([^\s'\"/:,;()\[\]<>]*)"
)


def without_paths(text: str) -> str:
    """`text` with every absolute path cut to its last part ("/srv/runs/ftjob-1/step-9.incomplete" becomes
    "…/step-9.incomplete")."""
    return _ABSOLUTE_PATH.sub(lambda match: f"…/{match.group(1)}", text)
