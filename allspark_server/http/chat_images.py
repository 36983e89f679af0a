"""Images in chat messages for vision-language models (Qwen2-VL, Qwen2.5-VL): the `image_url` parts' data: URLs
(protocol.py takes them out of the messages, which keep a {"type": "image"} part in their place) decoded and checked
(vision/image_files.py), resized and normalised by the model folder's image processor, and each image token the chat
template wrote repeated once per merged patch block: the text to tokenize and the request's `pixel_values` /
`image_grid_thw`. A bad image is a 400 naming it; the server keeps serving.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from allspark_server.http.protocol import bad_request
from allspark_server.vision.image_files import ImageError
from allspark_server.vision.processor import VisionProcessor

VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class ChatImages:
    def __init__(self, processor: VisionProcessor):
        self.processor = processor

    @classmethod
    def for_model(cls, folder: str) -> Optional["ChatImages"]:
        """The image side of a vision-language model folder; None for any other model (or a GGUF file)."""
        try:
            with open(os.path.join(folder, "config.json")) as f:
                architectures = json.load(f).get("architectures") or []
        except (OSError, ValueError):
            return None
        if not set(architectures) & set(VISION_ARCHITECTURES):
            return None
        return cls(VisionProcessor.from_folder(folder))

    def inputs(self, text: str, urls: list[str]) -> tuple[str, dict]:
        """(the rendered chat with its image tokens expanded, {"pixel_values", "image_grid_thw"}) of the images."""
        images = []
        for i, url in enumerate(urls):
            try:
                images.append(self.processor.load(url))
            except ImageError as e:
                raise bad_request(f"image {i + 1} of the request: {e}", param="messages",
                                  code="invalid_image") from None
        written = text.count(self.processor.image_token)
        if written != len(images):
            raise bad_request(f"the chat template wrote {written} image tokens for the request's {len(images)} "
                              "images", param="messages", code="chat_template_error")
        if len(images) > self.processor.max_images:
            raise bad_request(f"{len(images)} images in one request (at most {self.processor.max_images})",
                              param="messages")
        encoded = self.processor.encode_images(images)
        return self.processor.expand(text, encoded["image_grid_thw"]), encoded
