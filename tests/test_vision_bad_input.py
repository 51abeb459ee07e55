"""Bad image, mask and audio input and a changed class list: one clear error naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
from media_support import forgebench, make_shapes, write_config
from PIL import Image

from engine.config import load_config, recipe_module
from engine.errors import ForgebenchError
from engine.fsutil import sha256_file
from engine.jobs import execute, start_run
from engine.recipes.audio_generate_config import AudioSection
from engine.recipes.media_config import ImageSection
from engine.rundir import RunDir
from engine.train.media_data import read_clip, read_mask, read_rgb, write_wav


def test_an_image_with_no_rgb_reading_names_the_file(tmp_path):
    """Greyscale, palette and alpha files are converted (tests/test_data_own.py); a float
    image has no 8-bit RGB reading and is refused with the file named."""
    path = tmp_path / "depth.tiff"
    Image.new("F", (32, 32)).save(path)
    with pytest.raises(ForgebenchError) as err:
        read_rgb(path, ImageSection(size=32))
    assert str(path) in str(err.value) and "mode F cannot be read as RGB" in str(err.value)
    grey = tmp_path / "grey.png"
    Image.new("L", (32, 32), 200).save(grey)
    assert read_rgb(grey, ImageSection(size=32))[0].min() == 200


def test_wrong_image_size_names_the_file_and_field(tmp_path):
    path = tmp_path / "big.png"
    Image.new("RGB", (40, 32)).save(path)
    with pytest.raises(ForgebenchError) as err:
        read_rgb(path, ImageSection(size=32, resize="none"))
    assert str(path) in str(err.value) and "40x32" in str(err.value)
    assert "image.size" in str(err.value)
    # With a resize policy the same file is accepted and fitted.
    assert read_rgb(path, ImageSection(size=32, resize="pad"))[0].shape == (32, 32, 3)


def test_mask_of_another_size_names_the_mask(tmp_path):
    path = tmp_path / "mask.png"
    Image.new("L", (30, 32)).save(path)
    with pytest.raises(ForgebenchError) as err:
        read_mask(path, (32, 32), ImageSection(size=32))
    assert str(path) in str(err.value) and "differs" in str(err.value)


@pytest.mark.parametrize("channels, rate, samples, words", [
    (2, 16000, 8192, "channels"), (1, 44100, 8192, "sample rate"), (1, 16000, 8000, "samples")])
def test_bad_wav_names_the_file(tmp_path, channels, rate, samples, words):
    path = tmp_path / "clip.wav"
    soundfile.write(path, np.zeros((samples, channels)), rate, subtype="PCM_16")
    with pytest.raises(ForgebenchError) as err:
        read_clip(path, AudioSection())
    assert str(path) in str(err.value) and words in str(err.value)


def test_wav_writer_keeps_the_level(tmp_path):
    wave = 0.1 * np.sin(np.linspace(0, 60, 8192))
    write_wav(tmp_path / "quiet.wav", wave, 16000)
    data, rate = soundfile.read(tmp_path / "quiet.wav")
    info = soundfile.info(tmp_path / "quiet.wav")
    assert (rate, info.channels, info.subtype, len(data)) == (16000, 1, "PCM_16", 8192)
    assert abs(np.abs(data).max() - 0.1) < 1e-3      # not peak-normalized to 1


def test_run_refuses_a_dataset_with_a_grayscale_image(tmp_path):
    shapes = make_shapes(tmp_path, n=20)
    victim = sorted((shapes / "images").iterdir())[0]
    Image.open(victim).convert("L").save(victim)
    manifest = json.loads((shapes / "dataset.json").read_text())   # re-hashed: only the mode
    manifest["files"][f"images/{victim.name}"] = sha256_file(victim)  # is wrong now
    (shapes / "dataset.json").write_text(json.dumps(manifest))
    config = write_config(tmp_path / "c.toml", "image-classify", shapes)
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2
    assert victim.name in result.stderr and "mode" in result.stderr
    assert not (tmp_path / "run").exists()


def test_changed_class_list_is_refused_against_a_checkpoint(tmp_path):
    shapes = make_shapes(tmp_path, n=20)
    config_path = write_config(tmp_path / "c.toml", "image-classify", shapes, steps=1,
                               eval_every=0, save_every=0)
    run = start_run(load_config(config_path), tmp_path / "run", ["test"], threads=1)
    execute(run, load_config(config_path), None, threads=1, progress=False)
    manifest = json.loads((shapes / "dataset.json").read_text())
    manifest["classes"] = ["triangle", "square", "circle"]
    (shapes / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(ForgebenchError) as err:
        recipe_module("image-classify").evaluate(RunDir(run.path), run.checkpoint("latest"), "val")
    assert "meta.json" in str(err.value) and "class list changed" in str(err.value)
