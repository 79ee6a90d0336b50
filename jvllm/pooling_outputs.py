"""What a pooling engine returns: vLLM's `PoolingRequestOutput` and its embedding view."""

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
