"""The Responses API's objects for one request: the response, its output items (reasoning,
message, function_call) and its stream's numbered events. serving_responses.py answers a whole
reply with them; responses_stream.py streams one."""

from __future__ import annotations

import uuid

from jvllm.entrypoints.openai.protocol import ResponsesRequest
from jvllm.entrypoints.openai.serving_engine import now, sse
from jvllm.outputs import RequestOutput


class Events:
    """The stream's events, numbered as the API numbers them."""

    def __init__(self):
        self.sequence_number = 0

    def emit(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(body)}"


class ResponseView:
    """The response object of one request, around the output items it is given."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, num_prompt: int):
        self.request = request
        self.id = response_id
        self.model = model
        self.num_prompt = num_prompt
        self.created_at = now()

    def shell(self, status: str, output: list | None = None) -> dict:
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output or [],
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_logprobs": request.top_logprobs,
            "truncation": "disabled",
            "user": request.user,
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def response(
        self, result: RequestOutput, output: list[dict], num_reasoning: int, num_output: int
    ) -> dict:
        """The response to `result` (its last output, when streamed) with its `output` items and
        `num_output` tokens, `num_reasoning` of them reasoning."""
        incomplete = result.outputs[0].finish_reason == "length"
        body = self.shell("incomplete" if incomplete else "completed", output)
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": self.num_prompt + num_output,
        }
        return body


def reply_items(
    reasoning: str | None, text: str | None, calls: list[dict], logprobs: list[dict]
) -> list[dict]:
    """A whole reply's items: its reasoning, its message (unless it only calls tools; with the
    `logprobs` of the reply's tokens, as vLLM gives them) and a function_call item per call
    (chat's tool_calls entries)."""
    items = []
    if reasoning is not None:
        items.append(reasoning_item(reasoning, "completed"))
    if text or not calls:
        items.append(message_item(text or "", "completed", logprobs))
    for call in calls:
        function = call["function"]
        items.append(call_item(call["id"], function["name"], function["arguments"], "completed"))
    return items


def message_item(text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    """An assistant message of one output_text part (None: no part yet)."""
    content = [] if text is None else [text_part(text, logprobs or [])]
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def reasoning_item(text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": content,
        "status": status,
    }


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def text_part(text: str, logprobs: list[dict]) -> dict:
    """An output_text part; `logprobs`: chat's logprobs.content entries of its tokens."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
