"""embed-retrieval end to end on a tiny random BERT (the real MiniLM is not needed): a real
`forgebench run` stopped after step 1 and resumed matches an uninterrupted run bit for bit;
step 0 scores the untouched encoder; the best checkpoint is the highest val MRR@5; the selection
against TF-IDF and the index contract are checked against independent recomputation; `search`
answers from the selected system and refuses a tampered index; MNRL matches its formula."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from media_support import forgebench, same_tensors

from engine.cli import main
from engine.config import load_config
from engine.data.dataset import load_dataset
from engine.data.generators.retrieval import generate_help_articles, help_articles
from engine.data.retrieval import retrieval_data
from engine.errors import ForgebenchError
from engine.eval.retrieval import TfidfRetriever, retrieval_metrics
from engine.fsutil import read_json, sha256_bytes
from engine.jobs import execute, start_run
from engine.recipes import embed_retrieval as recipe
from engine.rundir import RunDir
from tests.retrieval_support import write_tiny_bert


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("er")
    docs, queries = help_articles("hard")
    write_tiny_bert(root / "tiny", [d["text"] for d in docs] + [q["text"] for q in queries])
    data = generate_help_articles(root / "data", "hard")
    config = root / "c.toml"
    config.write_text(f'recipe = "embed-retrieval"\nseed = 1\nsteps = 4\nbatch_size = 8\n'
                      f'eval_every = 2\nsave_every = 2\nkeep_last = 5\n'
                      f'[data]\ndir = "{data}"\n[encoder]\nsource = "{root / "tiny"}"\n'
                      f'[optim]\nlr = 1e-3\n', encoding="utf-8")
    return root, config, data


def train_series(run: RunDir) -> dict:
    return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in run.metrics()
            if m.get("split") == "train"}


@pytest.fixture(scope="module")
def trained(setup):
    root, config, _ = setup
    reference = start_run(load_config(config), root / "ref", ["test"], threads=1)
    execute(reference, load_config(config), None, threads=1, progress=False)
    out = root / "run"
    forgebench("run", str(config), "--out", str(out), "--threads", "1",
               "--stop-after-step", "1")
    run = RunDir(out)
    assert run.status()["state"] == "stopped" and not (out / "index").exists()
    forgebench("resume", str(out))
    return reference, run


def test_stop_resume_is_exact(trained):
    reference, run = trained
    assert run.status()["state"] == "completed"
    assert sorted(train_series(run)) == [1, 2, 3, 4]
    assert train_series(run) == train_series(reference)
    for name in ("model.safetensors", "optimizer.safetensors"):
        same_tensors(run.path / "checkpoints/step-000004" / name,
                     reference.path / "checkpoints/step-000004" / name)


def test_step_zero_is_the_untouched_encoder_and_best_is_the_top_val_mrr(trained, setup):
    _, run = trained
    root, config, data_dir = setup
    val = {m["step"]: m for m in run.metrics() if m.get("split") == "val"}
    assert sorted(val) == [0, 2, 4]
    data = retrieval_data(load_dataset(data_dir))
    encoder, _ = recipe.load_encoder(load_config(config))
    queries = data.split_queries("val")
    scores = recipe.neural_scores(encoder, load_config(config), data, [q.text for q in queries])
    untouched = recipe.scores_report(scores, data, queries, 20.0)
    assert val[0]["mrr@5"] == pytest.approx(untouched["mrr@5"], abs=1e-9)
    best_step = max(sorted(val), key=lambda s: (val[s]["mrr@5"], -s))  # first of the highest
    assert run.status()["best_checkpoint"] == f"step-{best_step:06d}"


def test_the_index_contract_records_the_selection_and_the_corpus(trained, setup):
    _, run = trained
    data = retrieval_data(load_dataset(setup[2]))
    contract = read_json(run.path / "index" / "contract.json")
    rows = {d: i for i, d in enumerate(data.doc_ids)}
    queries = data.split_queries("val")
    tfidf = retrieval_metrics(TfidfRetriever(data.doc_texts).scores([q.text for q in queries]),
                              [{rows[d] for d in q.relevant} for q in queries], (5,))
    assert contract["val"]["tfidf"]["mrr@5"] == pytest.approx(tfidf["mrr@5"], abs=1e-12)
    encoder_won = contract["val"]["encoder"]["mrr@5"] > tfidf["mrr@5"]
    assert contract["selected"] == ("encoder" if encoder_won else "tfidf")
    assert contract["checkpoint"] == run.status()["best_checkpoint"]
    assert contract["pooling"] == "mean" and contract["normalized"] is True
    assert [d["doc_id"] for d in contract["documents"]] == data.doc_ids
    assert [d["text_sha256"] for d in contract["documents"]] == [
        sha256_bytes(t.encode()) for t in data.doc_texts]


def test_search_answers_from_the_selected_system(trained, capsys):
    _, run = trained
    assert main(["search", str(run.path), "In Iris, I need to stop future renewals.", "--k",
                 "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    contract = read_json(run.path / "index" / "contract.json")
    assert result["selected"] == contract["selected"] and len(result["results"]) == 3
    scores = [hit["score"] for hit in result["results"]]
    assert scores == sorted(scores, reverse=True)


def test_search_prints_ranked_documents(trained, capsys):
    _, run = trained
    assert main(["search", str(run.path), "cancel", "--k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    selected = read_json(run.path / "index" / "contract.json")["selected"]
    assert lines[0].startswith(selected) and len(lines) == 3
    assert [line.split()[0] for line in lines[1:]] == ["1", "2"]


def test_the_encoder_is_selected_only_when_it_beats_tfidf_and_a_tampered_index_is_refused(
        trained, setup, capsys, tmp_path):
    run = RunDir(shutil.copytree(trained[1].path, tmp_path / "run"))   # this test tampers
    config = load_config(setup[1])
    data = retrieval_data(load_dataset(setup[2]))
    best = run.checkpoint("best")
    encoder = recipe.checkpoint_encoder(run, best)
    tie = recipe.write_index(run, config, data, best, encoder, "id", {"mrr@5": 0.5},
                             {"mrr@5": 0.5})
    assert tie["selected"] == "tfidf"              # a tie does not earn the neural model
    won = recipe.write_index(run, config, data, best, encoder, "id", {"mrr@5": 0.6},
                             {"mrr@5": 0.5})
    assert won["selected"] == "encoder"
    vectors = np.load(run.path / "index" / "embeddings.npy")
    assert vectors.shape == (len(data.doc_ids), 32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    hit = recipe.search(run, data.doc_texts[5], k=1)["results"][0]
    assert hit["doc_id"] == data.doc_ids[5] and hit["score"] == pytest.approx(1, abs=1e-5)

    (run.path / "index" / "embeddings.npy").write_bytes(
        recipe._npy_bytes(vectors[::-1].copy()))
    with pytest.raises(ForgebenchError, match="document vectors differ"):
        recipe.search(run, "cancel")
    assert main(["search", str(run.path), "cancel"]) == 2
    assert "error: " in capsys.readouterr().err
    changed = data.__class__(data.doc_ids, ["edited"] + data.doc_texts[1:], data.doc_splits,
                             data.queries)
    with pytest.raises(ForgebenchError, match="corpus differs"):
        recipe.check_index(run, changed)


def test_evaluate_reports_the_encoder_epoch0_and_tfidf(trained):
    _, run = trained
    report = recipe.evaluate(run, run.checkpoint("latest"), "test")
    assert report["split"] == "test" and report["queries"] == 48
    for system in ("encoder", "epoch0", "tfidf"):
        assert {"recall@5", "mrr@5", "ndcg@5", "recall@10"} <= set(report[system])
    assert report["beats_tfidf"] == (report["encoder"]["mrr@5"] > report["tfidf"]["mrr@5"])
    assert read_json(run.path / "evals" / "test-step-000004.json")["mrr@5"] == report["mrr@5"]


def test_mnrl_is_the_formula():
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 5), dim=1)
    d = torch.nn.functional.normalize(torch.randn(3, 5), dim=1)
    s = (q @ d.T).tolist()
    expected = sum(-math.log(math.exp(20 * s[i][i]) / sum(math.exp(20 * x) for x in s[i]))
                   for i in range(3)) / 3
    assert float(recipe.mnrl_loss(q, d, ["a", "b", "c"], 20.0)) == pytest.approx(expected,
                                                                                abs=1e-4)
    # a repeated document is no negative of itself: rows 0 and 2 drop each other's column
    masked = sum(-math.log(math.exp(20 * s[i][i]) / sum(math.exp(20 * s[i][j]) for j in
                                                         range(3) if j == i or j == 1))
                 for i in (0, 2))
    masked -= math.log(math.exp(20 * s[1][1]) / sum(math.exp(20 * x) for x in s[1]))
    assert float(recipe.mnrl_loss(q, d, ["a", "b", "a"], 20.0)) == pytest.approx(masked / 3,
                                                                                abs=1e-4)


def test_bad_data_is_refused_with_a_clear_error(setup, tmp_path, capsys):
    _, config, _ = setup
    text = config.read_text().replace(str(setup[2]), str(tmp_path / "missing"))
    (tmp_path / "c.toml").write_text(text)
    assert main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "dataset folder not found" in err
    assert "forgebench data generate help-articles" in err     # the sample of its kind
    assert not (tmp_path / "r").exists()


# -- the app's search box ------------------------------------------------------------------
def test_search_viewmodel_says_which_runs_can_be_searched(trained, tmp_path):
    from app.viewmodels import search as vm

    _, run = trained
    assert vm.searchable(None)[0] is False
    assert "not a readable run" in vm.searchable(tmp_path)[1]
    ok, reason = vm.searchable(run.path)
    assert ok and read_json(run.path / "index" / "contract.json")["selected"] in reason
    answer = vm.parse_answer(json.dumps({"query": "q", "selected": "tfidf", "checkpoint": "c",
                                         "results": [{"rank": 1, "doc_id": "d", "score": 0.5,
                                                      "text": "t"}]}), "", 0)
    assert answer.hits == [vm.Hit(1, "d", 0.5, "t")] and "TF-IDF" in answer.summary
    with pytest.raises(ForgebenchError, match="the run has no index yet"):
        vm.parse_answer("", "progress\nerror: the run has no index yet\nhint: resume", 2)


def test_search_box_shows_ranked_documents_off_the_gui_thread(trained, qtbot):
    from app.views.search_box import SearchBox

    _, run = trained
    box = SearchBox()
    qtbot.addWidget(box)
    box.set_run(run.path)
    box.query.setText("How do I cancel the subscription in Iris?")
    box.k.setValue(3)
    with qtbot.waitSignal(box.call.done, timeout=300_000):
        box.search()
    expected = recipe.search(run, "How do I cancel the subscription in Iris?", k=3)["results"]
    assert box.results.rowCount() == 3
    assert [box.results.item(r, 2).text() for r in range(3)] == [h["doc_id"] for h in expected]
    assert box.button.isEnabled() and "scores are similarities" in box.status.text()


def test_the_runs_pane_charts_validation_mrr(trained, qtbot):
    from app.views.charts import RunCharts

    _, run = trained
    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.show()
    charts.set_runs([run.path])
    qtbot.waitUntil(lambda: not charts.pending)          # plots are drawn one per tick
    assert charts.plot_widgets["mrr@5"].isVisible()
    curve = [list(item.getData()[1]) for item in charts.plots["mrr@5"].listDataItems()]
    expected = [m["mrr@5"] for m in run.metrics() if m.get("split") == "val"]
    assert [pytest.approx(v) for v in expected] in curve
