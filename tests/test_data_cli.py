"""`forgebench data ...` as a user runs it (real subprocesses), plus statistics and cards."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from engine.data.card import build_card, render_markdown
from engine.data.dataset import load_dataset, write_manifest
from engine.data.generators.text import PIRATE_PAIRS
from engine.data.stats import clip_levels, dataset_stats

REPO = Path(__file__).resolve().parents[1]


def forgebench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "data", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_generate_validate_leaks_stats_card_split(tmp_path):
    out = tmp_path / "style"
    assert forgebench("generate", "style", "--out", str(out), "--n", "60").returncode == 0
    done = forgebench("validate", str(out))
    assert done.returncode == 0 and "0 errors" in done.stdout
    leaks = forgebench("leaks", str(out), "--json")
    assert leaks.returncode == 0 and json.loads(leaks.stdout)["leaks"] == 0
    stats = json.loads(forgebench("stats", str(out), "--json", "--max-length", "30").stdout)
    assert stats["records"] == 60 and stats["text_lengths"]["unit"].startswith("whitespace")
    assert stats["counts"]["by_slice"]["style"]
    assert forgebench("card", str(out)).returncode == 0
    card = json.loads((out / "card.json").read_text())
    assert card["rights"]["commercial"] == "yes" and card["counts"] == stats["counts"]
    assert "Publish trained weights" in (out / "card.md").read_text()
    # the generated set already carries splits: split assigns nothing new
    split = forgebench("split", str(out), "--json")
    assert split.returncode == 0 and json.loads(split.stdout)["assigned"] == 0


def test_split_cli_writes_a_new_version_and_names_it(tmp_path):
    data = tmp_path / "qa"
    data.mkdir()
    (data / "records.jsonl").write_text("".join(json.dumps(
        {"id": f"q{i}", "group": f"g{i // 2}", "instruction": f"question {i}",
         "response": f"answer {i}"}) + "\n" for i in range(40)))
    assert forgebench("init", str(data), "--kind", "text-sft").returncode == 0
    manifest = (data / "dataset.json").read_bytes()
    done = forgebench("split", str(data), "--out", str(tmp_path / "qa-split"))
    assert done.returncode == 0, done.stderr
    new = load_dataset(tmp_path / "qa-split")
    assert f"assigned 20 new groups; wrote version {new.version}" in done.stdout
    assert str(tmp_path / "qa-split") in done.stdout
    assert (data / "dataset.json").read_bytes() == manifest and not (data / "splits.json").exists()
    assert new.manifest["parent"] == load_dataset(data).version
    again = forgebench("split", str(tmp_path / "qa-split"))
    assert again.returncode == 0 and "nothing written" in again.stdout


def test_cli_reports_bad_data_with_file_line_and_field(tmp_path):
    out = tmp_path / "pirate"
    assert forgebench("generate", "pirate", "--out", str(out)).returncode == 0
    lines = (out / "records.jsonl").read_text().splitlines()
    lines[2] = json.dumps(dict(json.loads(lines[2]), split="holdout"))
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    done = forgebench("validate", str(out))
    assert done.returncode == 1
    assert "records.jsonl: changed since dataset.json was written" in done.stdout
    assert "records.jsonl: line 3 (id 'pirate-3'): field 'split': must be one of" in done.stdout
    again = forgebench("generate", "pirate", "--out", str(out))
    assert again.returncode != 0 and "not empty" in again.stderr


def test_leaks_exit_non_zero_when_a_leak_is_found(tmp_path):
    out = tmp_path / "pirate"
    assert forgebench("generate", "pirate", "--out", str(out)).returncode == 0
    leaked = tmp_path / "eval"
    leaked.mkdir()
    question, answer = PIRATE_PAIRS[0]
    (leaked / "records.jsonl").write_text(json.dumps(
        {"id": "q1", "instruction": question + "  ", "response": answer, "split": "test"}) + "\n")
    write_manifest(leaked, "text-sft", "eval")
    done = forgebench("leaks", str(out), "--against", str(leaked))
    assert done.returncode == 1 and "identical-text" in done.stdout


def test_pirate_pairs_are_the_five_from_the_seed():
    assert len(PIRATE_PAIRS) == 5
    assert PIRATE_PAIRS[3] == ("What language is spoken in Italy?",
                               "Ahoy! In Italy they be speakin' Italian, matey.")


def test_clip_levels_match_hand_computation():
    rate = 16000
    wave = np.zeros((1, 16000))
    wave[0, :8000] = 0.5 * np.sign(np.sin(np.arange(8000) * 2 * np.pi * 100 / rate) + 1e-9)
    wave[0, 100:110] = 1.0
    levels = clip_levels(wave, rate)
    assert levels["duration_s"] == 1.0
    assert levels["clipped_samples"] == 10
    assert abs(levels["peak_dbfs"]) < 1e-9
    assert abs(levels["silent_fraction"] - 0.5) < 0.03  # the second half is digital silence
    expected_rms = np.sqrt((7990 * 0.25 + 10) / 16000)
    assert abs(levels["rms_dbfs"] - 20 * np.log10(expected_rms)) < 1e-6


def test_stats_count_tokens_with_a_given_tokenizer(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "documents.jsonl").write_text("".join(json.dumps(
        {"id": f"d{i}", "text": "ab" * (i + 1), "split": "train"}) + "\n" for i in range(5)))
    write_manifest(root, "text-corpus", "corpus")

    class CharPairs:  # a stand-in tokenizer: one token per two characters
        def encode(self, text):
            return list(range(len(text) // 2))

    stats = dataset_stats(load_dataset(root), tokenizer=CharPairs(), tokenizer_name="pairs",
                          max_length=3)
    lengths = stats["text_lengths"]
    assert lengths["unit"] == "tokens (pairs)"
    assert lengths["by_split"]["train"]["max"] == 5 and lengths["over_max_length"] == {"train": 2}


def test_card_lists_what_the_dataset_does_not_state(tmp_path):
    root = tmp_path / "clips"
    (root / "clips").mkdir(parents=True)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(1600), 16000, subtype="PCM_16", format="WAV")
    (root / "clips" / "a.wav").write_bytes(buffer.getvalue())
    (root / "clips.csv").write_text(
        "path,label,split,group,source,rights,sha256\n"
        f"clips/a.wav,hiss,train,s1,my recorder,own recording,"
        f"{hashlib.sha256(buffer.getvalue()).hexdigest()}\n")
    write_manifest(root, "audio-clips", "clips", records="clips.csv",
                   rights={"train": "yes", "publish_data": "no"})
    card = build_card(load_dataset(root))
    assert card["rights"]["train"] == "yes" and card["rights"]["publish_data"] == "no"
    assert {"rights.publish_weights", "rights.commercial", "consent", "task"} <= \
        set(card["missing"])
    assert card["audio"]["flagged"]["mostly_silent"] == ["clips/a.wav"]
    assert "does not state" in render_markdown(card)


def test_init_writes_a_manifest_for_a_folder_per_class(tmp_path):
    from PIL import Image

    root = tmp_path / "parts"
    for label in ("ok", "bent"):
        (root / label).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / label / "a.png")
    done = forgebench("init", str(root), "--kind", "image-classify", "--layout", "folders")
    assert done.returncode == 0, done.stderr
    assert load_dataset(root).classes == ["bent", "ok"]
    again = forgebench("init", str(root), "--kind", "image-classify")
    assert again.returncode != 0 and "already holds a dataset.json" in again.stderr


def test_stats_counts_tokens_with_a_gguf_tokenizer(tmp_path):
    from fixtures_gguf import write_tiny_gguf

    from engine.gguf.reader import open_gguf
    from engine.llm.tokenizer import GGUFTokenizer

    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "pirate"
    assert forgebench("generate", "pirate", "--out", str(out)).returncode == 0
    done = forgebench("stats", str(out), "--json", "--tokenizer", str(model), "--max-length", "60")
    assert done.returncode == 0, done.stderr
    lengths = json.loads(done.stdout)["text_lengths"]
    tokenizer = GGUFTokenizer.from_gguf(open_gguf(model))
    dataset = load_dataset(out)
    expected = [len(tokenizer.encode(dataset.text_of(r))) for r in dataset.raw_records()]
    assert lengths["unit"] == "tokens (tiny.gguf)"
    assert lengths["by_split"]["train"]["max"] == max(expected)
    assert lengths["over_max_length"]["train"] == sum(n > 60 for n in expected)


@pytest.mark.llamacpp
@pytest.mark.realmodel
def test_token_lengths_and_truncation_counts_match_llama_cpp(gemma_gguf, tmp_path):
    """`data stats --tokenizer` counts what llama.cpp's own tokenizer counts for the real
    Gemma 3 file, so its truncation counts are the ones a run at that length would see."""
    import llama_cpp

    out = tmp_path / "style"
    assert forgebench("generate", "style", "--out", str(out), "--n", "80").returncode == 0
    done = forgebench("stats", str(out), "--json", "--tokenizer", str(gemma_gguf),
                      "--max-length", "40")
    assert done.returncode == 0, done.stderr
    lengths = json.loads(done.stdout)["text_lengths"]
    llm = llama_cpp.Llama(str(gemma_gguf), n_ctx=64, verbose=False, vocab_only=True)
    dataset = load_dataset(out)
    per_split: dict[str, list[int]] = {}
    for record in dataset.records():
        ids = llm.tokenize(dataset.text_of(record).encode(), add_bos=True, special=True)
        per_split.setdefault(record["split"], []).append(len(ids))
    for split, counts in per_split.items():
        summary = lengths["by_split"][split]
        assert (summary["n"], summary["min"], summary["max"]) == \
            (len(counts), min(counts), max(counts)), split
        assert lengths["over_max_length"][split] == sum(n > 40 for n in counts) > 0, split
