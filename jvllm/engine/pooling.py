"""A pooling engine's requests on the host: checked at the edge, their chunks' pooled shares
added up (worker/pooler.py), and each finished one's vector cut to its dimensions and
normalized into a `PoolingRequestOutput`. It stands where a generating engine's
OutputProcessor stands (`add_request`, `make_output`, `discard`)."""

import dataclasses

import numpy as np

from jvllm.config import ModelConfig
from jvllm.core.engine_config import EngineConfig
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.engine.input_processor import truncate_prompt
from jvllm.logger import init_logger
from jvllm.outputs import RequestMetrics
from jvllm.pooler_config import PoolerConfig
from jvllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import SamplingParams

logger = init_logger(__name__)

# What a pooling request carries where a generation request has its sampling parameters: the
# step's host arrays read them, the pooling step does not.
_NO_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, seed=0)


@dataclasses.dataclass(frozen=True)
class Matryoshka:
    """Whether the model's embeddings may be cut short (config.json's `is_matryoshka` or
    `matryoshka_dimensions`, as vLLM reads them), and to which sizes (None: any)."""

    is_matryoshka: bool = False
    dimensions: tuple[int, ...] | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict | None) -> "Matryoshka":
        dims = (hf_config or {}).get("matryoshka_dimensions")
        is_matryoshka = bool(dims) or bool((hf_config or {}).get("is_matryoshka", False))
        return cls(is_matryoshka, tuple(dims) if dims else None)


def make_pooling_processor(
    config: EngineConfig, model_config: ModelConfig, hf_config: dict | None
) -> "PoolingOutputProcessor | None":
    """A pooling engine's processor (None for a generating engine) over its resolved
    PoolerConfig, its matryoshka sizes read from config.json (`hf_config`)."""
    pooler_config = config.pooler_config
    if pooler_config is None:
        return None
    processor = PoolingOutputProcessor(
        pooler_config,
        Matryoshka.from_hf_config(hf_config),
        model_config.hidden_size,
        model_config.vocab_size,
        config.max_model_len,
    )
    logger.info(
        "pooling runner: %s pooling, normalize=%s; prefix caching %s",
        pooler_config.pooling_type,
        pooler_config.normalize,
        "on" if processor.can_cache_prefix and config.cache_config.enable_prefix_caching else "off",
    )
    return processor


class PoolingOutputProcessor:
    def __init__(
        self,
        pooler_config: PoolerConfig,
        matryoshka: Matryoshka,
        hidden_size: int,
        vocab_size: int,
        max_model_len: int,
    ):
        self.pooler_config = pooler_config
        self.matryoshka = matryoshka
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._pooled: dict[str, np.ndarray] = {}  # request id -> f32[D], the shares so far

    @property
    def pooling_type(self) -> str:
        return self.pooler_config.pooling_type

    @property
    def can_cache_prefix(self) -> bool:
        """Only LAST pooling: a prefix-cache hit skips computing the prefix's hidden states,
        which MEAN sums and CLS takes (the hit never covers the last token)."""
        return self.pooling_type == "LAST"

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams | None,
        arrival_time: float,
        priority: int,
        cache_salt: str | None,
    ) -> Request:
        """A checked pooling request (ValueError/TypeError naming what is wrong), its
        `pooling_params.normalize` resolved against the engine's pooler config."""
        params = self._check_params(params)
        prompt_token_ids = truncate_prompt(
            prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len
        )
        self._check_prompt(prompt_token_ids)
        request = Request(
            request_id,
            prompt_token_ids,
            _NO_SAMPLING,
            eos_token_id=None,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            priority=priority,
        )
        request.pooling_params = params
        request.metrics = RequestMetrics(arrival_time=arrival_time)
        return request

    def _check_params(self, params: PoolingParams | None) -> PoolingParams:
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(  # noqa: TRY004 - the wrong runner's params: a ValueError (vLLM)
                "this engine runs runner='pooling' (embeddings): pass PoolingParams through "
                "LLM.embed / LLM.encode, or start the engine with runner='generate' to "
                f"generate; got {type(params).__name__}"
            )
        dims = params.dimensions
        if dims is not None:
            allowed = self.matryoshka.dimensions
            if not self.matryoshka.is_matryoshka:
                raise ValueError(
                    f"dimensions={dims}: this model does not support matryoshka representation "
                    "(its config.json sets neither is_matryoshka nor matryoshka_dimensions); "
                    "changing output dimensions would lead to poor results"
                )
            if allowed is not None and dims not in allowed:
                raise ValueError(f"dimensions={dims} is not supported; allowed: {list(allowed)}")
            if dims > self.hidden_size:
                raise ValueError(f"dimensions={dims} exceeds the hidden size {self.hidden_size}")
        if params.normalize is None:
            params = dataclasses.replace(params, normalize=self.pooler_config.normalize)
        return params

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be in [0, {self.vocab_size}) for this model, got {bad[:5]}"
            )
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens) is longer than max_model_len "
                f"({self.max_model_len}); shorten it, truncate it (truncate_prompt_tokens) or "
                "raise max_model_len"
            )

    def add_request(self, request: Request) -> None:
        self._pooled[request.request_id] = np.zeros(self.hidden_size, np.float32)

    def add_step(self, scheduler_output: SchedulerOutput, pooled: np.ndarray | None) -> None:
        """Add a step's shares (f32[num_reqs, D], rows in scheduled order). A request
        preempted in this schedule recomputes its prompt from the start: its shares so far
        are dropped."""
        for request in scheduler_output.preempted_requests:
            self._pooled[request.request_id][:] = 0.0
        if pooled is None:
            return
        for request, share in zip(scheduler_output.scheduled_requests, pooled, strict=True):
            self._pooled[request.request_id] += share

    def make_output(self, request: Request) -> PoolingRequestOutput | None:
        """The finished request's output (its vector; None for one that did not complete),
        None while it runs."""
        if not request.is_finished:
            return None
        pooled = self._pooled.pop(request.request_id)
        data = None
        if request.status == RequestStatus.FINISHED_STOPPED:
            data = PoolingOutput(_finish_vector(pooled, request.pooling_params))
        return PoolingRequestOutput(
            request_id=request.request_id,
            outputs=data,
            prompt_token_ids=request.prompt_token_ids,
            finished=True,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def discard(self, request: Request) -> None:
        self._pooled.pop(request.request_id, None)


def _finish_vector(pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
    """The first `dimensions` values (matryoshka), then the L2 norm if asked (torch's
    F.normalize: x / max(|x|, 1e-12)), as vLLM orders them."""
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
    return pooled.astype(np.float32)
