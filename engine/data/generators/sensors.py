"""The synthetic fault-alert table for `tabular-classify`: fictional machines, five readings
each of temperature (°C), vibration (mm/s), load (fraction 0..1) and age (months), and whether
a fault followed (the handbook's chapter-4 tiny-ml data, in Forgebench's own code).

Structure, as the handbook describes it: risk rises smoothly with temperature, vibration and
age, and jumps when load passes a threshold (an interaction a tree ensemble can find and a
linear model only approximates); each machine carries an unobserved wear level shared by its
five rows, so a row-level split would leak machine identity into evaluation. About 3% of each
reading is missing (an empty CSV cell). Whole machines go to train/calibration/val/test in the
handbook's 1200/300/200/300-of-2000 proportions (`block_split`, so every 20 machines hold
exactly 12/3/2/3). The numbers describe no real machinery.

Deterministic for a seed; dataset.json (kind "tabular") carries the table schema, the split
policy, provenance, rights and the card.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, staged_dataset_dir
from engine.data.splits import block_split
from engine.errors import ForgebenchError

READINGS_PER_MACHINE = 5
FEATURES = ("temperature", "vibration", "load", "age")
TARGET = "fault"
RATIOS = {"train": 0.6, "val": 0.1, "calibration": 0.15, "test": 0.15}
MISSING_RATE = 0.03
LOAD_THRESHOLD = 0.8  # above it risk jumps: the interaction the boosting candidate can learn


def machine_rows(index: int, rng: np.random.Generator) -> list[dict]:
    """The five readings of machine `index` with their fault labels."""
    wear = rng.normal()                                   # unobserved, shared by the machine
    age = rng.uniform(2, 72)
    rows = []
    for reading in range(READINGS_PER_MACHINE):
        temperature = rng.normal(68 + 2.5 * wear, 6)
        vibration = float(np.exp(rng.normal(np.log(3.0) + 0.12 * wear, 0.3)))
        load = float(rng.beta(2.5, 2.0))
        months = age + reading * rng.uniform(0, 2)
        logit = (-3.4 + 0.02 * (temperature - 68) + 0.15 * (vibration - 3.0) + 2.5 * load
                 + 0.018 * (months - 36) + 3.6 * (load > LOAD_THRESHOLD) + 1.3 * wear)
        fault = int(rng.random() < 1 / (1 + np.exp(-logit)))
        values = {"temperature": round(float(temperature), 2), "vibration": round(vibration, 3),
                  "load": round(load, 3), "age": round(float(months), 1)}
        for name in FEATURES:
            if rng.random() < MISSING_RATE:
                values[name] = None
        rows.append({"id": f"m{index:05d}-r{reading}", "machine": f"m{index:05d}",
                     **values, TARGET: fault})
    return rows


def table_schema() -> dict:
    return {"target": TARGET, "group": "machine",
            "features": {name: "number" for name in FEATURES},
            "units": {"temperature": "degC", "vibration": "mm/s", "load": "fraction",
                      "age": "months"}}


def generate_sensors(out_dir: str | Path, machines: int = 400, seed: int = 42) -> Path:
    """Write rows.csv (one row per reading, a `split` column by machine) and dataset.json."""
    if machines < 20:
        raise ForgebenchError(f"need at least 20 machines for four splits, got {machines}",
                              where="--n")
    with staged_dataset_dir(out_dir) as root:
        rng = np.random.default_rng(seed)
        buffer = io.StringIO(newline="")
        columns = ["id", "machine", "split", *FEATURES, TARGET]
        writer = csv.DictWriter(buffer, columns, lineterminator="\n")
        writer.writeheader()
        counts = {split: 0 for split in RATIOS}
        for index in range(machines):
            split = block_split(index, seed, RATIOS)
            for row in machine_rows(index, rng):
                writer.writerow({**row, "split": split})
                counts[split] += 1
        (root / "rows.csv").write_text(buffer.getvalue(), encoding="utf-8")
        write_manifest(
            root, "tabular", "sensors",
            description="fictional machines: five readings each of temperature, vibration, "
                        "load and age, and whether a fault followed; machine-disjoint splits",
            records="rows.csv", table=table_schema(),
            split_policy={"method": "by machine", "group": "machine", "ratios": RATIOS,
                          "seed": seed, "rows_per_split": counts},
            provenance={"generator": "engine.data.generators.sensors", "machines": machines,
                        "seed": seed},
            rights=GENERATED_RIGHTS,
            card={"task": "alert on a future fault from one row of four sensor readings",
                  "sources": ["procedural rows by engine.data.generators.sensors"],
                  "preprocessing": f"about {MISSING_RATE:.0%} of each reading left empty "
                                   "(missing); no other processing",
                  "known_gaps": ["a fictional generator, not an engineering reliability model",
                                 "machine wear is hidden: rows of one machine are correlated"],
                  "intended_uses": ["the tabular-classify demo: baselines, calibration and an "
                                    "alert threshold on grouped data"],
                  "prohibited_uses": ["claims about real machines or real fault rates"]})
    return Path(out_dir).expanduser().absolute()
