"""Tool call parsers for the chat API, by vLLM's `--tool-call-parser` names."""

from jvllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser
from jvllm.entrypoints.openai.tool_parsers.hermes import Hermes2ProToolParser
from jvllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
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
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "ToolParser",
    "get_tool_parser",
]
