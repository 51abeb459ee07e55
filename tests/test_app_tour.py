"""The first-run tour: its three steps (Datasets → Runs → Samples) walked through the real
window with pytest-qt, and dismissal remembered in the settings file across windows. The
viewmodel's rules are checked without Qt first."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

from app.viewmodels.tour import STEPS, TOUR_DONE_KEY, Tour
from app.viewmodels.workspace import BUNDLED_SAMPLE, Settings
from app.views.main_window import PANES, MainWindow


def test_tour_viewmodel_walks_three_steps_and_remembers_the_finish(tmp_path):
    settings = Settings(tmp_path / "settings.json")
    tour = Tour(settings)
    assert tour.active and [s.pane for s in STEPS] == ["Datasets", "Runs", "Samples"]
    tour.back()
    assert tour.index == 0                              # no step before the first
    tour.next(), tour.next()
    assert tour.is_last and tour.active
    tour.next()                                         # Finish
    assert not tour.active
    assert json.loads((tmp_path / "settings.json").read_text())[TOUR_DONE_KEY] is True
    assert not Tour(Settings(tmp_path / "settings.json")).active
    tour.restart()
    assert tour.active and tour.index == 0


def test_tour_names_what_the_sample_workspace_has():
    """The steps point at a dataset and a config the sample workspace really ships."""
    datasets, runs = STEPS[0].text, STEPS[1].text
    assert "“shapes”" in datasets and (BUNDLED_SAMPLE / "datasets" / "shapes").is_dir()
    assert "“lm-pretrain-demo”" in runs
    assert (BUNDLED_SAMPLE / "configs" / "lm-pretrain-demo.toml").is_file()


@pytest.fixture
def new_window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEBENCH_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FORGEBENCH_DATA_DIR", str(tmp_path / "data"))

    def make() -> MainWindow:
        win = MainWindow(Settings())
        win.close_policy = "leave"
        qtbot.addWidget(win)
        win.show()
        return win
    return make


def current_pane(window: MainWindow) -> str:
    return PANES[window.sidebar.currentRow()].replace("&&", "&")


def test_tour_walks_datasets_runs_samples_and_finishing_persists(new_window, qtbot):
    window = new_window()
    panel = window.tour_panel
    assert panel.isVisible() and current_pane(window) == "Datasets"
    assert "Datasets" in panel.title.text() and not panel.back_button.isEnabled()
    seen = [current_pane(window)]
    for _ in range(2):
        qtbot.mouseClick(panel.next_button, Qt.MouseButton.LeftButton)
        seen.append(current_pane(window))
        assert window.stack.currentIndex() == window.sidebar.currentRow()
    assert seen == ["Datasets", "Runs", "Samples"]
    assert window.stack.currentWidget().widget() is window.samples
    assert panel.next_button.text() == "Finish"
    qtbot.mouseClick(panel.back_button, Qt.MouseButton.LeftButton)
    assert current_pane(window) == "Runs"
    qtbot.mouseClick(panel.next_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(panel.next_button, Qt.MouseButton.LeftButton)      # Finish
    assert not panel.isVisible()
    window.close()
    assert not new_window().tour_panel.isVisible()                     # the next launch


def test_skipping_the_tour_persists_and_help_brings_it_back(new_window, qtbot):
    window = new_window()
    qtbot.mouseClick(window.tour_panel.next_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(window.tour_panel.skip_button, Qt.MouseButton.LeftButton)
    assert not window.tour_panel.isVisible()
    assert current_pane(window) == "Runs"              # skipping leaves the user where they are
    window.close()
    again = new_window()
    assert not again.tour_panel.isVisible()
    help_menu = next(a.menu() for a in again.menuBar().actions() if a.text() == "&Help")
    next(a for a in help_menu.actions() if "Tour" in a.text()).trigger()
    assert again.tour_panel.isVisible() and current_pane(again) == "Datasets"
