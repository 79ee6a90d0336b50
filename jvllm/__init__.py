"""jvllm: vLLM's inference engine in JAX."""

from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.llm_engine import LLMEngine
from jvllm.entrypoints.llm import LLM
from jvllm.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from jvllm.pooler_config import PoolerConfig
from jvllm.pooling_outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "PoolerConfig",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"
