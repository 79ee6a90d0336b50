"""Two processes on this machine (jax.distributed over a loopback coordinator, gloo CPU
collectives, 2 fake devices each) running one engine at T = 4 across them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import transformers
from family_parity import TINY_SHAPES, TP_VOCAB, ragged_prompts, save_random_model, save_tp_llama
from test_lora import save_adapter

from jvllm import LLM, SamplingParams
from jvllm.lora.request import LoRARequest

# Two jax.distributed processes a test, each compiling: 10-20 s each on 2 cores.
pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "multihost_script.py")
TIMEOUT_S = 15  # JVLLM_DISTRIBUTED_TIMEOUT: joining, and a silent process counted dead
PROMPTS = ragged_prompts(TP_VOCAB, lengths=(3, 17, 40))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tp_llama(tmp_path_factory.mktemp("multihost"), 2, tie=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("multihost_moe")
    config = transformers.MixtralConfig(
        **{**TINY_SHAPES, "vocab_size": TP_VOCAB}, num_local_experts=4, num_experts_per_tok=2
    )
    save_random_model(path, config)
    return str(path)


@pytest.fixture(scope="module")
def moe_adapter(moe_dir, tmp_path_factory) -> str:
    """A PEFT LoRA adapter on the MoE's attention projections."""
    path = str(tmp_path_factory.mktemp("multihost_lora"))
    save_adapter(
        moe_dir, path, 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]
    )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(process_id: int, port: int, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(process_id),
        "JVLLM_DISTRIBUTED_TIMEOUT": str(TIMEOUT_S),
    }
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def processes():
    """Started processes, killed at the end whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _result(process: subprocess.Popen):
    """The JSON the script prints after "RESULT " (gloo prints to stdout too)."""
    for line in process.stdout:
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    _, err = process.communicate(timeout=60)
    raise AssertionError(f"process exited with {process.returncode}:\n{err[-3000:]}")


def _one_device(model_dir, lora_path: str | None = None) -> list:
    """One device's tokens for PROMPTS; with `lora_path`, every other prompt with that adapter
    (as multihost_script.py runs them)."""
    options, lora = {}, None
    if lora_path:
        options = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
        lora = [LoRARequest("a", 1, lora_path) if i % 2 == 0 else None for i in range(3)]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outputs]


def test_two_processes_match_one_device_and_a_dead_worker_fails_process_0(model_dir, processes):
    port, prompts = _free_port(), json.dumps(PROMPTS)
    worker = _start(1, port, model_dir, "generate-then-wait", prompts)
    leader = _start(0, port, model_dir, "generate-then-wait", prompts)
    processes += [worker, leader]
    outputs = _result(leader)
    worker.kill()  # while process 0 waits 3 s before its second generate
    start = time.monotonic()
    _, err = leader.communicate(timeout=TIMEOUT_S + 60)
    assert time.monotonic() - start < TIMEOUT_S + 30
    assert leader.returncode != 0
    assert "WorkersLostError: a worker process stopped answering" in err
    assert outputs == _one_device(model_dir)


def test_a_dead_process_0_stops_the_worker(model_dir, processes):
    port, prompts = _free_port(), json.dumps(PROMPTS[:1])
    worker = _start(1, port, model_dir, "generate-then-wait", prompts)
    leader = _start(0, port, model_dir, "generate-then-wait", prompts)
    processes += [worker, leader]
    _result(leader)
    leader.send_signal(signal.SIGKILL)
    _, err = worker.communicate(timeout=TIMEOUT_S + 60)
    assert worker.returncode != 0
    assert "lost process 0" in err


def test_initializing_twice_is_refused(processes):
    process = _start(0, 0, "-", "initialize-twice", f"127.0.0.1:{_free_port()}")
    processes.append(process)
    error = _result(process)["error"]
    assert "jax.distributed is already initialized in this process" in error


@pytest.mark.parametrize(
    ("moe", "options"),
    [
        (False, {}),
        (True, {"tensor_parallel_size": 1}),
        (True, {"tensor_parallel_size": 2}),
        (True, {"tensor_parallel_size": 2, "all2all_backend": "ragged_all_to_all"}),
        (True, {"tensor_parallel_size": 1, "num_scheduler_steps": 4}),
        (True, {"tensor_parallel_size": 1, "num_scheduler_steps": 4, "draft": True}),
        (True, {"tensor_parallel_size": 1, "lora": True}),
        (True, {"tensor_parallel_size": 1, "async_scheduling": True}),
    ],
    ids=[
        "dense",
        "moe, experts over the 2 ranks' devices",
        "moe, T=2, experts over all 4",
        "moe, T=2, tokens by all-to-all",
        "moe, decode windows",
        "moe, windows of speculative rounds, a draft model",
        "moe, a LoRA adapter on every other prompt",
        "moe, async scheduling",
    ],
)
def test_two_data_parallel_ranks_one_a_process_give_one_devices_tokens(
    model_dir, moe_dir, moe_adapter, processes, moe, options
):
    """Each process a rank with an engine of its own (2 fake devices each), process 0 sending
    each request to the least loaded rank and gathering every rank's outputs. A dense model's
    ranks step independently; the MoE's (enable_expert_parallel) are one group: its 4 experts
    spread over both processes' devices, every step of the two ranks one SPMD call whose MoE
    layers exchange their tokens (gathered, "auto" on CPUs, or by all-to-all across the
    processes), rank 1 stepping padding once its one request is done; with decode windows
    the processes agree on a window only where both ranks scheduled one, and with a draft
    model (the target as its own) each rank's step drafts for its own requests; with a LoRA
    adapter each process writes its own rank's adapter slots; with async scheduling the
    processes agree on each step run ahead, and on using it."""
    path = moe_dir if moe else model_dir
    options = {**options, "enable_expert_parallel": True} if moe else {}
    lora_path = moe_adapter if options.pop("lora", False) else None
    if lora_path:
        options["lora_path"] = lora_path
    if options.pop("draft", False):
        options["speculative_config"] = {
            "method": "draft_model",
            "model": path,
            "num_speculative_tokens": 2,
        }
    port, prompts = _free_port(), json.dumps(PROMPTS)
    worker = _start(1, port, path, "data-parallel", prompts, json.dumps(options))
    leader = _start(0, port, path, "data-parallel", prompts, json.dumps(options))
    processes += [worker, leader]
    result = _result(leader)
    expected = _one_device(path, lora_path)
    assert result["tokens"] == result["generate"] == expected
    if lora_path:  # the adapter changes what it runs on
        assert _one_device(path) != expected
    assert result["ranks"] == [0, 1, 0]
    if moe:  # every step one call of the group
        assert result["group_steps"] > 0
        assert (result["windows"] > 0) == ("num_scheduler_steps" in options)
        assert bool(result["accepted"]) == ("speculative_config" in options)
        assert bool(result["steps_ahead_used"]) == ("async_scheduling" in options)
    else:
        assert result["group_steps"] is None
    assert leader.wait(timeout=60) == 0
    assert worker.wait(timeout=60) == 0  # process 0's exit stopped it


@pytest.fixture(scope="module")
def other_dirs(tmp_path_factory):
    """(dense, MoE) models of model_dir's and moe_dir's configs with other weights."""
    dense = save_tp_llama(tmp_path_factory.mktemp("multihost_b"), 2, tie=True, seed=1)
    moe = tmp_path_factory.mktemp("multihost_moe_b")
    config = transformers.MixtralConfig(
        **{**TINY_SHAPES, "vocab_size": TP_VOCAB}, num_local_experts=4, num_experts_per_tok=2
    )
    save_random_model(moe, config, seed=1)
    return dense, str(moe)


@pytest.mark.parametrize(
    ("moe", "options"),
    [
        (False, {"tensor_parallel_size": 4}),
        (False, {"data_parallel_size": 2}),
        (True, {"data_parallel_size": 2, "enable_expert_parallel": True}),
    ],
    ids=["T=4 across the processes", "a replica a process", "moe, a group of ranks"],
)
def test_sleep_and_new_weights_across_processes(
    model_dir, moe_dir, other_dirs, processes, moe, options
):
    """sleep, wake_up and load_weights on process 0 reach every process: at T = 4 the params
    cut over both processes' devices come back whole (each process its pieces), independent
    replicas each sleep and load, and a group of ranks frees and refills its shared arrays on
    both processes; the tokens equal one device's, of the second model's weights once loaded.
    reset_prefix_cache too reaches every process, whose schedulers must stay alike."""
    path, other = (moe_dir, other_dirs[1]) if moe else (model_dir, other_dirs[0])
    port, prompts = _free_port(), json.dumps(PROMPTS)
    args = ("sleep", prompts, json.dumps(options), other)
    worker = _start(1, port, path, *args)
    leader = _start(0, port, path, *args)
    processes += [worker, leader]
    result = _result(leader)
    expected = _one_device(path)
    assert result["asleep"]
    assert result["first"] == result["after_sleep_1"] == result["weights_back"] == expected
    assert result["after_reset"] == expected
    assert result["other_weights"] == _one_device(other) != expected
    assert leader.wait(timeout=60) == 0
    _, worker_log = worker.communicate(timeout=60)
    assert worker.returncode == 0
    for level, kept in ((1, "kept in host memory"), (2, "discarded")):  # process 1 slept too
        assert f"asleep (level {level}): the weights {kept}" in worker_log
