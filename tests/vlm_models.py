"""Tiny random vision-language checkpoints, saved with their HF processor, made on the fly
from the default model's tokenizer plus an image token."""

import numpy as np
import torch
import transformers
from PIL import Image

# A chat template that writes each image part as the image token, in a content list's order.
IMAGE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The language and vision models of every tiny checkpoint here, but their sizes of image.
_TINY_TEXT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
_TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


def _randomize(model: torch.nn.Module) -> None:
    """O(1) random weights, so that greedy choices are far from ties and images matter."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layrnorm" in name or "ln_q" in name:  # ln_q: Qwen's merger
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.05)


def save_tiny_llava(path: str, tokenizer_dir: str) -> None:
    """A LLaVA-1.5 of a 2-layer CLIP (28 px images, 7 px patches: 16 image tokens) and a
    2-layer Llama, with a LlavaProcessor."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = IMAGE_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(**_TINY_TEXT, vocab_size=len(tokenizer))
    vision = transformers.CLIPVisionConfig(**_TINY_VISION, image_size=28, patch_size=7)
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    _save_llava_processor(path, transformers.LlavaProcessor, image_processor, tokenizer)


def _save_llava_processor(path: str, processor_class, image_processor, tokenizer) -> None:
    """A LLaVA or LLaVA-NeXT processor for the tiny 28 px, 7 px-patch CLIP towers here."""
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
        chat_template=IMAGE_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)


def save_tiny_llava_next(path: str, tokenizer_dir: str) -> None:
    """A LLaVA-NeXT of a 2-layer CLIP (28 px tiles, 7 px patches: 16 features a tile; grids of
    1 x 2, 2 x 1 and 2 x 2 tiles) and a 2-layer Llama, with a LlavaNextProcessor (its image
    processor's PIL variant without torchvision)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = IMAGE_CHAT_TEMPLATE
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    text = transformers.LlamaConfig(**_TINY_TEXT, vocab_size=len(tokenizer))
    vision = transformers.CLIPVisionConfig(**_TINY_VISION, image_size=28, patch_size=7)
    config = transformers.LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
    )
    model = transformers.LlavaNextForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)
    image_processor_class = getattr(
        transformers, "LlavaNextImageProcessorPil", transformers.LlavaNextImageProcessor
    )
    image_processor = image_processor_class(
        size={"shortest_edge": 28},
        crop_size={"height": 28, "width": 28},
        image_grid_pinpoints=pinpoints,
    )
    _save_llava_processor(path, transformers.LlavaNextProcessor, image_processor, tokenizer)


def save_tiny_idefics3(path: str, tokenizer_dir: str, smolvlm: bool = False) -> None:
    """An Idefics3 (or, `smolvlm`, a SmolVLM: the same model) of a 2-layer SigLIP (56 px tiles,
    14 px patches, pixel shuffle by 2: 4 image tokens a tile; images of up to 112 px: up to 2 x
    2 tiles and the global view) and a 2-layer Llama, with an Idefics3Processor (a SmolVLM's
    own processor needs torchvision, for video)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    markers = ["<image>", "<fake_token_around_image>", "<global-img>", *tiles]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    text = {**_TINY_TEXT, "vocab_size": len(tokenizer), "model_type": "llama"}
    vision = {**_TINY_VISION, "image_size": 56, "patch_size": 14}
    config_class = transformers.SmolVLMConfig if smolvlm else transformers.Idefics3Config
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    model_class = (
        transformers.SmolVLMForConditionalGeneration
        if smolvlm
        else transformers.Idefics3ForConditionalGeneration
    )
    model = model_class(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4
    )
    processor.save_pretrained(path)


# Qwen2-VL's markers around each image's tokens, and its image and video tokens.
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def save_tiny_qwen2_vl(path: str, tokenizer_dir: str, version: str = "2") -> None:
    """A Qwen2-VL (version "2"), Qwen2.5-VL ("2.5", with windowed and full layers) or Qwen3-VL
    ("3": 16 px patches, a 4 x 4 table of learned positions, DeepStack features of blocks 0
    and 1 into a 3-layer Qwen3; "3-moe": a Qwen3-MoE, its first layer dense) of a
    2-layer tower (14 px patches merged 2 x 2; images of at most 64 merged patches) and a
    2-layer Qwen2 (Qwen3) with M-RoPE, with a Qwen2VLProcessor."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_TOKENS)))
    # Head dim 16: 8 rotary pairs, 2 turned by the temporal stream, 3 by each spatial one.
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}
    text = {**_TINY_TEXT, "vocab_size": len(tokenizer), "rope_parameters": rope}
    tower = {"depth": 2, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}
    patch = 14
    if version == "2":
        config_class = transformers.Qwen2VLConfig
        model_class = transformers.Qwen2VLForConditionalGeneration
        tower |= {"embed_dim": 32, "mlp_ratio": 2, "hidden_size": 64}
    elif version == "2.5":  # windows of 56 px (2 x 2 merged patches); layer 0 windowed
        config_class = transformers.Qwen2_5_VLConfig
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
        tower |= {
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
    else:
        config_class = transformers.Qwen3VLConfig
        model_class = transformers.Qwen3VLForConditionalGeneration
        # 3 text layers: DeepStack's two levels after layers 0 and 1, none after layer 2.
        text |= {"head_dim": 16, "num_hidden_layers": 3}
        if version == "3-moe":  # top 2 of 4 experts of width 48 after a dense layer
            config_class = transformers.Qwen3VLMoeConfig
            model_class = transformers.Qwen3VLMoeForConditionalGeneration
            text |= {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 48,
                "mlp_only_layers": [0],
            }
        patch = 16
        tower |= {
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "patch_size": patch,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
        }
    config = config_class(
        text_config=text,
        vision_config=tower,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    model = model_class(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)
    # Qwen2VLProcessor needs torchvision (for video), so the directory holds its image
    # processor and tokenizer, as jvllm reads them.
    image_processor_class = getattr(
        transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor
    )
    side = 2 * patch  # a merged patch's pixels
    image_processor_class(
        min_pixels=side * side * 4, max_pixels=side * side * 64, patch_size=patch
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)


def hf_qwen_greedy(model, path: str, prompt: str, images, max_new_tokens: int):
    """(the prompt token ids, HF's greedy continuation) as Qwen2VLProcessor would give them:
    each <|image_pad|> repeated once an embedding of its image."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    out = transformers.AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    counts = iter(int(g.prod()) // merge**2 for g in out["image_grid_thw"])
    ids = [t for i in tokenizer.encode(prompt) for t in ([i] * next(counts) if i == pad else [i])]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == pad).int(),  # what M-RoPE reads (the processor's)
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return ids, generated[0, len(ids) :].tolist()


def random_image(seed: int, height: int = 40, width: int = 50) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def hf_greedy_with_images(model, processor, prompt: str, images, max_new_tokens: int):
    """(HF's prompt token ids, its greedy continuation) for a text prompt with images."""
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    num_prompt = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, num_prompt:].tolist()


def assert_greedy_equals_hf(llm, cases, max_tokens: int, hf_greedy) -> list:
    """Generate `cases` ((prompt, images) each) greedily in one batch and check each prompt's
    token ids and continuation against `hf_greedy(prompt, images, max_tokens)`; -> outputs."""
    from jvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [{"prompt": p, "multi_modal_data": {"image": images}} for p, images in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (prompt, images), output in zip(cases, outputs):
        prompt_ids, expected = hf_greedy(prompt, images, max_tokens)
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
    return outputs


# Pixtral's markers of an image's rows, as PixtralProcessor writes them.
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def save_tiny_mistral3(path: str, tokenizer_dir: str) -> None:
    """A Mistral 3 of a 2-block Pixtral tower (14 px patches merged 2 x 2; images of at most
    112 px a side: at most 4 x 4 merged patches) and a 2-layer Mistral, with its image
    processor and tokenizer (PixtralProcessor's image processor needs its patch size times
    the merge at each call, which jvllm passes)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": PIXTRAL_TOKENS})
    text = {**_TINY_TEXT, "vocab_size": len(tokenizer), "sliding_window": None}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "patch_size": 14,
        "image_size": 112,
        "hidden_act": "silu",
    }
    config = transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**text),
        vision_config=transformers.PixtralVisionConfig(**vision),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)
    image_processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": 112}, patch_size=14
    )
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)


def hf_mistral3_greedy(model, path: str, prompt: str, images, max_new_tokens: int):
    """(the prompt token ids, HF's greedy continuation) as PixtralProcessor would give them:
    each [IMG] expanded into its image's rows of [IMG], [IMG_BREAK] and the final [IMG_END]."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    side = model.config.vision_config.patch_size * model.config.spatial_merge_size
    out = transformers.AutoImageProcessor.from_pretrained(path)(
        images=images, return_tensors="pt", patch_size=side
    )
    image, row_break, end = tokenizer.convert_tokens_to_ids(PIXTRAL_TOKENS)
    expansions = []
    for height, width in out["image_sizes"].tolist():
        rows = ([image] * (width // side) + [row_break]) * (height // side)
        expansions.append(rows[:-1] + [end])
    expansions = iter(expansions)
    ids = [t for i in tokenizer.encode(prompt) for t in (next(expansions) if i == image else [i])]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=out["pixel_values"],
            image_sizes=out["image_sizes"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return ids, generated[0, len(ids) :].tolist()
