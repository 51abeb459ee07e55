"""The Runs pane's "New run" tab: a config of the workspace's configs/ folder (or a new one
copied from a recipe's template) in a recipe form, the machine's devices and the process
count, Start and "Add to queue". Reading a config into the form (its schema import and path
checks) and writing a new config run on worker threads (`BackgroundCall`); the pane starts
the run when `start_requested` fires."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMenu,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.viewmodels import jobs
from app.viewmodels.forms import RecipeForm, new_config_from_template, recipe_templates
from app.viewmodels.models import library_files
from app.viewmodels.workspace import Workspace
from app.views import theme
from app.views.background import BackgroundCall
from app.views.combos import refill_keeping_choice
from app.views.form_widget import RecipeFormWidget

RECIPE_NOTES = {
    "lm-sft": "The Gemma 3 270M package is a base model, not a chat model: its BEFORE answers "
              "are not meant to be good. A handful of training pairs (the pirate set has 5) "
              "is memorised rather than generalised; that is what this demo shows."}


class RunForm(QWidget):
    start_requested = Signal(bool)      # queue: add to the queue rather than start now
    message = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.workspace: Workspace | None = None
        self.start_when_built: str | None = None   # a config another pane asked to start
        self.form_call = BackgroundCall(self)       # a config read into a form
        self.form_call.done.connect(self._form_loaded)
        self.form_call.failed.connect(lambda exc: self.form_status.setText(exc.render()))
        self.template_call = BackgroundCall(self)   # a new config written from a template
        self.template_call.done.connect(self._config_created)
        self.template_call.failed.connect(lambda exc: self.form_status.setText(exc.render()))
        self.form_widget = RecipeFormWidget()
        self.form_widget.validity_changed.connect(self._validity_changed)
        self.form_widget.built.connect(self._form_built)
        self.form_status = QLabel()
        self.form_status.setWordWrap(True)
        self.recipe_note = QLabel()
        self.recipe_note.setWordWrap(True)
        theme.style(self.recipe_note, "QLabel {{ color: {muted}; }}")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(QLabel("Config (from the workspace's configs/ folder)"))
        layout.addLayout(self._config_row())
        layout.addWidget(self.recipe_note)
        layout.addWidget(self.form_widget, 1)
        layout.addWidget(self.form_status)
        self._add_start_row(layout)

    def _config_row(self) -> QHBoxLayout:
        self.config_combo = QComboBox()
        self.config_combo.currentIndexChanged.connect(self._config_chosen)
        self.new_config_button = QPushButton("New from recipe ▾")
        self.new_config_button.setToolTip("Copy a recipe's template config into this "
                                          "workspace's configs/ folder")
        templates = QMenu(self.new_config_button)
        for stem in recipe_templates():
            templates.addAction(stem, lambda s=stem: self.ask_new_config(s))
        self.new_config_button.setMenu(templates)
        row = QHBoxLayout()
        row.addWidget(self.config_combo, 1)
        row.addWidget(self.new_config_button)
        return row

    def _add_start_row(self, layout: QVBoxLayout) -> None:
        machine = jobs.machine_devices()     # the form's `device` field picks among these
        self.processes = QSpinBox()
        self.processes.setRange(1, max(machine["cpus"], len(machine["gpus"]), 1))
        self.processes.setPrefix("processes: ")
        self.processes.setToolTip("lm-pretrain and lm-sft: train on N processes (torchrun; "
                                  "one per GPU, or CPU threads split among them)")
        self.machine_label = QLabel(jobs.machine_text(machine))
        theme.style(self.machine_label, "QLabel {{ color: {muted}; }}")
        self.start_button = QPushButton("Start")
        self.queue_button = QPushButton("Add to queue")
        self.start_button.clicked.connect(lambda: self.start_requested.emit(False))
        self.queue_button.clicked.connect(lambda: self.start_requested.emit(True))
        layout.addWidget(self.machine_label)
        row = QHBoxLayout()
        row.addWidget(self.processes)
        row.addWidget(self.start_button)
        row.addWidget(self.queue_button)
        layout.addLayout(row)

    def set_workspace(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.config_combo.clear()
        self.form_widget.set_datasets(workspace.dataset_dirs())
        self.form_widget.set_models(library_files(workspace.root))
        self.reload_configs()

    @property
    def form(self) -> RecipeForm | None:
        return self.form_widget.form

    def config_stem(self) -> str:
        """The chosen config's name (the new run folder is named after it)."""
        return Path(self.config_combo.currentData() or self.form.recipe).stem

    def reload_configs(self) -> None:
        """The configs/ folder's TOML files; the chosen one stays chosen (and its edits kept)
        when others appear or go."""
        paths = [str(p) for p in self.workspace.config_files()] if self.workspace else []
        if paths == [self.config_combo.itemData(i) for i in range(self.config_combo.count())]:
            return
        if not refill_keeping_choice(self.config_combo, [(Path(p).stem, p) for p in paths]):
            self._config_chosen()

    @property
    def loading(self) -> bool:
        return self.form_call.running or self.template_call.running or \
            self.form_widget.building

    def _config_chosen(self) -> None:
        path = self.config_combo.currentData()
        self.start_button.setEnabled(False)
        self.queue_button.setEnabled(False)
        if not path:
            self.form_call.cancel()
            self.form_status.setText("No configs in this workspace's configs/ folder.")
            return
        self.form_status.setText(f"reading {Path(path).name}…")
        self.form_call.start(lambda: RecipeForm.from_file(path))

    def _form_loaded(self, form: RecipeForm) -> None:
        self.form_widget.set_form(form)
        self.recipe_note.setText(RECIPE_NOTES.get(form.recipe, ""))
        self.recipe_note.setVisible(form.recipe in RECIPE_NOTES)

    def ask_new_config(self, template: str) -> None:
        name, ok = QInputDialog.getText(self, "New config", f"Name for the new {template} "
                                        "config:", text=template)
        if ok and name.strip():
            self.new_config(template, name.strip())

    def new_config(self, template: str, name: str) -> None:
        """Copy a recipe template into configs/ (on a worker thread), then open it in the
        form; `loading` is true until it is there."""
        source, folder = recipe_templates()[template], self.workspace.configs_dir
        self.form_status.setText(f"writing {name}.toml…")
        self.template_call.start(lambda: new_config_from_template(source, folder, name))

    def _config_created(self, path: Path) -> None:
        self.reload_configs()
        self.config_combo.setCurrentIndex(self.config_combo.findData(str(path)))
        self.message.emit(f"new config {path.name} in configs/")

    def _validity_changed(self, valid: bool) -> None:
        self.start_button.setEnabled(valid)
        self.queue_button.setEnabled(valid)
        self.form_status.setText("" if valid else "Fix the fields marked in red to start.")

    def start_config(self, path: Path) -> None:
        """Open a config of configs/ in the form (pre-filled by another pane) and ask to start
        it once the form is read and built (both off the GUI thread's long slices)."""
        self.reload_configs()
        self.config_combo.setCurrentIndex(self.config_combo.findData(str(path)))
        if self.loading:
            self.start_when_built = str(path)
        else:
            self.start_requested.emit(False)

    def _form_built(self) -> None:
        wanted, self.start_when_built = self.start_when_built, None
        if wanted and wanted == self.config_combo.currentData():
            self.start_requested.emit(False)
