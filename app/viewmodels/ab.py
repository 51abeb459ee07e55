"""Blind A/B sessions over what runs generated: systems, the session itself, and its results.

A system is one run's checkpoint (or an lm-sft run's untuned base); its outputs are the samples
(images, sounds) or generations (text) that checkpoint wrote, keyed by item — the
class/seed/position of a sample or the prompt of a generation — so every system answers the same
items. The pane can make those outputs itself: `generation_jobs` plans one engine job per system
and seed (or prompt), all with one settings dict that the session header records. Planning,
storage (append-only, fsynced per answer, hidden mapping in every record) and statistics are
`engine.ratings`'; this module gathers the outputs and shapes the results for the pane. No Qt.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from app.viewmodels.jobs import forgebench_argv
from app.viewmodels.samples import (
    MEDIA,
    Sample,
    generation_settings,
    generations,
    run_samples,
    sample_argv,
    text_file,
)
from engine.data.card import write_card
from engine.data.dataset import load_dataset, write_manifest
from engine.errors import ForgebenchError
from engine.export.bundle import GGUF_BASE_RECIPES
from engine.fsutil import (
    append_jsonl,
    atomic_write_text,
    read_json,
    read_jsonl,
    sha256_file,
    staged_dir,
)
from engine.ratings import (
    Pair,
    RatingStore,
    bradley_terry,
    head_to_head,
    judgement_counts,
    plan_session,
    preference_records,
    rater_agreement,
)
from engine.recipe_registry import recipes_with
from engine.rundir import RunDir

KEYS = {"A": "left", "B": "right", "T": "tie", "S": "skip"}


def system_name(run_dir: Path, checkpoint: str) -> str:
    return f"{Path(run_dir).name}/{checkpoint}"


def gather_system(run_dir: str | Path, checkpoint: str, folder: Path | None = None) -> dict:
    """One system: its kind, the settings its outputs were made with, and item → output —
    the checkpoint's samples, or those a generation job wrote into `folder`."""
    run_dir = Path(run_dir)
    if folder is None:
        media = [s for s in run_samples(run_dir) if s.checkpoint == checkpoint]
    else:
        media = [Sample(path, read_json(path.with_suffix(".json")))
                 for path in sorted(Path(folder).glob("*"))
                 if path.suffix in MEDIA and path.with_suffix(".json").is_file()]
    if media:
        settings = [s.settings for s in media]
        differing = sorted({k for s in settings for k in s
                            if len({repr(x.get(k)) for x in settings}) > 1})
        if differing:
            raise ForgebenchError(
                f"the samples of {checkpoint} were made with different settings: "
                + ", ".join(differing), path=run_dir / "samples" / checkpoint,
                hint="generate a fresh sample set for the comparison with one set of settings")
        return {"run": str(run_dir), "checkpoint": checkpoint, "kind": media[0].kind,
                "settings": settings[0], "outputs": {s.item: str(s.path) for s in media}}
    if folder is not None:
        raise ForgebenchError("the generation job wrote no samples", path=folder,
                              hint="see the job's output; generate again")
    folder = RunDir(run_dir).samples_dir / checkpoint
    if text_file(folder):
        return {"run": str(run_dir), "checkpoint": checkpoint, "kind": "text",
                "settings": generation_settings(run_dir, checkpoint),
                "outputs": generations(run_dir, checkpoint)}
    raise ForgebenchError("this checkpoint has no samples to compare", path=folder,
                          hint="generate samples for it first (Samples pane → Generate)")


GENERATOR_RECIPES = recipes_with("generator")
TEXT_RECIPES = recipes_with("text")
BASE = "base"                       # the system "the run's base model, untuned" (lm-sft)
TEXT_OUTPUTS = "generations.jsonl"  # what a text system's generation jobs append to


@dataclass(frozen=True)
class GenerationJob:
    """One engine job of an A/B generation: a system, one seed (media) or one prompt (text),
    and the folder its outputs go to."""

    system: str
    run_dir: Path
    checkpoint: str
    argv: list[str]
    folder: Path
    prompt: str | None = None


def available_systems(run_dirs: list[Path]) -> dict[tuple[str, str], str]:
    """{(run folder, checkpoint or BASE): system name} of every run checkpoint that has
    samples or generations, or whose generator can make them, and the base of a run that
    names a GGUF base."""
    found: dict[tuple[str, str], str] = {}
    for run_dir in run_dirs:
        run = RunDir(run_dir)
        names = []
        if run.samples_dir.is_dir():
            names += [p.name for p in sorted(run.samples_dir.iterdir()) if p.is_dir() and (
                any(f.suffix in (".png", ".wav") and f.stem != "grid"
                    for f in p.iterdir()) or text_file(p))]
        if run.manifest().get("recipe") in GENERATOR_RECIPES + TEXT_RECIPES:
            names += [c.name for c in run.checkpoints()]
        if base_gguf(run_dir) is not None:
            names.append(BASE)
        for name in sorted(set(names)):
            found[(str(run_dir), name)] = system_name(run_dir, name)
    return found


def all_text(chosen: list[tuple[str, str]]) -> bool:
    """The chosen systems are all text runs (they are generated from prompts, not seeds)."""
    return bool(chosen) and all(RunDir(r).manifest().get("recipe") in TEXT_RECIPES
                                for r, _ in chosen)


def session_files(ratings_dir: Path) -> list[Path]:
    """The blind A/B sessions saved in ratings/ (the rubric files beside them are not)."""
    return [p for p in sorted(ratings_dir.glob("*.jsonl")) if not p.name.startswith("rubric-")] \
        if ratings_dir.is_dir() else []


def preferences_written(out: Path) -> str:
    """What an export of preferences says: where, and how many pairs went in or not."""
    provenance = read_json(out / "dataset.json")["provenance"]
    return (f"preference dataset written: {out} ({provenance['exported']} pairs; "
            f"{provenance['not_exported']} left out)")


def generation_settings_of(seeds: list[int], n: int, cfg: float | None, steps: int | None,
                           class_name: str | None) -> dict:
    """The one settings dict every image/audio system's outputs are generated with (recorded
    in the session header)."""
    if not seeds:
        raise ForgebenchError("give at least one seed", where="seeds", hint="e.g. 0, 1")
    return {"seeds": sorted(set(seeds)), "n": n, "cfg": cfg, "steps": steps,
            "class": class_name}


def text_settings_of(prompts: list[str], max_tokens: int, seed: int = 0) -> dict:
    """The one settings dict every text system answers with: greedy, the same prompts."""
    prompts = [p.strip() for p in prompts if p.strip()]
    if not prompts:
        raise ForgebenchError("give at least one prompt", where="prompts",
                              hint="one prompt per line")
    return {"prompts": list(dict.fromkeys(prompts)), "max_tokens": max_tokens,
            "temperature": 0.0, "seed": seed}


def base_gguf(run_dir: str | Path) -> Path | None:
    """An lm-sft run's GGUF base (which `forgebench generate --model` runs untuned), if any."""
    manifest = RunDir(run_dir).manifest()
    path = Path((manifest.get("base_model") or {}).get("path", ""))
    return path if manifest.get("recipe") in GGUF_BASE_RECIPES and path.suffix == ".gguf" \
        else None


def _text_argv(run_dir: str | Path, checkpoint: str, prompt: str, settings: dict) -> list[str]:
    common = ["--prompt", prompt, "--max-tokens", str(settings["max_tokens"]),
              "--temperature", str(settings["temperature"]), "--seed", str(settings["seed"]),
              "--json"]
    if checkpoint == BASE:
        base = base_gguf(run_dir)
        if base is None:
            raise ForgebenchError("only an lm-sft run over a GGUF file has a base to compare",
                                  path=run_dir, where="systems")
        # the base answers through its chat template in f32, as lm-sft's tuned model does
        return forgebench_argv() + ["generate", "--model", str(base), "--chat",
                                    "--numerics", "f32", *common]
    return forgebench_argv() + ["generate", str(run_dir), "--checkpoint", checkpoint, *common]


def generation_jobs(chosen: list[tuple[str, str]], settings: dict,
                    outputs_dir: Path) -> list[GenerationJob]:
    """The engine jobs that make every system's outputs with `settings`: one `forgebench
    sample` per system and seed (images, sounds) or one `forgebench generate` per system and
    prompt (text), each system writing into its own fresh folder under `outputs_dir`."""
    if len(chosen) < 2:
        raise ForgebenchError("choose at least two systems", where="systems")
    if outputs_dir.exists():
        raise ForgebenchError("outputs for a session of this name exist already",
                              path=outputs_dir, hint="choose another session name")
    text = "prompts" in settings
    jobs = []
    for index, (run_dir, checkpoint) in enumerate(chosen):
        recipe = RunDir(run_dir).manifest().get("recipe")
        if recipe not in (TEXT_RECIPES if text else GENERATOR_RECIPES):
            raise ForgebenchError(
                f"recipe '{recipe}' does not make {'text' if text else 'images or sounds'}",
                path=run_dir, where="systems",
                hint="compare systems of one kind: generator runs, or language-model runs")
        folder = outputs_dir / f"{index:02d}-{Path(run_dir).name}-{checkpoint}"
        system = system_name(run_dir, checkpoint)
        if text:
            jobs += [GenerationJob(system, Path(run_dir), checkpoint,
                                   _text_argv(run_dir, checkpoint, prompt, settings), folder,
                                   prompt) for prompt in settings["prompts"]]
            continue
        for seed in settings["seeds"]:
            jobs.append(GenerationJob(
                system, Path(run_dir), checkpoint,
                sample_argv(run_dir, checkpoint=checkpoint, class_name=settings["class"],
                            n=settings["n"], seed=seed, cfg=settings["cfg"],
                            steps=settings["steps"], out=folder), folder))
    return jobs


def last_json(output: str) -> dict:
    """The JSON object a `generate --json` job printed last (its output may carry log lines
    before it)."""
    starts = [m.start() for m in re.finditer(r"(?m)^\{", output)]
    for start in reversed(starts):
        try:
            return json.loads(output[start:])
        except json.JSONDecodeError:
            continue
    raise ForgebenchError("the generation job printed no result", where="job output",
                          hint=output[-500:])


def record_text_output(job: GenerationJob, output: str) -> None:
    """Append a finished text job's answer to its system's generations file (durably)."""
    result = last_json(output)
    job.folder.mkdir(parents=True, exist_ok=True)
    append_jsonl(job.folder / TEXT_OUTPUTS, {"prompt": job.prompt, "text": result["text"],
                                             "engine_settings": result.get("settings", {})})


def generated_systems(jobs: list[GenerationJob], settings: dict) -> dict[str, dict]:
    """The systems of a finished generation: exactly the outputs its jobs wrote."""
    systems = {}
    for job in jobs:
        if job.system in systems:
            continue
        if job.prompt is None:
            systems[job.system] = gather_system(job.run_dir, job.checkpoint, job.folder)
            continue
        answers = {r["prompt"]: r["text"] for r in read_jsonl(job.folder / TEXT_OUTPUTS)}
        systems[job.system] = {"run": str(job.run_dir), "checkpoint": job.checkpoint,
                               "kind": "text", "outputs": answers,
                               "settings": {k: v for k, v in settings.items()
                                            if k != "prompts"}}
    return systems


def common_items(systems: dict[str, dict]) -> list[str]:
    """Items every system has an output for, in a stable order."""
    sets = [set(s["outputs"]) for s in systems.values()]
    return sorted(set.intersection(*sets)) if sets else []


def session_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    if not name:
        raise ForgebenchError("a session needs a name (letters, digits, . _ -)", where="session")
    return name


@dataclass
class Side:
    """What the rater sees of one side: the output only, never the system."""

    kind: str
    output: str        # a file path (image/audio) or the generated text


class ABSession:
    """One rater working through a session file, one pair at a time."""

    def __init__(self, store: RatingStore, rater: str):
        self.store = store
        self.rater = rater
        self.plan = store.plan()
        self._remaining = store.remaining(rater)

    @classmethod
    def create(cls, ratings_dir: Path, name: str, systems: dict[str, dict], rater: str,
               seed: int = 0, items: list[str] | None = None, limit: int | None = None,
               allow_differences: tuple[str, ...] = (),
               generation: dict | None = None) -> "ABSession":
        """Plan and start a session. `items` defaults to every common item; `limit` keeps the
        first N pairs of the shuffled plan (a session of a chosen length); `generation` is
        the settings dict the pane generated every system's outputs with."""
        items = common_items(systems) if items is None else items
        if not items:
            raise ForgebenchError("the systems have no item in common to compare",
                                  where="systems",
                                  hint="generate the same classes and seeds for each")
        kinds = {s["kind"] for s in systems.values()}
        if len(kinds) > 1:
            raise ForgebenchError("cannot compare " + " with ".join(sorted(kinds)),
                                  where="systems")
        plan = plan_session(session_name(name), systems, items, seed, allow_differences)
        plan.generation = generation
        if limit is not None:
            plan.pairs = plan.pairs[:limit]
            plan.items = sorted({p.item for p in plan.pairs})
        store = RatingStore(Path(ratings_dir) / f"{plan.session}.jsonl")
        store.start(plan, rater)
        return cls(store, rater)

    @classmethod
    def open(cls, path: Path, rater: str) -> "ABSession":
        return cls(RatingStore(path), rater)

    @property
    def kind(self) -> str:
        return next(iter(self.plan.systems.values()))["kind"]

    @property
    def total(self) -> int:
        return len(self.plan.pairs)

    @property
    def done(self) -> int:
        return self.total - len(self._remaining)

    @property
    def finished(self) -> bool:
        return not self._remaining

    def current(self) -> Pair | None:
        return self._remaining[0] if self._remaining else None

    def sides(self, pair: Pair) -> tuple[Side, Side]:
        outputs = {name: s["outputs"][pair.item] for name, s in self.plan.systems.items()}
        return Side(self.kind, str(outputs[pair.left])), Side(self.kind, str(outputs[pair.right]))

    def prompt(self, pair: Pair) -> str:
        """What the rater is told was asked: the prompt (text) or class and seed (media)."""
        return self.describe(pair.item)

    def answer(self, choice: str, rubric: dict | None = None) -> dict:
        """Store the answer (fsynced) and move on; only then is the next pair available."""
        pair = self.current()
        if pair is None:
            raise ForgebenchError("the session is finished", path=self.store.path)
        record = self.store.record(pair, choice, self.rater, rubric)
        self._remaining.pop(0)
        return record

    def results(self) -> dict:
        return session_results(self.store)

    def export_preferences(self, out_dir: Path) -> Path:
        """The answered pairs as a preference dataset: prompt / chosen / rejected texts
        (`preferences`), or for images and sounds the chosen and rejected files copied into
        the folder and listed with their SHA-256 (`media-preferences`). Ties and skips are
        not preferences and are left out (counted in the manifest's provenance)."""
        out_dir = Path(out_dir)
        if out_dir.exists():
            raise ForgebenchError("the folder exists already", path=out_dir,
                                  hint="choose a new dataset name")
        answers = self.store.answers()
        outputs = {(name, item): output for name, s in self.plan.systems.items()
                   for item, output in s["outputs"].items()}
        prompts = {item: self.describe(item) for item in self.plan.items}
        records = preference_records(answers, outputs, prompts)
        if not records:
            raise ForgebenchError("no answered pair has a winner yet (ties and skips are not "
                                  "preferences)", path=self.store.path)
        media = self.kind != "text"
        with staged_dir(out_dir) as staging:   # all or nothing
            copied: dict[str, str] = {}
            lines = []
            for i, record in enumerate(records):
                if media:
                    for side in ("chosen", "rejected"):
                        record[side] = self._copy_output(Path(record[side]), staging, copied)
                # every pair trains (held-out prompts are new ones); grouped by prompt, so a
                # later `forgebench data split` keeps a prompt's pairs together
                lines.append({"id": f"pref-{i:05d}", **record, "session": self.plan.session,
                              "group": record["item"], "split": "train",
                              "rights": "generated by the compared models; rated by "
                                        f"{record['rater']}"})
            atomic_write_text(staging / "records.jsonl",
                              "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
            counts = judgement_counts(answers)
            write_manifest(staging, "media-preferences" if media else "preferences", out_dir.name,
                           provenance={"session": str(self.store.path),
                                       "answers": len(answers), "exported": len(lines),
                                       "ties": counts["ties"], "skips": counts["skips"],
                                       "raters": counts["raters"],
                                       "not_exported": f"{counts['ties'] + counts['skips']} "
                                                       f"ties and skips (no preference: "
                                                       f"{counts['ties']} ties, "
                                                       f"{counts['skips']} skips)"})
            write_card(load_dataset(staging, check_media=False), stated={
                "task": "prefer the chosen answer (blind A/B judgements)",
                "sources": [f"blind A/B session {self.plan.session}: "
                            + ", ".join(sorted(self.plan.systems))],
                "collection_dates": time.strftime("%Y-%m-%d", time.gmtime(
                    self.store.header().get("created", time.time()))),
                "preprocessing": f"ties ({counts['ties']}) and skips ({counts['skips']}) left "
                                 "out; each pair keeps its rater and session",
                "reviewed_by": ", ".join(sorted(counts["raters"]))})
        return out_dir

    def describe(self, item: str) -> str:
        """An item as a prompt: the prompt text, or the class, seed and position asked for."""
        if self.kind == "text":
            return item
        label, seed, position = item.rsplit("-", 2)
        return f"class {label}, {seed}, sample {int(position)}"

    @staticmethod
    def _copy_output(source: Path, root: Path, copied: dict[str, str]) -> str:
        """Copy a generated file into the dataset once (named by its content); return its
        relative path."""
        digest = sha256_file(source)
        if digest not in copied:
            rel = f"files/{digest[:16]}{source.suffix}"
            (root / "files").mkdir(exist_ok=True)
            shutil.copyfile(source, root / rel)
            copied[digest] = rel
        return copied[digest]


def session_results(store: RatingStore) -> dict:
    """Win rates with 95% Wilson intervals per system pair, Bradley–Terry strengths when more
    than two systems were compared, the per-item table, and agreement between raters."""
    answers = store.answers()
    plan = store.plan()
    pairs = []
    for (a, b), g in sorted(head_to_head(answers).items()):
        low, high = g.interval_a
        pairs.append({"a": a, "b": b, "wins_a": g.wins_a, "wins_b": g.wins_b, "ties": g.ties,
                      "n": g.n, "win_rate_a": g.win_rate_a, "ci_low": low, "ci_high": high})
    items: dict[str, dict] = {}
    for ans in answers:
        row = items.setdefault(ans["item"], {"item": ans["item"], "answers": 0, "ties": 0,
                                             "skips": 0, "wins": {}})
        row["answers"] += 1
        if ans["choice"] == "tie":
            row["ties"] += 1
        elif ans["choice"] == "skip":
            row["skips"] += 1
        else:
            row["wins"][ans["winner"]] = row["wins"].get(ans["winner"], 0) + 1
    return {"systems": sorted(plan.systems), "answered": len(answers), "planned": len(plan.pairs),
            "pairs": pairs,
            "bradley_terry": bradley_terry(answers) if len(plan.systems) > 2 else None,
            "items": [items[k] for k in sorted(items)],
            "raters": sorted({a["rater"] for a in answers}),
            "agreement": rater_agreement(answers),
            "recorded_differences": plan.recorded_differences}


# -- closing the loop: train on a session's preferences, then compare ------------------------
DPO_STEPS = 10        # a short run over a session's pairs: on the real model 10 steps won a
                      # session's re-rating 12/0, while 30 ran answers on past the question into
                      # gibberish (tests/test_dpo_closed_loop.py)
DPO_LR = 1e-4         # adapters on tens of pairs; the schema's 5e-6 suits larger data sets


def next_free(folder: Path, name: str, suffix: str = "") -> Path:
    """folder/name+suffix, or the first of name-v2, name-v3, … that does not exist yet: a new
    export is a new dataset version (or config), never an edit of an old one."""
    candidate, version = Path(folder) / f"{name}{suffix}", 1
    while candidate.exists():
        version += 1
        candidate = Path(folder) / f"{name}-v{version}{suffix}"
    return candidate


def session_winner(results: dict) -> str:
    """The system a finished session preferred: the top Bradley–Terry strength, or of two
    systems the one with the higher win rate."""
    if results["bradley_terry"]:
        strengths = results["bradley_terry"]
        return max(strengths, key=strengths.get)
    row = results["pairs"][0] if results["pairs"] else None
    if row is None or row["win_rate_a"] == 0.5:
        raise ForgebenchError("the session has no winner (no answers, or an even split)",
                              where="results", hint="rate more pairs")
    return row["a"] if row["win_rate_a"] > 0.5 else row["b"]


def dpo_config_for(session: ABSession, dataset_dir: Path, configs_dir: Path) -> Path:
    """An lm-dpo config in configs/ that refines the winning system on the exported pairs:
    the winner must be an lm-sft checkpoint (its adapters start the policy and are the
    reference); the session's prompts are answered BEFORE and AFTER."""
    from app.viewmodels.forms import RecipeForm

    winner = session_winner(session.results())
    system = session.plan.systems[winner]
    run_dir, checkpoint = Path(system["run"]), system["checkpoint"]
    if RunDir(run_dir).manifest().get("recipe") != "lm-sft" or checkpoint == BASE:
        raise ForgebenchError(
            f"the preferred system {winner} is not an lm-sft checkpoint, so there is no SFT "
            "policy to refine", where="results",
            hint="preference tuning starts from an lm-sft run's checkpoint")
    pairs = len(read_jsonl(Path(dataset_dir) / "records.jsonl"))
    values = {"steps": DPO_STEPS, "model": {"sft_run": str(run_dir), "checkpoint": checkpoint},
              "data": {"path": str(dataset_dir)}, "optim": {"lr": DPO_LR},
              "train": {"window": min(8, pairs), "micro_batch": min(4, pairs)},
              "sample": {"prompts": session.plan.items[:4],
                         "max_tokens": (session.plan.generation or {}).get("max_tokens", 32)}}
    form = RecipeForm("lm-dpo", values, base_dir=str(configs_dir))
    if not form.valid:
        raise ForgebenchError("the lm-dpo config does not validate: "
                              + "; ".join(f"{k}: {v}" for k, v in form.errors.items())
                              + (form.general_error or ""), where="lm-dpo config")
    return form.write_toml(next_free(configs_dir, f"dpo-{session.plan.session}", ".toml"))


def tuned_runs(run_dirs: list[Path], session_path: Path) -> list[Path]:
    """Completed lm-dpo runs trained on an export of this session, oldest first."""
    found = []
    for run_dir in run_dirs:
        run = RunDir(run_dir)
        try:
            manifest = run.manifest()
        except ForgebenchError:
            continue
        if manifest.get("recipe") != "lm-dpo" or run.live_status().get("state") != "completed":
            continue
        data = Path(manifest["config"]["data"]["path"])
        if not data.is_absolute():
            data = Path(manifest["config"].get("base_dir") or ".") / data
        try:
            provenance = read_json(data / "dataset.json").get("provenance") or {}
        except ForgebenchError:
            continue
        if provenance.get("session") == str(session_path):
            found.append(Path(run_dir))
    return sorted(found, key=lambda p: RunDir(p).manifest().get("created", 0))


def comparison_systems(tuned_run: Path) -> list[tuple[str, str]]:
    """(run, checkpoint) of the tuned model and of the model it started from."""
    run = RunDir(tuned_run)
    start = run.manifest()["data"]["start"]
    return [(str(tuned_run), run.latest_checkpoint().name), (start["run"], start["checkpoint"])]


def held_out_prompts(prompts: list[str], tuned_run: Path) -> list[str]:
    """The prompts the tuned model was not trained on (a fair comparison holds them out)."""
    manifest = RunDir(tuned_run).manifest()
    data = Path(manifest["config"]["data"]["path"])
    if not data.is_absolute():
        data = Path(manifest["config"].get("base_dir") or ".") / data
    trained = {r.get("prompt") for r in read_jsonl(data / "records.jsonl")}
    held = [p.strip() for p in prompts if p.strip() and p.strip() not in trained]
    if not held:
        raise ForgebenchError("every prompt given was trained on", where="prompts",
                              hint="give held-out prompts (one per line) the tuned model has "
                                   "not seen")
    return list(dict.fromkeys(held))
