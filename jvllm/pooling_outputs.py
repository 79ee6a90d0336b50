"""What a pooling engine returns: vLLM's `PoolingRequestOutput`, its embedding view, a score."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class PoolingOutput:
    data: np.ndarray  # f32[D'] (D' = the request's dimensions, else the hidden size)


@dataclasses.dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None  # None when the request was aborted
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        """vLLM's conversion: the pooled array as a list of floats."""
        embedding = EmbeddingOutput(output.outputs.data.tolist())
        return cls(output.request_id, embedding, output.prompt_token_ids, output.finished)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """vLLM's output of LLM.score: one pair's score; its prompt tokens are both texts'."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
