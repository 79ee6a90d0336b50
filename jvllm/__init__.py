"""jvllm: vLLM's inference engine in JAX."""

from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.llm_engine import LLMEngine
from jvllm.entrypoints.llm import LLM
from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"
