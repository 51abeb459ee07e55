"""`forgebench serve` (issue 47) driven by the official `openai` client over loopback: the model
list, chat (streaming and not), completions and embeddings; a JSON-schema response that
parses; four concurrent streams equal to the same requests one at a time; a disconnect that
frees its slot; every error status; a served export's greedy answer equal to `forgebench
generate` and llama.cpp's on the same file; a checkpoint served as base + adapter equal to
the Chat pane's worker; and a hostile chat template refused while everyone else is served.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import jsonschema
import pytest
from chat_support import chat_answer, chat_workspace
from fixtures_gguf import write_tiny_gguf
from lm_pretrain_support import forgebench
from serve_support import PLAIN_TEMPLATE, Served

openai = pytest.importorskip(
    "openai", reason="the openai client is a test extra: pip install -e '.[serve-test]'")
try:                             # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx", reason="httpx comes with the openai client")

NESTED_STRING_LOOPS = ("{% set s = 'x' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}"
                       "{% endfor %}")
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "ok", "colour"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "colour": {"enum": ["red", "green", "blue"]}}}
LONG_PROMPT = "hello"     # this fixture's greedy reply never ends before 1500 tokens


def _embedding_run(root, workspace) -> None:
    """A 2-step embed-retrieval run of a tiny random BERT in the workspace."""
    from retrieval_support import write_tiny_bert

    from engine.config import load_config
    from engine.data.generators.retrieval import generate_help_articles, help_articles
    from engine.jobs import execute, start_run

    docs, queries = help_articles("hard")
    write_tiny_bert(root / "bert", [d["text"] for d in docs] + [q["text"] for q in queries])
    data = generate_help_articles(root / "er-data", "hard")
    config = root / "er.toml"
    config.write_text(f'recipe = "embed-retrieval"\nseed = 1\nsteps = 2\nbatch_size = 8\n'
                      f'eval_every = 2\nsave_every = 2\n[data]\ndir = "{data}"\n'
                      f'[encoder]\nsource = "{root / "bert"}"\n[optim]\nlr = 1e-3\n',
                      encoding="utf-8")
    run = start_run(load_config(config), workspace / "runs" / "er", ["test"], threads=1)
    execute(run, load_config(config), None, threads=1, progress=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The chat workspace (library model `tiny`, LoRA run `sft`), plus exports `plain`
    (a tiny Llama with a plain template and a 2048 context), `broken` (its template fails on
    line 2), `hostile` (nested string loops) and an embed-retrieval run `er`."""
    root = chat_workspace(tmp_path_factory)
    scratch = tmp_path_factory.mktemp("serve")
    for name, template in (("plain", PLAIN_TEMPLATE),
                           ("broken", "{{ bos_token }}\n{{ messages[0]['content'] + 1 }}"),
                           ("hostile", NESTED_STRING_LOOPS)):
        folder = root / "exports" / name
        folder.mkdir(parents=True, exist_ok=True)
        write_tiny_gguf(folder / "model.gguf", "llama", "Q8_0", n_layers=1,
                        context_length=2048, metadata={"tokenizer.chat_template": template})
    if not (root / "runs" / "er").exists():
        _embedding_run(scratch, root)
    return root


@pytest.fixture(scope="module")
def served(workspace):
    server = Served("--workspace", str(workspace))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=300)


def ask(client, model: str, prompt: str, max_tokens: int = 8, **extra):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, **extra)


def test_models_lists_bases_checkpoints_exports_and_embedding_runs(client):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert {"tiny", "sft", "sft/step-000002", "exports/plain", "er", "er/step-000002"} \
        <= set(cards)
    assert cards["tiny"]["type"] == "base" and cards["tiny"]["family"] == "Gemma 3"
    assert cards["tiny"]["context_length"] == 256
    assert cards["sft/step-000002"]["type"] == "checkpoint"
    assert "over tiny" in cards["sft/step-000002"]["origin"]
    assert cards["exports/plain"]["type"] == "export"
    assert cards["exports/plain"]["context_length"] == 2048
    assert cards["er"]["type"] == "embedding"


def test_chat_of_an_export_equals_forgebench_generate(client, workspace):
    path = workspace / "exports" / "plain" / "model.gguf"
    for prompt in ("the cat sat", "a b c"):
        reply = ask(client, "exports/plain", prompt, max_tokens=12)
        generated = json.loads(forgebench("generate", "--model", str(path), "--prompt", prompt,
                                          "--chat", "--max-tokens", "12", "--json")
                               .stdout.splitlines()[-1])
        assert reply.choices[0].message.content == generated["text"]
        assert reply.usage.prompt_tokens == generated["prompt_tokens"]
        assert reply.usage.completion_tokens == generated["new_tokens"]
        assert reply.choices[0].finish_reason == \
            {"max_tokens": "length", "eos": "stop"}[generated["stop_reason"]]


@pytest.mark.llamacpp
def test_chat_of_an_export_equals_llamacpp(client, workspace):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the verify extra")
    from llamacpp_oracle import require_same_plan

    from engine.export.llamacpp import open_llama
    from engine.llm.chat import ChatTemplate, encode_prompt
    from engine.llm.tokenizer import GGUFTokenizer

    require_same_plan()
    path = workspace / "exports" / "plain" / "model.gguf"
    tokenizer = GGUFTokenizer.from_gguf(path)
    llm = open_llama(path, n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    stops = {tokenizer.eos_id, *tokenizer.eot_ids}
    try:
        for prompt in ("the cat sat", "a b c"):
            ids = encode_prompt(tokenizer, ChatTemplate.from_gguf(path)(
                [{"role": "user", "content": prompt}]))
            llm.reset()
            llm.eval(ids)
            theirs = []
            for _ in range(12):
                token = int(llm.scores[llm.n_tokens - 1].argmax())
                if token in stops:
                    break
                theirs.append(token)
                llm.eval([token])
            reply = ask(client, "exports/plain", prompt, max_tokens=12)
            assert reply.choices[0].message.content == tokenizer.decode(theirs)
    finally:
        llm.close()


def test_streaming_chat_arrives_in_pieces_that_join_to_the_whole_reply(client):
    whole = ask(client, "exports/plain", "a b c", max_tokens=10)
    chunks = list(ask(client, "exports/plain", "a b c", max_tokens=10, stream=True,
                      stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices
              and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_equal_forgebench_generate_on_a_raw_prompt(client, workspace):
    path = workspace / "exports" / "plain" / "model.gguf"
    reply = client.completions.create(model="exports/plain", prompt="once upon", max_tokens=9,
                                      temperature=0)
    generated = json.loads(forgebench("generate", "--model", str(path), "--prompt", "once upon",
                                      "--max-tokens", "9", "--json").stdout.splitlines()[-1])
    assert reply.choices[0].text == generated["text"]
    assert reply.usage.prompt_tokens == generated["prompt_tokens"]
    streamed = client.completions.create(model="exports/plain", prompt="once upon",
                                         max_tokens=9, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == generated["text"]


def test_a_lora_checkpoint_is_served_as_its_base_with_the_adapter(client, workspace):
    """The run's latest checkpoint, served without an export, answers as the Chat pane's
    worker does (its base from the library, the checkpoint's adapter attached)."""
    _, expected = chat_answer(workspace / "runs" / "sft", workspace, "hello", 6)
    assert ask(client, "sft", "hello", max_tokens=6).choices[0].message.content == expected
    assert ask(client, "sft/step-000002", "hello",
               max_tokens=6).choices[0].message.content == expected


def test_embeddings_are_the_runs_encoder_vectors(client, workspace):
    import numpy as np

    from engine.recipes.embed_retrieval import checkpoint_encoder
    from engine.rundir import RunDir

    texts = ["how do I reset my password", "shipping takes three days"]
    run = RunDir(workspace / "runs" / "er")
    expected = checkpoint_encoder(run, run.checkpoint("latest")).encode(texts).numpy()
    for encoding in ("float", "base64"):      # the client asks for base64 unless told
        reply = client.embeddings.create(model="er", input=texts, encoding_format=encoding) \
            if encoding == "float" else client.embeddings.create(model="er", input=texts)
        got = np.array([d.embedding for d in reply.data], dtype=np.float32)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        client.embeddings.create(model="exports/plain", input="x")


def test_a_json_schema_response_always_parses_and_validates(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="exports/plain", messages=[{"role": "user", "content": "describe"}],
            max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "card", "schema": SCHEMA, "strict": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    # the twin: the same model unconstrained does not write this JSON
    free = client.chat.completions.create(
        model="exports/plain", messages=[{"role": "user", "content": "describe"}],
        max_tokens=60, temperature=1.0, seed=0)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content), SCHEMA)


def test_four_concurrent_streams_equal_the_same_requests_one_at_a_time(client, served):
    prompts = ["the cat sat", "go on", "hello", "a b c"]
    alone = [ask(client, "exports/plain", p, max_tokens=300).choices[0].message.content
             for p in prompts]
    before = len(served.requests())
    together: dict[int, str] = {}

    def stream(i: int) -> None:
        pieces = ask(client, "exports/plain", prompts[i], max_tokens=300, stream=True)
        together[i] = "".join(c.choices[0].delta.content or "" for c in pieces)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [together[i] for i in range(4)] == alone
    # the four were generated at the same time: every pair of them overlapped in the log
    logged = [r for r in served.requests()[before:] if r.get("stream")]
    spans = [(r["time"] - r["seconds"], r["time"]) for r in logged]
    assert len(spans) == 4
    assert all(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans)


def test_errors_have_openais_shape_and_status(client, served):
    raw = httpx.post(f"{served.url}/chat/completions", content=b'{"model": "exports/plain", ',
                     headers={"content-type": "application/json"}, timeout=300)
    assert raw.status_code == 400 and "not a JSON request" in raw.json()["error"]["message"]
    deep = httpx.post(f"{served.url}/chat/completions", content=b"[" * 50_000, timeout=300)
    assert deep.status_code == 400 and "nests 50000 levels" in deep.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        ask(client, "no-such-model", "hi")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "tiny", "hi", max_tokens=300)
    message = info.value.body["message"]
    assert "maximum context length is 256 tokens" in message and "300 for the completion" \
        in message and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "exports/broken", "hi")
    assert "tokenizer.chat_template line 2" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="exports/plain", messages=[
            {"role": "user", "content": "hi"}], temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="exports/plain", messages=[
            {"role": "user", "content": "hi"}], extra_body={"warmth": 2})
    assert info.value.body["param"] == "warmth"


def test_a_hostile_template_is_refused_and_everyone_else_is_served(client):
    refused: list = []

    def hostile() -> None:
        try:
            ask(client, "exports/hostile", "hi")
        except openai.BadRequestError as exc:
            refused.append(exc.body["message"])

    thread = threading.Thread(target=hostile)
    thread.start()
    answer = ask(client, "exports/plain", "a b c")       # served while the hostile one renders
    thread.join(300)
    assert answer.choices[0].message.content is not None
    assert refused and "render budget" in refused[0]


@pytest.fixture(scope="module")
def strict(workspace):
    """One slot, no queue, a 4 KB body limit and a key; 250 ms between tokens, so the tiny model's
    stream still holds its slot when the next request arrives on a busy machine."""
    server = Served("--workspace", str(workspace), "--model", "exports/plain", "--slots", "1",
                    "--queue", "0", "--max-body", "4096", "--api-key", "sekrit",
                    "--token-delay", "0.25")
    yield server
    server.close()


def test_a_key_a_body_limit_a_full_queue_and_a_disconnect_that_frees_the_slot(strict):
    with pytest.raises(openai.AuthenticationError):
        ask(openai.OpenAI(base_url=strict.url, api_key="wrong", max_retries=0), "exports/plain",
            "hi")
    client = openai.OpenAI(base_url=strict.url, api_key="sekrit", max_retries=0, timeout=300)
    big = httpx.post(f"{strict.url}/chat/completions", content=b" " * 5000,
                     headers={"authorization": "Bearer sekrit"}, timeout=300)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def load() -> dict:
        return httpx.get(f"{strict.url.removesuffix('/v1')}/health",
                         headers={"authorization": "Bearer sekrit"}, timeout=300).json()["loaded"]

    stream = ask(client, "exports/plain", LONG_PROMPT, max_tokens=1500, stream=True)
    next(iter(stream))                                  # it is generating: the one slot is taken
    with pytest.raises(openai.InternalServerError) as info:
        ask(client, "exports/plain", "a b c")
    assert info.value.status_code == 503 and "busy" in info.value.body["message"]
    stream.close()                                      # the client goes away mid-stream
    deadline = time.monotonic() + 120                   # a hang guard, not a speed check
    while load()["exports/plain"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load()["exports/plain"] == {"active": 0, "waiting": 0}
    assert ask(client, "exports/plain", "a b c").choices[0].message.content is not None
    cancelled = [r for r in strict.requests() if r.get("finish_reason") == "cancelled"]
    assert cancelled and cancelled[0]["completion_tokens"] < 1500


def test_binding_beyond_loopback_needs_an_api_key(tmp_path):
    done = forgebench("serve", "--host", "0.0.0.0", "--model", str(tmp_path / "x.gguf"),
                      check=False)
    assert done.returncode == 2
    assert "exposes the models beyond this machine" in done.stderr and "--api-key" in \
        done.stderr


def test_copying_the_workspace_is_not_needed_for_a_file(tmp_path, workspace):
    """`--model FILE.gguf` serves a file outside any workspace under its file name."""
    path = tmp_path / "solo.gguf"
    shutil.copy(workspace / "exports" / "plain" / "model.gguf", path)
    server = Served("--model", str(path))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["solo"]
        assert ask(client, "solo", "a b c").choices[0].message.content is not None
    finally:
        server.close()


def test_a_conversations_next_turn_reuses_the_cached_prefix(client, workspace):
    """The second turn's prompt starts with the first turn's prompt and reply: those positions
    come from the KV cache, and the answer is the one a cold start gives."""
    from engine.llm.chat import ChatTemplate, encode_prompt
    from engine.llm.generate import generate
    from engine.models.gguf_model import load_gguf_model

    first = [{"role": "user", "content": "the cat sat"}]
    reply = ask(client, "exports/plain", "the cat sat", max_tokens=10)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "go on"}]
    again = client.chat.completions.create(model="exports/plain", messages=second,
                                           max_tokens=10, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    path = workspace / "exports" / "plain" / "model.gguf"
    model, tokenizer = load_gguf_model(path, numerics="llamacpp", weights="dense-cache")
    ids = encode_prompt(tokenizer, ChatTemplate.from_gguf(path)(second))
    cold = generate(model, tokenizer, ids, max_new_tokens=10)
    assert again.choices[0].message.content == cold.text


def test_stop_strings_and_seeded_sampling_match_forgebench_generate(client, workspace):
    path = workspace / "exports" / "plain" / "model.gguf"
    sampled = client.chat.completions.create(
        model="exports/plain", messages=[{"role": "user", "content": "go on"}], max_tokens=12,
        temperature=0.8, top_p=0.9, seed=3, extra_body={"top_k": 40})
    generated = json.loads(forgebench(
        "generate", "--model", str(path), "--prompt", "go on", "--chat", "--max-tokens", "12",
        "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "3",
        "--json").stdout.splitlines()[-1])
    assert sampled.choices[0].message.content == generated["text"]
    whole = ask(client, "exports/plain", "go on", max_tokens=30).choices[0].message.content
    at = next(i for i in range(5, len(whole) - 2)
              if whole[i:i + 2].isascii() and whole[i:i + 2].isalnum())
    stop = whole[at:at + 2]
    cut = ask(client, "exports/plain", "go on", max_tokens=30, stop=[stop])
    assert cut.choices[0].message.content == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def _served_gemma(gemma_gguf, prompt: str, n: int) -> str:
    server = Served("--model", str(gemma_gguf), "--threads", "2")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        return ask(client, model, prompt, max_tokens=n).choices[0].message.content
    finally:
        server.close()


@pytest.mark.realmodel
def test_served_gemma_equals_forgebench_generate(gemma_gguf):
    """gemma-3-270m served from its GGUF: the greedy chat reply is `forgebench generate
    --chat`'s on the same file."""
    prompt, n = "What is the capital of France?", 24
    generated = json.loads(forgebench("generate", "--model", str(gemma_gguf), "--prompt", prompt,
                                      "--chat", "--max-tokens", str(n), "--json", timeout=900)
                           .stdout.splitlines()[-1])
    assert _served_gemma(gemma_gguf, prompt, n) == generated["text"]


@pytest.mark.realmodel
@pytest.mark.llamacpp
def test_served_gemma_equals_llamacpp(gemma_gguf):
    """The same reply against llama.cpp on the same file, fed the same prompt token ids. llama.cpp
    computes only the last row's logits, as a generation does (under logits_all its last layer
    and head run the batch kernels on every prompt row, another summation order)."""
    import llama_cpp
    import numpy as np
    from llamacpp_oracle import require_same_plan

    from engine.export.llamacpp import open_llama
    from engine.llm.chat import ChatTemplate, encode_prompt
    from engine.llm.tokenizer import GGUFTokenizer

    require_same_plan()
    prompt, n = "What is the capital of France?", 24
    served = _served_gemma(gemma_gguf, prompt, n)
    tokenizer = GGUFTokenizer.from_gguf(gemma_gguf)
    ids = encode_prompt(tokenizer, ChatTemplate.from_gguf(gemma_gguf)(
        [{"role": "user", "content": prompt}]))
    llm = open_llama(gemma_gguf, n_ctx=256, n_threads=2, verbose=False)
    stops = {tokenizer.eos_id, *tokenizer.eot_ids}
    try:
        llm.eval(ids)
        theirs = []
        for _ in range(n):
            row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            token = int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())
            if token in stops:
                break
            theirs.append(token)
            llm.eval([token])
    finally:
        llm.close()
    assert served == tokenizer.decode(theirs)
