"""A tiny Qwen2-VL value model and rollouts with one image per sample (mrope position ids), shared by the main suite
and the verl suites (it needs neither's fixtures)."""

from __future__ import annotations

import numpy as np
import torch

from ppo_critic import build_value_model

IMAGE, VIDEO, VISION_START, VISION_END = 150, 151, 152, 153
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 160,
    "max_position_embeddings": 256,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}


def tiny_qwen2_vl() -> torch.nn.Module:
    """A randomly initialised Qwen2-VL backbone (one-layer vision tower) with ppo-critic's generic value head."""
    from transformers import Qwen2VLConfig

    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 2}
    vision |= {"temporal_patch_size": 1, "spatial_merge_size": 2, "in_channels": 3}
    config = Qwen2VLConfig(
        text_config=TEXT,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        bos_token_id=None,
        eos_token_id=None,
    )
    return build_value_model(config.to_dict())


def add_images(batch: dict, model: torch.nn.Module, prompt_len: int, seed: int) -> dict:
    """`batch` (left-padded prompts of `prompt_len`, ids < 150) with one image of 2 or 4 tokens opening every prompt,
    its `multi_modal_inputs` and the model's mrope position ids [B, 3, T]; changed in place and returned."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mask[:, : prompt_len - 8] = 0  # room for the image tokens in every prompt
    grids, inputs = [], []
    for i in range(len(ids)):
        h = 4 if i % 2 else 2
        start = int((mask[i] == 1).nonzero()[0])
        ids[i, start] = VISION_START
        ids[i, start + 1 : start + 1 + h] = IMAGE
        ids[i, start + 1 + h] = VISION_END
        grids.append(torch.tensor([[1, h, 4]]))
        inputs.append({"pixel_values": torch.randn(4 * h, 12, generator=g), "image_grid_thw": grids[-1]})
    batch["responses"] = ids[:, -batch["responses"].shape[1] :]
    positions, _ = model.model.get_rope_index(
        ids, (ids == IMAGE).int(), image_grid_thw=torch.cat(grids), attention_mask=mask
    )
    batch["position_ids"] = positions.transpose(0, 1).contiguous()
    batch["multi_modal_inputs"] = np.array(inputs, dtype=object)
    return batch
