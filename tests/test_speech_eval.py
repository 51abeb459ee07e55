"""The ASR scorer against the handbook's worked examples, a brute-force edit distance, and
jiwer (a test-only extra) on a fixture corpus."""

from __future__ import annotations

import itertools

import pytest

from engine.eval.speech import align, edit_counts, normalize_lexical, score


def clip(reference, hypothesis, speaker="s1", cid=None):
    return {"id": cid or reference, "speaker": speaker, "reference": reference,
            "hypothesis": hypothesis}


def test_handbook_worked_examples():
    # "turn the pump off" -> "turn pump on": one deletion and one substitution out of 4
    report = score([clip("turn the pump off", "turn pump on")],
                   {"negation": ["not", "off", "on"]})
    assert report["raw"]["wer"] == 0.5
    assert (report["raw"]["substitutions"], report["raw"]["deletions"]) == (1, 1)
    assert report["terms"]["negation"] == {"reference": 1, "missed": 1, "invented": 1}
    # Chinese: one changed character out of four is 25 % CER; whitespace WER is one word
    chinese = score([clip("你好世界", "你好世间")])
    assert chinese["raw"]["cer"] == 0.25 and chinese["raw"]["wer"] == 1.0
    # many inserted words: WER above 100 %
    assert score([clip("stop", "please do not stop now")])["raw"]["wer"] == 4.0


def test_raw_keeps_case_and_punctuation_lexical_does_not():
    report = score([clip("Do not restart pump three.", "do not restart pump three")])
    assert report["raw"]["wer"] == pytest.approx(2 / 5)      # "Do" and "three." differ
    assert report["lexical"]["wer"] == 0.0
    assert normalize_lexical("Don\u2019t  stop!") == "don t stop"   # apostrophes split words


def test_corpus_aggregation_is_not_an_average_of_utterances():
    clips = [clip("stop", "start"), clip("replace the m eight bolt on pump three",
                                         "replace the m eight bolt on pump three")]
    report = score(clips)
    assert report["lexical"]["wer"] == pytest.approx(1 / 9)
    # twin: the per-utterance mean the handbook warns about is a different number here
    assert (1.0 + 0.0) / 2 != pytest.approx(report["lexical"]["wer"])


def test_empty_references_are_counted_apart_from_wer():
    clips = [clip("", "", cid="quiet"), clip("", "pump three", cid="noise"),
             clip("check the seal", "check the seal")]
    report = score(clips)
    assert report["empty_reference"] == {"clips": 2, "false_positives": 1, "inserted_words": 2,
                                         "ids": ["noise"]}
    assert report["lexical"]["wer"] == 0.0 and report["scored_clips"] == 1
    assert report["inserted_words"] == 2


def test_per_speaker_slices():
    report = score([clip("stop pump one", "stop pump one", "a"),
                    clip("stop pump two", "stop pump", "b")])
    assert report["speakers"]["a"]["wer"] == 0.0
    assert report["speakers"]["b"]["wer"] == pytest.approx(1 / 3)


def brute_distance(a, b):
    """Edit distance by trying every alignment recursively (tiny inputs only)."""
    if not a or not b:
        return len(a) + len(b)
    return min(brute_distance(a[1:], b[1:]) + (a[0] != b[0]),
               brute_distance(a[1:], b) + 1, brute_distance(a, b[1:]) + 1)


def test_alignment_is_minimal_and_consistent():
    words = ["a", "b", "c"]
    for n, m in itertools.product(range(4), range(4)):
        for ref in itertools.product(words, repeat=n):
            for hyp in list(itertools.product(words, repeat=m))[:9]:
                ops = align(list(ref), list(hyp))
                counts = edit_counts(list(ref), list(hyp))
                assert counts["sub"] + counts["del"] + counts["ins"] == brute_distance(ref, hyp)
                assert [r for _, r, _ in ops if r is not None] == list(ref)
                assert [h for _, _, h in ops if h is not None] == list(hyp)


def test_jiwer_agrees_on_a_fixture():
    jiwer = pytest.importorskip("jiwer", reason="jiwer is a test-only extra: pip install "
                                                "'.[speech-test]'")
    references = ["replace the m eight bolt on pump three", "do not restart pump three",
                  "set motor two to forty bar", "check the pressure before opening the valve",
                  "never open fan nine without a permit"]
    hypotheses = ["replace the m eight bolts on pump tree", "do restart pump three",
                  "set motor two to forty forty bar", "check pressure before opening valve",
                  "never open fan nine without a permit now"]
    report = score([clip(r, h) for r, h in zip(references, hypotheses)])
    words = jiwer.process_words(references, hypotheses)
    assert report["lexical"]["wer"] == pytest.approx(words.wer, abs=1e-12)
    assert (report["lexical"]["substitutions"], report["lexical"]["deletions"],
            report["lexical"]["insertions"]) == (words.substitutions, words.deletions,
                                                 words.insertions)
    stripped = [[r.replace(" ", "") for r in references], [h.replace(" ", "") for h in hypotheses]]
    assert report["lexical"]["cer"] == pytest.approx(jiwer.cer(*stripped), abs=1e-12)
    # twin: jiwer's CER keeps spaces as characters, so it differs from ours on the same text
    assert jiwer.cer(references, hypotheses) != pytest.approx(report["lexical"]["cer"])
