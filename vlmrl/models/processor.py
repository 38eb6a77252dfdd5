"""Loading a Qwen-VL processor (tokenizer + image processor + chat template).

transformers builds a Qwen-VL processor with a video processor, which needs torchvision.
vlmrl works on images only and runs where torchvision cannot be installed (CPU machines:
its only wheel there is CUDA-linked). With torchvision present, `AutoProcessor` is used as
is; without it, the same processor class is built from its tokenizer and (PIL) image
processor with the video part left out. Either way pixel bounds come from the caller, so
rollout and training produce identical image token counts.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@functools.cache
def image_only(processor_cls: type) -> type:
    """`processor_cls` without its video processor (a subclass with an image-only __init__)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):  # noqa: N807
        processor_cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(processor_cls.__name__, (processor_cls,), {"__init__": __init__, "__module__": __name__})


def pixel_size(min_pixels: int, max_pixels: int) -> dict[str, int]:
    return {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)}


def load_processor(path: str, *, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The checkpoint's processor, with image pixel bounds overridden when given."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if min_pixels is not None and max_pixels is not None:
        kwargs["size"] = pixel_size(min_pixels, max_pixels)
    if has_torchvision():
        return AutoProcessor.from_pretrained(path, **kwargs)

    cfg_file = Path(path) / "processor_config.json"
    name = json.loads(cfg_file.read_text()).get("processor_class") if cfg_file.exists() else None
    if name is None:
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(path).model_type
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        name = PROCESSOR_MAPPING_NAMES[model_type]
    cls = image_only(getattr(transformers, name))
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, **kwargs)
    template_file = Path(path) / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else tokenizer.chat_template
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def save_processor(processor: Any, out: str | Path, processor_class: str) -> None:
    """Write a processor's files as the original processor class would (loadable by
    AutoProcessor where torchvision exists, and by `load_processor` everywhere)."""
    out = Path(out)
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    if processor.chat_template:
        (out / "chat_template.jinja").write_text(processor.chat_template)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2))
