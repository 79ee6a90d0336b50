"""Random paged KV caches for the kernel tests and the benchmark."""

import numpy as np


def make_paged_kv(
    rng: np.random.Generator,
    seq_lens: list[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    max_pages_per_seq: int,
    fill_unused_with_nan: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns kv_cache f32[L, 2, K, P, B, H] and block_tables i32[S, M].

    Pages are handed out in a random order (never page 0, the null page); table entries past a
    sequence's length point at page 0. With `fill_unused_with_nan`, every slot that no sequence
    owns (the null page, free pages, the tail of each last page) is NaN in every layer, so a
    kernel that reads past a length produces NaN.
    """
    pages_needed = [-(-n // page_size) for n in seq_lens]
    if max(pages_needed, default=0) > max_pages_per_seq:
        raise ValueError(f"a length in {seq_lens} needs more than M={max_pages_per_seq} pages")
    if sum(pages_needed) > num_pages - 1:
        raise ValueError(f"{seq_lens} need {sum(pages_needed)} pages, the pool has {num_pages - 1}")
    shape = (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)
    kv_cache = rng.standard_normal(shape, dtype=np.float32)
    is_used = np.zeros((num_pages, page_size), dtype=bool)  # [P, B]
    free_pages = iter(rng.permutation(np.arange(1, num_pages)))
    block_tables = np.zeros((len(seq_lens), max_pages_per_seq), dtype=np.int32)
    for s, (seq_len, num_seq_pages) in enumerate(zip(seq_lens, pages_needed, strict=True)):
        for j in range(num_seq_pages):
            page = next(free_pages)
            block_tables[s, j] = page
            is_used[page, : min(page_size, seq_len - j * page_size)] = True
    if fill_unused_with_nan:
        kv_cache[:, :, :, ~is_used] = np.nan
    return kv_cache, block_tables
