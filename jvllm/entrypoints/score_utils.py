"""vLLM's score for embedding models (LLM.score, /v1/score, /v1/rerank): texts of one side
against the other's, 1:1, 1:N (one text against each of N) or N:N (pairwise), each pair scored
by the cosine similarity of the two texts' embeddings."""

from collections.abc import Sequence

import numpy as np

from jvllm.pooling_outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput

_COSINE_EPS = 1e-8  # torch's cosine_similarity's, which vLLM scores with


def score_sides(text_1, text_2, names: tuple[str, str] = ("text_1", "text_2")) -> tuple:
    """Both sides as lists (a lone string or prompt dict is one text), or a ValueError naming
    the side (`names`) when one is empty or the two do not pair 1:1, 1:N or N:N."""
    sides = [[t] if isinstance(t, str | dict) else list(t) for t in (text_1, text_2)]
    for side, name in zip(sides, names):
        if not side:
            raise ValueError(f"{name} must hold at least one text")
    if len(sides[0]) > 1 and len(sides[0]) != len(sides[1]):
        raise ValueError(
            f"{names[0]} and {names[1]} must pair 1:1, 1:N or N:N, got {len(sides[0])} and "
            f"{len(sides[1])} texts"
        )
    return sides[0], sides[1]


def cosine_scores(
    embeds_1: Sequence[PoolingRequestOutput],
    embeds_2: Sequence[PoolingRequestOutput],
    pad_token_id: int | None,
) -> list[ScoringRequestOutput]:
    """One score per text of side 2, against side 1's one text or its text of the same index.
    A pair's prompt tokens are both texts' with the pad token between them (vLLM's count)."""
    if len(embeds_1) == 1:
        embeds_1 = list(embeds_1) * len(embeds_2)
    padding = [] if pad_token_id is None else [pad_token_id]
    return [
        ScoringRequestOutput(
            request_id=f"{e1.request_id}_{e2.request_id}",
            outputs=ScoringOutput(cosine_similarity(e1.outputs.data, e2.outputs.data)),
            prompt_token_ids=e1.prompt_token_ids + padding + e2.prompt_token_ids,
            finished=True,
        )
        for e1, e2 in zip(embeds_1, embeds_2, strict=True)
    ]


def cosine_similarity(x: np.ndarray, y: np.ndarray) -> float:
    """torch's F.cosine_similarity of f32[D] x and y: each over max(its norm, eps), then their
    dot product."""
    x = x / max(float(np.linalg.norm(x)), _COSINE_EPS)
    y = y / max(float(np.linalg.norm(y)), _COSINE_EPS)
    return float(np.dot(x, y))
