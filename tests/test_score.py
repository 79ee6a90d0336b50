"""vLLM's score and rerank for an embedding model: LLM.score and /v1/score, /v1/rerank (and
/rerank) on a server started with runner="pooling", each score the cosine similarity of the two
texts' embeddings, against LLM.embed's and HF's; the broadcasting rules; bad input refused."""

import httpx
import numpy as np
import pytest
import torch

from jvllm import LLM, PoolingParams, ScoringRequestOutput
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny-embed"
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow", "the capital city", "a"]
ENGINE = {"max_model_len": 64, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, runner="pooling", **ENGINE)
    texts = [QUERY, *DOCS]
    embeds = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL)).start()
    yield {"llm": llm, "url": server.url, "embeds": dict(zip(texts, embeds))}
    server.stop()
    engine.shutdown()


def _cosine(x, y) -> float:
    """torch's cosine similarity (vLLM's score) of two vectors."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def test_score_is_the_cosine_of_the_embeddings_1_to_n_and_n_to_n(setup, tiny_llama_hf):
    llm, embeds = setup["llm"], setup["embeds"]
    tokenizer = llm.get_tokenizer()
    outputs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) for o in outputs)
    got = [o.outputs.score for o in outputs]
    np.testing.assert_allclose(got, [_cosine(embeds[QUERY], embeds[d]) for d in DOCS], atol=1e-6)
    assert len(set(np.round(got, 4))) == len(DOCS)  # distinct: an ordering check means something
    raw = llm.score(QUERY, DOCS, use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    np.testing.assert_allclose([o.outputs.score for o in raw], got, atol=1e-6)  # a cosine

    hf_base = tiny_llama_hf.model  # the causal LM's base model: last_hidden_state after the norm
    with torch.no_grad():
        last = [hf_base(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1] for t in DOCS]
    hf_scores = [_cosine(last[0], v) for v in last]
    outputs = llm.score(DOCS[0], DOCS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outputs], hf_scores, atol=1e-5)
    assert outputs[0].outputs.score == pytest.approx(1.0, abs=1e-6)

    pairwise = llm.score(DOCS[:2], [QUERY, DOCS[3]], use_tqdm=False)
    want = [_cosine(embeds[DOCS[0]], embeds[QUERY]), _cosine(embeds[DOCS[1]], embeds[DOCS[3]])]
    np.testing.assert_allclose([o.outputs.score for o in pairwise], want, atol=1e-6)
    pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
    assert pairwise[1].prompt_token_ids == tokenizer.encode(DOCS[1]) + pad + tokenizer.encode(
        DOCS[3]
    )

    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(DOCS[:2], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="text_2 must hold at least one text"):
        llm.score(QUERY, [], use_tqdm=False)


def test_score_route_answers_with_the_offline_scores(setup):
    offline = [o.outputs.score for o in setup["llm"].score(QUERY, DOCS, use_tqdm=False)]
    reply = httpx.post(
        setup["url"] + "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert {d["object"] for d in body["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in body["data"]], offline, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    pairwise = httpx.post(
        setup["url"] + "/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}
    ).json()
    want = [o.outputs.score for o in setup["llm"].score(DOCS[:2], DOCS[2:], use_tqdm=False)]
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], want, atol=1e-6)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank"])
def test_rerank_sorts_the_documents_best_first_and_keeps_top_n(setup, route):
    scores = [o.outputs.score for o in setup["llm"].score(QUERY, DOCS, use_tqdm=False)]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    reply = httpx.post(setup["url"] + route, json=body).json()
    assert [r["index"] for r in reply["results"]] == order
    for result in reply["results"]:
        assert result["document"] == {"text": DOCS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(scores[result["index"]], abs=1e-6)
    assert reply["id"].startswith("rerank-") and reply["usage"]["total_tokens"] > 0

    top = httpx.post(setup["url"] + route, json={**body, "top_n": 2}).json()
    assert [r["index"] for r in top["results"]] == order[:2]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
        ("/v1/score", {"text_1": [1, 2], "text_2": DOCS}, "text_1"),
        (
            "/v1/score",
            {"text_1": QUERY, "text_2": "a", "truncate_prompt_tokens": -5},
            "truncate_prompt_tokens",
        ),
        ("/v1/score", {"text_1": "word " * 80, "text_2": "a"}, "text_1"),  # > max_model_len
        ("/v1/rerank", {"query": 5, "documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": "a"}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": "x"}, "top_n"),
    ],
)
def test_bad_score_requests_are_400_naming_the_field(setup, route, body, param):
    reply = httpx.post(setup["url"] + route, json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_generating_engine_refuses_to_score(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE)
    with pytest.raises(ValueError, match="LLM.score needs runner='pooling'"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL)).start()
    try:
        for route in ("/v1/score", "/v1/rerank", "/rerank"):
            body = {"text_1": QUERY, "text_2": DOCS, "query": QUERY, "documents": DOCS}
            reply = httpx.post(server.url + route, json=body)
            assert reply.status_code == 400
            assert "--runner pooling" in reply.json()["error"]["message"]
    finally:
        server.stop()
        engine.shutdown()
