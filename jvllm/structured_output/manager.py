"""Grammars compiled once per distinct constraint, off the step loop, and each step's masks.

The engine compiles each request's constraint at `add_request` and gives the request a
`GrammarState` over it; the scheduler holds a request back (without holding back others) until
its state `is_ready()`, and after each sampled token calls `accept`. Before each step the engine asks for the step's bitmask:
one packed row `i32[ceil(V / 32)]` per scheduled request, all ones for the unconstrained.
"""

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jvllm.sampling_params import StructuredOutputsParams
from jvllm.structured_output.grammar import cache_key, parser_limits, validate

logger = logging.getLogger("jvllm.structured_output")

# Distinct constraints whose compiled matchers are kept for the requests that repeat them.
_MAX_CACHED = 256


class GrammarState:
    """One request's matcher: ready once its grammar compiled, then advanced token by token.

    The state lives on the host beside the request's tokens, so preemption (which keeps the
    tokens and recomputes only the KV) leaves it as it is."""

    def __init__(self, template: concurrent.futures.Future):
        self._template = template
        self.matcher: llguidance.LLMatcher | None = None
        # Why the grammar failed: it did not compile, or it rejected a token (its first line
        # from llguidance, which names a resource limit hit where there is one).
        self.error: str | None = None

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed: then `error` says why)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._template.done():
            return False
        try:
            self.matcher = self._template.result().deep_copy()
        except Exception as e:  # noqa: BLE001 - reported on the request, not raised
            self.error = f"the grammar failed to compile: {e}"
        return True

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here."""
        return self.matcher.validate_tokens(token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it (`error` says why)."""
        if self.matcher.consume_token(token_id):
            return True
        reason = self.matcher.get_error().partition("\n")[0]
        self.error = f"the grammar rejected token {token_id}: {reason}"
        return False

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its end (or EOS) and nothing more can follow."""
        return self.matcher.is_stopped()


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        synchronous: bool = False,
    ):
        """`vocab_size`: the model's logits width (masks cover it; ids the tokenizer lacks are
        never allowed). `eos_token_ids`: the tokens a grammar allows once it may end.
        `synchronous`: compile each grammar before `compile` returns, for engines that run in
        lockstep over several processes, whose schedules must not depend on a thread's timing."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids) or None
        self._synchronous = synchronous
        # One thread: the tokenizer's token table (about a second for a 49k vocabulary) is built
        # on first use, then each new grammar; the step loop never waits on either.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jvllm-grammar")
        self._tokenizer: llguidance.LLTokenizer | None = None
        # Compiled constraints, least recently used first; at most _MAX_CACHED of them, so a
        # server that sees ever new schemas does not grow without bound.
        self._templates: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self.num_words = (vocab_size + 31) // 32
        self.mask_seconds = 0.0  # time spent filling masks, for the benchmarks

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Validate the constraint (ValueError saying what is wrong) and start compiling it,
        unless an equal one was compiled before -> the compiled matcher, to be given to each
        request's `GrammarState`."""
        if self._hf_tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model ships none")
        key = cache_key(params)
        template = self._templates.get(key)
        if template is None or (template.done() and template.exception() is not None):
            # Checked once per distinct constraint: a cached one was valid when it came.
            template = self._pool.submit(self._compile, validate(params), key)
            self._templates[key] = template
            if len(self._templates) > _MAX_CACHED:
                self._templates.popitem(last=False)  # requests hold their own copies
        self._templates.move_to_end(key)
        if self._synchronous:
            concurrent.futures.wait([template])
        return template

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a compile in flight (the engine has nothing else
        to do)."""
        pending = [f for f in self._templates.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def _compile(self, grammar: str, key: str) -> llguidance.LLMatcher:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        logger.debug("compiled grammar %s in %.3fs", key[:80], time.perf_counter() - start)
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
            )
            logger.info("built the grammar tokenizer in %.1fs", time.perf_counter() - start)
        return self._tokenizer

    def bitmask(
        self, requests: list, will_sample, spec_token_ids: Mapping[str, list[int]] | None = None
    ) -> np.ndarray | None:
        """i32[len(requests), ceil(V / 32)]: the allowed next tokens of each constrained request
        that samples in this step (`will_sample(request)`), all ones elsewhere; None when no
        request needs a mask, so the step skips applying one.

        With speculative decoding's drafts (`spec_token_ids`, request id -> drafts the grammar
        accepts), a request's row is the mask after its drafts (its bonus token's), and one row
        per draft follows the requests' rows, in request order: the mask at that draft's
        position (worker/draft_scoring.py samples there)."""
        drafts = [
            (spec_token_ids or {}).get(request.request_id, []) if will_sample(request) else []
            for request in requests
        ]
        rows = [
            (request.structured_output.matcher, i)
            for i, request in enumerate(requests)
            if request.structured_output is not None and will_sample(request)
        ]
        if not rows:
            return None
        start = time.perf_counter()
        num_drafts = sum(len(d) for d in drafts)
        mask = np.full((len(requests) + num_drafts, self.num_words), -1, np.int32)
        drafted = [(matcher, i) for matcher, i in rows if drafts[i]]
        rows = [(matcher, i) for matcher, i in rows if not drafts[i]]
        if len(rows) == 1:
            llguidance.numpy.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
        elif rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        draft_rows = np.cumsum([len(requests), *(len(d) for d in drafts)])  # each one's first
        for matcher, i in drafted:  # one position after another, then back
            for j, token_id in enumerate(drafts[i]):
                llguidance.numpy.fill_next_token_bitmask(matcher, mask, int(draft_rows[i]) + j)
                matcher.consume_token(token_id)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, i)
            matcher.rollback(len(drafts[i]))
        self.mask_seconds += time.perf_counter() - start
        return mask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
