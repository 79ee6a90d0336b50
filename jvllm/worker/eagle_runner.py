"""A draft head on the runner's device (speculative decoding's "eagle3" and "mtp" methods,
worker/eagle.py): its params, its KV cache over the target's pages, and what the target's step
runs of it."""

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec

from jvllm.attention.backends import get_attention
from jvllm.config import ModelConfig
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.sharded_model import KV_CACHE_SPEC
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs, shard_config
from jvllm.worker.draft_model import DraftModel
from jvllm.worker.eagle import draft_head
from jvllm.worker.proposal_runner import ProposalRunner


class EagleRunner(ProposalRunner):
    def __init__(self, draft: DraftModel, target: ModelConfig, mesh: Mesh, **layout) -> None:
        """The head's params and KV cache, and `head` for the target's step, which runs it
        over the step and k - 1 steps past it; `layout`: ProposalRunner's.
        Under tensor parallelism the head's layer is cut as the target's layers are (its
        heads and MLP over the "model" axis, its KV cache on its KV heads), inside a shard_map
        of its own; its fc and LM head run outside, as XLA partitions them."""
        config = draft.config
        super().__init__(config, mesh, **layout)
        self.params = draft.params
        attn = get_attention(layout["attention_backend"], sm_scale=config.sm_scale)
        k = self.num_speculative_tokens
        self.head = draft_head(config, target, attn, k)
        num_shards = mesh.shape[TP_AXIS]
        if num_shards > 1:
            local = draft_head(shard_config(config, num_shards), target, attn, k)
            specs = params_in_specs(param_specs(config), self.params)
            whole = PartitionSpec()
            forward = jax.shard_map(
                local.forward,
                mesh=mesh,
                in_specs=(specs, KV_CACHE_SPEC, whole, whole, whole, whole),
                out_specs=(whole, whole, KV_CACHE_SPEC),
                check_vma=False,
            )
            self.head = dataclasses.replace(self.head, forward=forward)
        self.step_options = {"draft_head": self.head}
        self.reads_layer_inputs = self.head.layer_ids is not None
