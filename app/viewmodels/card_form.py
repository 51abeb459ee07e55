"""The data-card form: generated from the engine's `CardStatement` schema, validated by it on
every edit (the recipe form's machinery, over another schema), saved through the engine's card
module as card.json + card.md.

List fields are edited one item per line (sources and uses often contain commas).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.viewmodels.forms import FieldSpec, RecipeForm, _get, _set, field_specs
from engine.data import formats as F
from engine.data.card import CardStatement, statement_of, write_card
from engine.data.dataset import load_dataset
from engine.errors import ForgebenchError
from engine.fsutil import read_json

CARD_JSON = "card.json"


def _as_text(spec: FieldSpec, value: Any) -> str:
    if value in (None, ""):
        return "" if spec.kind != "choice" else str(spec.default)
    if spec.kind == "list":
        return "\n".join(v if isinstance(v, str) else json.dumps(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


class CardForm(RecipeForm):
    """Field texts, per-field errors and the save of one dataset's card."""

    def __init__(self, root: str | Path, values: dict | None = None):
        self.root = Path(root)
        self.recipe = None
        self.schema = CardStatement
        self.fields = field_specs(CardStatement)
        self.base_dir = None
        self.extra: dict = {}
        values = self.current_statement(self.root) if values is None else values
        self.text = {spec.name: _as_text(spec, _get(values, spec.name))
                     for spec in self.fields}
        self.errors: dict[str, str] = {}
        self.general_error: str | None = None
        self.validate()

    @staticmethod
    def current_statement(root: Path) -> dict:
        """What the card says now: card.json's statements, else the manifest's card and
        rights sections (a dataset imported with rights answers starts with them)."""
        path = root / CARD_JSON
        if path.is_file():
            try:
                card = read_json(path)
            except ForgebenchError:
                card = None
            if isinstance(card, dict):
                return statement_of(card)
        try:
            manifest = read_json(root / F.MANIFEST)
        except ForgebenchError:
            return {}
        if not isinstance(manifest, dict):
            return {}
        values = dict(manifest.get("card") or {})
        rights = manifest.get("rights")
        if isinstance(rights, dict):
            values["rights"] = rights
            if rights.get("consent") and "consent" not in values:
                values["consent"] = rights["consent"]
        provenance = manifest.get("provenance")
        if "sources" not in values and isinstance(provenance, dict) and \
                provenance.get("description"):
            values["sources"] = [provenance["description"]]
        if "collection_dates" not in values and isinstance(provenance, dict) and \
                provenance.get("collection_dates"):
            values["collection_dates"] = provenance["collection_dates"]
        return values

    def _parse(self, spec: FieldSpec, text: str) -> Any:
        if spec.kind == "list":
            return [line.strip() for line in text.split("\n") if line.strip()]
        return text.strip()

    def config_dict(self) -> dict:
        data: dict = {}
        for spec in self.fields:
            _set(data, spec.name, self._parse(spec, self.text[spec.name]))
        return data

    def validate(self) -> bool:
        super().validate()
        self.errors = {k: v.removeprefix("Value error, ") for k, v in self.errors.items()}
        return self.valid

    def statement(self) -> CardStatement:
        return CardStatement.model_validate(self.config_dict())

    def save(self) -> tuple[Path, Path]:
        """card.json + card.md through the engine's card module."""
        if not self.valid:
            problem = ", ".join(sorted(self.errors)) or str(self.general_error)
            raise ForgebenchError(f"the card has invalid fields: {problem}",
                                  path=self.root / CARD_JSON, hint="fix the fields marked in red")
        dataset = load_dataset(self.root, check_media=False)
        return write_card(dataset, stated=self.statement().given())
