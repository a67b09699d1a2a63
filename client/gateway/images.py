"""Images in requests: every API's image parts as the protocol's `ImageData` (the file's
bytes, never a URL or path), each API only translating its own shape.

An image comes as base64 (Anthropic's `source`, Ollama's `images`) or as a data URL
(OpenAI's `image_url`, the Responses API's `input_image`); a remote http(s) URL is
refused with a 400 that says to send the bytes: neither the gateway nor the daemon fetches
anything from the network for a client. Here: the size (MAX_IMAGE_BYTES), the count per
request (MAX_IMAGES) and the format by its first bytes; the daemon decodes the image
(the pixel limit, a truncated file: its `bad_image` error, also a 400).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ...shared import protocol as proto
from .daemon_link import bad_request

# The body limit of the routes that take images: Anthropic's own request limit (its
# Messages API's), base64 images included.
IMAGE_BODY_BYTES = 32 << 20


# A file's first bytes -> its media type (the formats the models' processors read).
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def sniff(data: bytes) -> str | None:
    """The media type of an image file's bytes, by their first bytes; None: not one."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def from_base64(text: Any, where: str) -> proto.ImageData:
    """An image sent as base64 text; 400 for text that is not base64 of an image file
    within MAX_IMAGE_BYTES."""
    if not isinstance(text, str) or not text:
        raise bad_request(f"{where} must be the image's bytes as a base64 string", where)
    # 4 characters carry 3 bytes: a string this long is over the limit, undecoded.
    if len(text) > (proto.MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:
        raise bad_request(f"{where}: the image is over the limit of {proto.MAX_IMAGE_BYTES} bytes", where)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where} is not valid base64", where) from None
    if len(data) > proto.MAX_IMAGE_BYTES:
        raise bad_request(f"{where}: the image is {len(data)} bytes, over the limit of {proto.MAX_IMAGE_BYTES}", where)
    kind = sniff(data)
    if kind is None:
        raise bad_request(f"{where} is not an image: send PNG, JPEG, GIF or WebP", where)
    return proto.ImageData(data, kind)


def from_url(url: Any, where: str) -> proto.ImageData:
    """An image given by URL: a data URL's bytes; 400 for a remote URL (never fetched)."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} must be a data URL (data:image/png;base64,...)", where)
    if url.startswith(("http://", "https://")):
        raise bad_request(
            f"{where}: remote image URLs are not fetched (this server reaches no network for a client); "
            "send the image itself as a data URL (data:image/png;base64,...)",
            where,
            code="remote_image_url",
        )
    head, comma, payload = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise bad_request(f"{where} must be a base64 data URL (data:image/png;base64,...)", where)
    return from_base64(payload, where)


def count_images(messages: list[dict[str, Any]]) -> int:
    """The images of a chat's messages; 400 past MAX_IMAGES."""
    n = sum(len(m.get("images") or ()) for m in messages)
    if n > proto.MAX_IMAGES:
        raise bad_request(f"{n} images in one request are over the limit of {proto.MAX_IMAGES}", "messages")
    return n
