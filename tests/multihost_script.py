"""One process of a multi-process engine, for tests/test_multihost.py (run as a script, with
the launcher's JAX_* variables set). Every process runs the same script: process 0 prints
its outputs as JSON after "RESULT "; a worker follows it inside LLM() and exits when it stops.

argv: model directory, then "generate-then-wait" and the prompts as JSON (process 0 generates,
waits 3 s, generates again), "data-parallel", the prompts and more engine options as JSON
(one rank a process: process 0 prints each prompt's tokens and rank, then the same through
LLM.generate; with "lora_path" among the options, every other prompt runs that LoRA
adapter), "sleep", the prompts, engine options as JSON and a second model directory
(process 0 generates, sleeps at level 1 and wakes, sleeps at level 2, loads the second model's
weights and wakes, loads the first's back, then resets the prefix cache: the tokens after
each), or
"initialize-twice" and a coordinator address."""

import glob
import json
import sys
import time

from jvllm import LLM, SamplingParams
from jvllm.distributed.multihost import DistributedConfig, initialize
from jvllm.lora.request import LoRARequest
from jvllm.model_loader.safetensors_file import read_safetensors

model, mode = sys.argv[1], sys.argv[2]
if mode == "initialize-twice":
    config = DistributedConfig(sys.argv[3], 1, 0)
    initialize(config)
    try:
        initialize(config)
    except RuntimeError as e:
        print("RESULT", json.dumps({"error": str(e)}), flush=True)
    sys.exit(0)
prompts = json.loads(sys.argv[3])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
if mode == "data-parallel":
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    lora_path = options.pop("lora_path", None)
    lora = [None] * len(prompts)
    if lora_path:
        options.update(enable_lora=True, max_loras=1, max_lora_rank=8)
        lora = [LoRARequest("a", 1, lora_path) if i % 2 == 0 else None for i in range(len(lora))]
    llm = LLM(model, dtype="float32", max_num_batched_tokens=32, data_parallel_size=2, **options)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=lora[i])
    ranks = [engine.rank_of(str(i)) for i in range(len(prompts))]
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    again = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora
    )
    group = engine._group  # the MoE layers' group of ranks, if they step as one
    result = {
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "ranks": ranks,
        "generate": [o.outputs[0].token_ids for o in again],
        "group_steps": group and group.num_group_steps,
        "windows": group and group.num_windows,
        "steps_ahead_used": group and group.ahead.num_used,
        # Rank 0's accepted drafts (process 0's engine), None without speculation.
        "accepted": getattr(engine.replicas[0].spec_decoding_stats, "num_accepted_tokens", None),
    }
    print("RESULT", json.dumps(result), flush=True)
    sys.exit(0)
if mode == "sleep":
    options, other_model = json.loads(sys.argv[4]), sys.argv[5]
    llm = LLM(model, dtype="float32", max_num_batched_tokens=32, enable_sleep_mode=True, **options)
    generate = lambda: [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    weights = lambda path: read_safetensors(glob.glob(f"{path}/*.safetensors")[0]).items()
    result = {"first": generate()}
    llm.sleep(level=1)
    result["asleep"] = llm.is_sleeping()
    llm.wake_up()
    result["after_sleep_1"] = generate()
    llm.sleep(level=2)
    llm.load_weights(weights(other_model))
    llm.wake_up()
    result["other_weights"] = generate()
    llm.load_weights(weights(model))  # awake: replaced in place, the prefix cache reset
    result["weights_back"] = generate()
    llm.reset_prefix_cache()  # every process's: else their schedulers part ways
    result["after_reset"] = generate()
    print("RESULT", json.dumps(result), flush=True)
    sys.exit(0)
llm = LLM(model, dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, tensor_parallel_size=4)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print("RESULT", json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
if mode == "generate-then-wait":
    time.sleep(3)  # the test kills the worker meanwhile
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
