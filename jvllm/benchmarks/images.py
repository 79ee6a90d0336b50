"""Throughput with images, `python -m jvllm.benchmarks.throughput --images-per-prompt 1`: one
engine runs the same random prompts as text alone and with images, and prints images encoded a
second, output tok/s with images against text alone, and the encoder cache's hit rate (images
repeat when --unique-images is below the prompts' images).

Without --model it builds a LLaVA-1.5 of the default model's text dimensions and a ViT-B/16
CLIP tower at 224 pixels (196 image tokens), with random weights (load_format "dummy"): the
shapes decide the speed, not the values. With --model, a directory of a model that takes
images (its processor too)."""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

from jvllm import LLM
from jvllm.model_loader.default_model import default_model_dir

# A ViT-B/16 CLIP tower at 224 pixels: 196 patches, LLaVA's "default" drops the class token.
_TOWER = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
}


def llava_like_dir(path: str) -> str:
    """Write, under `path`, the config and processor of a LLaVA-1.5 on the default model's text
    model and _TOWER (no weights: load it with load_format "dummy")."""
    import transformers

    text_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    with open(os.path.join(text_dir, "config.json")) as f:
        text = json.load(f)
    text["vocab_size"] = len(tokenizer)
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=_TOWER,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config.to_dict(), "architectures": ["LlavaForConditionalGeneration"]}, f)
    size = _TOWER["image_size"]
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tokenizer,
        patch_size=_TOWER["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(path)
    return path


def image_prompts(
    prompts: list[list[int]], image_token_id: int, args, set_index: int
) -> list[dict]:
    """Each token-id prompt with --images-per-prompt placeholders in front and its images,
    drawn in turn from --unique-images random images of --image-size pixels (the same ones for
    every prompt set), or new ones for every prompt (--unique-images 0)."""
    rng = np.random.default_rng(args.seed + (0 if args.unique_images else 1 + set_index))
    size = args.image_size
    pool = [
        Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
        for _ in range(args.unique_images or len(prompts) * args.images_per_prompt)
    ]
    k = args.images_per_prompt
    return [
        {
            # A random id that is the image token would ask for one more image.
            "prompt_token_ids": [image_token_id] * k + [t % image_token_id for t in ids],
            "multi_modal_data": {"image": [pool[(i * k + j) % len(pool)] for j in range(k)]},
        }
        for i, ids in enumerate(prompts)
    ]


def bench_images(llm: LLM, prompt_sets: list[list[list[int]]], params, args) -> dict:
    """Median output tok/s of each prompt set as text and with images, and the encoder's
    counters over the image runs."""
    engine = llm.llm_engine
    if engine.mm_processor is None:
        raise SystemExit(f"--images-per-prompt needs a model that takes images, not {args.model}")
    encoder, cache = engine.model_runner.encoder, engine.scheduler.encoder.cache
    image_token_id = engine.model_config.option("image_token_id")
    # Compiles the encoder's batch sizes and the longer prompts' steps outside the timed runs.
    llm.generate(image_prompts(prompt_sets[0], image_token_id, args, -1), params, use_tqdm=False)
    num_tokens = len(prompt_sets[0]) * params.max_tokens
    text_walls, image_walls = [], []
    encoded, encode_seconds = encoder.num_images_encoded, encoder.encode_seconds
    lookups, hits = cache.num_lookups, cache.num_hits
    for i, prompts in enumerate(prompt_sets):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        text_walls.append(time.perf_counter() - start)
        with_images = image_prompts(prompts, image_token_id, args, i)
        start = time.perf_counter()
        llm.generate(with_images, params, use_tqdm=False)
        image_walls.append(time.perf_counter() - start)
    processed = engine.mm_processor.process(with_images[0], None).token_ids
    return {
        "text_tok_s": num_tokens / statistics.median(text_walls),
        "image_tok_s": num_tokens / statistics.median(image_walls),
        "images_encoded": encoder.num_images_encoded - encoded,
        "encode_seconds": encoder.encode_seconds - encode_seconds,
        "cache_lookups": cache.num_lookups - lookups,
        "cache_hit_rate": (cache.num_hits - hits) / max(cache.num_lookups - lookups, 1),
        "image_tokens": len(processed) - len(prompts[0]),
    }


def chat_requests(args) -> list[tuple[str, dict]]:
    """`jvllm bench serve --images-per-prompt K`'s requests: streamed greedy chats, each of
    --input-len words of text and K PNG data: URL images, drawn as image_prompts draws them."""
    rng = np.random.default_rng(args.seed)
    size, k = args.image_size, args.images_per_prompt
    num_images = args.unique_images or args.num_prompts * k
    urls = [_png_data_url(rng, size) for _ in range(num_images)]
    words = ["tiles", "river", "stone", "light", "paper", "cloud", "green", "seven"]
    requests = []
    for i in range(args.num_prompts):
        text = " ".join(rng.choice(words, args.input_len))
        content = [
            {"type": "image_url", "image_url": {"url": urls[(i * k + j) % num_images]}}
            for j in range(k)
        ]
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        requests.append(("/v1/chat/completions", body))
    return requests


def _png_data_url(rng, size: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def print_images(results: dict, args) -> None:
    encoded, seconds = results["images_encoded"], results["encode_seconds"]
    print(
        f"images: {args.images_per_prompt} a prompt of {results['image_tokens']} tokens in all, "
        f"{args.unique_images or 'all'} distinct; {encoded} encoded in {seconds:.2f}s "
        f"({encoded / max(seconds, 1e-9):.1f} images/s)"
    )
    text, image = results["text_tok_s"], results["image_tok_s"]
    print(
        f"output tok/s: text alone {text:.1f}, with images {image:.1f} "
        f"(ratio images / text {image / text:.2f}x)"
    )
    if results["cache_lookups"]:
        print(
            f"encoder cache: {results['cache_lookups']} lookups, hit rate "
            f"{100 * results['cache_hit_rate']:.1f}%"
        )
    else:  # a repeated image at a prompt's start: its tokens' KV came from the prefix cache
        print("encoder cache: no lookups (the prefix cache held every image's tokens)")


def model_dir(args) -> tuple[str, str]:
    """(the model directory, its load format): --model's, else a llava_like_dir in a temporary
    folder with random weights."""
    if args.model:
        return args.model, args.load_format
    return llava_like_dir(tempfile.mkdtemp(prefix="jvllm-llava-")), "dummy"
