"""Data parallelism across processes (vLLM's --data-parallel-size over hosts): one replica a
process, each an LLMEngine on its own process's devices with its own scheduler, KV pool and
prefix cache, behind process 0's front end.

Process 0 takes every request (validated there, so nothing a rank refuses ever leaves it) and
sends it to the least loaded rank (fewest unfinished requests, the lowest rank on a tie). Each
step it broadcasts what changed (requests added to or aborted on a rank) with `jax.distributed`'s
collectives (distributed/multihost.py); every process applies its rank's share, steps its own
engine if it has work, and the step's outputs of every rank come back to process 0 in one
all-gather. A rank's step runs no collective, so the ranks' steps overlap; only the two small
exchanges a step are in lockstep. Process 0's rank announces the engine-wide calls (sleep,
wake_up, load_weights, reset_prefix_cache: engine/sleep.py) to every other rank the same way,
each rank running them on its own engine.

For a mixture of experts with enable_expert_parallel the ranks are one group instead
(worker/rank_group.py): the experts spread over every process's devices, and every step every
process steps its rank, work or not, in one SPMD call whose MoE layers reach across the ranks
(a rank without work steps padding), after a small exchange of the ranks' step sizes. The
other ranks hold their model whole, or cut over their own devices' tensor or expert
parallelism, and step only with work.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref

from jvllm.core.request import RequestStatus
from jvllm.distributed.multihost import ENGINE_CALLS, broadcast_commands, gather_objects
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.input_processor import PromptType
from jvllm.engine.leader import WorkersLostError
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.replica_front import ReplicaFront
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams
from jvllm.worker.rank_group import RankGroupRunner
from jvllm.worker.rank_group_worker import RankGroupWorker, runs_moe_across_ranks

logger = init_logger(__name__)


class ProcessDataParallelEngine(ReplicaFront):
    """LLMEngine's request API over `data_parallel_size` ranks, one a process: process 0's."""

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.pop("data_parallel_rank", None)
        local, self._group = rank_engine(model, 0, **kwargs)
        self.replicas = [local]  # the ones in this process
        local.peers = self  # sleep and the like reach every rank
        self._share_first_replica()
        self.num_ranks = self.engine_config.parallel_config.data_parallel_size
        self._requests_of: list[set[str]] = [set() for _ in range(self.num_ranks)]
        self._pending: list[tuple] = []  # for the other ranks, sent with the next step
        self._last_finished: list = []
        self._stopped = False
        ref = weakref.ref(self)
        atexit.register(lambda: (engine := ref()) and engine.stop_workers())
        logger.info("serving with %d data-parallel ranks, one a process", self.num_ranks)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """LLMEngine.add_request on the least loaded rank; raises here, before anything is
        sent, what any rank would refuse."""
        if isinstance(request_id, str) and self.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        rank = min(range(self.num_ranks), key=lambda r: len(self._requests_of[r]))
        local = self.replicas[0]
        arrival_time = time.time() if arrival_time is None else arrival_time
        args = (request_id, prompt, params, arrival_time, priority, lora_request)
        if rank == 0:
            local.add_request(*args)
        else:
            self.check_request(*args)
            self._pending.append(("add", rank, *args))
        self._requests_of[rank].add(request_id)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            rank = self.rank_of(rid)
            if rank is None:
                continue
            self._requests_of[rank].discard(rid)
            if rank == 0:
                self.replicas[0].abort_request(rid)
            else:
                self._pending.append(("abort", rank, rid))

    def has_unfinished_requests(self) -> bool:
        return any(self._requests_of) or bool(self._pending)

    def has_request(self, request_id: str) -> bool:
        return self.rank_of(request_id) is not None

    def rank_of(self, request_id: str) -> int | None:
        """The rank running a live request; None for none."""
        return next((r for r, ids in enumerate(self._requests_of) if request_id in ids), None)

    def get_num_unfinished_requests(self) -> int:
        return sum(len(ids) for ids in self._requests_of)

    def load_weights(self, weights) -> set[str]:
        """LLMEngine.load_weights on every rank: process 0's sends the pairs to the others."""
        return self.replicas[0].load_weights(weights)

    def num_unfinished_elsewhere(self) -> int:
        """The other ranks' unfinished requests (Peers', for process 0's rank)."""
        return sum(len(ids) for ids in self._requests_of[1:])

    def announce(self, call: str, *args) -> None:
        """Every other rank runs LLMEngine.`call`(*args) on its engine (Peers'; "step" steps
        them), after the adds and aborts still pending for them."""
        if self._stopped:
            raise WorkersLostError("the worker processes were stopped; start every process anew")
        commands, self._pending = [*self._pending, (call, *args)], []
        try:
            broadcast_commands(commands)
        except Exception as e:
            raise self._lost(e) from e

    def step(self) -> list[RequestOutput]:
        """One step of every rank with work; their outputs in rank order."""
        self.announce("step")
        local = self.replicas[0]
        # The ranks' gather waits for this one.
        report, error = _step_and_report(local, [], self._group)
        try:
            gathered = gather_objects(report)
        except Exception as e:
            raise self._lost(e) from e
        if error is not None:
            raise error
        for rank, (_, _, _, rank_error) in enumerate(gathered):
            if rank_error is not None:
                self._stopped = True
                raise WorkersLostError(f"data-parallel rank {rank}'s step failed: {rank_error}")
        merged = [o for outputs, _, _, _ in gathered for o in outputs]
        for request_id in (rid for _, refused, _, _ in gathered for rid in refused):
            for ids in self._requests_of:  # its rank refused it after all: logged there
                ids.discard(request_id)
        for output in merged:
            if output.finished:
                for ids in self._requests_of:
                    ids.discard(output.request_id)
        remote = [record for _, _, records, _ in gathered[1:] for record in records]
        self._last_finished = [*local.last_finished_requests, *remote]
        return merged

    def _lost(self, e: Exception) -> WorkersLostError:
        """Stop: a collective with the ranks failed (`e`) -> the error to raise."""
        self._stopped = True
        return WorkersLostError(
            "a data-parallel rank stopped answering (it exited, crashed or lost its "
            f"connection): {type(e).__name__}: {e}. Restart every process"
        )

    @property
    def last_finished_requests(self) -> list:
        """The requests that finished in the last step: this process's rank's, and the other
        ranks' as FinishedRecords (what LLM reads of a failed one)."""
        return self._last_finished

    def stop_workers(self) -> None:
        """Let the other ranks' processes end (once)."""
        if not self._stopped:
            self._stopped = True
            broadcast_commands([("stop",)])


@dataclasses.dataclass(frozen=True)
class FinishedRecord:
    """A request another rank finished: its id, status and message."""

    request_id: str
    status: RequestStatus
    status_message: str | None


def rank_engine(model: str | None, rank: int, **kwargs) -> tuple[LLMEngine, RankGroupRunner | None]:
    """Rank `rank`'s engine in this process, and the runner of the group of ranks it steps in
    where their MoE layers run across them (None: an independent replica)."""
    config = EngineArgs(model=model, **kwargs, data_parallel_rank=rank).create_engine_config()
    if not runs_moe_across_ranks(config):
        return LLMEngine(model, **kwargs, data_parallel_rank=rank), None
    group = RankGroupWorker(config)
    engine = LLMEngine(model, worker=group.rank_worker(rank), **kwargs, data_parallel_rank=rank)
    return engine, group.group_runner()


def _step_and_report(engine: LLMEngine, refused: list[str], group: RankGroupRunner | None):
    """Step the rank's engine if it has work, or in its `group` always -> (what the ranks'
    gather carries: its outputs, the requests it refused, a record of each request it
    finished, its step's error as text; the error itself, None when the step did not fail)."""
    try:
        if group is not None:
            outputs = _step_in_group(engine, group)
        else:
            outputs = engine.step() if engine.has_unfinished_requests() else []
    except Exception as e:
        logger.exception("data-parallel rank's step failed")
        return ([], refused, [], f"{type(e).__name__}: {e}"), e
    records = [
        FinishedRecord(r.request_id, r.status, r.status_message)
        for r in engine.last_finished_requests
    ]
    return (outputs, refused, records, None), None


def _step_in_group(engine: LLMEngine, group: RankGroupRunner) -> list[RequestOutput]:
    """The process's rank's step of the group's: every process's, work or not."""
    (rank,) = group.local_ranks
    group.hand_over.begin()
    try:
        return engine.step()
    finally:
        group.hand_over.finish(rank)


def run_rank(engine: LLMEngine, rank: int, group: RankGroupRunner | None = None) -> None:
    """A rank's life in a process other than 0: apply process 0's commands for this rank,
    step (in its `group`, where the ranks' MoE layers run across them), and send the outputs
    back, until it says stop."""
    logger.info("data-parallel rank %d following process 0", rank)
    refused = []  # since the last step's report
    while True:
        try:
            commands = broadcast_commands(None)
        except Exception as e:
            raise RuntimeError(
                f"data-parallel rank {rank} lost process 0 (it exited or crashed without "
                f"stopping the ranks): {type(e).__name__}: {e}"
            ) from e
        for name, *args in commands:
            if name == "stop":
                logger.info("process 0 stopped; data-parallel rank %d ends", rank)
                return
            if name == "add" and args[0] == rank:
                try:
                    engine.add_request(*args[1:])
                except (ValueError, TypeError) as e:  # process 0 checked it: not expected
                    logger.error("rank %d refused request %s: %s", rank, args[1], e)
                    refused.append(args[1])
            elif name == "abort" and args[0] == rank:
                engine.abort_request(args[1])
            elif name in ENGINE_CALLS:
                getattr(engine, name)(*args)
        if commands[-1] != ("step",):  # an engine call, announced alone: no step follows
            continue
        report, error = _step_and_report(engine, refused, group)
        gather_objects(report)
        refused = []
        if error is not None:  # process 0 stops the engine on it
            raise error
