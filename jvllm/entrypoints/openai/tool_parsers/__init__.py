"""Tool call parsers for the chat API, by vLLM's `--tool-call-parser` names."""

from jvllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser
from jvllm.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from jvllm.entrypoints.openai.tool_parsers.gpt_oss import OpenAIToolParser
from jvllm.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from jvllm.entrypoints.openai.tool_parsers.hermes import Hermes2ProToolParser
from jvllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jvllm.entrypoints.openai.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from jvllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from jvllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from jvllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "granite": GraniteToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "openai": OpenAIToolParser,
    "glm45": Glm45ToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; allowed: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return TOOL_PARSERS[name]


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "Glm45ToolParser",
    "GraniteToolParser",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "MiniMaxM2ToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolParser",
    "get_tool_parser",
]
