"""Data parallelism: D engine replicas behind one front end (vLLM's DP, in one process).

Replica r is an LLMEngine on row r of the ("data", "model") mesh: its own T devices, weights
and KV pool, scheduler and prefix cache. The front end sends each new request to the least
loaded replica (fewest unfinished requests, the lowest rank on a tie) and steps every busy
replica at once, each in its own thread: a replica's host work and device calls release the
GIL while XLA runs, so the replicas' devices work side by side.

For a mixture of experts with enable_expert_parallel the replicas are the ranks of one group
instead (vLLM's data-parallel attention with expert parallelism, worker/rank_group.py): each
keeps its own scheduler, KV pool, prefix cache and requests, but the model is loaded once over
the D x T mesh, its experts spread over every device, and every step of the front steps every
rank, their steps run as ONE jitted call whose MoE layers reach across the ranks (a rank with
nothing to run steps padding, so that the collectives line up).

`make_engine` is what LLM and the server construct: an LLMEngine when D = 1, else this.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax

from jvllm.distributed.multihost import DistributedConfig, initialize, run_worker
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.input_processor import PromptType
from jvllm.engine.leader import LeaderEngine
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.process_data_parallel import (
    ProcessDataParallelEngine,
    rank_engine,
    run_rank,
)
from jvllm.engine.replica_front import ReplicaFront
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams
from jvllm.worker.rank_group_worker import RankGroupWorker, runs_moe_across_ranks

logger = init_logger(__name__)


def make_engine(
    model: str | None = None, **kwargs
) -> LLMEngine | DataParallelEngine | ProcessDataParallelEngine:
    """On a worker process of a multi-process engine, this follows process 0 until it stops,
    then exits the process (SystemExit(0)): the same command serves every host."""
    # Every option checked before any replica loads.
    parallel = EngineArgs(model=model, **kwargs).create_engine_config().parallel_config
    distributed = DistributedConfig.resolve(
        parallel.distributed_coordinator_address,
        parallel.distributed_num_processes,
        parallel.distributed_process_id,
    )
    if distributed is None:
        if parallel.data_parallel_size == 1:
            return LLMEngine(model, **kwargs)
        return DataParallelEngine(model, **kwargs)
    size = parallel.data_parallel_size
    if size > 1 and size != distributed.num_processes:
        raise ValueError(
            f"data_parallel_size={size} over {distributed.num_processes} processes: "
            "data parallelism across processes runs one rank a process, so set "
            "data_parallel_size to the number of processes (each rank's "
            "tensor_parallel_size devices its own), or spread tensor_parallel_size over "
            "the hosts with data_parallel_size=1"
        )
    if not jax.distributed.is_initialized():
        initialize(distributed)
    if size > 1:
        kwargs.pop("data_parallel_rank", None)
        if distributed.process_id == 0:
            return ProcessDataParallelEngine(model, **kwargs)
        rank = distributed.process_id
        engine, group = rank_engine(model, rank, **kwargs)
        run_rank(engine, rank, group)
        raise SystemExit(0)
    if distributed.process_id == 0:
        return LeaderEngine(model, **kwargs)
    run_worker(LLMEngine(model, **kwargs))
    raise SystemExit(0)


def replicas(engine) -> list[LLMEngine]:
    """The LLMEngines that `engine` runs in this process: itself, or its data-parallel
    replicas (across processes: process 0's rank)."""
    if isinstance(engine, DataParallelEngine | ProcessDataParallelEngine):
        return engine.replicas
    return [engine]


class DataParallelEngine(ReplicaFront):
    """LLMEngine's request API over `data_parallel_size` replicas."""

    def __init__(self, model: str | None = None, **kwargs):
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        parallel = config.parallel_config
        if parallel.data_parallel_rank is not None:
            raise ValueError(
                "data_parallel_rank picks the one replica an LLMEngine runs; the "
                "data-parallel front end runs them all, so leave it unset"
            )
        size = parallel.data_parallel_size
        kwargs.pop("data_parallel_rank", None)  # None here (from_engine_args passes every field)
        # The ranks of one group whose MoE layers reach across them, or independent replicas.
        self.group = RankGroupWorker(config) if runs_moe_across_ranks(config) else None
        self.replicas = [
            LLMEngine(
                model,
                worker=self.group and self.group.rank_worker(r),
                **kwargs,
                data_parallel_rank=r,
            )
            for r in range(size)
        ]
        self._share_first_replica()
        self._replica_of: dict[str, LLMEngine] = {}
        self._stepped: list[LLMEngine] = []  # the replicas the last step() ran
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="jvllm-dp")
        what = "ranks whose MoE layers run across them" if self.group else "replicas"
        logger.info("serving with %d data-parallel %s", size, what)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """LLMEngine.add_request on the least loaded replica."""
        if isinstance(request_id, str) and self.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        replica = min(self.replicas, key=lambda r: r.get_num_unfinished_requests())
        replica.add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self._replica_of[request_id] = replica

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                replica.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def has_request(self, request_id: str) -> bool:
        replica = self._replica_of.get(request_id)
        return replica is not None and replica.has_request(request_id)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, side by side; their outputs in rank order. The
        ranks of a group step all at once, those without work too (worker/rank_group.py)."""
        if self.group is not None:
            outputs = self._step_group()
        else:
            outputs = self._step_busy()
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        return outputs

    def _step_busy(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        self._stepped = busy
        if len(busy) == 1:
            outputs = busy[0].step()
        else:
            outputs = [o for step in self._pool.map(LLMEngine.step, busy) for o in step]
        return outputs

    def _step_group(self) -> list[RequestOutput]:
        """Every rank's engine steps in its own thread; the ranks' scheduled steps run as one
        once each has handed its step over or stepped without one."""
        runner = self.group.group_runner()
        runner.hand_over.begin()
        num_steps = runner.num_group_steps

        def step_rank(rank: int) -> list[RequestOutput]:
            try:  # a rank waiting on a grammar would hold every rank's step back
                return self.replicas[rank].step(wait_for_grammars=False)
            finally:
                runner.hand_over.finish(rank)

        self._stepped = self.replicas
        outputs = [o for s in self._pool.map(step_rank, range(len(self.replicas))) for o in s]
        if runner.num_group_steps == num_steps:  # no rank ran a step: grammars may hold some
            waiting = [r for r in self.replicas if r.scheduler.waiting]
            if waiting:
                waiting[0].wait_for_grammars()
        return outputs

    def load_weights(self, weights) -> set[str]:
        """LLMEngine.load_weights on every replica; the ranks of a group share their weights,
        which load once (rank 0's engine), each other rank resetting its prefix cache."""
        weights = list(weights)  # every loading replica reads them
        loading = self.replicas if self.group is None else self.replicas[:1]
        replaced = set().union(*[r.load_weights(weights) for r in loading])
        for replica in self.replicas[len(loading) :]:
            replica.reset_prefix_cache()
        return replaced

    @property
    def last_finished_requests(self) -> list:
        """The requests that finished in the last step (of the replicas it stepped)."""
        return [req for r in self._stepped for req in r.last_finished_requests]
