"""The Chat pane on the real Gemma 3 270M Q4_K_M (FORGEBENCH_REAL=1): the package model in the
library and the pirate LoRA run (trained as tests/test_lm_sft_pirate.py trains it) answer one
prompt side by side through the serve-local worker; the tuned answer opens "Ahoy", the base's
does not. Prints the time to the first streamed token of each."""

from __future__ import annotations

import pytest
from lm_sft_support import pirate_run

from app.viewmodels.workspace import Workspace
from app.views.chat_pane import ChatPane
from engine import model_library

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]
PROMPT = "What is the capital of Germany?"


def test_base_and_pirate_checkpoint_side_by_side(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    print(model_library.register_package_if_installed(workspace.root))
    [entry] = model_library.entries(workspace.root)
    gguf = model_library.entry_path(workspace.root, entry)
    pirate_run(tmp_path, gguf, workspace.runs_dir / "pirate")

    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    try:
        for side, label in (("A", f"model: {entry['name']}"), ("B", "run: pirate/step-000030")):
            combo = pane.source[side]
            combo.setCurrentIndex(next(i for i in range(combo.count())
                                       if combo.itemData(i) is not None
                                       and combo.itemData(i).label == label))
            pane.choose(side)
        qtbot.waitUntil(lambda: len(pane.session.loaded) + len(pane.session.load_errors) == 2,
                        timeout=600_000)
        assert not pane.session.load_errors, pane.session.load_errors
        pane.max_tokens.setValue(24)
        pane.prompt.setText(PROMPT)
        pane.send()
        qtbot.waitUntil(lambda: not pane.session.busy(), timeout=600_000)
        replies = {r.system: r for r in pane.session.replies.values()}
        for side, reply in sorted(replies.items()):
            print(f"{side} ({pane.session.labels[side]}): first streamed token after "
                  f"{reply.first_token_s:.2f} s (from the request; prompt "
                  f"{reply.prompt_tokens} tokens), {reply.tokens} tokens, "
                  f"{reply.done['timings']}: {reply.text!r}")
        assert replies["B"].text.lstrip().startswith("Ahoy"), replies["B"].text
        assert not replies["A"].text.lstrip().startswith("Ahoy"), replies["A"].text
        assert pane.session.last_pair() is not None
    finally:
        pane.shutdown()
