"""The draft model on the runner's mesh (speculative decoding's "draft_model" method,
worker/draft_model.py): its params, its KV cache over the target's pages, and its model, which
the target's step runs."""

from jax.sharding import Mesh

from jvllm.attention.backends import get_attention
from jvllm.distributed.sharded_model import sharded_model
from jvllm.layers.scan import unstack_layers
from jvllm.models.model import param_axes
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.proposal_runner import ProposalRunner


class DraftRunner(ProposalRunner):
    def __init__(self, draft: DraftModel, mesh: Mesh, *, layers_unstacked: bool, **layout) -> None:
        """The draft's params (layers split as the target's), its KV cache and its model;
        `layout`: ProposalRunner's."""
        config = draft.config
        super().__init__(config, mesh, **layout)
        params = (
            unstack_layers(draft.params, param_axes(config)) if layers_unstacked else draft.params
        )
        self.params = params
        attn = get_attention(
            layout["attention_backend"],
            sm_scale=config.sm_scale,
            logit_softcap=config.attn_logit_softcap,
        )
        self.model = sharded_model(config, mesh, attn, layers_unstacked, params)
        self.step_options = {"draft_model": self.model}
