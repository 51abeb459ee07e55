"""The installable forms (`make package`): the wheel's file list, and the one-folder desktop
bundle opened for real.

Both build a package, so both are slow-marked (`make test-package`). The wheel is built from a
copy of the sources that includes tests/, so "no tests in the wheel" is the packaging config's
doing, not the copy's. The bundle test (PyInstaller over torch takes many minutes on 2 cores)
builds dist/Forgebench/, opens it under
Xvfb on a scratch HOME, waits for its window, screenshots it to
build/test-package/bundle-window.png and runs one engine command through the bundle's
`forgebench` link.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "app", "engine", "resources", "docs/user-guide.md",
           "tests")
NEEDED = ("app/main.py", "app/views/main_window.py", "engine/cli.py",
          "engine/kernels/ggml_kernels.c", "resources/configs/lm-pretrain.toml",
          "resources/sample-workspace/workspace.json",
          "resources/sample-workspace/datasets/pirate/records.jsonl")
SCREENSHOT = REPO / "build" / "test-package" / "bundle-window.png"


def wheel_problems(names: list[str]) -> list[str]:
    """What is wrong with a wheel's file list: a needed file missing, any test file present,
    no console scripts or no user guide."""
    problems = [f"missing {n}" for n in NEEDED if n not in names]
    problems += [f"holds {n}" for n in names if n.startswith("tests/") or "/tests/" in n]
    if not any(n.endswith(".data/data/share/forgebench/user-guide.md") for n in names):
        problems.append("missing the user guide")
    if not any(n.endswith(".dist-info/entry_points.txt") for n in names):
        problems.append("missing entry_points.txt")
    return problems


def ignore_build_outputs(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith(".egg-info")]


SLOW = pytest.mark.skipif(os.environ.get("FORGEBENCH_SLOW") != "1",
                          reason="builds a package (half a minute or more): set FORGEBENCH_SLOW=1 "
                                 "or run `make test-package`")


@pytest.mark.slow
@SLOW
def test_the_wheel_holds_app_engine_resources_and_the_guide_but_no_tests(tmp_path):
    source = tmp_path / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore_build_outputs)
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), "."],
                          cwd=source, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("forgebench-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        scripts = next(archive.read(n).decode() for n in names
                       if n.endswith(".dist-info/entry_points.txt"))
    assert (source / "tests" / "test_package.py").is_file()     # tests were there to leave out
    assert wheel_problems(names) == []
    assert "forgebench = engine.cli:main" in scripts
    assert "forgebench-app = app.main:main" in scripts
    sample = [n for n in names if n.startswith("resources/sample-workspace/")]
    on_disk = [p for p in (REPO / "resources/sample-workspace").rglob("*") if p.is_file()]
    assert len(sample) == len(on_disk)                           # all of the sample workspace


def test_twin_the_file_list_check_sees_tests_and_missing_resources():
    names = ["app/main.py", "engine/cli.py", "tests/test_x.py",
             "forgebench-0.1.0.dist-info/entry_points.txt"]
    problems = wheel_problems(names)
    assert "holds tests/test_x.py" in problems
    assert "missing resources/configs/lm-pretrain.toml" in problems
    assert "missing the user guide" in problems


def window_titles(display: str) -> list[str]:
    tree = subprocess.run(["xwininfo", "-root", "-tree"],
                          env={**os.environ, "DISPLAY": display, "LC_ALL": "C.UTF-8"},
                          capture_output=True, text=True).stdout
    return [line.split('"')[1] for line in tree.splitlines() if line.count('"') >= 2]


def settled_screen(display: str, timeout: float = 60.0):
    """The screen once a window has painted (more than 16 colours) and two grabs half a second
    apart are the same picture: the pane has filled its lists and stopped redrawing."""
    from PIL import ImageChops, ImageGrab

    deadline = time.monotonic() + timeout
    previous = None
    while True:
        shot = ImageGrab.grab(xdisplay=display)
        painted = len(shot.getcolors(1 << 16) or range(1 << 16)) > 16
        if painted and previous is not None \
                and ImageChops.difference(shot, previous).getbbox() is None:
            return shot
        assert time.monotonic() < deadline, "the window never settled"
        previous = shot
        time.sleep(0.5)


@pytest.mark.slow
@SLOW
@pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xwininfo")),
                    reason="needs Xvfb and xwininfo (apt: xvfb x11-utils)")
@pytest.mark.skipif(importlib.util.find_spec("PyInstaller") is None,
                    reason="PyInstaller is not installed (the 'package' extra)")
def test_the_bundle_opens_its_window_on_a_scratch_home(tmp_path):
    dist = REPO / "dist"
    built = subprocess.run([str(Path(sys.executable).with_name("pyinstaller")), "--noconfirm",
                            "--log-level", "WARN", "--distpath", str(dist), "--workpath",
                            str(REPO / "build" / "pyinstaller"),
                            str(REPO / "packaging" / "forgebench.spec")],
                           cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-3000:]
    bundle = dist / "Forgebench"
    assert (bundle / "forgebench").is_symlink() and (bundle / "forgebench.desktop").is_file()

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FORGEBENCH_", "QT_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local/share"), QT_QPA_PLATFORM="xcb",
               LC_ALL="C.UTF-8")       # the title's dash, for Qt and for xwininfo's listing
    env["PATH"] = "/usr/bin:/bin"                               # not this venv's python
    read, write = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1280x800x24"],
                            pass_fds=(write,), stderr=subprocess.DEVNULL)
    os.close(write)
    display = ":" + os.read(read, 16).decode().strip()
    env["DISPLAY"] = display
    app = subprocess.Popen([str(bundle / "Forgebench")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(t.startswith("Forgebench —") for t in window_titles(display)):
            assert app.poll() is None, app.stdout.read()
            assert time.monotonic() < deadline, window_titles(display)
            time.sleep(0.5)
        shot = settled_screen(display)                  # the first pane's lists filled in
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shot.save(SCREENSHOT)
        assert len(shot.getcolors(1 << 16) or range(1 << 16)) > 16     # a window, not a void
        assert "Forgebench — Forgebench sample workspace" in window_titles(display)
        assert (home / ".local/share/forgebench/sample-workspace/workspace.json").is_file()

        # The engine side of the same bundle, as the app starts its jobs.
        validate = subprocess.run(
            [str(bundle / "forgebench"), "data", "validate",
             str(home / ".local/share/forgebench/sample-workspace/datasets/pirate")],
            env=env, capture_output=True, text=True, timeout=300)
        assert validate.returncode == 0, validate.stderr[-2000:]
        assert "0 errors" in validate.stdout
    finally:
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()
        xvfb.terminate()
        xvfb.wait(10)
