"""Several hosts: one process per host through `jax.distributed`, every device of every process
in one mesh.

JAX is multi-controller: each process must make the same jitted calls in the same order. So
every process runs the same engine in lockstep. Process 0 (the leader) runs the API and the
server; with each step it broadcasts what changed since the last one (requests added or
aborted), and every other process (a worker) applies the same changes and steps too; the
engine-wide calls that RL loops make between steps (sleep, wake_up, load_weights,
reset_prefix_cache) go the same way, each as the leader makes it. Given the
same requests in the same order an engine's steps are deterministic, and the sampled tokens
come back identical on every process, so the schedulers never diverge; compiles happen in the
caller (ModelRunner's lockstep mode), never in background threads whose timing would differ.

The broadcast is JAX's own (`multihost_utils.broadcast_one_to_all`, a collective over all
devices). A worker that never joins makes `initialize` fail after the timeout; one that dies
makes the leader's next broadcast fail (or JAX's heartbeat check end it) within the timeout.
The leader tells the workers to stop when it shuts down; a leader that dies takes the
coordination service, hence the workers, with it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jvllm.logger import init_logger

logger = init_logger(__name__)

# What a launcher sets, read where an option is not given.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Seconds to wait for every process to join, and before a silent process counts as dead.
ENV_TIMEOUT = "JVLLM_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 60
# The engine calls the leader sends its workers besides requests and steps (engine/sleep.py).
ENGINE_CALLS = ("sleep", "wake_up", "load_weights", "reset_prefix_cache")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str
    num_processes: int
    process_id: int

    @classmethod
    def resolve(
        cls, coordinator_address: str | None, num_processes: int | None, process_id: int | None
    ) -> DistributedConfig | None:
        """The options, else the launcher's environment; None for one process."""
        num = num_processes or int(os.environ.get(ENV_NUM_PROCESSES, "1"))
        if num == 1:
            return None
        address = coordinator_address or os.environ.get(ENV_COORDINATOR)
        pid = process_id if process_id is not None else os.environ.get(ENV_PROCESS_ID)
        if not address or pid is None:
            raise ValueError(
                f"distributed_num_processes={num} needs distributed_coordinator_address "
                f"(or {ENV_COORDINATOR}) as host:port, and distributed_process_id (or "
                f"{ENV_PROCESS_ID}) in [0, {num})"
            )
        if not 0 <= int(pid) < num:
            raise ValueError(f"distributed_process_id must be in [0, {num}), got {pid}")
        return cls(address, num, int(pid))


def initialize(config: DistributedConfig) -> None:
    """jax.distributed.initialize, before JAX starts its backends; CPU collectives over gloo."""
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jax.distributed is already initialized in this process; initialize it once "
            "(an engine started with distributed options does it itself)"
        )
    timeout = int(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info(
        "process %d of %d joining %s (timeout %ds)",
        config.process_id,
        config.num_processes,
        config.coordinator_address,
        timeout,
    )
    jax.distributed.initialize(
        config.coordinator_address,
        config.num_processes,
        config.process_id,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
    )


def broadcast_commands(commands: list[tuple] | None) -> list[tuple]:
    """The leader's `commands` on every process (workers pass None): a length, then the
    pickled bytes padded to a power of two (so that few payload shapes ever compile)."""
    payload = b"" if commands is None else pickle.dumps(commands)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
    buffer = np.zeros(max(1024, 1 << (size - 1).bit_length()), np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return pickle.loads(buffer[:size].tobytes())


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, in process order, on every process: each pickles its own, the
    lengths and then the bytes (padded to the longest's power of two) are all-gathered."""
    payload = pickle.dumps(obj)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(payload)))).reshape(-1)
    buffer = np.zeros(max(1024, 1 << (int(sizes.max()) - 1).bit_length()), np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))  # [P, N]
    return [pickle.loads(row[:size].tobytes()) for row, size in zip(gathered, sizes.tolist())]


def run_worker(engine: Any) -> None:
    """A worker's life: apply the leader's commands and step, until it says stop."""
    logger.info("worker process %d following process 0", jax.process_index())
    while True:
        try:
            commands = broadcast_commands(None)
        except Exception as e:
            raise RuntimeError(
                f"worker process {jax.process_index()} lost process 0 (it exited or crashed "
                f"without stopping the workers): {type(e).__name__}: {e}"
            ) from e
        for name, *args in commands:
            if name == "stop":
                logger.info("process 0 stopped; worker process %d ends", jax.process_index())
                return
            if name == "add":
                engine.add_request(*args)
            elif name == "abort":
                engine.abort_request(*args)
            elif name == "step":
                engine.step()
            elif name in ENGINE_CALLS:
                getattr(engine, name)(*args)
