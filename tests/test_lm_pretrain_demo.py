"""`forgebench demo` end to end in a real process.

The default suite runs it for two steps and checks its structure: the "Where is X?" corpus
(entity-disjoint splits, one question per record), the run, the BEFORE/AFTER block and a
score that this test recomputes from the checkpoint with its own reading of val.txt. The slow
test trains 900 steps (what the demo's 90 s budget buys on a busy 2-core machine; it never
trains fewer than 600) and holds the issue's bar: at least 15 of the 20 unseen records
answered with their room. Measured: 20/20 at step 600 on a 2-core AVX-512 Xeon.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from lm_pretrain_support import REPO, forgebench

from engine.config import load_config
from engine.recipes.lm_pretrain import complete, load_model
from engine.rundir import RunDir
from engine.sampling import SamplingSettings

RECORD = re.compile(r"^(Record (item\d+): the \w+ \w+ is in the (\w+)\. .*?) Question: "
                    r"Where is \2\? Answer: the \3\.$")
SCORE_BAR = 15
SLOW_STEPS = 900


def recomputed_score(run: RunDir, val_text: str, n: int = 20) -> int:
    """Greedy answers of the run's last checkpoint to the first `n` val records, read with a
    regular expression of this test rather than the demo's parser."""
    model, tokenizer, _ = load_model(run, run.latest_checkpoint())
    right = 0
    for line in val_text.splitlines()[:n]:
        record, entity, room = RECORD.match(line).groups()
        prompt = f"{record} Question: Where is {entity}? Answer:"
        said = complete(model, tokenizer, prompt, max_tokens=16, settings=SamplingSettings(),
                        seed=0, stop=[".", "\n"])
        right += said.strip() == f"the {room}"
    return right


def demo(tmp_path, *args):
    result = forgebench("demo", *args, "--out", str(tmp_path), timeout=1800)
    run = RunDir(re.search(r"^run:\s+(\S+)$", result.stdout, re.M).group(1))
    score = int(re.search(r"^score: (\d+)/20$", result.stdout, re.M).group(1))
    return result.stdout, run, score


def test_demo_structure_two_steps(tmp_path):
    out, run, score = demo(tmp_path, "--steps", "2", "--threads", "1")
    assert "run completed after 2 steps" in out
    corpus = tmp_path / "datasets" / "where-records"
    manifest = json.loads((corpus / "dataset.json").read_text())
    assert manifest["provenance"]["questions"] == ["where"]
    splits = {s: (corpus / f"{s}.txt").read_text().splitlines() for s in ("train", "val")}
    assert all(RECORD.match(line) for lines in splits.values() for line in lines)
    entities = {s: {RECORD.match(line).group(2) for line in lines}
                for s, lines in splits.items()}
    assert not entities["train"] & entities["val"]      # scored entities are never trained on
    assert re.search(r"BEFORE training: \d+/20 right", out)
    assert f"AFTER training:  {score}/20 right" in out
    assert out.count("    BEFORE:   ") == out.count("    AFTER:    ") == 3
    first_val = RECORD.match(splits["val"][0])
    assert f"    expected: the {first_val.group(3)}" in out
    assert score == recomputed_score(run, "\n".join(splits["val"]))
    config = load_config(tmp_path / "configs" / "lm-pretrain-demo.toml")  # the copy it ran
    assert (config.steps, config.eval_every, config.save_every) == (2, 1, 1)
    assert run.manifest()["config"]["model"] == config.model.model_dump()
    assert (tmp_path / "workspace.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FORGEBENCH_SLOW") != "1",
                    reason="900 training steps (about a minute on 2 idle cores): "
                           "set FORGEBENCH_SLOW=1")
def test_demo_learns_to_read_the_room(tmp_path):
    out, run, score = demo(tmp_path, "--steps", str(SLOW_STEPS), "--threads", "1")
    assert f"run completed after {SLOW_STEPS} steps" in out
    assert score >= SCORE_BAR, out
    assert score == recomputed_score(run, (tmp_path / "datasets" / "where-records" /
                                           "val.txt").read_text())
    before = int(re.search(r"BEFORE training: (\d+)/20", out).group(1))
    assert before < SCORE_BAR          # the twin: the untrained weights do not pass the bar


def test_sample_workspace_ships_the_demo_corpus_and_model(tmp_path):
    """The sample workspace's "Where is X?" records are what the generator writes (so they can
    be rebuilt, and the demo's reading of them holds), and its lm-pretrain-demo config trains
    the demo's model with the demo's optimiser."""
    from engine.data.generators.records import generate_records

    sample = REPO / "resources" / "sample-workspace"
    rebuilt = generate_records(tmp_path / "where-records", n=5000, questions=("where",))
    for split in ("train.txt", "val.txt", "test.txt"):
        assert (rebuilt / split).read_bytes() == \
            (sample / "datasets" / "where-records" / split).read_bytes()
    assert all(RECORD.match(line) for line in (rebuilt / "val.txt").read_text().splitlines())
    shipped = load_config(sample / "configs" / "lm-pretrain-demo.toml")
    demo_config = load_config(REPO / "resources" / "configs" / "lm-pretrain-demo.toml")
    for section in ("tokenizer", "model", "optim", "train"):
        assert getattr(shipped, section) == getattr(demo_config, section), section
    assert shipped.resolve_path(shipped.data.dir) == (sample / "datasets" / "where-records")
