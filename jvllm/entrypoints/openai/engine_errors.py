"""What the engine refuses, as the HTTP answers OpenAI's clients expect: bad input a 400, a dead
engine a 500, a full or sleeping one a 503 (the full one's with a Retry-After)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from jvllm.engine.async_llm import EngineDeadError, EngineOverloadedError
from jvllm.engine.sleep import EngineSleepingError
from jvllm.entrypoints.openai.protocol import OpenAIError

# What a 503's Retry-After asks of a client: the engine admits again within steps.
RETRY_AFTER_SECONDS = 1


@contextlib.contextmanager
def engine_errors(param_of: Callable[[str], str | None] = lambda message: None):
    """Around a call into the engine: its errors as OpenAIErrors; `param_of(message)` names
    the request field a bad input's message is about."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise OpenAIError(str(e), param=param_of(str(e))) from None
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
