"""Images plus a chat -> the inputs of a Qwen2-VL / Qwen2.5-VL request, as transformers' processor makes them.

    processor = VisionProcessor.from_folder(model_folder)
    inputs = processor(messages)            # {"input_ids", "pixel_values", "image_grid_thw"}: numpy arrays

`messages` are OpenAI-style chat messages whose `content` is a string or a list of parts: {"type": "text", "text"},
{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} (or the URL string itself), or
{"type": "image", "image": <PIL image | bytes | data: URL>}; an {"type": "image"} part without a payload takes the
next of `images`. Each image is decoded and checked (image_files.py: ImageError, a ValueError, says what is wrong),
resized and normalised by the folder's own image processor (preprocessor_config.json: min / max pixels, patch and
merge sizes, mean and std), the chat is rendered by the folder's chat template, and each image's placeholder token
is repeated once per merged patch block (t * h * w / merge^2) before tokenizing. input_ids is 1-D int64;
pixel_values float32 [patches, C * T * P * P]; image_grid_thw int64 [images, 3]; a chat without images gives
input_ids alone."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from allspark_server.vision.image_files import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageError, load_image

IMAGE_TOKEN = "<|image_pad|>"


def _folder_chat_template(folder: str) -> str | None:
    """The processor's chat template of a folder (chat_template.jinja or chat_template.json), if any."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("chat_template")
    return None


class VisionProcessor:
    """A model folder's tokenizer, chat template and image processor, with the image limits."""

    def __init__(self, tokenizer, image_processor, chat_template: str | None = None,
                 max_image_bytes: int = MAX_IMAGE_BYTES, max_image_pixels: int = MAX_IMAGE_PIXELS,
                 max_images: int = 64):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no image token {self.image_token!r}")
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.max_image_bytes, self.max_image_pixels, self.max_images = max_image_bytes, max_image_pixels, max_images

    @classmethod
    def from_folder(cls, folder: str, **limits) -> "VisionProcessor":
        """From the model folder's tokenizer files, chat template and preprocessor_config.json."""
        from transformers import AutoImageProcessor, AutoTokenizer

        if not os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
            raise ValueError(f"{folder!r} has no preprocessor_config.json (the image processor's settings)")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        template = getattr(tokenizer, "chat_template", None) or _folder_chat_template(folder)
        return cls(tokenizer, AutoImageProcessor.from_pretrained(folder), template, **limits)

    def load(self, source):
        """One checked, decoded image (images.load_image with this processor's limits)."""
        return load_image(source, self.max_image_bytes, self.max_image_pixels)

    def render(self, messages: Sequence[dict], images: Sequence[Any] = (),
               add_generation_prompt: bool = True) -> tuple[str, list]:
        """(the chat as text with one image token per image, the decoded images in order)."""
        if self.chat_template is None:
            raise ValueError("the model folder has no chat template")
        pending = list(images)
        found: list = []
        plain = []
        for m, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{m}] must be a dict with a role and a content")
            content = message.get("content")
            if content is None or isinstance(content, str):
                plain.append(message)
                continue
            if not isinstance(content, (list, tuple)):
                raise ValueError(f"messages[{m}].content must be a string or a list of parts, not "
                                 f"{type(content).__name__}")
            parts = []
            for p, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                    continue
                if kind == "image_url":
                    source = part.get("image_url")
                elif kind == "image":
                    source = part.get("image")
                    if source is None:
                        if not pending:
                            raise ValueError(f"messages[{m}].content[{p}] is an image placeholder but no image is "
                                             "left in `images`")
                        source = pending.pop(0)
                else:
                    raise ValueError(f"messages[{m}].content[{p}]: a part must be text, image_url or image, got "
                                     f"{kind if kind is not None else type(part).__name__!r}")
                try:
                    found.append(self.load(source))
                except ImageError as e:
                    raise ImageError(f"messages[{m}].content[{p}]: {e}") from None
                parts.append({"type": "image"})
            plain.append({**message, "content": parts})
        if pending:
            raise ValueError(f"{len(pending)} of `images` have no image placeholder in the messages")
        if len(found) > self.max_images:
            raise ValueError(f"{len(found)} images in one request, over the limit of {self.max_images}")
        text = self.tokenizer.apply_chat_template(plain, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        if text.count(self.image_token) != len(found):
            raise ValueError(f"the chat template wrote {text.count(self.image_token)} image tokens for "
                             f"{len(found)} images")
        return text, found

    def encode_images(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        """{"pixel_values", "image_grid_thw"} of already loaded (or loadable) images."""
        loaded = [self.load(image) for image in images]
        out = self.image_processor(images=loaded, return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
                "image_grid_thw": np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)}

    def expand(self, text: str, image_grid_thw: np.ndarray) -> str:
        """Each image token of `text` repeated once per merged patch block of its image."""
        pieces = text.split(self.image_token)
        counts = [int(np.prod(g)) // self.merge_size ** 2 for g in image_grid_thw.tolist()]
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the text has {len(pieces) - 1} image tokens for {len(counts)} images")
        return pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))

    def __call__(self, messages: Sequence[dict], images: Sequence[Any] = (),
                 add_generation_prompt: bool = True) -> dict[str, np.ndarray]:
        text, found = self.render(messages, images, add_generation_prompt)
        out: dict[str, np.ndarray] = {}
        if found:
            out = self.encode_images(found)
            text = self.expand(text, out["image_grid_thw"])
        ids = self.tokenizer(text)["input_ids"]
        return {"input_ids": np.asarray(ids, dtype=np.int64), **out}


_processors: dict[str, VisionProcessor] = {}


def vision_inputs(folder: str, messages: Sequence[dict], images: Sequence[Any] = (),
                  add_generation_prompt: bool = True) -> dict[str, np.ndarray]:
    """VisionProcessor.from_folder(folder)(messages, images), the processor kept per folder."""
    processor = _processors.get(folder)
    if processor is None:
        processor = _processors[folder] = VisionProcessor.from_folder(folder)
    return processor(messages, images, add_generation_prompt)
