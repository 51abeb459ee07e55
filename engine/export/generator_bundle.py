"""`forgebench export RUN --dtype f32|f16 --out DIR` for the class-conditional generators
(image-generate, audio-generate): the EMA U-Net as a self-contained, verified bundle.

    DIR/model.safetensors   the EMA weights of the U-Net (f32, or rounded to f16)
    DIR/model.json          what a loader needs and nothing local: the U-Net's shape, the
                            classes (label index; index len(classes) is the learned null class
                            of classifier-free guidance), the noise schedule, the sampling
                            defaults and the output format (image size, or sample rate and
                            clip length)
    DIR/reference/          one fixed-seed output per class drawn from the bundle (PNG or WAV)
    DIR/model_card.md       data, training config, evaluation, verification, limitations
    DIR/report.json, .txt   the verification below
    DIR/SHA256SUMS          `sha256sum -c` format, every other file

Verification: the bundle is loaded back from its own two files alone (`load_bundle`: no run
folder, no dataset, no recipe config) and draws a fixed-seed batch (one sample per class, the
same noise) beside the checkpoint loaded the way the recipe loads it. Both use the same sampler
and f32 arithmetic, so the only difference is the weights': an f32 bundle must reproduce the
checkpoint's outputs bit for bit; an f16 bundle rounds the weights, and the report gives how far
its outputs move (max and mean |Δ| in the model's [-1, 1] range, PSNR) and passes when the PSNR
is at least MIN_PSNR_F16_DB. The layout is written into a staging folder and renamed at the end
(engine.fsutil.staged_dir): a failed export leaves nothing.

torch is imported inside the functions: the app reads this module's names (the recipes and
dtypes a generator exports as) and never imports torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import recipe_module
from engine.errors import ForgebenchError
from engine.fsutil import atomic_write_json, atomic_write_text, read_json
from engine.recipe_registry import recipes_with
from engine.rundir import Checkpoint, RunDir

if TYPE_CHECKING:
    import torch

    from engine.models.diffusion import DenoisingUNet

GENERATOR_RECIPES = recipes_with(export="generator")
GENERATOR_DTYPES = ("f32", "f16")
BUNDLE_FORMAT = "forgebench-generator-1"
WEIGHTS, SPEC = "model.safetensors", "model.json"
VERIFY_SEED = 1234
VERIFY_STEPS = 25          # sampler steps of the check (respaced; the model's own levels)
MIN_PSNR_F16_DB = 30.0     # f16 weights move the outputs a little; a broken file moves them a lot


def _recipe_module(recipe: str):
    return recipe_module(recipe)     # a GENERATOR_RECIPES row (engine/recipe_registry.py)


def _output_format(recipe: str, config) -> dict:
    if recipe == "image-generate":
        return {"kind": "image", "shape": [3, config.image.size, config.image.size],
                "range": [-1, 1], "pixels": "(x + 1) / 2 * 255, channels RGB"}
    return {"kind": "audio", "shape": [1, config.audio.samples], "range": [-1, 1],
            "sample_rate": config.audio.sample_rate}


def load_bundle(folder: str | Path) -> tuple[dict, DenoisingUNet]:
    """(model.json, the U-Net in f32 eval mode) from a bundle's own files."""
    from safetensors.torch import load_file

    from engine.models.diffusion import DenoisingUNet, UNetConfig

    folder = Path(folder)
    spec = read_json(folder / SPEC)
    if spec.get("format") != BUNDLE_FORMAT:
        raise ForgebenchError("not a generator bundle", path=folder / SPEC,
                              hint=f"expected format {BUNDLE_FORMAT}")
    model = DenoisingUNet(UNetConfig(**{**spec["unet"], "channels": tuple(spec["unet"]
                                                                         ["channels"])}))
    tensors = load_file(str(folder / WEIGHTS))
    model.load_state_dict({name: tensor.float() for name, tensor in tensors.items()})
    return spec, model.eval()


def draw(model: DenoisingUNet, spec: dict, seed: int = VERIFY_SEED,
         steps: int = VERIFY_STEPS) -> torch.Tensor:
    """One sample per class from fixed noise, with the bundle's guidance default."""
    import torch

    from engine.diffusion import Schedule, ancestral_sample

    classes = spec["classes"]
    schedule = Schedule(spec["schedule"]["levels"], min(steps, spec["schedule"]["levels"]))
    labels = torch.arange(len(classes))
    shape = (len(classes), *spec["output"]["shape"])
    return ancestral_sample(model, schedule, shape, labels, len(classes), spec["sample"]["cfg"],
                            torch.Generator().manual_seed(seed))


def compare(reference: torch.Tensor, got: torch.Tensor) -> dict:
    diff = (reference.double() - got.double()).abs()
    mse = float((diff ** 2).mean())
    # PSNR over the [-1, 1] range (peak-to-peak 2); None for identical outputs (infinite).
    psnr = None if mse == 0 else 10 * math.log10(4.0 / mse)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "psnr_db": psnr, "identical": bool(mse == 0)}


def _write_references(recipe: str, folder: Path, spec: dict, outputs: torch.Tensor) -> list[str]:
    from engine.train.media_data import save_png, write_wav

    names = []
    for label, x in zip(spec["classes"], outputs):
        if recipe == "image-generate":
            pixels = ((x.permute(1, 2, 0).clamp(-1, 1) + 1) / 2 * 255).round().byte().numpy()
            name = f"reference/{label}.png"
            save_png(folder / name, pixels)
        else:
            name = f"reference/{label}.wav"
            write_wav(folder / name, x[0].double().numpy(), spec["output"]["sample_rate"])
        names.append(name)
    return names


def export_generator(run: RunDir, checkpoint: Checkpoint, dtype: str, staging: Path,
                     progress) -> dict:
    """Fill `staging` with the bundle; return the verification report."""
    import torch
    from safetensors.torch import save_file

    from engine.diffusion import SCHEDULE_ID
    from engine.train.generators import load_generator

    if dtype not in GENERATOR_DTYPES:
        raise ForgebenchError(f"a generator exports as {' or '.join(GENERATOR_DTYPES)}, "
                              f"not {dtype}", where="--dtype",
                              hint="GGUF quantization is for language models")
    recipe = run.manifest()["recipe"]
    module = _recipe_module(recipe)
    progress.say("loading the checkpoint's EMA weights")
    config, _, meta, model = load_generator(run, checkpoint, module.KINDS, module.unet_config)
    unet = module.unet_config(config, len(meta["classes"]))
    spec = {"format": BUNDLE_FORMAT, "recipe": recipe, "family": "DenoisingUNet",
            "unet": unet.to_dict(), "classes": list(meta["classes"]),
            "null_label": len(meta["classes"]), "weights": "ema", "dtype": dtype,
            "schedule": {"id": SCHEDULE_ID, "levels": config.diffusion.levels,
                         "sampler": "ddpm-ancestral"},
            "sample": {"cfg": config.sample.cfg, "steps": config.sample.steps},
            "output": _output_format(recipe, config),
            "source": {"run": run.path.name, "checkpoint": checkpoint.name,
                       "step": checkpoint.step}}
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if dtype == "f16":
        tensors = {name: t.half() for name, t in tensors.items()}
    save_file(tensors, str(staging / WEIGHTS), metadata={"format": BUNDLE_FORMAT})
    atomic_write_json(staging / SPEC, spec)

    progress.say(f"verification: the checkpoint draws {len(spec['classes'])} fixed-seed samples")
    reference = draw(model, spec)
    progress.say("verification: the bundle, loaded from its own files, draws the same")
    _, reloaded = load_bundle(staging)
    got = draw(reloaded, spec)
    weights_same = all(torch.equal(t.float(), reloaded.state_dict()[n]) for n, t in
                       model.state_dict().items()) if dtype == "f32" else False
    result = compare(reference, got)
    passed = result["identical"] or (dtype == "f16" and result["psnr_db"] >= MIN_PSNR_F16_DB)
    files = [WEIGHTS, SPEC] + _write_references(recipe, staging, spec, got)
    report = {"kind": "generator", "recipe": recipe, "dtype": dtype, "passed": bool(passed),
              "seed": VERIFY_SEED, "sampler_steps": min(VERIFY_STEPS, config.diffusion.levels),
              "classes": spec["classes"],
              "bar": "bit-identical outputs" if dtype == "f32" else
              f"PSNR ≥ {MIN_PSNR_F16_DB:g} dB (f16 rounds the weights)",
              "stages": [{"name": "checkpoint", "description": "training checkpoint, EMA "
                          "weights (reference)", "file": None},
                         {"name": "bundle", "description": f"{WEIGHTS} + {SPEC} loaded alone "
                          f"({dtype})", "file": WEIGHTS, "weights_identical": weights_same,
                          "passed": bool(passed), **result}],
              "export": {"run": run.path.name, "checkpoint": checkpoint.name, "dtype": dtype,
                         "files": files}}
    atomic_write_text(staging / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(staging / "report.txt", render_text(report))
    return report


def render_text(report: dict) -> str:
    stage = report["stages"][1]
    psnr = "∞ (identical)" if stage["psnr_db"] is None else f"{stage['psnr_db']:.1f} dB"
    return "\n".join([
        "Generator bundle verification", "=============================",
        f"{len(report['classes'])} fixed-seed samples (seed {report['seed']}, "
        f"{report['sampler_steps']} sampler steps, one per class), drawn by the checkpoint and "
        "by the bundle loaded from its own files.",
        f"Overall: {'VERIFIED' if report['passed'] else 'NOT verified'} "
        f"(needs {report['bar']})", "",
        f"[bundle] {stage['description']}",
        f"  outputs max|Δ| {stage['max_abs_diff']:.4g}   mean|Δ| {stage['mean_abs_diff']:.4g}"
        f"   PSNR {psnr}",
        f"  weights identical to the checkpoint's EMA weights: {stage['weights_identical']}",
        ""]) + "\n"
