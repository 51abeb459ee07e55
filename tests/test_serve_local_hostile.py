"""`forgebench serve-local` under hostile input (issue 52, items 1 and 2): no request line, no
chat template and no mix of them ends the worker, hangs it, or changes another request's
answer; every refusal is a structured error line naming the field.

The soak test sends 1,000 requests drawn from a fixed seed, valid ones (greedy chats whose
answers are known from a worker that saw nothing else, renders, pings) mixed with hostile
ones (50,000 nested `[`, NaN and string numbers, out-of-range settings, unknown fields and
ops, non-objects, broken JSON and UTF-8, a template of nested string loops, a prompt over the
context), and checks every answer and that the worker's memory stays flat.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys

import psutil
import pytest
from fixtures_gguf import write_tiny_gguf

from engine.server import requests as schema

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
NESTED_STRING_LOOPS = ("{% set s = 'x' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}"
                       "{% endfor %}")
PROMPTS = ("hello", "the cat sat", "one two three", "what is this?")


class Worker:
    """A serve-local process spoken to in raw bytes (a hostile client sends any bytes)."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve-local"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
        self.ready = self.read()

    def write(self, raw: bytes) -> None:
        self.process.stdin.write(raw + b"\n")
        self.process.stdin.flush()

    def send(self, **request) -> None:
        self.write(json.dumps(request).encode())

    def read(self) -> dict:
        line = self.process.stdout.readline()
        assert line, f"the worker ended (exit {self.process.poll()})"
        return json.loads(line)

    def answer(self, rid) -> dict:
        """The final line (done, rendered, ok, loaded or error) of request `rid`."""
        while True:
            line = self.read()
            if line.get("request") == rid and line["event"] not in ("start", "token"):
                return line

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def close(self) -> int:
        self.send(op="shutdown")
        self.process.stdin.close()
        code = self.process.wait(60)
        self.process.stdout.close()
        return code


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    good = write_tiny_gguf(folder / "good.gguf", "llama", "Q8_0", n_layers=1,
                           metadata={"tokenizer.chat_template": PLAIN})
    bad = write_tiny_gguf(folder / "bad.gguf", "llama", "Q8_0", n_layers=1,
                          metadata={"tokenizer.chat_template": NESTED_STRING_LOOPS})
    return good, bad


def chat(rid, prompt: str, **extra) -> dict:
    return {"request": rid, "op": "chat", "system": "A", "max_tokens": 3,
            "messages": [{"role": "user", "content": prompt}], **extra}


HOSTILE = {  # what a line sends -> a piece of the error it must get (None: any error line)
    "nested": (b"[" * 50_000, "nests 50000 levels deep"),
    "nested object": (b'{"op": "chat", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                      "nests 50001 levels deep"),
    "nan": (chat("h", "hi", settings={"temperature": float("nan")}),
            "settings.temperature: must be a finite number"),
    "nan string": (chat("h", "hi", settings={"temperature": "nan"}), "settings.temperature"),
    "negative temperature": (chat("h", "hi", settings={"temperature": -1}),
                             "settings.temperature"),
    "top_p": (chat("h", "hi", settings={"top_p": 5}), "settings.top_p"),
    "top_k": (chat("h", "hi", settings={"top_k": -3}), "settings.top_k"),
    "penalty": (chat("h", "hi", settings={"repetition_penalty": 0}),
                "settings.repetition_penalty"),
    "seed": (chat("h", "hi", seed="x"), "seed: input should be a valid integer"),
    "max_tokens": (chat("h", "hi", max_tokens=-1), "max_tokens"),
    "tools": (chat("h", "hi", tools="notalist"), "tools: input should be a valid list"),
    "unknown field": (chat("h", "hi", colour="red"), "colour: unknown field"),
    "unknown op": ({"request": "h", "op": "format_disk"}, "unknown op 'format_disk'"),
    "bad role": (chat("h", "hi") | {"messages": [{"role": "root", "content": "x"}]},
                 "messages[0].role"),
    "list": (b"[1, 2, 3]", "a request is a JSON object"),
    "broken json": (b'{"op": "chat", ', "not a JSON request"),
    "bad utf-8": (b'{"op": "ping", "request": "\xff\xfe"}', "ok"),  # read as U+FFFD
    "over the context": (chat("h", "hi", max_tokens=100_000), "exceeds the model's context"),
    "cancel nothing": ({"request": "h", "op": "cancel", "target": "nobody"}, "ok"),
}


def encoded(line) -> bytes:
    return line if isinstance(line, bytes) else json.dumps(line).encode()


def reference_answers(good) -> dict[str, str]:
    """Each of PROMPTS' greedy answer from a worker that sees nothing else."""
    reference = Worker()
    try:
        reference.send(request="load", op="load", system="A", model=str(good))
        assert reference.answer("load")["event"] == "loaded"
        expected = {}
        for prompt in PROMPTS:
            reference.send(**chat(prompt, prompt))
            expected[prompt] = reference.answer(prompt)["text"]
    finally:
        assert reference.close() == 0
    return expected


def soak_valid_chat(worker, rng, rid, expected) -> str:
    prompt = rng.choice(PROMPTS)
    worker.send(**chat(rid, prompt))
    answer = worker.answer(rid)
    assert answer["event"] == "done" and answer["text"] == expected[prompt], answer
    return "chat"


def soak_render(worker, rid) -> None:
    worker.send(request=rid, op="render", system="A",
                messages=[{"role": "user", "content": "hi"}])
    answer = worker.answer(rid)
    assert answer["event"] == "rendered", answer
    assert answer["text"] == "user: hi\nassistant:"


def soak_ping(worker, rid) -> None:
    worker.send(request=rid, op="ping")
    assert worker.answer(rid)["event"] == "ok"


def soak_hostile_template(worker, rid) -> str:
    worker.send(**(chat(rid, "hi") | {"system": "H"}))
    answer = worker.answer(rid)
    assert answer["event"] == "error" and "render budget" in answer["message"]
    return "template"


def soak_hostile_line(worker, rng, rid, n) -> str:
    case = rng.choice(sorted(HOSTILE))
    line, expect = HOSTILE[case]
    if isinstance(line, dict):
        line = line | {"request": rid}
        if line.get("op") == "cancel":
            line["target"] = f"nobody{n}"
    worker.write(encoded(line))
    if isinstance(line, dict):
        answer = worker.answer(rid)
    else:                 # no request id to pair by: the next line answers it
        answer = worker.read()
    if expect == "ok":
        assert answer["event"] == "ok", answer
    else:
        assert answer["event"] == "error", (case, answer)
        assert "traceback" not in answer, (case, answer)
        if expect is not None:
            assert expect in answer["message"], (case, answer)
    return "hostile"


def soak_step(worker, rng, n, expected) -> str | None:
    """One request of the soak, drawn from `rng`: which count it adds to (None: none)."""
    rid = f"r{n}"
    roll = rng.random()
    if roll < 0.4:
        return soak_valid_chat(worker, rng, rid, expected)
    if roll < 0.45:
        soak_render(worker, rid)
    elif roll < 0.5:
        soak_ping(worker, rid)
    elif roll < 0.505:
        return soak_hostile_template(worker, rid)
    else:
        return soak_hostile_line(worker, rng, rid, n)
    return None


def test_serve_local_soak_of_mixed_valid_and_hostile_requests(models):
    good, bad = models
    expected = reference_answers(good)

    rng = random.Random(52)
    worker = Worker()
    try:
        worker.send(request="load", op="load", system="A", model=str(good))
        worker.send(request="loadH", op="load", system="H", model=str(bad))
        assert worker.answer("load")["event"] == worker.answer("loadH")["event"] == "loaded"
        counts = {"chat": 0, "hostile": 0, "template": 0}
        baseline = None
        for n in range(1000):
            if n == 200:
                baseline = worker.rss()
            counted = soak_step(worker, rng, n, expected)
            if counted is not None:
                counts[counted] += 1
        growth = worker.rss() - baseline
        assert min(counts.values()) > 0, counts
        # flat: 800 requests after the warm-up grow the worker by less than 32 MB
        assert growth < 32 * 2**20, f"the worker grew {growth / 2**20:.1f} MB"
    finally:
        assert worker.close() == 0


def test_hostile_template_and_nesting_leave_the_worker_answering(models):
    """The two cases that ended or hung serve-local, then a valid chat, in one quick run."""
    good, bad = models
    worker = Worker()
    try:
        worker.send(request="1", op="load", system="A", model=str(good))
        worker.send(request="2", op="load", system="H", model=str(bad))
        assert worker.answer("1")["event"] == worker.answer("2")["event"] == "loaded"
        worker.send(**(chat("3", "hi") | {"system": "H"}))
        refused = worker.answer("3")
        assert refused["event"] == "error" and "render budget" in refused["message"]
        assert refused["path"] == str(bad) and refused["where"].startswith(
            "tokenizer.chat_template")
        worker.write(b"[" * 50_000)
        deep = worker.read()
        assert deep["event"] == "error" and "nests 50000 levels deep" in deep["message"]
        worker.send(**chat("4", "hello"))
        assert worker.answer("4")["event"] == "done"
    finally:
        assert worker.close() == 0


def test_a_line_over_the_size_limit_is_refused_without_being_held():
    from engine.serve_local import bounded_lines

    stream = io.StringIO("x" * 100 + "\n" + '{"op": "ping"}\n' + "y" * 25)
    assert list(bounded_lines(stream, limit=20)) == [None, '{"op": "ping"}\n', None]
    # the twin: under the limit every line passes as it was
    stream = io.StringIO("x" * 10 + "\n" + '{"op": "ping"}\n')
    assert list(bounded_lines(stream, limit=20)) == ["x" * 10 + "\n", '{"op": "ping"}\n']


def test_nesting_depth_ignores_brackets_inside_strings():
    assert schema.nesting_depth('{"a": "[[[[[[", "b": [[1]]}') == 3
    assert schema.nesting_depth("[" * 70 + "]" * 70) == 70
    with pytest.raises(schema.RequestError, match="nests 70 levels"):
        schema.parse_json("[" * 70 + "]" * 70)
    assert schema.parse_json("[" * 60 + "]" * 60) == eval("[" * 60 + "]" * 60)  # noqa: S307


@pytest.mark.parametrize("settings, field", [
    ({"temperature": float("inf")}, "settings.temperature"),
    ({"temperature": "0.7"}, "settings.temperature"),
    ({"top_p": 0}, "settings.top_p"),
    ({"top_k": 1.5}, "settings.top_k"),
    ({"repetition_penalty": -1.0}, "settings.repetition_penalty"),
])
def test_the_schema_refuses_what_the_cli_refuses(settings, field):
    request = chat("1", "hi", settings=settings)
    with pytest.raises(schema.RequestError) as info:
        schema.local_op(request)
    assert info.value.param == field
    # the twin: the same request with valid settings passes
    valid = schema.local_op(chat("1", "hi", settings={"temperature": 0.7, "top_p": 0.9,
                                                      "top_k": 40, "repetition_penalty": 1.1}))
    assert valid.settings.top_k == 40
