"""tabular-classify's calibration check: does Platt scaling improve ECE, on validation and in
truth, across generator seeds?

For each generator seed, generates the sensors table (400 machines, the handbook's
1200/300/200/300 split), runs the sample config as a real `forgebench run` subprocess once per
calibration method ("cross-fit", the default: on out-of-fold train scores, folds by machine;
"split": the handbook's sigmoid on the calibration split), reads
evals/selection-step-000001.json (val ECE before and after, equal-mass ECE, the noise floor,
Brier, log loss, val AP of every candidate), and reads the test split once with `forgebench eval
--split test` (test AP, ROC-AUC).

The 200 validation rows cannot resolve the small miscalibration of the boosted model (the ECE
a perfectly calibrated model shows on them is about 0.06), so the bench also scores the saved
model, before and after its calibration, on a large fresh sample of machines drawn from the
same generator (`--truth-machines`, 50,000 rows by default; not a split of any run): the ECE
there is close to the model's true calibration error. Prints one JSON object.

    python bench/bench_tabular_calibration.py [--seeds 42,1,2,3,4,5,6,7,8]
        [--methods split,cross-fit] [--truth-machines 10000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.engine_cli import forgebench  # noqa: E402  (a `python -m engine` subprocess)
from engine.data.generators.sensors import machine_rows  # noqa: E402
from engine.eval import binary  # noqa: E402
from engine.recipes.tabular_classify import load_model  # noqa: E402
from engine.rundir import RunDir  # noqa: E402

TRUTH_SEED = 1_000_003   # machines no generator seed of the sweep draws in this order


def truth_sample(machines: int, feature_names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Fresh machines from the generator's own row model, columns in the model's order."""
    rng = np.random.default_rng(TRUTH_SEED)
    rows = [row for index in range(machines) for row in machine_rows(index, rng)]
    features = np.array([[np.nan if row[name] is None else row[name] for name in feature_names]
                         for row in rows], dtype=np.float64)
    return features, np.array([row["fault"] for row in rows])


def one_run(data: Path, out: Path, method: str) -> Path:
    config = (REPO / "resources" / "configs" / "tabular-classify.toml").read_text()
    config = config.replace('dir = "datasets/sensors"', f'dir = "{data}"')
    config = re.sub(r'^calibration = "[a-z-]+"', f'calibration = "{method}"', config, count=1,
                    flags=re.M)
    (out / f"{method}.toml").write_text(config)
    run = out / method
    forgebench("run", str(out / f"{method}.toml"), "--out", str(run))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="42,1,2,3,4,5,6,7,8")
    parser.add_argument("--methods", default="split,cross-fit")
    parser.add_argument("--truth-machines", type=int, default=10_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-tabular-calibration-"))
    truth = None
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        data = out / f"sensors-{seed}"
        if not data.exists():
            forgebench("data", "generate", "sensors", "--out", str(data), "--seed", str(seed))
        for method in args.methods.split(","):
            (out / str(seed)).mkdir(parents=True, exist_ok=True)
            run = one_run(data, out / str(seed), method)
            selection = json.loads((run / "evals" / "selection-step-000001.json").read_text())
            test = json.loads(forgebench("eval", str(run), "--split", "test"))
            model, _ = load_model(RunDir(run).checkpoint(1))
            if truth is None:
                truth = truth_sample(args.truth_machines, model.feature_names)
            before, after = model.uncalibrated(truth[0]), model.probability(truth[0])
            row = {"seed": seed, "method": method, "calibration": selection["calibration"],
                   "val_ap": selection["candidates"], "test_ap": test["average_precision"],
                   "test_roc_auc": test["roc_auc"],
                   "truth_rows": int(len(truth[1])),
                   "truth_ece": [binary.reliability(truth[1], p, 10)["ece"]
                                 for p in (before, after)],
                   "truth_log_loss": [binary.log_loss(truth[1], p) for p in (before, after)]}
            for key in ("ece", "ece_equal_mass", "ece_noise_floor", "brier", "log_loss"):
                row[f"val_{key}"] = [selection["uncalibrated"][key],
                                     selection["calibrated"][key]]
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for method in args.methods.split(","):
        rows = [r for r in results if r["method"] == method]
        summary[method] = {
            "seeds": len(rows),
            "val_ece_improved": sum(r["val_ece"][1] < r["val_ece"][0] for r in rows),
            "truth_ece_improved": sum(r["truth_ece"][1] < r["truth_ece"][0] for r in rows),
            **{f"mean_{key}": np.mean([r[key] for r in rows], axis=0).round(4).tolist()
               for key in ("val_ece", "val_ece_equal_mass", "val_ece_noise_floor", "val_brier",
                           "val_log_loss", "truth_ece", "truth_log_loss", "test_ap",
                           "test_roc_auc")}}
    print(json.dumps({"out": str(out), "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
