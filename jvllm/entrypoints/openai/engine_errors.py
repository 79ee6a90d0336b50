"""What the engine refuses, as the HTTP answers OpenAI's clients expect: bad input a 400, a dead
engine a 500, a full or sleeping one a 503 (the full one's with a Retry-After)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection

from jvllm.engine.async_llm import EngineDeadError, EngineOverloadedError
from jvllm.engine.sleep import EngineSleepingError
from jvllm.entrypoints.openai.protocol import OpenAIError

# What a 503's Retry-After asks of a client: the engine admits again within steps.
RETRY_AFTER_SECONDS = 1
# The fields a request may carry its prompt in (completions, chat, the Responses API and
# embeddings): the engine's messages call it "prompt".
_PROMPT_FIELDS = ("prompt", "messages", "input")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def param_of(message: str, fields: Collection[str]) -> str | None:
    """The request field an error's message is about: the first of its words that names one of
    `fields` (the request's), the word "prompt" naming the field the prompt came in; None when
    it names none. `model` is not looked for: a message's "this model" is the model itself,
    and the request's model name is checked (a 404) before anything else."""
    prompt_field = next((f for f in _PROMPT_FIELDS if f in fields), None)
    for word in _WORD.findall(message):
        if word == "prompt" and prompt_field is not None:
            return prompt_field
        if word in fields and word != "model":
            return word
    return None


@contextlib.contextmanager
def engine_errors(fields: Collection[str] = (), default: str | None = None):
    """Around a call into the engine: its errors as OpenAIErrors; a bad input's names the field
    of `fields` (the request's) its message is about (`param_of`), else `default`."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise OpenAIError(str(e), param=param_of(str(e), fields) or default) from None
    except EngineDeadError as e:
        raise OpenAIError(str(e), status_code=500, type="internal_server_error") from None
    except EngineSleepingError as e:  # slept after the request passed the 503 middleware
        raise OpenAIError(str(e), status_code=503, type="service_unavailable_error") from None
    except EngineOverloadedError as e:
        raise OpenAIError(
            f"the server is overloaded: {e}",
            status_code=503,
            type="service_unavailable_error",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from None
