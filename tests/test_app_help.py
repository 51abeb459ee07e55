"""Help where users look: every field of every recipe's new-run form has the schema's
description as its tooltip, and every "What does this mean?" link in the window opens a section
docs/user-guide.md really has. Twins show each check fails on a field without a description and
on an anchor the guide lacks."""

from __future__ import annotations

import dataclasses
import re

import pytest
from PySide6.QtWidgets import QLabel

from app.viewmodels.forms import RecipeForm
from app.viewmodels.guide import GUIDE_PLACES, HELP_TOPICS, guide_section, sections, slug
from app.viewmodels.workspace import Settings
from app.views.form_widget import RecipeFormWidget
from app.views.help_link import GuideDialog
from app.views.main_window import PANE_NAMES, MainWindow
from engine.config import RECIPES
from engine.errors import ForgebenchError

GUIDE = GUIDE_PLACES[0]


def fields_without_tooltips(widget: RecipeFormWidget) -> list[str]:
    """The form's fields whose editor has no tooltip, or one that is not the description."""
    return [spec.name for spec in widget.form.fields
            if not widget.editors[spec.name].toolTip().strip()
            or widget.editors[spec.name].toolTip() != spec.description]


def built_form(qtbot, form: RecipeForm) -> RecipeFormWidget:
    widget = RecipeFormWidget()
    qtbot.addWidget(widget)
    widget.progressive = False
    widget.set_form(form)
    return widget


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_field_of_the_recipe_form_has_its_description_as_tooltip(qtbot, recipe):
    widget = built_form(qtbot, RecipeForm(recipe))
    assert set(widget.editors) == {spec.name for spec in widget.form.fields}
    assert fields_without_tooltips(widget) == []


def test_twin_a_field_without_a_description_is_reported(qtbot):
    form = RecipeForm("lm-pretrain")
    form.fields[0] = dataclasses.replace(form.fields[0], description="")
    assert fields_without_tooltips(built_form(qtbot, form)) == [form.fields[0].name]


def test_slugs_follow_github_headings():
    assert slug("Leaks & duplicates") == "leaks--duplicates"
    assert slug("Export verdicts") == "export-verdicts"
    text = "# A\n## Sub one\ntext\n```\n# not a heading\n```\n## Sub two\nmore\n"
    found = sections(text)
    assert list(found) == ["a", "sub-one", "sub-two"]
    assert found["sub-one"] == "## Sub one\ntext\n```\n# not a heading\n```"


def test_every_help_topic_opens_a_section_the_guide_has():
    guide = sections(GUIDE.read_text(encoding="utf-8"))
    for topic, anchor in HELP_TOPICS.items():
        assert anchor in guide, topic
        assert len(guide[anchor].splitlines()) > 5, topic     # a real section, not a heading


def test_the_guides_own_links_to_its_sections_exist():
    text = GUIDE.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert linked and linked <= set(sections(text))


def test_twin_an_anchor_the_guide_lacks_is_an_error():
    with pytest.raises(ForgebenchError, match="no section #no-such-section"):
        guide_section("no-such-section", GUIDE)


def test_the_window_links_findings_verdicts_and_metrics_to_existing_sections(
        qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FORGEBENCH_DATA_DIR", str(tmp_path / "data"))
    window = MainWindow(Settings())
    window.close_policy = "leave"
    qtbot.addWidget(window)
    for name in PANE_NAMES:
        window.pane(name)
    links = {}
    for label in window.findChildren(QLabel):
        for anchor in re.findall(r'href="guide:([^"]+)"', label.text()):
            links[anchor] = label
    guide = sections(GUIDE.read_text(encoding="utf-8"))
    assert set(links) == set(HELP_TOPICS.values())
    assert all(anchor in guide for anchor in links)

    # Following the Datasets pane's link shows the findings section itself.
    link = links[HELP_TOPICS["findings"]]
    assert window.datasets.isAncestorOf(link)
    link.linkActivated.emit(f"guide:{HELP_TOPICS['findings']}")
    dialog = next(d for d in link.findChildren(GuideDialog))
    qtbot.addWidget(dialog)
    assert dialog.anchor == "dataset-findings"
    shown = dialog.text.toPlainText()
    assert shown.startswith("Dataset findings") and "required field is missing" in shown
    assert "Export verdicts" not in shown               # that is the next section's
