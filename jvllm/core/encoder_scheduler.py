"""The scheduler's side of images: which images a step encodes, within vLLM's encoder budget
and the encoder cache's room, and where a step's tokens must stop for them.

An image is encoded whole, in the step whose tokens first reach it; a step stops before an
image its budget or the cache cannot take, and, for a model whose image tokens attend to their
whole image (Gemma 3), before an image it would cut. An image over the whole budget is encoded
alone in a step. Encodings scheduled for a request that then does not run are undone: handed
to another request of the step that reads the same image, else dropped.
"""

from jvllm.core.config import SchedulerConfig
from jvllm.core.encoder_cache_manager import EncoderCacheManager
from jvllm.core.multimodal import overlapping
from jvllm.core.request import Request


class EncoderScheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.cache = EncoderCacheManager(config.encoder_cache_size)
        self.budget = 0  # of the step being scheduled

    def start_step(self) -> None:
        self.budget = self.config.max_num_encoder_input_tokens

    def inputs_for(
        self, request: Request, num_computed: int, num_new_tokens: int
    ) -> tuple[list[int], int]:
        """(the request's images to encode for tokens `num_computed ..` + num_new_tokens, the
        tokens cut to end before the first image that this step cannot take). Images held in
        the encoder cache are referenced, not encoded again."""
        if not request.mm_features:  # text: every request, every step
            return [], num_new_tokens
        encode: list[int] = []
        end = num_computed + num_new_tokens
        if self.config.keep_images_whole:  # stop before an image the step would cut
            for i in overlapping(request.mm_features, num_computed, end):
                placeholder = request.mm_features[i].placeholder
                if placeholder.end > end:
                    end = max(placeholder.offset, num_computed)
                    num_new_tokens = end - num_computed
                    break
        for i in overlapping(request.mm_features, num_computed, end):
            feature = request.mm_features[i]
            if self.cache.use(request, feature):
                continue
            is_first = self.budget == self.config.max_num_encoder_input_tokens
            fits = feature.num_embeds <= self.budget or is_first
            if not fits or not self.cache.can_allocate(feature):
                return encode, max(feature.placeholder.offset - num_computed, 0)
            self.cache.allocate(request, feature)
            self.budget -= min(feature.num_embeds, self.budget)
            encode.append(i)
        return encode, num_new_tokens

    def undo(self, request: Request, encode: list[int], output) -> None:
        """The request does not run this step after all: each of its scheduled encodings goes
        to another request of `output` (a SchedulerOutput) that reads the same image, or is
        dropped and its budget given back; its references go (it holds none while not
        running)."""
        refund = 0
        for i in encode:
            feature = request.mm_features[i]
            heir = self._heir(request, feature, output)
            if heir is None:
                self.cache.discard(feature)
                refund += feature.num_embeds
                continue
            index = next(
                j for j, f in enumerate(heir.mm_features) if f.identifier == feature.identifier
            )
            output.scheduled_encoder_inputs.setdefault(heir.request_id, []).append(index)
        self.cache.release_all(request)
        self.budget = min(self.budget + refund, self.config.max_num_encoder_input_tokens)

    def _heir(self, request: Request, feature, output) -> Request | None:
        """A request scheduled in `output` besides `request` that reads `feature`'s image."""
        users = self.cache.users(feature)
        return next(
            (r for r in output.scheduled_requests if r is not request and r.request_id in users),
            None,
        )

    def forget(self, output) -> list[str]:
        """A step that failed: the images it was to encode are not held (the worker drops
        what it did encode) -> their hashes."""
        hashes = []
        for request in output.scheduled_requests:
            for i in output.scheduled_encoder_inputs.get(request.request_id, ()):
                self.cache.discard(request.mm_features[i])
                hashes.append(request.mm_features[i].identifier)
        return hashes
