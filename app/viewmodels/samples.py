"""What a run generated, read from `samples/<checkpoint>/` (docs/design.md), and the rubric ratings
people give it, appended to `ratings/rubric-<run>.jsonl`.

Images and sounds come with a JSON sidecar per file (seed, settings, checkpoint, nearest training
item, integrity flags for audio); LLM runs write `generations.jsonl` per checkpoint, where
`step-000000` holds the base model's answers (BEFORE) and later checkpoints the tuned ones.
No Qt and no torch here.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.runs import run_label
from engine.errors import ForgebenchError
from engine.fsutil import append_jsonl, read_json, read_jsonl
from engine.recipe_registry import recipes_with
from engine.rundir import RunDir

MEDIA = {".png": "image", ".wav": "audio"}
SAMPLE_RECIPES = recipes_with("samples")     # the runs whose samples/ the pane shows
# generations file -> (its sidecar, the answer field): lm-sft writes the first, lm-pretrain the
# second
TEXT_FILES = {"generations.jsonl": ("generations.json", "answer"),
              "samples.jsonl": ("samples.json", "text")}
# The dimensions each kind of sample is rated on (issue #9); scores are 1 (poor) .. 5 (good).
RUBRICS = {
    "audio": ("class correctness", "integrity", "diversity", "memorization"),
    "image": ("content", "style", "control", "diversity", "retention", "memorization"),
    "text": ("fidelity", "style"),
}
SCORES = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Sample:
    """One generated file and its sidecar."""

    path: Path
    sidecar: dict

    @property
    def kind(self) -> str:
        return MEDIA[self.path.suffix]

    @property
    def checkpoint(self) -> str:
        """The samples folder: the checkpoint's name, unless the job was given its own --out
        (e.g. a second sample set of one checkpoint with other settings)."""
        return self.path.parent.name

    @property
    def seed(self) -> int:
        return int(self.sidecar.get("seed", 0))

    @property
    def label(self) -> str:
        return str(self.sidecar.get("class", ""))

    @property
    def item(self) -> str:
        """What the sample was asked for — class, seed and position — the same across
        checkpoints, so two checkpoints' samples of one item can be compared blind."""
        return self.path.stem

    @property
    def settings(self) -> dict:
        """Everything that shaped the output except the weights (what an A/B must hold equal)."""
        found = dict(self.sidecar.get("settings", {}))
        for key in ("cfg", "steps", "sample_rate", "samples"):
            if key in self.sidecar:
                found[key] = self.sidecar[key]
        return found

    @property
    def integrity_flags(self) -> list[str]:
        return list(self.sidecar.get("integrity", {}).get("flags", []))

    def nearest_training_id(self) -> str | None:
        near = self.sidecar.get("nearest_training") or {}
        for measure in ("pixel", "log_stft", "feature"):
            if measure in near:
                return near[measure]["id"]
        return None


def showcase_order(run_dir: str | Path, checkpoints: set[str]) -> list[str]:
    """The order a run's sample folders are shown in: the best checkpoint first (the one
    chosen in the run's notes, else the one the run marked best, else the latest), then the
    others newest first. The early, still noisy checkpoints come last."""
    from app.viewmodels.runs import chosen_checkpoint

    def step(name: str) -> int:
        found = re.match(r"step-(\d+)", name)
        return int(found.group(1)) if found else -1

    newest_first = sorted(checkpoints, key=lambda name: (step(name), name), reverse=True)
    best = chosen_checkpoint(Path(run_dir))
    return ([best] if best in checkpoints else []) + [n for n in newest_first if n != best]


def run_samples(run_dir: str | Path) -> list[Sample]:
    """Every image or audio sample of a run, by checkpoint (`showcase_order`: the best
    first), class, seed and position."""
    root = RunDir(run_dir).samples_dir
    found = []
    if root.is_dir():
        for sidecar in sorted(root.glob("*/*.json")):
            media = [sidecar.with_suffix(s) for s in MEDIA if sidecar.with_suffix(s).is_file()]
            if not media or sidecar.stem == "grid":
                continue
            found.append(Sample(media[0], read_json(sidecar)))
    rank = {name: i for i, name in enumerate(
        showcase_order(run_dir, {sample.checkpoint for sample in found}))}
    return sorted(found, key=lambda s: (rank[s.checkpoint], s.label, s.seed, s.item))


def image_grid(samples: list[Sample]) -> tuple[list[str], list[tuple[str, int, str]], dict]:
    """(rows = classes, columns = (checkpoint, seed, position), cells → Sample) for images;
    the checkpoints in the order the samples come (`run_samples`: the best first)."""
    images = [s for s in samples if s.kind == "image"]
    rows = sorted({s.label for s in images})
    rank: dict[str, int] = {}
    for sample in images:
        rank.setdefault(sample.checkpoint, len(rank))
    columns = sorted({(s.checkpoint, s.seed, s.item.rsplit("-", 1)[-1]) for s in images},
                     key=lambda c: (rank[c[0]], c[1], c[2]))
    cells = {(s.label, (s.checkpoint, s.seed, s.item.rsplit("-", 1)[-1])): s for s in images}
    return rows, columns, cells


def nearest_training_file(run_dir: str | Path, sample: Sample) -> Path | None:
    """The training file the sample is nearest to (memorization check), found in the run's
    dataset by the id its sidecar names."""
    wanted = sample.nearest_training_id()
    dataset = RunDir(run_dir).manifest().get("data", {}).get("dataset")
    if wanted is None or not dataset:
        return None
    from engine.data.dataset import load_dataset

    for record in load_dataset(dataset).records():
        if record.get("id") == wanted:
            return Path(record.get("image") or record.get("path"))
    return None


def waveform(path: Path) -> tuple[np.ndarray, int]:
    """Mono float samples in [-1, 1] exactly as written (never normalized) and the rate."""
    import soundfile

    wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    return wave[:, 0], int(rate)


def spectrogram(wave: np.ndarray) -> np.ndarray:
    """log |STFT| [frames, bins], the same measure the engine's neighbour search uses."""
    from engine.eval.audio import log_stft

    return log_stft(wave)


# -- text: BEFORE / AFTER ------------------------------------------------------------------
def text_file(folder: Path) -> Path | None:
    """The generations file of a checkpoint's samples folder (lm-sft or lm-pretrain)."""
    for name in TEXT_FILES:
        if (folder / name).is_file():
            return folder / name
    return None


def sample_runs(run_dirs: list[Path]) -> list[tuple[str, str]]:
    """(label, folder) of the runs whose samples the pane shows; a run whose run.json cannot
    be read is left out (the Runs pane reports it)."""
    runs = []
    for path in run_dirs:
        try:
            recipe = RunDir(path).manifest().get("recipe")
        except ForgebenchError:
            continue
        if recipe in SAMPLE_RECIPES:
            runs.append((run_label(path, recipe), str(path)))
    return runs


def checkpoint_names(run_dir: str | Path) -> list[str]:
    """The run's checkpoints, newest first."""
    return [c.name for c in reversed(RunDir(run_dir).checkpoints())]


@dataclass(frozen=True)
class SamplingOptions:
    checkpoints: list[str]      # newest first
    media: bool                 # a diffusion run: the pane can sample it (n, seed, cfg, steps)
    max_steps: int              # the diffusion's levels (sampling takes at most that many)
    classes: list[str]          # the class labels of a class-conditional run


def sampling_options(run_dir: str | Path) -> SamplingOptions:
    """What the pane offers for sampling a run: its checkpoints and, for an image or audio
    generator, its class labels (from the latest checkpoint's meta.json) and step range."""
    run = RunDir(run_dir)
    manifest = run.manifest()
    levels = ((manifest.get("config") or {}).get("diffusion") or {}).get("levels")
    classes = []
    for checkpoint in run.checkpoints()[-1:]:
        meta = checkpoint.path / "meta.json"
        if meta.is_file():
            classes = list(read_json(meta).get("classes", []))
    return SamplingOptions(checkpoint_names(run_dir),
                           manifest.get("recipe") in ("image-generate", "audio-generate"),
                           int(levels) if isinstance(levels, int) else 1000, classes)


def generations_file(run_dir: str | Path, checkpoint: str) -> Path | None:
    """The generations file of one checkpoint's samples (None when it has none)."""
    return text_file(RunDir(run_dir).samples_dir / checkpoint)


def generation_checkpoints(run_dir: str | Path) -> list[str]:
    root = RunDir(run_dir).samples_dir
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and text_file(p))


def generations(run_dir: str | Path, checkpoint: str) -> dict[str, str]:
    """prompt → answer of one checkpoint's generations (the first seed's, for lm-pretrain)."""
    path = text_file(RunDir(run_dir).samples_dir / checkpoint)
    if path is None:
        raise ForgebenchError("no generations for this checkpoint",
                              path=RunDir(run_dir).samples_dir / checkpoint)
    field = TEXT_FILES[path.name][1]
    found: dict[str, str] = {}
    for record in read_jsonl(path):
        found.setdefault(record["prompt"], record[field])
    return found


def generation_settings(run_dir: str | Path, checkpoint: str) -> dict:
    """The sampling settings a checkpoint's generations were made with (from the sidecar)."""
    path = text_file(RunDir(run_dir).samples_dir / checkpoint)
    sidecar = read_json(path.with_name(TEXT_FILES[path.name][0]))
    settings = dict(sidecar.get("settings", {}))
    if "max_tokens" in sidecar:
        settings["max_tokens"] = sidecar["max_tokens"]
    return settings


def before_after(run_dir: str | Path, after: str | None = None) -> list[tuple[str, str, str]]:
    """(prompt, BEFORE answer, AFTER answer): the base's generations (the first checkpoint)
    against `after` (default: the last one)."""
    names = generation_checkpoints(run_dir)
    if not names:
        return []
    last = generations(run_dir, after or names[-1])
    if len(names) < 2:      # one checkpoint with answers (a short lm-pretrain run): AFTER only
        return [(p, "—", answer) for p, answer in last.items()]
    first = generations(run_dir, names[0])
    return [(p, first[p], last.get(p, "")) for p in first]


def before_after_headers(run_dir: str | Path) -> tuple[str, str]:
    """Column titles: an SFT run's first answers are its base's (step 0); a run trained from
    scratch has no base, so its columns name the checkpoints compared."""
    names = generation_checkpoints(run_dir)
    if not names:
        return "BEFORE", "AFTER"
    if names[0] == "step-000000":
        return "BEFORE (base)", f"AFTER ({names[-1]})"
    return (f"first ({names[0]})" if len(names) > 1 else "—"), f"latest ({names[-1]})"


# -- rubric ratings ------------------------------------------------------------------------
class RubricStore:
    """Append-only rubric ratings of one run's samples; each answer is fsynced when saved."""

    def __init__(self, ratings_dir: Path, run_dir: str | Path):
        self.run = Path(run_dir)
        self.path = Path(ratings_dir) / f"rubric-{self.run.name}.jsonl"

    def record(self, sample_path: Path, kind: str, scores: dict[str, int], rater: str,
               note: str = "") -> dict:
        unknown = [d for d in scores if d not in RUBRICS[kind]]
        if unknown:
            raise ForgebenchError(f"not a {kind} rubric dimension: {', '.join(unknown)}",
                                  where="rubric", hint="one of " + ", ".join(RUBRICS[kind]))
        bad = [d for d, v in scores.items() if v not in SCORES]
        if bad:
            raise ForgebenchError(f"scores must be 1..5 ({', '.join(bad)})", where="rubric")
        entry = {"type": "rubric", "run": str(self.run),
                 "sample": str(Path(sample_path).relative_to(self.run)), "kind": kind,
                 "scores": scores, "note": note, "rater": rater, "time": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.path, entry)
        return entry

    def ratings(self) -> list[dict]:
        return read_jsonl(self.path) if self.path.is_file() else []

    def latest(self, sample_path: Path, rater: str) -> dict | None:
        """The rater's most recent scores for a sample (later entries supersede earlier)."""
        name = str(Path(sample_path).relative_to(self.run))
        mine = [r for r in self.ratings() if r["sample"] == name and r["rater"] == rater]
        return mine[-1] if mine else None


# -- sampling jobs -------------------------------------------------------------------------
def sample_argv(run_dir: str | Path, *, checkpoint: str = "latest", class_name: str | None = None,
                n: int = 2, seed: int = 0, cfg: float | None = None, steps: int | None = None,
                out: Path | None = None) -> list[str]:
    argv = forgebench_argv() + ["sample", str(run_dir), "--checkpoint", checkpoint,
                                "--n", str(n), "--seed", str(seed)]
    for flag, value in (("--class", class_name), ("--cfg", cfg), ("--steps", steps),
                        ("--out", out)):
        if value is not None:
            argv += [flag, str(value)]
    return argv
