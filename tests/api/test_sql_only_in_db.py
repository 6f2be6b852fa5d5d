"""SQL lives only in fusetune/db: the API imports sessions, connections and errors from SQLAlchemy, never its
query constructs, and runs no statement itself; it calls the named query functions of fusetune.db.queries."""

from __future__ import annotations

import ast
from pathlib import Path

import fusetune.api

API_DIR = Path(fusetune.api.__file__).parent

# What the API may take from SQLAlchemy: types to annotate with and errors to catch.
ALLOWED_IMPORTS = {
    "sqlalchemy": {"Connection", "Engine", "Row"},
    "sqlalchemy.orm": {"Session"},
    "sqlalchemy.exc": None,  # any exception
}
# Methods of a Session or Connection that run a statement.
STATEMENT_METHODS = {"execute", "scalar", "scalars", "query"}
# Methods that only a session (or connection) has, so a call on one named that is an ORM write or read.
SESSION_ONLY_METHODS = {"get", "delete", "merge"}
SESSION_NAMES = {"session", "connection"}


def sql_outside_db(source: str) -> list[str]:
    """Each import of a SQLAlchemy query construct and each statement run, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name == "sqlalchemy" or alias.name.startswith("sqlalchemy.")
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            allowed = ALLOWED_IMPORTS.get(node.module, set())
            found += [
                f"line {node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if allowed is not None and alias.name not in allowed
            ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else None
            if method in STATEMENT_METHODS or (
                method in SESSION_ONLY_METHODS and owner_name in SESSION_NAMES
            ):
                found.append(f"line {node.lineno}: .{method}(...)")
    return sorted(found, key=lambda problem: int(problem.split(":")[0].removeprefix("line ")))


def test_api_runs_no_sql_of_its_own():
    offences = {
        str(path.relative_to(API_DIR.parent.parent)): problems
        for path in sorted(API_DIR.rglob("*.py"))
        if (problems := sql_outside_db(path.read_text()))
    }
    assert not offences, f"SQL belongs in fusetune/db (a named function in db/queries.py): {offences}"


def test_the_check_finds_sql():
    """The test above would fail on each way SQL used to sit in the routes."""
    assert sql_outside_db("from sqlalchemy import select, Connection") == [
        "line 1: from sqlalchemy import select"
    ]
    assert sql_outside_db("import sqlalchemy as sa") == ["line 1: import sqlalchemy"]
    assert sql_outside_db("from sqlalchemy.sql import func") == ["line 1: from sqlalchemy.sql import func"]
    assert sql_outside_db("from sqlalchemy.orm import Session, selectinload") == [
        "line 1: from sqlalchemy.orm import selectinload"
    ]
    assert len(sql_outside_db("session.execute(q)\ndb.scalars(q)\nsession.query(Job.id).first()")) == 3
    assert sql_outside_db("session.delete(row)\nsession.get(Job, job_id)") == [
        "line 1: .delete(...)",
        "line 2: .get(...)",
    ]
    # Not SQL: a router's DELETE route, a dict's get, errors and type hints.
    assert not sql_outside_db(
        "from sqlalchemy.exc import IntegrityError\nfrom sqlalchemy import Connection, Row\n"
        "@router.delete('/x')\ndef f(): return headers.get('a')"
    )
