"""Images in prompt rows: where a row's images are, checked once when the data is read, kept as references.

A row's images come from its ``vision.image_field`` (a list, or one image) and from its messages' content
parts (``{"type": "image"}``, inline ``{"type": "image", "image": ...}``, OpenAI's ``{"type": "image_url",
"image_url": {"url": ...}}``). An image is a file path (relative to the data file), a ``data:image/...;base64,``
URL, bytes (Parquet, a ``datasets`` Image feature's ``{"bytes", "path"}``) or a PIL image. Each is decoded once
here, so a missing, truncated or non-image file names its row and field before anything runs; a remote URL is
refused (nothing is fetched from the network).

What a ``Prompt`` keeps is a reference per image, a string that survives a checkpoint: the file's absolute path,
or a data URL (bytes). Messages keep their text with ``IMAGE`` where each image goes, in order, so everything
that reads a prompt's text (verifiers, judges, records) reads a string; ``models.vision`` turns the markers back
into the parts a processor's chat template renders.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
from pathlib import Path
from typing import Any

IMAGE = "<image>"  # where an image goes in a message's text (EasyR1's convention)
_DATA = "data:image/"


class ImageError(ValueError):
    pass


def _data_url(raw: bytes, fmt: str | None) -> str:
    return f"{_DATA}{(fmt or 'png').lower()};base64,{base64.b64encode(raw).decode()}"


def _check_bytes(raw: bytes, what: str) -> str:
    """The image format of ``raw``, decoded in full (a truncated file fails here, not mid-run)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            return im.format or "png"
    except Exception as e:
        why = str(e).split(" <_io.")[0][:80]  # (PIL names its buffer object)
        raise ImageError(f"{what}: not a readable image ({type(e).__name__}: {why})") from None


def to_ref(value: Any, base: Path | None, what: str) -> str:
    """``value`` (a path, a data URL, bytes, a ``datasets`` Image dict, a PIL image) as a checked reference."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature, Parquet's struct
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        return _data_url(raw, _check_bytes(raw, what))
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        return _data_url(buf.getvalue(), "png")
    if not isinstance(value, str) or not value.strip():
        raise ImageError(f"{what}: an image is a file path, a data:image URL or bytes, got {type(value).__name__} "
                         f"{value!r:.60}")
    if value.startswith(("http://", "https://")):
        raise ImageError(f"{what}: {value[:80]!r} is a remote URL; nothing is fetched from the network (give a file "
                         "path or a data:image URL)")
    if value.startswith("data:"):
        raw = decode_data_url(value, what)
        _check_bytes(raw, what)
        return value
    p = Path(value).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if not p.is_file():
        raise ImageError(f"{what}: no such image file {str(p)!r}")
    _check_bytes(p.read_bytes(), f"{what} ({p})")
    return str(p.resolve())


def decode_data_url(url: str, what: str = "image") -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith(_DATA) or not head.endswith(";base64") or not payload:
        raise ImageError(f"{what}: a malformed data URL {url[:40]!r}... (data:image/<format>;base64,<bytes>)")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        raise ImageError(f"{what}: a data URL whose base64 does not decode ({url[:40]!r}...)") from None


def _part_image(part: dict) -> Any:
    """An image part's inline image, or None (the next of the row's image field)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def split_parts(content: list, images: list, base: Path | None, at: str) -> tuple[str, list[str]]:
    """A message's content parts as text with ``IMAGE`` markers, and the references of its inline images (an
    image part without one takes the next of ``images``, the row's image field, consumed in place)."""
    text, refs = [], []
    for i, part in enumerate(content, start=1):
        where = f"{at} part {i}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            inline = _part_image(part)
            if inline is None:
                if not images:
                    raise ImageError(f"{where}: an image part with no image (none left in the row's image field)")
                inline = images.pop(0)
            refs.append(to_ref(inline, base, where))
            text.append(IMAGE)
        else:
            raise ImageError(f"{where}: a content part is {{'type': 'text', 'text': ...}} or an image part "
                             f"({{'type': 'image'}}, {{'type': 'image_url', ...}}), got {part!r:.80}")
    return "".join(text), refs


def place(messages: list[dict], refs: list[str], at: str) -> list[dict]:
    """``messages`` with a marker for each of ``refs`` not already marked: before the first user message's text
    (TRL's placement of a row's ``images``). Markers and images must then agree in number."""
    marked = sum(m["content"].count(IMAGE) for m in messages)
    if marked > len(refs):
        raise ImageError(f"{at}: {marked} {IMAGE} markers but {len(refs)} images")
    if marked < len(refs):
        if marked:
            raise ImageError(f"{at}: {marked} {IMAGE} markers but {len(refs)} images (mark each, or none)")
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise ImageError(f"{at}: images but no user message to place them in")
        messages = [dict(m) for m in messages]
        messages[first]["content"] = IMAGE * len(refs) + messages[first]["content"]
    return messages


def count(messages: list[dict]) -> int:
    return sum(m["content"].count(IMAGE) for m in messages if isinstance(m.get("content"), str))


@functools.lru_cache(maxsize=256)
def open_image(ref: str):
    """The RGB PIL image of a reference (a few hundred kept: a group's responses and the trainer share them)."""
    from PIL import Image

    raw = decode_data_url(ref) if ref.startswith("data:") else Path(ref).read_bytes()
    with Image.open(io.BytesIO(raw)) as im:
        return im.convert("RGB")


def key(ref: str) -> str:
    """A short stable name for a reference (a data URL is long): what caches of its encoding are keyed by."""
    return ref if len(ref) < 200 else hashlib.sha1(ref.encode()).hexdigest()


def with_images(message: dict, what: str) -> dict:
    """A message whose content may hold image parts (an environment's screenshot, a client's ``image_url``) as
    text with ``IMAGE`` markers, its images' references under ``"images"``; a message of text as it is."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text, refs = split_parts(content, [], None, what)
    return {**message, "content": text, "images": list(message.get("images") or []) + refs}


def attach(messages: list[dict], refs) -> list[dict]:
    """A prompt's messages with its images' references (``Prompt.images``, in marker order) on the messages whose
    markers they fill."""
    out, k = [], 0
    for m in messages:
        n = m["content"].count(IMAGE) if isinstance(m.get("content"), str) and "images" not in m else 0
        out.append({**m, "images": list(refs[k:k + n])} if n else m)
        k += n
    return out


def refs_of(messages: list[dict]) -> list[str]:
    """The references of the images of ``messages`` (``with_images``, ``attach``), in order."""
    return [r for m in messages for r in m.get("images") or ()]
