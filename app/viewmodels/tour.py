"""The first-run tour: three steps (Datasets → Runs → Samples) that show a new user where the
data is, where training happens and where its results appear.

Qt-free. The tour is on until the user dismisses or finishes it; that choice is remembered in
the app's Settings under `TOUR_DONE_KEY`, so it is shown once per user, not per workspace.
The Help menu starts it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.viewmodels.workspace import Settings

TOUR_DONE_KEY = "tour_done"


@dataclass(frozen=True)
class TourStep:
    pane: str       # the sidebar entry the step shows (main_window.PANES without "&&")
    title: str
    text: str


STEPS = (
    TourStep("Datasets", "1 of 3 · Datasets: what the model learns from",
             "Each dataset is a folder with its records, media and a data card. Pick "
             "“shapes” to browse its images and labels; Validate checks every record and "
             "marks the bad ones. Import… brings in your own folder, CSV or JSONL."),
    TourStep("Runs", "2 of 3 · Runs: train and watch",
             "Pick a config and press Start: try “lm-pretrain-demo”, a tiny language model "
             "that learns in about two minutes to answer “Where is X?” from a record it has "
             "never seen. The job runs in its own process; the charts follow its loss as it "
             "learns, with the stage and the time left."),
    TourStep("Samples", "3 of 3 · Samples: what the model makes",
             "Every checkpoint's generated images, sounds and text, with the seed and "
             "settings that made them. Step through a run's checkpoints to see it learn "
             "(the demo's answers turn from noise into the record's room); rate samples, "
             "or compare two checkpoints blind in Blind A/B."),
)


class Tour:
    """Where the user is in the tour, and whether it is still to be shown."""

    def __init__(self, settings: Settings, steps: tuple[TourStep, ...] = STEPS):
        self.settings = settings
        self.steps = steps
        self.index = 0
        self.active = not settings.get(TOUR_DONE_KEY, False)

    @property
    def step(self) -> TourStep:
        return self.steps[self.index]

    @property
    def is_last(self) -> bool:
        return self.index == len(self.steps) - 1

    def next(self) -> None:
        """The next step; past the last one the tour is finished (and remembered)."""
        if self.is_last:
            self.dismiss()
        else:
            self.index += 1

    def back(self) -> None:
        self.index = max(self.index - 1, 0)

    def dismiss(self) -> None:
        self.active = False
        self.settings.set(TOUR_DONE_KEY, True)

    def restart(self) -> None:
        """Help → Tour: from the first step again (dismissing it still remembers)."""
        self.index = 0
        self.active = True
