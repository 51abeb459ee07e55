"""The Models pane's Serve switch (pytest-qt): turning it on starts `forgebench serve` for the
workspace as a background engine process, shows the URL and models; a request sent to that
URL appears in the live log with its tokens and tokens/s; turning it off stops the server.
The view-model's snippets and log rows are checked without Qt."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fixtures_gguf import write_tiny_gguf
from serve_support import PLAIN_TEMPLATE

from app.viewmodels.serve import ServeSession
from app.viewmodels.workspace import Workspace
from app.views.models_pane import ModelsPane
from engine import model_library

START_MS = 120_000


@pytest.fixture
def workspace(tmp_path):
    root = Workspace.create(tmp_path / "ws").root
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0", n_layers=1,
                            metadata={"tokenizer.chat_template": PLAIN_TEMPLATE})
    model_library.add_model(root, model, name="tiny")
    return root


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_the_serve_switch_serves_and_logs_a_request(qtbot, workspace):
    pane = ModelsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(Workspace.open(workspace))
    panel = pane.serve
    panel.port.setValue(0)                      # any free port
    panel.switch.setChecked(True)
    try:
        qtbot.waitUntil(lambda: panel.session.running, timeout=START_MS)
        assert panel.url.text() == f"URL: {panel.session.url}"
        assert panel.session.url.startswith("http://127.0.0.1:")
        assert "tiny" in panel.models.text() and "loopback" in panel.key.text()
        assert panel.session.url in panel.curl.toPlainText()
        reply = post(f"{panel.session.url}/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "temperature": 0})
        tokens = reply["usage"]["completion_tokens"]
        qtbot.waitUntil(lambda: "chat/completions" in panel.log.toPlainText(),
                        timeout=START_MS)
        line = panel.log.toPlainText().splitlines()[-1]
        assert "tiny" in line and " 200 " in line and f"+ {tokens} tokens" in line
        assert "tok/s" in line
    finally:
        panel.switch.setChecked(False)
    assert not panel.running() and panel.url.text() == "not serving"
    with pytest.raises(urllib.error.URLError):           # the server is gone
        post(f"{panel.session.url or 'http://127.0.0.1:9'}/models", {})


def test_snippets_and_log_rows_say_what_the_server_said(tmp_path):
    session = ServeSession(tmp_path, host="0.0.0.0", port=9000)
    args = session.args()
    assert args[args.index("--api-key") + 1] == session.api_key and len(session.api_key) > 20
    session.feed(json.dumps({"event": "listening", "url": "http://0.0.0.0:9000/v1",
                             "api_key": session.api_key, "models": ["a", "b"]}))
    curl = session.curl_snippet()
    assert f"Authorization: Bearer {session.api_key}" in curl and '"model": "a"' in curl
    python = session.python_snippet("b")
    compile(python, "snippet", "exec")                    # it is Python that runs
    assert "base_url='http://0.0.0.0:9000/v1'" in python and "model='b'" in python
    row = session.feed(json.dumps({"event": "request", "time": 0, "model": "a",
                                   "endpoint": "/v1/chat/completions", "status": 200,
                                   "prompt_tokens": 5, "completion_tokens": 40,
                                   "tokens_per_s": 12.5, "finish_reason": "length"}))
    assert session.row(row).endswith("a  chat/completions  200  5 + 40 tokens  12.5 tok/s  "
                                     "length")
    # the twin: on loopback no key is made up
    local = ServeSession(tmp_path)
    assert "--api-key" not in local.args() and local.key_text().startswith("none")
