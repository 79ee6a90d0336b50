"""The OpenAI server with a model that takes images: image_url parts as data: URLs, http(s)
URLs from allowed hosts and file:// URLs under the allowed folder give the offline engine's
replies; every other image is a 400 that names the part, and the engine stays clean."""

import base64
import http.server
import io
import threading

import httpx
import openai
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread
from tests.vlm_models import random_image

MODEL = "tiny-llava"


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.fixture(scope="module")
def setup(tiny_llava_dir, tmp_path_factory):
    media = tmp_path_factory.mktemp("served_media")
    random_image(41).save(media / "cat.png")
    image_bytes = png_bytes(random_image(42))

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image_bytes)))
            self.end_headers()
            self.wfile.write(image_bytes)

        def log_message(self, *args):
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    llm = LLM(
        tiny_llava_dir,
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=256,
        allowed_local_media_path=str(media),
        allowed_media_domains=["127.0.0.1"],
    )
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL, None)).start()
    yield {
        "llm": llm,
        "url": server.url,
        "media": media,
        "images_url": f"http://127.0.0.1:{images.server_address[1]}",
        "engine": engine,
    }
    server.stop()
    engine.shutdown()
    images.shutdown()


@pytest.fixture
def client(setup):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key="unused", max_retries=0)


def ask(client, url: str):
    content = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=6,
    )


def offline(setup, image) -> str:
    content = [{"type": "text", "text": "What is in"}, {"type": "image_pil", "image_pil": image}]
    messages = [{"role": "user", "content": content}]
    [out] = setup["llm"].chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    return out.outputs[0].text


def test_data_file_and_http_images_give_the_offline_replies(setup, client):
    assert ask(client, data_url(random_image(40))).choices[0].message.content == offline(
        setup, random_image(40)
    )
    by_file = ask(client, f"file://{setup['media']}/cat.png").choices[0].message.content
    assert by_file == offline(setup, random_image(41))
    by_http = ask(client, setup["images_url"] + "/dog.png").choices[0].message.content
    assert by_http == offline(setup, random_image(42))


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file:///etc/passwd", "outside|allowed"),
        ("FILE_ESCAPE", "outside|allowed"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "decode"),
        ("data:audio/wav;base64,AAAA", "image"),
        ("http://localhost:1/x.png", "localhost"),
    ],
)
def test_images_the_server_may_not_or_cannot_load_are_400s(setup, client, url, match):
    if url == "FILE_ESCAPE":
        url = f"file://{setup['media']}/../served_media_escape.png"
    with pytest.raises(openai.BadRequestError, match=match):
        ask(client, url)
    assert not setup["engine"].engine.has_unfinished_requests()


def test_tokenize_and_image_pil_parts_are_400s_that_fetch_nothing(setup, client):
    content = [{"type": "image_url", "image_url": {"url": setup["images_url"] + "/a.png"}}]
    response = httpx.post(
        setup["url"] + "/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}]},
        timeout=30,
    )
    assert response.status_code == 400 and "chat/completions only" in response.text
    pil = [{"type": "image_pil", "image_pil": "x"}]
    with pytest.raises(openai.BadRequestError, match="only the offline LLM.chat takes"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": pil}], max_tokens=1
        )


def test_images_are_processed_off_the_engine_s_thread(setup, client, monkeypatch):
    processor = setup["engine"].engine.mm_processor
    threads = []
    process = processor.process

    def recording(prompt, tokenizer):
        threads.append(threading.current_thread().name)
        return process(prompt, tokenizer)

    monkeypatch.setattr(processor, "process", recording)
    ask(client, data_url(random_image(43)))
    assert threads and "jvllm-engine" not in threads
