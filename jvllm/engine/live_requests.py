"""The requests an LLMEngine has taken and not yet reported finished, from add_request to their
last output: by id, with the parents of n > 1 samples (whose outputs carry the parent's id, and
whose abort ends every sample). A step's outputs are made here: a stop string finishes a
request, and a failure while making one request's output aborts that request alone."""

import time

from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.engine.output_processor import OutputProcessor
from jvllm.engine.parallel_sampling import ParentRequest
from jvllm.engine.pooling import PoolingOutputProcessor
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.pooling_outputs import PoolingRequestOutput

logger = init_logger(__name__)


class LiveRequests:
    def __init__(
        self, scheduler: Scheduler, output_processor: OutputProcessor | PoolingOutputProcessor
    ) -> None:
        self._scheduler = scheduler
        self._output_processor = output_processor
        self._requests: dict[str, Request] = {}
        # n > 1: parent request id -> child ids, and each live child's parent.
        self._children: dict[str, list[str]] = {}
        self._parent_of: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or the parent of n > 1 samples) is still live."""
        return request_id in self._requests or request_id in self._children

    def get(self, request_id: str) -> Request | None:
        """The live request of this id (a sample's, not a parent's), or None."""
        return self._requests.get(request_id)

    def add(self, request: Request, parent: ParentRequest | None = None) -> None:
        """Take a request that passed every check; `parent`: the one whose sample it is."""
        self._requests[request.request_id] = request
        if parent is not None:
            self._children[parent.request_id] = parent.child_ids
            self._parent_of[request.request_id] = parent.request_id

    def abort(self, request_ids: str | list[str]) -> None:
        """Finish requests as FINISHED_ABORTED, the scheduler freeing their KV blocks (a
        parent's id: all its samples); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [child for i in ids for child in self._children.get(i, [i])]
        live = [i for i in dict.fromkeys(ids) if i in self._requests]  # each once
        self._scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.end([self._requests[i] for i in live])

    def end(self, requests: list[Request]) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """The last outputs of live requests that finished, which are then forgotten."""
        outputs = []
        for request in requests:
            self._finish(request)
            output = self._output_processor.make_output(request)
            if output is not None:
                outputs.append(output)
            del self._requests[request.request_id]
        return outputs

    def step_outputs(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> tuple[list[RequestOutput], list[Request]]:
        """The outputs of the requests a step changed -> (the outputs, the requests that
        finished); `sampled`: request id -> the step's token(s), `finished`: the requests that
        the scheduler's update finished."""
        changed = {
            r.request_id: r for r in scheduler_output.scheduled_requests if r.request_id in sampled
        }
        changed.update((r.request_id, r) for r in scheduler_output.finished_requests)
        changed.update((r.request_id, r) for r in finished)
        outputs, finished_requests = [], []
        for request in changed.values():
            if request.request_id not in self._requests:
                continue  # aborted during this step: its output was made then
            output = self._output_for(request)
            if request.is_finished:
                finished_requests.append(request)
                self._requests.pop(request.request_id, None)
            if output is not None:
                outputs.append(output)
        return outputs, finished_requests

    def _output_for(self, request: Request) -> RequestOutput | None:
        """This step's output of one request; a failure here aborts that request alone."""
        try:
            if not request.is_finished and not self._output_processor.has_new_tokens(request):
                return None  # a prefill (or recompute) chunk: nothing to report yet
            stop = self._output_processor.detokenize(request)
            if stop is not None:
                if not request.is_finished:
                    self._scheduler.finish_requests(
                        [request.request_id], RequestStatus.FINISHED_STOPPED
                    )
                elif request.status == RequestStatus.FINISHED_LENGTH:
                    request.status = RequestStatus.FINISHED_STOPPED  # the text stopped first
                request.stop_reason = stop
            if request.is_finished:
                self._finish(request)
            return self._output_processor.make_output(request)
        except Exception as error:
            logger.exception(
                "request %s failed while processing its output; aborting it", request.request_id
            )
            request.status_message = f"processing its output failed: {error!r}"
            if not request.is_finished:
                self._scheduler.finish_requests(
                    [request.request_id], RequestStatus.FINISHED_ABORTED
                )
            request.status = RequestStatus.FINISHED_ABORTED  # also where it had finished already
            self._finish(request)
            self._output_processor.discard(request)
            return None

    def _finish(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        parent_id = self._parent_of.pop(request.request_id, None)
        if parent_id is not None and not any(
            c in self._parent_of for c in self._children[parent_id]
        ):
            del self._children[parent_id]
