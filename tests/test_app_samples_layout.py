"""The Samples pane at the size a 1024x700 window gives it, showing a sound clip: the waveform
and spectrogram keep a readable height (they were squashed to ~15 px, only their titles
showing) and the flags, playback message and settings show whole; the detail column scrolls
instead. The Transcripts pane shows its clips in the same AudioView and keeps its plots too."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
import soundfile
from layout_support import PANE_SIZE, labels_cut_off, shown_at
from PySide6.QtGui import QColor, QPixmap

from app.viewmodels import samples as vm
from app.views.samples_pane import PLOT_MIN_HEIGHT, SamplesPane
from app.views.transcripts_pane import TranscriptsPane

NO_DEVICE = ("<span style='color:#b71c1c'>audio playback is unavailable: no output device "
             "(Error querying device -1). Everything else works; the waveform and "
             "spectrogram are shown.</span>")


def clip(tmp_path) -> vm.Sample:
    path = tmp_path / "thump-seed7-000.wav"
    t = np.arange(8192) / 16_000
    soundfile.write(path, np.clip(3 * np.sin(2 * np.pi * 220 * t), -1, 1).astype(np.float32),
                    16_000)
    return vm.Sample(path, {"seed": 7, "class": "thump", "step": 20, "cfg": 4.0, "steps": 16,
                            "integrity": {"flags": ["clipping", "edge_click"], "peak": 1.0,
                                          "rms": 0.785}})


def test_an_audio_sample_shows_its_plots_and_text_whole_at_1024x700(qtbot, tmp_path):
    pane = shown_at(qtbot, SamplesPane())
    sample = clip(tmp_path)
    pane.views.setCurrentWidget(pane.clips)
    pane.clips.addItems([f"step-0000{s}  {c}-seed7-000  ⚠ clipping, edge_click"
                         for s in (20, 40) for c in ("hiss", "ping", "thump")])
    pane.rubric.set_kind("audio")
    pane.neighbour_button.show()
    pane.audio.show()
    pane.audio.show_clip(sample)
    pane.audio.device.setText(NO_DEVICE)
    pane.info.setText(f"<b>{sample.item}</b> — step-000020 (step 20), seed 7, class thump<br>"
                      "settings: cfg=4.0, levels=16, peak_normalized=False, sample_rate=16000, "
                      "sampler=ddpm-ancestral, samples=8192, schedule=cosine-s0.008-"
                      "maxbeta0.999, steps=16, weights=ema")
    qtbot.waitUntil(lambda: pane.audio.wave_plot.height() >= PLOT_MIN_HEIGHT)
    assert pane.audio.spec_plot.height() >= PLOT_MIN_HEIGHT
    assert "clipping, edge_click" in pane.audio.flags.text()
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])     # laid out once the text is set
    # the column scrolls (the list beside it does not): all of it is reachable
    assert pane.detail_scroll.verticalScrollBar().maximum() > 0
    assert pane.height() <= PANE_SIZE[1]
    # twin: the same check finds the playback message when it is squeezed below its text
    pane.audio.device.setFixedHeight(15)
    qtbot.waitUntil(lambda: pane.audio.device.height() == 15)
    assert NO_DEVICE in labels_cut_off(pane)


def test_the_transcripts_pane_keeps_its_audio_plots(qtbot, tmp_path):
    pane = shown_at(qtbot, TranscriptsPane())
    pane.audio.show_file(clip(tmp_path).path, "<b>integrity: no flags</b>")
    qtbot.waitUntil(lambda: pane.audio.wave_plot.height() >= PLOT_MIN_HEIGHT)
    assert pane.audio.spec_plot.height() >= PLOT_MIN_HEIGHT
    assert labels_cut_off(pane) == []


def test_clip_plots_are_light_even_when_samples_is_the_first_pane_built(qtbot):
    # panes are built when first shown: the Runs charts no longer set the style beforehand
    pg.setConfigOptions(background="k", foreground="d")
    plain = pg.PlotWidget()         # twin: a plot built now takes the dark default
    qtbot.addWidget(plain)
    assert plain.backgroundBrush().color().name() == "#000000"
    pane = SamplesPane()
    qtbot.addWidget(pane)
    for plot in (pane.audio.wave_plot, pane.audio.spec_plot):
        assert plot.backgroundBrush().color().name() == "#ffffff"


def test_an_image_sample_and_its_neighbour_fit_the_detail_column(qtbot):
    pane = shown_at(qtbot, SamplesPane())
    pane.rubric.set_kind("image")
    square = QPixmap(192, 192)
    square.fill(QColor("#4caf50"))
    for image in (pane.detail_image, pane.neighbour_image):
        image.setPixmap(square)
        image.show()
    pane.neighbour_button.show()
    pane.info.setText("<b>square-seed7-001</b> — step-000040 (step 40), seed 7, class square<br>"
                      "nearest training item: shape-00037 (distance 0.3205)")
    scroll = pane.detail_scroll
    content = scroll.widget()
    # the column widens to what its content needs: nothing runs past its right edge
    qtbot.waitUntil(lambda: content.minimumSizeHint().width() <= scroll.viewport().width())
    assert content.width() <= scroll.viewport().width()
    assert pane.neighbour_image.geometry().right() <= scroll.viewport().width()
    qtbot.waitUntil(lambda: labels_cut_off(pane) == [])
