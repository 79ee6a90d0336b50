"""Which images' encoder outputs the worker holds (vLLM's EncoderCacheManager), on the host.

The worker keeps each image's embeddings under its content hash. An entry is referenced by the
requests whose unprocessed tokens still need it; once none does, it stays until its room is
needed (least recently released first), so a repeated image, a preempted request and the next
chunk of a prefill that cut through an image find it without encoding again. Capacity counts
embedding rows; `freed_hashes` tells the worker what to drop.
"""

from collections import OrderedDict

from jvllm.core.multimodal import MultiModalFeature
from jvllm.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.num_free_rows = cache_size
        self._sizes: dict[str, int] = {}  # hash -> rows, every entry the worker holds
        self._users: dict[str, set[str]] = {}  # hash -> ids of the requests that need it
        self._unused: OrderedDict[str, None] = OrderedDict()  # held, needed by nobody
        self._freed: list[str] = []
        self.num_lookups = 0
        self.num_hits = 0

    def users(self, feature: MultiModalFeature) -> set[str]:
        """The ids of the requests that reference the image."""
        return set(self._users.get(feature.identifier, ()))

    def use(self, request: Request, feature: MultiModalFeature) -> bool:
        """Reference an image the request needs; False when it must be encoded first."""
        key = feature.identifier
        if request.request_id in self._users.get(key, ()):
            return True
        self.num_lookups += 1
        if key not in self._sizes:
            return False
        self.num_hits += 1
        self._users.setdefault(key, set()).add(request.request_id)
        self._unused.pop(key, None)
        return True

    def can_allocate(self, feature: MultiModalFeature) -> bool:
        """Room for the image's rows, counting what evicting unused entries would free; an
        image larger than the whole cache fits once no entry is in use (it then holds the
        cache alone, over its size, until released)."""
        evictable = sum(self._sizes[k] for k in self._unused)
        is_idle = len(self._unused) == len(self._sizes)
        return feature.num_embeds <= self.num_free_rows + evictable or is_idle

    def allocate(self, request: Request, feature: MultiModalFeature) -> None:
        """Make room (evicting unused entries, oldest first) and reserve the image's rows."""
        while self.num_free_rows < feature.num_embeds and self._unused:
            key, _ = self._unused.popitem(last=False)
            self.num_free_rows += self._sizes.pop(key)
            self._users.pop(key, None)
            self._freed.append(key)
        key = feature.identifier
        self._sizes[key] = feature.num_embeds
        self.num_free_rows -= feature.num_embeds
        self._users[key] = {request.request_id}

    def discard(self, feature: MultiModalFeature) -> None:
        """Undo an allocation whose encoding was not run after all (its step dropped the
        request): the worker never held it, so it is not reported freed."""
        key = feature.identifier
        if self._sizes.pop(key, None) is not None:
            self.num_free_rows += feature.num_embeds
        self._users.pop(key, None)
        self._unused.pop(key, None)

    def release(self, request: Request, feature: MultiModalFeature) -> None:
        """The request no longer needs the image (its tokens are computed, or it left)."""
        key = feature.identifier
        users = self._users.get(key)
        if users is None or request.request_id not in users:
            return
        users.discard(request.request_id)
        if not users:
            self._unused[key] = None

    def release_all(self, request: Request) -> None:
        for feature in request.mm_features:
            self.release(request, feature)

    def release_computed(self, request: Request) -> None:
        """Release the images whose tokens the request has all computed."""
        for feature in request.mm_features:
            if feature.placeholder.end <= request.num_computed_tokens:
                self.release(request, feature)

    def take_freed_hashes(self) -> list[str]:
        """The entries evicted since the last call: the worker drops their embeddings."""
        freed, self._freed = self._freed, []
        return freed
