"""Per-request parameters of a pooling (embedding) request, with vLLM's names."""

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """`dimensions`: keep the first `dimensions` values of the embedding (matryoshka models
    only: vLLM refuses it for the others), cut before normalizing. `normalize`: L2-normalize
    the embedding; None takes the engine's `PoolerConfig.normalize`.
    `truncate_prompt_tokens` (vLLM's): pool over the prompt's last k tokens (-1: max_model_len).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ValueError(f"dimensions must be None or an int >= 1, got {dims!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be None or a bool, got {self.normalize!r}")
