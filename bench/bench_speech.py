"""speech-recognize's acceptance run: WER on held-out espeak-ng voices within a stated CPU
budget, the training curve, and the silence/noise probe counts.

Generates the spoken-command corpus (40 speakers, two sessions of 16 clips each; 32 train, 4
val and 4 test voices), trains the default config (resources/configs/speech-recognize.toml)
as a real `forgebench run` subprocess, evaluates the best checkpoint on the test split with
`forgebench eval --split test`, and prints the val curve, the test report's headline figures
and the process CPU seconds the training used (from its metrics rows).

    python bench/bench_speech.py [--steps 1500] [--threads 2] [--data DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.engine_cli import forgebench  # noqa: E402  (a `python -m engine` subprocess)


def acceptance(data: Path | None, out: Path, steps: int, threads: int) -> dict:
    """Train and evaluate; the figures the report quotes."""
    if data is None:
        data = out / "speech"
        forgebench("data", "generate", "speech", "--out", str(data), "--n", "40")
    config = (REPO / "resources" / "configs" / "speech-recognize.toml").read_text()
    config = config.replace('dir = "datasets/speech"', f'dir = "{data}"')
    config = "\n".join(f"steps = {steps}" if line.startswith("steps =") else line
                       for line in config.splitlines())
    (out / "speech.toml").write_text(config + "\n")
    run = out / "run"
    forgebench("run", str(out / "speech.toml"), "--out", str(run), "--threads", str(threads))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    curve = [{k: r[k] for k in ("step", "loss", "wer", "cer")} for r in rows
             if r.get("split") == "val"]
    status = json.loads((run / "status.json").read_text())
    best = status.get("best_checkpoint", "latest")
    report = json.loads(forgebench("eval", str(run), "--split", "test", "--checkpoint", best))
    return {"run": str(run), "steps": steps, "threads": threads,
            "train_wall_s": train[-1]["elapsed_s"],
            "train_cpu_s": train[-1]["process_cpu_s"],   # the invocation's CPU, all threads
            "examples_per_s": train[-1]["examples_per_s"], "curve": curve,
            "best_checkpoint": best, "test": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-speech-"))
    out.mkdir(parents=True, exist_ok=True)
    result = acceptance(args.data, out, args.steps, args.threads)
    test = result["test"]
    print(f"run {result['run']}: {result['steps']} steps on {result['threads']} threads, "
          f"{result['train_wall_s']:.0f} s wall, {result['train_cpu_s']:.0f} s process CPU")
    print("val curve (step, loss, WER, CER):")
    for row in result["curve"]:
        print(f"  {row['step']:5d}  {row['loss']:.4f}  {row['wer']:.3f}  {row['cer']:.3f}")
    print(f"test ({result['best_checkpoint']}, held-out voices): greedy WER "
          f"{test['wer']:.3f}, CER {test['cer']:.3f}; beam WER {test['beam_wer']:.3f}")
    print("per speaker:", {k: round(v["wer"], 3) for k, v in test["greedy"]["speakers"].items()})
    print("empty references:", test["greedy"]["empty_reference"])
    print("terms:", test["greedy"]["terms"])
    probes = test["probes"]
    print(f"probes: {probes['non_speech_empty_or_flagged']}/{probes['non_speech_clips']} "
          "non-speech probes empty or flagged;",
          {k: {f: v[f] for f in ("clips", "empty", "flagged", "empty_or_flagged")}
           for k, v in probes["kinds"].items()})


if __name__ == "__main__":
    main()
