"""MiniMax-M2 tool calls (vLLM's "minimax_m2" parser): content, then blocks
`<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="P">VALUE</parameter>\n...
</invoke>\n<invoke ...>...</invoke>\n</minimax:tool_call>`: a block holds one or more calls.
Values are typed by the parameters' JSON schemas as Qwen3-Coder's (qwen3_coder.py, whose
parser reads this markup too)."""

from jvllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


class MiniMaxM2ToolParser(Qwen3CoderToolParser):
    tool_call_start, tool_call_end = "<minimax:tool_call>", "</minimax:tool_call>"
    function_start, function_end = '<invoke name="', "</invoke>"
    parameter_start, parameter_end = '<parameter name="', "</parameter>"
    name_end = parameter_name_end = '">'
    calls_share_blocks = True
