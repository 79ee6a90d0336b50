"""Speculative decoding (vLLM's `speculative_config`): n-gram (prompt lookup) drafts, proposed
on the host and verified by the target model in one forward pass (docs/design.md,
"Speculative decoding")."""

from jvllm.spec_decode.config import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = ["SPECULATIVE_METHODS", "SpeculativeConfig"]
