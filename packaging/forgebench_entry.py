"""The desktop bundle's one program. Started as `Forgebench` it opens the workbench; started
through the `forgebench` link beside it (how the app runs its jobs: app/viewmodels/jobs.py
finds `forgebench` next to its own executable) it is the engine's command line; started as
`Forgebench -m MODULE ARGS` it runs that module, as `python -m` would (the export's
equivalence stages and `--nproc` launches start their workers that way)."""

import multiprocessing
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    multiprocessing.freeze_support()    # torch's DataLoader workers re-enter the executable
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        sys.exit(0)
    if Path(sys.argv[0]).name == "forgebench":
        from engine.cli import main
    else:
        from app.main import main
    sys.exit(main(sys.argv[1:]))
