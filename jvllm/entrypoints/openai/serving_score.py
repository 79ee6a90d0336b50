"""vLLM's /v1/score (and /score) and its Jina/Cohere-style /v1/rerank (and /rerank,
/v2/rerank) over an engine started with runner="pooling": each text embedded once, each pair
scored by the cosine similarity of its two embeddings (score_utils.py), as vLLM scores with
an embedding model."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jvllm.entrypoints.openai.admission import unless_disconnected
from jvllm.entrypoints.openai.protocol import OpenAIError, _Request
from jvllm.entrypoints.openai.serving_embedding import (
    RERANK_ROUTES,
    SCORE_ROUTES,
    OpenAIServingEmbedding,
)
from jvllm.entrypoints.score_utils import cosine_scores, score_sides
from jvllm.pooling_outputs import ScoringRequestOutput
from jvllm.pooling_params import PoolingParams


class ScoreRequest(_Request):
    model: str | None = None
    text_1: Any  # str | list[str], checked in `_texts`
    text_2: Any
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Request):
    model: str | None = None
    query: Any  # str
    documents: Any  # list[str]
    top_n: int = 0  # the best top_n results; <= 0: all (vLLM's)
    truncate_prompt_tokens: int | None = None


class OpenAIServingScore:
    """Scores through the embedding route's engine calls (`OpenAIServingEmbedding`)."""

    def __init__(self, embedding: OpenAIServingEmbedding):
        self.embedding = embedding
        tokenizer = embedding.tokenizer
        self.pad_token_id = None if tokenizer is None else tokenizer.pad_token_id

    async def score(self, request: ScoreRequest) -> dict:
        self._check_model(request.model)
        texts_1, texts_2 = _texts(request.text_1, "text_1"), _texts(request.text_2, "text_2")
        request_id = f"score-{uuid.uuid4().hex}"
        scores = await self._scores(
            texts_1, texts_2, ("text_1", "text_2"), request.truncate_prompt_tokens, request_id
        )
        data = [
            {"index": i, "object": "score", "score": s.outputs.score} for i, s in enumerate(scores)
        ]
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.embedding.model_name,
            "data": data,
            "usage": _usage(scores),
        }

    async def rerank(self, request: RerankRequest) -> dict:
        """The documents by their score against the query, best first; the first top_n."""
        self._check_model(request.model)
        if not isinstance(request.query, str) or not request.query:
            raise OpenAIError("query must be a non-empty string", param="query")
        documents = _texts(request.documents, "documents", allow_one=False)
        request_id = f"rerank-{uuid.uuid4().hex}"
        scores = await self._scores(
            [request.query],
            documents,
            ("query", "documents"),
            request.truncate_prompt_tokens,
            request_id,
        )
        results = [
            {"index": i, "document": {"text": doc}, "relevance_score": s.outputs.score}
            for i, (doc, s) in enumerate(zip(documents, scores))
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties by index
        top_n = request.top_n if request.top_n > 0 else len(results)
        return {
            "id": request_id,
            "model": self.embedding.model_name,
            "usage": _usage(scores),
            "results": results[:top_n],
        }

    def _check_model(self, model: str | None) -> None:
        if self.embedding.check_model(model) is not None:
            raise OpenAIError("LoRA adapters do not serve scores", param="model")

    async def _scores(
        self, texts_1, texts_2, names: tuple[str, str], truncate_prompt_tokens, request_id: str
    ) -> list[ScoringRequestOutput]:
        """Both sides embedded side by side (the first failure cancels the other)."""
        try:
            score_sides(texts_1, texts_2, names)
        except ValueError as e:
            raise OpenAIError(str(e), param=names[1]) from None
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        sides = [(texts_1, names[0]), (texts_2, names[1])]
        tasks = [
            asyncio.ensure_future(self._embed(texts, name, params, f"{request_id}-{i}"))
            for i, (texts, name) in enumerate(sides)
        ]
        try:
            embeds_1, embeds_2 = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return cosine_scores(embeds_1, embeds_2, self.pad_token_id)

    async def _embed(self, texts, name: str, params: PoolingParams, request_id: str) -> list:
        """The texts' embeddings; an error about a prompt names the side (`name`)."""
        try:
            return await self.embedding.encode_all(texts, params, request_id)
        except OpenAIError as e:
            if e.param == "input":
                e.param = name
            raise


def _texts(value, name: str, allow_one: bool = True) -> list[str]:
    """A side of a score as a list of non-empty strings (one string: a list of one, where
    `allow_one`); OpenAIError naming the field otherwise."""
    if allow_one and isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        kinds = "a non-empty string or list of strings" if allow_one else "a non-empty list"
        raise OpenAIError(f"{name} must be {kinds}, got {value!r}"[:200], param=name)
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise OpenAIError(
                f"{name}[{i}] must be a non-empty string, got {text!r}"[:200], param=name
            )
    return value


def _usage(scores: list[ScoringRequestOutput]) -> dict:
    """vLLM's count: every pair's tokens (a 1:N side's one text counted N times)."""
    num_tokens = sum(len(s.prompt_token_ids) for s in scores)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def add_score_routes(app: FastAPI, embedding: OpenAIServingEmbedding) -> None:
    serving = OpenAIServingScore(embedding)

    async def reply(raw: Request, work) -> Response:
        result = await unless_disconnected(raw, work)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def create_score(request: ScoreRequest, raw: Request):
        return await reply(raw, serving.score(request))

    async def do_rerank(request: RerankRequest, raw: Request):
        return await reply(raw, serving.rerank(request))

    for path in SCORE_ROUTES:
        app.post(path)(create_score)
    for path in RERANK_ROUTES:
        app.post(path)(do_rerank)
