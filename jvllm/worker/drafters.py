"""The runner of speculative decoding's draft, by method: a whole draft model
(worker/draft_runner.py) or a draft head (EAGLE-1 / EAGLE-3 / MTP, worker/eagle_runner.py)."""

from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.spec_decode.config import HEAD_METHODS
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.draft_runner import DraftRunner
from jvllm.worker.eagle_runner import EagleRunner
from jvllm.worker.proposal_runner import ProposalRunner


def make_drafter(
    draft: DraftModel, target: ModelConfig, mesh: Mesh, *, layers_unstacked: bool, **layout
) -> ProposalRunner:
    """`draft` on the target's `mesh`, its KV cache over the target's pages (`layout`:
    ProposalRunner's); `layers_unstacked`: whether the target's layers are split (a draft
    model's are split alike)."""
    if draft.method in HEAD_METHODS:
        return EagleRunner(draft, target, mesh, **layout)
    return DraftRunner(draft, mesh, layers_unstacked=layers_unstacked, **layout)
