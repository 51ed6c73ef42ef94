"""Example inputs of vision and multimodal models: the image forms a forward needs beyond plain pixels.

Used by :func:`packedinit.trace.inputs.example_inputs`. :func:`pixels` sizes an image from the config
(height and width apart, a size the windows or crops divide). :func:`vision_inputs` builds the inputs
that come as a set: a patch sequence with its grid (SigLIP-2's ``spatial_shapes``, Gemma 4's
``pixel_position_ids``), a packed image with its ``target_sizes`` (MiniCPM-V), region features and
their boxes (LXMERT), word boxes (``bbox``), a task prompt (OneFormer), prompt images and masks
(SegGPT), the vision features a Q-Former attends to. :func:`prompt_images` then makes a text prompt
hold the image tokens its images fill (BLIP-2, InstructBLIP, Kosmos-2) and gives several-image models
their image axis (IDEFICS). transformers is never imported: a config is read through its attributes.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn

from packedinit.trace.config_read import BATCH, TOKENS, image_size, int_of, sub_config
from packedinit.trace.trial import first_fitting

__all__ = ["image_hw", "is_video", "patch_images", "pixels", "prompt_images", "vision_inputs"]

_VISION = ("vision_config", "backbone_config", "encoder_config", "image_model_config")


def image_hw(vision: Any) -> tuple[int, int]:
    """``(height, width)`` from the config: ``image_size`` (an int, a pair, a dict) or ``max_img_size``."""
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
        h, w = int(size[0]), int(size[1])
    elif isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
        h, w = size["height"], size["width"]
    else:
        h = w = image_size(vision) if size is not None else int_of(vision, "max_img_size", default=224)
    windows = int_of(vision, "num_windows_side", default=0) or math.isqrt(int_of(vision, "num_windows", default=1))
    patch = int_of(vision, "patch_size", default=1)
    if windows > 1:  # windowed attention (RF-DETR): the patch grid splits into whole windows
        step = patch * windows
        h, w = max(h // step, 1) * step, max(w // step, 1) * step
    return h, w


def pixels(config: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
    """An image batch ``(2, C, H, W)`` of the size the config describes."""
    vision = sub_config(config, *_VISION)
    if not hasattr(vision, "image_size"):  # a tower around a backbone (SAM 2): the backbone's size
        vision = sub_config(vision, "backbone_config")
    channels = int_of(vision, "num_channels", "in_channels", "in_chans", "input_channels", default=3)
    h, w = image_hw(vision)
    ratios = getattr(config, "scaled_images_ratios", None)
    crop = getattr(config, "patch_size", None)
    if isinstance(ratios, (list, tuple)) and ratios and isinstance(crop, int):  # crops of every scale (DepthPro)
        h = w = max(h, math.ceil(crop / min(ratios)))
    return torch.zeros(BATCH, channels, h, w, device=device, dtype=dtype)


def is_video(config: Any) -> bool:
    """A video model whose frames come as ``pixel_values`` (VideoMAE, ViViT, InstructBLIP-Video, TVP)."""
    if hasattr(sub_config(config, "vision_config"), "num_frames"):
        return True
    image_token = any(hasattr(config, k) for k in ("image_token_index", "image_token_id"))
    return not image_token and any(hasattr(config, k) for k in ("video_token_index", "video_token_id"))


def patch_images(model: nn.Module, config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Flattened patches ``(N, C * p * p)`` as ``(N, C, p, p)`` where a 2-D convolution embeds each (Kimi-K2.5).

    Kept flat where the model embeds them flat (a ``Linear`` of that width) or as clips (a ``Conv3d``). Where
    a ``p x p`` ``Conv2d`` could read either (HunYuan-VL reshapes the flat patches itself), both are tried on
    a meta twin and the first the forward accepts is kept, the patch images first.
    """
    patches = kwargs["pixel_values"]
    vision = sub_config(config, "vision_config")
    p, channels = int_of(vision, "patch_size", default=14), int_of(vision, "num_channels", "in_channels", default=3)
    width = patches.shape[-1]
    kinds = list(model.modules())
    flat = any(isinstance(m, nn.Conv3d) or (isinstance(m, nn.Linear) and m.in_features == width) for m in kinds)
    conv = any(isinstance(m, nn.Conv2d) and m.kernel_size == (p, p) and m.in_channels * p * p == width for m in kinds)
    if not conv or flat or width != channels * p * p:
        return kwargs
    images = {**kwargs, "pixel_values": patches.view(-1, width // (p * p), p, p)}
    return first_fitting(model, [images, kwargs]) or kwargs


def _grid(side: int, device: torch.device) -> Tensor:
    """``(side * side, 2)`` patch positions ``(x, y)``, row by row."""
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return torch.stack([xs.flatten(), ys.flatten()], dim=-1).to(device)


def _patch_width(vision: Any) -> int:
    return int_of(vision, "num_channels", default=3) * int_of(vision, "patch_size", default=16) ** 2


def _patch_sequences(config: Any, params: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    vision = sub_config(config, "vision_config")
    out: dict[str, Any] = {}
    if "spatial_shapes" in params:  # NaFlex (SigLIP-2): (batch, patches, C * p * p) with each image's grid
        side = math.isqrt(int_of(vision, "num_patches", default=256))
        out["pixel_values"] = torch.zeros(BATCH, side * side, _patch_width(vision), device=device, dtype=dtype)
        out["spatial_shapes"] = torch.tensor([[side, side]] * BATCH, device=device)
        if "pixel_attention_mask" in params:
            out["pixel_attention_mask"] = torch.ones(BATCH, side * side, device=device, dtype=torch.long)
    elif "pixel_position_ids" in params:  # patches and their (x, y), pooled k x k after (Gemma 4)
        side = 2 * int_of(vision, "pooling_kernel_size", default=1)
        out["pixel_values"] = torch.zeros(BATCH, side * side, _patch_width(vision), device=device, dtype=dtype)
        out["pixel_position_ids"] = _grid(side, device).expand(BATCH, -1, -1).contiguous()
    elif "target_sizes" in params:  # one packed image and its patch grid (MiniCPM-V): windows divide the grid
        window = int_of(vision, "window_kernel_size", default=1)
        side = 2 * window
        patch = int_of(vision, "patch_size", default=14)
        channels = int_of(vision, "num_channels", default=3)
        out["pixel_values"] = torch.zeros(1, channels, side * patch, side * patch, device=device, dtype=dtype)
        out["target_sizes"] = torch.tensor([[side, side]], device=device, dtype=torch.int32)
    return out


def vision_inputs(
    model: nn.Module, config: Any, params: Any, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The image inputs that come as a set, keyed by the forward's argument names (empty: none here).

    A model whose text holds image tokens (LFM2-VL, MiniCPM-V) gets no image unless its forward requires one:
    the text built for it has none of those tokens.
    """
    main = getattr(model, "main_input_name", None)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    image_tokens = any(hasattr(config, k) for k in ("image_token_id", "image_token_index", "image_token"))
    if image_tokens and main != "pixel_values" and "pixel_values" not in required:
        return {}
    out = _patch_sequences(config, params, device, dtype)
    matcher = hasattr(config, "keypoint_detector_config") or any("matching" in k for k in vars(config))
    if matcher and "pixel_values" in params:  # a keypoint matcher reads image pairs: (batch, 2, C, H, W)
        out["pixel_values"] = torch.stack([pixels(config, device, dtype)] * 2, dim=1)
    if "prompt_pixel_values" in params and "prompt_masks" in params:  # in-context segmentation (SegGPT)
        image = pixels(config, device, dtype)
        image = image[:, :, : image.shape[2] // 2]  # the prompt above the image fill image_size together
        out.update(pixel_values=image, prompt_pixel_values=image.clone(), prompt_masks=image.clone())
    if "visual_feats" in params and "visual_pos" in params:  # region features and their boxes (LXMERT)
        feats, pos = int_of(config, "visual_feat_dim", default=2048), int_of(config, "visual_pos_dim", default=4)
        out["visual_feats"] = torch.zeros(BATCH, 4, feats, device=device, dtype=dtype)
        out["visual_pos"] = torch.zeros(BATCH, 4, pos, device=device, dtype=dtype)
    if "bbox" in params:  # a box per token, as (x0, y0, x1, y1) (LayoutLM, BROS, UDOP)
        out["bbox"] = torch.zeros(BATCH, TOKENS, 4, device=device, dtype=torch.long)
    if "task_inputs" in params:  # a tokenized task prompt (OneFormer)
        length = int_of(config, "task_seq_len", default=TOKENS)
        out["task_inputs"] = (torch.arange(BATCH * length) % 100 + 1).view(BATCH, length).to(device)
    width = getattr(config, "encoder_hidden_size", None)
    if "encoder_hidden_states" in params and isinstance(width, int) and "query_embeds" in params:
        out["encoder_hidden_states"] = torch.zeros(BATCH, 4, width, device=device, dtype=dtype)  # a Q-Former's
    if "merge_sizes" in params and "grid_thw" in params:  # one merge size per image (VideoLLaMA 3)
        merge = int_of(sub_config(config, "vision_config"), "spatial_merge_size", "merge_size", default=2)
        out["merge_sizes"] = torch.tensor([merge], device=device)
    return out


def prompt_images(config: Any, params: Any, kwargs: dict[str, Any], device: torch.device) -> None:
    """Fit the built text to the built images, in place: image tokens in the prompt, an image axis.

    A model that writes its query outputs into the text at its image token (BLIP-2, InstructBLIP) gets
    ``num_query_tokens`` of them before the text; one that marks the image positions with a mask
    (Kosmos-2's ``image_embeds_position_mask``) gets ``latent_query_num`` marked positions. A model
    reading several images per text (IDEFICS) gets ``(batch, 1, C, H, W)`` and the text-to-image mask.
    """
    ids, image = kwargs.get("input_ids"), kwargs.get("pixel_values", kwargs.get("pixel_values_videos"))
    if not isinstance(image, Tensor):
        return
    if not isinstance(ids, Tensor) and "input_ids" in params and hasattr(config, "num_query_tokens"):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = int_of(text, "vocab_size", default=100)
        ids = (torch.arange(BATCH * TOKENS) % max(min(vocab, 200) - 1, 1) + 1).view(BATCH, TOKENS).to(device)
        kwargs["input_ids"] = ids
    if not isinstance(ids, Tensor):
        return
    token = next(
        (getattr(config, k) for k in ("image_token_index", "image_token_id", "video_token_index")
         if isinstance(getattr(config, k, None), int)),
        None,
    )  # fmt: skip
    queries = getattr(config, "num_query_tokens", None)
    if isinstance(token, int) and isinstance(queries, int) and queries > 0:
        frames = image.shape[1] if image.dim() == 5 else 1  # a video's frames each bring their queries
        positions = int_of(config.get_text_config() if hasattr(config, "get_text_config") else config,
                           "max_position_embeddings", default=1 << 20)  # fmt: skip
        if frames > 1 and queries * frames + ids.shape[1] > positions:  # as many frames as the text has room for
            frames = max((positions - ids.shape[1]) // queries, 1)
            kwargs["pixel_values" if "pixel_values" in kwargs else "pixel_values_videos"] = image[:, :frames]
        kwargs["input_ids"] = torch.cat([torch.full((BATCH, queries * frames), token, device=device), ids], dim=1)
    latent = getattr(config, "latent_query_num", None)
    if "image_embeds_position_mask" in params and isinstance(latent, int) and latent > 0:
        kwargs["input_ids"] = torch.cat([ids[:, :1], torch.ones(BATCH, latent, device=device, dtype=ids.dtype), ids], 1)
        mask = torch.zeros_like(kwargs["input_ids"])
        mask[:, 1 : 1 + latent] = 1
        kwargs["image_embeds_position_mask"] = mask
    if "image_attention_mask" in params and image.dim() == 4:
        kwargs["pixel_values"] = image.unsqueeze(1)
        kwargs["image_attention_mask"] = torch.ones(BATCH, ids.shape[1], 1, device=device, dtype=torch.long)
