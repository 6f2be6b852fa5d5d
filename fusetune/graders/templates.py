"""Template substitution: `{{ item.answer }}` and `{{ sample.output_text }}` replaced by their values.

The syntax is parsed by fusetune/spec/graders.py (`template_references`); this module looks the values up. A
string value goes in as it is, any other value (a number, a list, an object) as its JSON text, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fusetune.spec.graders import TEMPLATE, TemplateReference, parse_reference


class TemplateError(ValueError):
    """A reference to a variable the item or the sample does not have (OpenAI's invalid_variable_error)."""


def lookup(reference: TemplateReference, namespaces: Mapping[str, Any]) -> Any:
    value = namespaces[reference.namespace]
    walked = reference.namespace
    for part in reference.path:
        if isinstance(part, int) and isinstance(value, list) and part < len(value):
            value = value[part]
        elif isinstance(part, str) and isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            has = f"has no {part!r}" if isinstance(value, Mapping | list) else f"is {json.dumps(value)[:40]}"
            raise TemplateError(f"{reference.text}: {walked} {has}")
        walked += f"[{part}]" if isinstance(part, int) else f".{part}"
    return value


def render(template: str, namespaces: Mapping[str, Any]) -> str:
    """`template` with every `{{ ... }}` replaced; raises TemplateError naming a missing variable."""

    def substitute(match) -> str:
        value = lookup(parse_reference(match.group(0)), namespaces)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return TEMPLATE.sub(substitute, template)
