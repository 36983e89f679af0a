"""Images from the outside world, decoded and checked before anything else touches them, and their hashes.

`load_image` takes a PIL image, the bytes of an image file, a `data:image/...;base64,` URL or an OpenAI
`image_url` object ({"url": ...}); remote (http, https, file, ...) URLs are refused here. Every problem is an
ImageError (a ValueError) that says what was wrong: a wrong type, bad base64, bytes that are no image or a
corrupt one, a file over `max_bytes`, more than `max_pixels` pixels (checked from the header, before the pixels
are decoded: the decompression-bomb bound), or an aspect ratio the processor cannot resize (over 200:1).

`image_hashes` names each image of a processor output by its decoded pixels (sha256 of its grid and its
pixel_values rows), which is what its embeddings depend on; `file_hash` names the raw file."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings

import numpy as np

MAX_IMAGE_BYTES = 32 << 20          # an encoded image file
MAX_IMAGE_PIXELS = 64 << 20         # width x height before resizing (about 8192 x 8192)
MAX_ASPECT_RATIO = 200              # the Qwen2-VL processor's limit


class ImageError(ValueError):
    """An image that cannot be used, with the reason."""


def decode_data_url(url: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a `data:[image/<type>][;...];base64,<payload>` URL."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "no scheme"
        raise ImageError(f"image URL with {scheme!r}: only data: URLs (data:image/png;base64,...) are accepted, "
                         "remote and file URLs are refused")
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("data: URL without a ',' before its payload")
    params = head.split(";")
    if "base64" not in params[1:]:
        raise ImageError("data: URL is not base64 (expected data:image/<type>;base64,...)")
    if params[0] and not params[0].lower().startswith("image/"):
        raise ImageError(f"data: URL of media type {params[0]!r}, not an image")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"image data: URL carries more than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data: URL payload is not valid base64 ({e})") from None


def check_size(width: int, height: int, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"image of {width} x {height} pixels is empty")
    if width * height > max_pixels:
        raise ImageError(f"image of {width} x {height} = {width * height} pixels is over the limit of {max_pixels}")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ImageError(f"image of {width} x {height} pixels: aspect ratio over {MAX_ASPECT_RATIO}:1")


def decode_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """A loaded PIL image from an image file's bytes."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise ImageError(f"image file of {len(data)} bytes is over the limit of {max_bytes}")
    if not data:
        raise ImageError("image file is empty (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ImageError(f"not an image: the {len(data)} bytes are in no image format known to Pillow "
                             f"(starting {data[:8]!r})") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"image has too many pixels (decompression bomb bound): {e}") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"corrupt image: {e}") from None
        check_size(*image.size, max_pixels)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageError(f"corrupt {image.format or ''} image: {e}".replace("  ", " ")) from None
    return image


def load_image(source, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """A loaded PIL image from a PIL image, image file bytes, a data: URL or an OpenAI {"url": ...} object."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_size(*source.size, max_pixels)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), max_bytes, max_pixels)
    if isinstance(source, str):
        return decode_image(decode_data_url(source.strip(), max_bytes), max_bytes, max_pixels)
    if isinstance(source, dict) and isinstance(source.get("url"), str):
        return load_image(source["url"], max_bytes, max_pixels)
    raise ImageError(f"an image must be a PIL image, image file bytes or a data: URL, not {type(source).__name__}")


def file_hash(data: bytes) -> str:
    """sha256 of an image file's bytes."""
    return hashlib.sha256(data).hexdigest()


def image_hashes(pixel_values, image_grid_thw) -> list[str]:
    """One sha256 an image of a processor output: of its (t, h, w) grid and its rows of pixel_values."""
    pixels = np.ascontiguousarray(np.asarray(pixel_values))
    out, offset = [], 0
    for t, h, w in np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3).tolist():
        rows = pixels[offset:offset + t * h * w]
        offset += t * h * w
        digest = hashlib.sha256(np.asarray([t, h, w], dtype=np.int64).tobytes())
        digest.update(memoryview(rows).cast("B"))          # the rows as they are: no copy
        out.append(digest.hexdigest())
    if offset != len(pixels):
        raise ValueError(f"image_grid_thw covers {offset} patches but pixel_values has {len(pixels)} rows")
    return out
