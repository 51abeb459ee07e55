"""The typed-decision contract (dataset kind `decisions`, recipe lm-decision): a record's
options and the closed option schema they are drawn from.

The schema is dataset.json's `"options": [{"id": "billing", "text": "Payments, ..."}, ...]`: the
only option ids a record may offer, and the only ones a trained decision model may be asked to
choose between. One function answers "is this option list acceptable?" for the validator (a
record's `options` field) and for serving (`forgebench decide --options`), so the two cannot
drift apart.
"""

from __future__ import annotations

from typing import Any

MIN_OPTIONS = 2   # a decision between fewer than two options decides nothing


def schema_of(manifest: dict) -> list[dict] | None:
    """The manifest's option schema ({id, text} per option), or None when it declares none."""
    return manifest.get("options")


def options_problem(value: Any, schema: list[dict] | None) -> str | None:
    """Why `value` is not a valid option list ([{id, text}, ...], two or more, unique ids,
    every id in `schema` when there is one), or None."""
    if not isinstance(value, list) or len(value) < MIN_OPTIONS:
        return f"must be a list of at least {MIN_OPTIONS} {{id, text}} objects"
    seen: set[str] = set()
    for i, option in enumerate(value):
        if not isinstance(option, dict) or set(option) != {"id", "text"}:
            return f"option {i} must be an object with exactly the keys id and text"
        for key in ("id", "text"):
            if not isinstance(option[key], str) or not option[key].strip():
                return f"option {i} {key} must be a non-empty string"
        if option["id"] in seen:
            return f"option id {option['id']!r} appears twice"
        seen.add(option["id"])
    outside = outside_schema([o["id"] for o in value], schema)
    if outside:
        return (f"option {outside[0]!r} is not in the option schema "
                f"({', '.join(o['id'] for o in schema)})")
    return None


def outside_schema(ids: list[str], schema: list[dict] | None) -> list[str]:
    """The ids not offered by `schema` (none when there is no schema)."""
    if schema is None:
        return []
    allowed = {o["id"] for o in schema}
    return [i for i in ids if i not in allowed]


def schema_problem(schema: Any) -> str | None:
    """Why a manifest's `options` value is not a valid schema, or None."""
    return options_problem(schema, None)
