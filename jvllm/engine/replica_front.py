"""What a data-parallel front end shares with its first replica: the model, its tokenizer,
limits and defaults (engine/data_parallel.py, engine/process_data_parallel.py)."""

from jvllm.engine.llm_engine import LLMEngine
from jvllm.sampling_params import SamplingParams


class ReplicaFront:
    replicas: list[LLMEngine]  # the replicas in this process, the first of rank 0

    def _share_first_replica(self) -> None:
        first = self.replicas[0]
        self.engine_config = first.engine_config  # rank 0's; the others' differ in rank
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.generation_config = first.generation_config
        self.max_model_len = first.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].get_default_sampling_params()

    def check_request(self, *args) -> None:
        """LLMEngine.check_request: every rank refuses what the first does."""
        self.replicas[0].check_request(*args)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.replicas[0].eos_token_ids
