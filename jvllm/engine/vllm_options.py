"""vLLM's engine options that jvllm takes so that vLLM's scripts run unchanged, at the values
that say what jvllm does anyway; any other value is refused with what is allowed and why.

vLLM's scripts pass these to `LLM(...)`, `EngineArgs(...)` and `vllm serve` routinely
(`tokenizer_mode="auto"`, `swap_space=4`, `disable_log_stats=True`, ...); taking them changes
nothing here, refusing them would stop the script for nothing.
"""

from collections.abc import Callable
from typing import Any, NamedTuple


class NeutralOption(NamedTuple):
    accepts: Callable[[Any], bool]
    allowed: str  # what is allowed, and why


def _is_none(value) -> bool:
    return value is None


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_number_at_least_0(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _is_int_at_least_1(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_LOCAL_ONLY = "None: jvllm reads local files only (no model hub); pass a local directory"

NEUTRAL_OPTIONS: dict[str, NeutralOption] = {
    "tokenizer_mode": NeutralOption(
        lambda v: v in ("auto", "hf"), "'auto' or 'hf': jvllm loads the Hugging Face tokenizer"
    ),
    "revision": NeutralOption(_is_none, _LOCAL_ONLY),
    "tokenizer_revision": NeutralOption(_is_none, _LOCAL_ONLY),
    "code_revision": NeutralOption(_is_none, _LOCAL_ONLY),
    "download_dir": NeutralOption(_is_none, _LOCAL_ONLY),
    "swap_space": NeutralOption(
        _is_number_at_least_0, "GiB >= 0: jvllm recomputes preempted requests, it never swaps"
    ),
    "cpu_offload_gb": NeutralOption(lambda v: v == 0, "0: the weights stay on the device"),
    "pipeline_parallel_size": NeutralOption(
        lambda v: v == 1, "1: scale out with tensor_parallel_size and data_parallel_size"
    ),
    "distributed_executor_backend": NeutralOption(
        lambda v: v in (None, "mp", "uni"),
        "None, 'mp' or 'uni': JAX runs the devices of one process (several hosts: "
        "distributed_coordinator_address)",
    ),
    "disable_log_stats": NeutralOption(_is_bool, "a bool: the offline engine logs no stats"),
    "disable_custom_all_reduce": NeutralOption(_is_bool, "a bool: XLA picks the all-reduce"),
    "max_seq_len_to_capture": NeutralOption(
        _is_int_at_least_1, "an int >= 1: XLA compiles every step shape"
    ),
    "compilation_config": NeutralOption(
        lambda v: v is None or isinstance(v, int | dict), "None, an int or a dict: XLA compiles"
    ),
    "served_model_name": NeutralOption(
        lambda v: v is None or isinstance(v, str | list),
        "None, a name or a list of names (what `jvllm serve` answers to)",
    ),
}


def check_neutral_options(options: dict[str, Any]) -> None:
    """ValueError naming the first option whose value would ask for what jvllm does not do."""
    for name, value in options.items():
        option = NEUTRAL_OPTIONS[name]
        if not option.accepts(value):
            raise ValueError(f"{name} must be {option.allowed}; got {value!r}")
