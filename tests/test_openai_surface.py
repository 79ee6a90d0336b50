"""The rest of vLLM's OpenAI surface on the default model: refused fields, vLLM's extra request
fields and response fields, /ping and /invocations, and the `jvllm serve` command line.

One in-process server per module (plus one that trusts request chat templates and one with an
API key, on the same engine); offline references are taken on that engine before it serves.
"""

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS

from jvllm import LLM, BeamSearchParams, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints import cli
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "smol"
API_KEY = "sekret"
PROMPT = "The capital of France is"
MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def served(smollm2_dir):
    llm = LLM(smollm2_dir, **SMOLLM2_ENGINE_KWARGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[1]
    stopped = {
        include: llm.generate(
            [PROMPT],
            SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                stop_token_ids=[stop_id],
                include_stop_str_in_output=include,
            ),
            use_tqdm=False,
        )[0].outputs[0]
        for include in (False, True)
    }
    prompt_logprobs = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0].prompt_logprobs
    beams = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    engine = AsyncLLM(llm.llm_engine)
    servers = [
        ServerThread(build_app(engine, MODEL)).start(),
        ServerThread(build_app(engine, MODEL, trust_request_chat_template=True)).start(),
        ServerThread(build_app(engine, MODEL, API_KEY)).start(),
        ServerThread(build_app(engine, MODEL, reasoning_parser="qwen3")).start(),
    ]
    yield {
        "url": servers[0].url,
        "trusting_url": servers[1].url,
        "keyed_url": servers[2].url,
        "reasoning_url": servers[3].url,
        "tokenizer": engine.get_tokenizer(),
        "ref": ref,
        "stop_id": stop_id,
        "stopped": stopped,
        "prompt_logprobs": prompt_logprobs,
        "beams": beams,
        "engine": engine,
    }
    for server in servers:
        server.stop()
    engine.shutdown()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0)


def _greedy(**kw) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **kw}


def _post(url: str, path: str, body: dict, status: int = 200) -> dict:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def _error(url: str, path: str, body: dict, status: int = 400) -> dict:
    return _post(url, path, body, status)["error"]


# ---- part 4: nothing silently ignored ----


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "reasoning_effort", "low"),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
        ("/v1/chat/completions", "documents", [{"title": "t", "text": "x"}]),
        ("/v1/chat/completions", "store", True),
        ("/v1/chat/completions", "service_tier", "flex"),
        ("/v1/completions", "logits_processors", ["my.Processor"]),
        ("/v1/completions", "suffix", "The end."),
    ],
)
def test_known_but_unsupported_field_is_400_naming_it(served, path, field, value):
    body = {"model": MODEL, "max_tokens": 1, field: value}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    error = _error(served["url"], path, body)
    assert error["param"] == field and f"'{field}' is not supported by jvllm" in error["message"]


def test_unsupported_fields_at_their_defaults_and_vendor_fields_pass(served):
    chat = {
        "messages": CHAT,
        "modalities": ["text"],
        "include_reasoning": True,
        "audio": None,
        "store": False,
        "service_tier": "auto",
        "metadata": {"team": "a"},
    }
    completion = {"prompt": PROMPT, "priority": 0, "suffix": None, "some_vendor_field": 1}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        assert _post(served["url"], path, {"model": MODEL, "max_tokens": 1, **body})["choices"]


def test_serve_without_server_packages_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails
    monkeypatch.delitem(sys.modules, "jvllm.entrypoints.openai.api_server")
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve"])
    message = str(exited.value.code)
    assert "pip install 'jvllm[serve]'" in message and "fastapi" in message
    assert "\n" not in message


def test_python_m_api_server_runs_serve_as_vllm_does():
    # vLLM's older launch line, `python -m vllm.entrypoints.openai.api_server --model M`.
    launched = subprocess.run(
        [sys.executable, "-m", "jvllm.entrypoints.openai.api_server", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launched.returncode == 0, launched.stderr
    assert "--max-model-len" in launched.stdout and "--tool-call-parser" in launched.stdout


def test_serve_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # one line: no wrapped "(default:"
    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = [a for a in serve._actions if a.dest != "help"]
    assert len(actions) > 25
    assert text.count("(default: ") == len(actions)
    for action in actions:
        assert f"(default: {action.default})" in text
        assert all(option in text for option in action.option_strings)
    assert "--trust-request-chat-template" in text


# ---- part 5: the rest of vLLM's surface ----


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="gpt-5"):
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=1)


def test_int64_seeds_sample_the_same_tokens_each_time(served, client):
    def sample(seed: int) -> list[int]:
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            temperature=1.0,
            seed=seed,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return out.choices[0].token_ids

    for seed in (2**40 + 7, -3, 2**63 - 1):
        assert sample(seed) == sample(seed)
    body = {"model": MODEL, "prompt": PROMPT, "seed": 2**63}
    assert _error(served["url"], "/v1/completions", body)["param"] == "seed"


def test_stream_options_without_stream_is_400(served):
    options = {"stream_options": {"include_usage": True}, "max_tokens": 1}
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        error = _error(served["url"], path, {"model": MODEL, **body, **options})
        assert error["param"] == "stream_options"


def test_stop_token_id_text_is_left_out_unless_include_stop_str_in_output(served, client):
    ref, stop_id, tokenizer = served["ref"], served["stop_id"], served["tokenizer"]
    first = ref.token_ids.index(stop_id)
    kept = ref.token_ids[: first + 1]
    without, including = tokenizer.decode(kept[:-1]), tokenizer.decode(kept)
    assert without != including
    for include, text in ((False, without), (True, including)):
        offline = served["stopped"][include]
        assert (offline.text, offline.token_ids, offline.stop_reason) == (text, kept, stop_id)
        extra = {"stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        extra |= {"ignore_eos": True, "return_token_ids": True}
        out = client.completions.create(prompt=PROMPT, extra_body=extra, **_greedy()).choices[0]
        assert (out.text, out.token_ids, out.finish_reason) == (text, kept, "stop")
        assert out.stop_reason == stop_id
        chunks = client.completions.create(
            prompt=PROMPT, stream=True, extra_body=extra, **_greedy()
        )
        assert "".join(c.choices[0].text for c in chunks) == text


def test_chat_content_parts_are_joined_by_newlines_and_images_refused(client):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    joined = [{"role": "user", "content": "What is\nthe capital?"}]
    ids = [
        client.chat.completions.create(
            messages=messages, extra_body={"return_token_ids": True}, **_greedy(max_tokens=1)
        ).prompt_token_ids
        for messages in ([{"role": "user", "content": parts}], joined)
    ]
    assert ids[0] == ids[1]
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\].*image_url"):
        client.chat.completions.create(
            messages=[{"role": "user", "content": [parts[0], image]}], **_greedy(max_tokens=1)
        )


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "text"}, "messages[0].content[1].text is missing"),
        ({"type": "text", "text": 5}, "messages[0].content[1].text must be a string"),
    ],
)
def test_a_text_part_without_its_text_is_a_400_naming_the_field(served, part, message):
    content = [{"type": "text", "text": "What is"}, part]
    body = _greedy(messages=[{"role": "user", "content": content}])
    error = _error(served["url"], "/v1/chat/completions", body)
    assert error["param"] == "messages" and error["message"].startswith(message)


def test_prompt_logprobs_equal_the_offline_engine(served, client):
    out = client.completions.create(
        prompt=PROMPT, extra_body={"prompt_logprobs": 2, "return_token_ids": True}, **_greedy()
    ).choices[0]
    offline = served["prompt_logprobs"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(offline)
    for served_position, position in zip(out.prompt_logprobs[1:], offline[1:]):
        assert set(served_position) == {str(token_id) for token_id in position}
        for token_id, logprob in position.items():
            entry = served_position[str(token_id)]
            assert entry["logprob"] == pytest.approx(logprob.logprob, abs=1e-5)
            assert (entry["rank"], entry["decoded_token"]) == (logprob.rank, logprob.decoded_token)
    chat = client.chat.completions.create(
        messages=CHAT, extra_body={"prompt_logprobs": 1, "return_token_ids": True}, **_greedy()
    )
    again = client.completions.create(
        prompt=chat.prompt_token_ids, extra_body={"prompt_logprobs": 1}, **_greedy(max_tokens=1)
    )
    assert chat.prompt_logprobs == again.choices[0].prompt_logprobs
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}, **_greedy()
        )


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    streams = [
        client.completions.create(prompt=PROMPT, stream=True, stream_options=options, **_greedy()),
        # vLLM's default include_usage is true: continuous_usage_stats alone is enough.
        client.chat.completions.create(
            messages=CHAT,
            stream=True,
            stream_options={"continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
            **_greedy(),
        ),
    ]
    for stream in streams:
        chunks = list(stream)
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
        assert all(
            c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            for c in chunks
        )


def test_continuous_usage_stats_count_each_chunks_own_choice(served, client):
    """Several prompts, n each: one choice a chunk, its usage that choice's prompt and tokens so
    far (vLLM's); the last chunk, every prompt once and every choice's tokens."""
    prompts = [PROMPT, "Hello"]
    num_prompt = [len(served["tokenizer"].encode(p)) for p in prompts]
    chunks = list(
        client.completions.create(
            prompt=prompts,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
            **_greedy(),
        )
    )
    sent: dict[int, int] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        sent[choice.index] = sent.get(choice.index, 0) + len(choice.token_ids)
        assert chunk.usage.prompt_tokens == num_prompt[choice.index // 2]
        assert chunk.usage.completion_tokens == sent[choice.index]
    assert sent == {index: MAX_TOKENS for index in range(4)}
    final = chunks[-1]
    assert final.choices == [] and final.usage.prompt_tokens == sum(num_prompt)
    assert final.usage.completion_tokens == 4 * MAX_TOKENS


def test_a_chat_streams_one_choice_a_chunk_with_its_own_usage(client):
    """n = 2 in a chat stream: every chunk one choice (its role first), its usage that
    choice's tokens so far (vLLM's serving_chat); the last chunk every choice's."""
    chunks = list(
        client.chat.completions.create(
            messages=CHAT,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
            **_greedy(),
        )
    )
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant"] * 2
    sent = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        sent[choice.index] += len(getattr(choice, "token_ids", None) or [])
        assert chunk.usage.completion_tokens == sent[choice.index]
    assert sent == {0: MAX_TOKENS, 1: MAX_TOKENS}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS


def test_return_token_ids_are_the_tokenizers_ids(served, client):
    tokenizer = served["tokenizer"]
    out = client.completions.create(
        prompt=PROMPT, extra_body={"return_token_ids": True, "ignore_eos": True}, **_greedy()
    ).choices[0]
    assert out.prompt_token_ids == tokenizer.encode(PROMPT)
    assert out.token_ids == served["ref"].token_ids
    assert tokenizer.decode(out.token_ids) == out.text
    chat = client.chat.completions.create(
        messages=CHAT, extra_body={"return_token_ids": True}, **_greedy()
    )
    expected = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert chat.prompt_token_ids == list(expected)
    assert tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            messages=CHAT, stream=True, extra_body={"return_token_ids": True}, **_greedy()
        )
    )
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    # The role and finish_reason chunks carry no token ids.
    streamed = [
        t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids", [])
    ]
    assert streamed == chat.choices[0].token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(prompt=PROMPT, logprobs=2, extra_body=extra, **_greedy())
    choice = out.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(
        re.fullmatch(r"token_id:\d+", k) for top in choice.logprobs.top_logprobs for k in top
    )
    chat = client.chat.completions.create(
        messages=CHAT, logprobs=True, top_logprobs=2, extra_body=extra, **_greedy()
    ).choices[0]
    assert [t.token for t in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]
    assert all(
        re.fullmatch(r"token_id:\d+", top.token)
        for t in chat.logprobs.content
        for top in t.top_logprobs
    )


def test_allowed_token_ids_and_bad_words_reach_the_sampler(served, client):
    allowed = [1000, 2000, 3000]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=1,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    ).choices[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    assert "Paris" in served["ref"].text
    out = client.completions.create(
        prompt=PROMPT, extra_body={"bad_words": ["Paris"], "ignore_eos": True}, **_greedy()
    ).choices[0]
    assert "Paris" not in out.text and out.text


def test_use_beam_search_equals_offline_beam_search(served, client):
    prompt_len = len(served["tokenizer"].encode(PROMPT))
    expected = [beam.tokens[prompt_len:] for beam in served["beams"].sequences]
    extra = {"use_beam_search": True, "return_token_ids": True}
    out = client.completions.create(prompt=PROMPT, n=2, extra_body=extra, **_greedy(max_tokens=3))
    assert [c.token_ids for c in out.choices] == expected
    chunks = list(
        client.completions.create(
            prompt=PROMPT, n=2, stream=True, extra_body=extra, **_greedy(max_tokens=3)
        )
    )
    streamed = {c.index: c.text for chunk in chunks for c in chunk.choices}
    assert streamed == {c.index: c.text for c in out.choices}
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        client.completions.create(prompt=PROMPT, extra_body={"length_penalty": 0.5}, **_greedy())
    body = {"model": MODEL, "prompt": PROMPT, "n": 11, "use_beam_search": True}
    error = _error(served["url"], "/v1/completions", body)  # more beams than max_logprobs / 2
    assert error["param"] == "n" and "beam_width" in error["message"]


def test_chat_echo_prepends_the_continued_message(client):
    messages = [*CHAT, {"role": "assistant", "content": "The capital of France"}]
    kwargs = {"messages": messages, **_greedy(max_tokens=3)}
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(extra_body=extra, **kwargs).choices[0].message
    echoed = client.chat.completions.create(extra_body={**extra, "echo": True}, **kwargs)
    message = echoed.choices[0].message
    assert message.role == "assistant"
    assert message.content == "The capital of France" + plain.content
    chunks = client.chat.completions.create(
        stream=True, extra_body={**extra, "echo": True}, **kwargs
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    # After a user's message the reply (the assistant's) has another role: nothing to echo.
    plain, echoed = (
        client.chat.completions.create(messages=CHAT, extra_body=extra, **_greedy(max_tokens=3))
        for extra in ({}, {"echo": True})
    )
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_tokenize_return_token_strs_and_continue_final_message(served):
    tokenizer = served["tokenizer"]
    out = _post(served["url"], "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    messages = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    continued = _post(
        served["url"],
        "/tokenize",
        {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert tokenizer.decode(continued["tokens"]).endswith("The capital is")
    # add_generation_prompt left at its default lets the reply continue; sent true, it is a
    # 400 (vLLM's), as in chat completions.
    alone = {"messages": messages, "continue_final_message": True}
    assert _post(served["url"], "/tokenize", alone)["tokens"] == continued["tokens"]
    both = {**alone, "add_generation_prompt": True}
    assert _error(served["url"], "/tokenize", both)["param"] == "continue_final_message"
    closed = _post(
        served["url"], "/tokenize", {"messages": messages, "add_generation_prompt": False}
    )
    assert tokenizer.decode(closed["tokens"]).rstrip().endswith("<|im_end|>")


def test_request_chat_template_needs_the_trust_flag(served):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "chat_template": TEMPLATE}
    error = _error(served["url"], "/v1/chat/completions", body)
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    out = _post(served["trusting_url"], "/v1/chat/completions", {**body, "return_token_ids": True})
    text = f"user: {CHAT[0]['content']}\n"
    assert out["prompt_token_ids"] == served["tokenizer"].encode(text, add_special_tokens=False)
    tokens = _post(
        served["trusting_url"], "/tokenize", {"messages": CHAT, "chat_template": TEMPLATE}
    )
    assert tokens["tokens"] == out["prompt_token_ids"]


def test_ping_and_invocations_route_by_body(served):
    url = served["url"]
    assert httpx.get(url + "/ping").status_code == 200
    assert httpx.post(url + "/ping").status_code == 200
    completion = _post(url, "/invocations", {"prompt": PROMPT, **_greedy(max_tokens=3)})
    assert completion["object"] == "text_completion"
    assert served["ref"].text.startswith(completion["choices"][0]["text"])
    chat = _post(url, "/invocations", {"messages": CHAT, **_greedy(max_tokens=1)})
    assert chat["object"] == "chat.completion"
    assert "messages" in _error(url, "/invocations", {"model": MODEL})["message"]
    assert _error(url, "/invocations", {"prompt": PROMPT, "n": "many"})["param"] == "n"
    keyed = served["keyed_url"]
    assert httpx.post(keyed + "/invocations", json={"prompt": PROMPT}).status_code == 401


def test_request_id_names_the_response(client):
    out = client.completions.create(
        prompt=PROMPT, extra_body={"request_id": "my-id"}, **_greedy(max_tokens=1)
    )
    assert out.id == "cmpl-my-id"


def test_explicit_nulls_mean_the_defaults(served):
    """Clients send null for fields they leave at their defaults (vLLM's fields are Optional)."""
    nulls = {"stream": None, "n": None, "logprobs": None, "echo": None}
    out = _post(served["url"], "/v1/completions", {"prompt": PROMPT, **nulls, **_greedy()})
    [choice] = out["choices"]
    assert choice["text"] == served["ref"].text and choice["logprobs"] is None
    del nulls["echo"]
    chat = _post(served["url"], "/v1/chat/completions", {"messages": CHAT, **nulls, **_greedy()})
    assert len(chat["choices"]) == 1 and chat["choices"][0]["logprobs"] is None


def test_a_tool_calling_turn_without_content_is_an_empty_string(served):
    """The assistant turn of a tool call comes back from OpenAI with content null; sent back in
    the next request it renders as vLLM renders it, as empty text."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    empty = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]}]
    no_key = [*CHAT, {"role": "assistant", "tool_calls": [call]}]
    ids = [
        _post(served["url"], "/tokenize", {"model": MODEL, "messages": m})["tokens"]
        for m in (turns, empty, no_key)
    ]
    assert ids[0] == ids[1] == ids[2]
    chat = _post(served["url"], "/v1/chat/completions", {"messages": turns, **_greedy()})
    assert chat["choices"][0]["message"]["content"]


def test_streamed_logprobs_text_offsets_count_from_the_choice_start(client):
    whole = client.completions.create(prompt=PROMPT, logprobs=1, **_greedy())
    chunks = client.completions.create(prompt=PROMPT, logprobs=1, stream=True, **_greedy())
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] > 0


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(client):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "model": MODEL, "max_tokens": 0}
    out = client.completions.create(**body)
    [choice] = out.choices
    prompt_ids = (
        client.completions.create(
            **{**body, "max_tokens": 1}, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .prompt_token_ids
    )
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(prompt_ids) and out.usage.completion_tokens == 0
    streamed = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(**{**body, "echo": False})


def test_serve_takes_vllm_launch_flags(monkeypatch, tmp_path):
    """What vLLM launch scripts pass: --model, several served names, VLLM_API_KEY, a chat
    template file, a response role, vLLM's "float", and flags that change nothing here."""
    from jvllm.entrypoints.openai import api_server

    served = {}
    monkeypatch.setattr(
        api_server, "run_server", lambda model, **kw: served.update(kw, model=model)
    )
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    cli.main(
        ["serve", "--model", "some/dir", "--served-model-name", "a", "b", "--dtype", "float"]
        + ["--chat-template", str(template), "--response-role", "bot"]
        + ["--disable-log-requests", "--trust-remote-code", "--enforce-eager"]
        + ["--max-logprobs", "5", "--swap-space", "16", "--tokenizer-mode", "auto"]
        + ["--override-generation-config", '{"temperature": 0.6}']
    )
    assert served["override_generation_config"] == {"temperature": 0.6}
    assert (served["swap_space"], served["tokenizer_mode"]) == (16.0, "auto")
    assert (served["model"], served["served_model_name"]) == ("some/dir", ["a", "b"])
    assert (served["api_key"], served["chat_template"]) == ("from-env", TEMPLATE)
    assert (served["response_role"], served["dtype"], served["max_logprobs"]) == (
        "bot",
        "float32",
        5,
    )
    monkeypatch.delenv("VLLM_API_KEY")
    cli.main(["serve", "--chat-template", "{{ messages }}\\n你"])  # escapes decoded, as vLLM
    assert served["api_key"] is None and served["chat_template"] == "{{ messages }}\n你"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "half"], "float32 or bfloat16"),
        (["--uvicorn-log-level", "bogus"], "invalid choice"),
        (["a", "--model", "b"], "given twice"),
        (["--chat-template", "./missing.jinja"], "looks like a file path"),
    ],
)
def test_serve_refuses_bad_flags_before_loading(monkeypatch, capsys, flags, message):
    from jvllm.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *flags])
    assert message in str(exited.value.code) + capsys.readouterr().err


def test_several_served_names_a_server_template_and_response_role(served):
    names = ["smol-a", "smol-b"]
    app = build_app(served["engine"], names, chat_template=TEMPLATE, response_role="bot")
    server = ServerThread(app).start()
    try:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == names
        body = {"model": "smol-b", "messages": CHAT, "max_tokens": 1, "return_token_ids": True}
        out = _post(server.url, "/v1/chat/completions", body)
        assert out["model"] == "smol-a" and out["choices"][0]["message"]["role"] == "bot"
        text = served["tokenizer"].decode(out["prompt_token_ids"])
        assert text == "user: What is the capital of France?\n"
        error = _error(server.url, "/v1/completions", {"model": "smol", "prompt": PROMPT}, 404)
        assert "`smol-a`, `smol-b`" in error["message"]
    finally:
        server.stop()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(served):
    url, tokenizer = served["url"], served["tokenizer"]
    long_prompt = "word " * 20_000 + PROMPT  # past max_model_len tokens and characters
    ids = tokenizer.encode(long_prompt)
    cut = _post(url, "/v1/completions", _greedy(prompt=long_prompt, truncate_prompt_tokens=5))
    tail = _post(url, "/v1/completions", _greedy(prompt=ids[-5:]))
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    chat = _post(url, "/v1/chat/completions", _greedy(messages=CHAT, truncate_prompt_tokens=3))
    assert chat["usage"]["prompt_tokens"] == 3
    for value, message in ((10**6, "greater than max_model_len"), (0, "must be None, -1")):
        error = _error(url, "/v1/completions", _greedy(prompt=PROMPT, truncate_prompt_tokens=value))
        assert error["param"] == "truncate_prompt_tokens" and message in error["message"]


def test_priority_needs_the_priority_scheduling_policy(served):
    error = _error(served["url"], "/v1/completions", _greedy(prompt=PROMPT, priority=1))
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert _post(served["url"], "/v1/completions", _greedy(prompt=PROMPT, priority=0))["choices"]


def _stream_deltas(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [c["choices"][0]["delta"] for c in map(json.loads, lines[:-1]) if c["choices"]]


def test_reasoning_parser_splits_the_thought_from_the_content(served):
    url = served["reasoning_url"]
    # The constraint makes SmolLM2 think first, as a thinking model would.
    thinking = _greedy(
        messages=CHAT, max_tokens=40, guided_regex=r"<think>[a-z ]{2,12}</think> ?[A-Z][a-z]{1,9}"
    )
    message = _post(url, "/v1/chat/completions", thinking)["choices"][0]["message"]
    text = _post(served["url"], "/v1/chat/completions", thinking)["choices"][0]["message"]
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", text["content"]).groups()
    assert (message["reasoning_content"], message["content"]) == (thought, answer)
    assert message["reasoning"] == thought
    deltas = _stream_deltas(url, {**thinking, "stream": True})
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    left_out = _post(url, "/v1/chat/completions", {**thinking, "include_reasoning": False})
    assert left_out["choices"][0]["message"]["reasoning_content"] is None
    assert left_out["choices"][0]["message"]["content"] == answer
    # A reply that does not think (Qwen3 with thinking off) is all content.
    plain = [
        _post(u, "/v1/chat/completions", _greedy(messages=CHAT))["choices"][0]["message"]
        for u in (url, served["url"])
    ]
    assert plain[0]["reasoning_content"] is None and plain[0]["content"] == plain[1]["content"]
