"""Cold start of the workbench: process start → first paint → first responsive event, beside a
bare PySide6 window (the floor no Qt app can beat on this machine).

Each launch is a fresh process on a scratch HOME. The first launch installs the sample
workspace (its copy is timed and shown apart); the timed launches reopen it, as every launch
after the first does. A launch is timed with the system-wide monotonic clock: the parent reads
it just before starting the child; the child (this file with --child) notes the first Paint
event of a widget in its main window, then posts an event to itself and notes when the event
loop delivers it (the window answers input from then on), and closes the window.

    xvfb-run -a python bench/bench_app_start.py [--runs 5] [--compare CHECKOUT]

--compare adds a third launch: the app of another checkout (say the main branch before a
change), timed the same way in the same rounds.

Without a display the children render offscreen (QT_QPA_PLATFORM=offscreen), which paints
the same widgets without an X server. The file cache is warm after the first launch: this is
the start a user sees every day, not the first after a reboot. The load average is printed
before and after: the figures mean little on a machine busy with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(kind: str, root: Path) -> None:
    """One launch: the real `forgebench-app` of the checkout `root` (or a bare window),
    instrumented from outside."""
    from PySide6.QtCore import QCoreApplication, QEvent, QObject
    from PySide6.QtWidgets import QApplication, QLabel, QMainWindow, QWidget

    app = QApplication(sys.argv[:1])
    marks: dict[str, float] = {}
    answered = QEvent.Type(QEvent.registerEventType())

    class Probe(QObject):
        def eventFilter(self, obj, event) -> bool:
            if "paint" not in marks and event.type() == QEvent.Type.Paint and \
                    isinstance(obj, QWidget) and isinstance(obj.window(), QMainWindow):
                marks["paint"] = time.monotonic()
                QCoreApplication.postEvent(self, QEvent(answered))
            return False

        def event(self, event) -> bool:
            if event.type() == answered:
                marks["responsive"] = time.monotonic()
                print(json.dumps(marks), flush=True)
                for window in QApplication.topLevelWidgets():
                    window.close()      # the app's own close path: its worker threads end
                return True
            return super().event(event)

    probe = Probe()
    app.installEventFilter(probe)
    if kind == "bare":
        window = QMainWindow()
        window.setCentralWidget(QLabel("a bare PySide6 window"))
        window.resize(1024, 700)
        window.show()
        app.exec()
    else:
        sys.path.insert(0, str(root))
        from app.main import main

        main([])


def launch(kind: str, env: dict, root: Path = REPO) -> dict:
    start = time.monotonic()
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--root", str(root)],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} launch failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    marks = json.loads(lines[-1])
    return {"paint_s": marks["paint"] - start, "responsive_s": marks["responsive"] - start,
            "exit_s": time.monotonic() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout whose app to time too")
    parser.add_argument("--child", choices=("app", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.root)
        return 0
    home = Path(tempfile.mkdtemp(prefix="forgebench-start-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORGEBENCH_CONFIG_DIR", "FORGEBENCH_DATA_DIR")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local/share"))
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        env.setdefault("QT_QPA_PLATFORM", "offscreen")
    platform = env.get("QT_QPA_PLATFORM") or f"default on display {env.get('DISPLAY')}"
    print(f"platform: {platform}; {os.cpu_count()} CPUs; load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    first = launch("app", env)
    print(f"first launch (copies the sample workspace): {first['responsive_s']:.2f} s to "
          "responsive")
    launches = {"bare": ("bare", REPO), "app": ("app", REPO)}
    labels = {"bare": "bare PySide6 window (floor)", "app": "forgebench-app"}
    if args.compare:
        launches["compare"] = ("app", args.compare.resolve())
        labels["compare"] = "the compared checkout's app"
    rows: dict[str, list[dict]] = {name: [] for name in launches}
    for _ in range(args.runs):                  # interleaved: all see the same load
        for name, (kind, root) in launches.items():
            rows[name].append(launch(kind, env, root))
    print(f"\n{'launch':<28}{'first paint s':>15}{'responsive s':>15}   runs (responsive)")
    medians = {}
    for kind, label in labels.items():
        paint = statistics.median(r["paint_s"] for r in rows[kind])
        ready = statistics.median(r["responsive_s"] for r in rows[kind])
        medians[kind] = ready
        runs = " ".join(f"{r['responsive_s']:.2f}" for r in rows[kind])
        print(f"{label:<28}{paint:>15.2f}{ready:>15.2f}   {runs}")
    print(f"\nmedian to responsive: app {medians['app']:.2f} s, floor {medians['bare']:.2f} s, "
          f"ratio {medians['app'] / medians['bare']:.2f}x; goal ≤ 2 s"
          + (f"; the compared checkout {medians['compare']:.2f} s" if args.compare else ""))
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
