"""Images in every form a dataset row carries them, decoded to RGB PIL images.

A row's image may be a PIL image, a `{"bytes", "path"}` dict (HF `datasets`' storage of
its Image feature), raw bytes, a file path, an http(s) URL or a base64 data URI.
`image_bytes` turns any of them except a PIL image into the encoded file bytes;
`decode_image` turns any of them into an RGB image after checking its size from the
file header, before a single pixel is decoded. URLs are fetched with a timeout, transient
failures retried with backoff, and cached on disk under the SHA-256 of the URL.

Errors are `ImageError`s whose `reason` names the failure class (unreadable image, fetch
failure, too large). Their messages name the image, not the row: callers add the row.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

_PIL_LIMIT_LOCK = threading.Lock()


class ImageError(ValueError):
    """An image that cannot be used; `reason` is a short identifier for skip statistics."""

    reason = "unreadable_image"


class ImageFetchError(ImageError):
    """A URL that could not be fetched (offline, unreachable, HTTP error, timeout), after
    `attempts` tries; `transient` when a later try may succeed (connection failures,
    timeouts, HTTP 408/429/5xx)."""

    reason = "image_fetch_failed"

    def __init__(self, message: str, *, transient: bool = True, attempts: int = 1) -> None:
        super().__init__(message)
        self.transient, self.attempts = transient, attempts


class ImageTooLargeError(ImageError):
    """An image whose header declares more pixels than allowed."""

    reason = "image_too_large"


def describe(obj: Any) -> str:
    """A short description of an image object for error messages (never its bytes)."""
    if isinstance(obj, Image.Image):
        return f"PIL image {obj.size[0]}x{obj.size[1]}"
    if isinstance(obj, dict):
        return f"image dict (path={obj.get('path')!r}, {len(obj.get('bytes') or b'')} bytes)"
    if isinstance(obj, bytes | bytearray):
        return f"{len(obj)} image bytes"
    if isinstance(obj, str):
        return obj if len(obj) <= 80 else obj[:60] + "..."
    return type(obj).__name__


def image_bytes(obj: Any, *, cache_dir: str | os.PathLike | None = None, timeout_s: float = 10.0,
                retries: int = 3) -> bytes:
    """The encoded file bytes of an image given as bytes, a `{"bytes", "path"}` dict, a file
    path, an http(s) URL or a base64 data URI; a PIL image is encoded as PNG."""
    if isinstance(obj, Image.Image):
        return encode_png(obj)
    if isinstance(obj, bytes | bytearray):
        return bytes(obj)
    if isinstance(obj, dict):
        if obj.get("bytes"):
            return bytes(obj["bytes"])
        if obj.get("path"):
            return image_bytes(obj["path"], cache_dir=cache_dir, timeout_s=timeout_s, retries=retries)
        raise ImageError("image dict has neither bytes nor path")
    if isinstance(obj, str):
        if obj.startswith("data:"):
            return _decode_data_uri(obj)
        if obj.startswith(("http://", "https://")):
            return fetch_url(obj, cache_dir=cache_dir, timeout_s=timeout_s, retries=retries)
        path = Path(obj.removeprefix("file://"))
        try:
            return path.read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read image file {obj}: {e.strerror or e}") from e
    raise ImageError(f"unsupported image object of type {type(obj).__name__}")


def decode_image(obj: Any, *, cache_dir: str | os.PathLike | None = None, timeout_s: float = 10.0,
                 max_megapixels: float | None = None, retries: int = 3) -> Image.Image:
    """`obj` (any form `image_bytes` accepts, or a PIL image) as a fully loaded RGB image.

    With `max_megapixels`, a larger image raises `ImageTooLargeError` after reading only its
    header (PIL's own decompression-bomb limit is lifted for that read so the size can be
    reported); without it, PIL's limit applies. Corrupt or truncated data raises `ImageError`.
    """
    if isinstance(obj, Image.Image):
        _check_size(obj.size, max_megapixels)
        return obj if obj.mode == "RGB" else obj.convert("RGB")
    data = image_bytes(obj, cache_dir=cache_dir, timeout_s=timeout_s, retries=retries)
    try:
        if max_megapixels is None:
            img = Image.open(io.BytesIO(data))
        else:
            with _pil_limit_lifted():
                img = Image.open(io.BytesIO(data))
        _check_size(img.size, max_megapixels)
        img.load()
        return img.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"cannot decode image ({describe(obj)}): {e}") from e


_TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})


def fetch_url(url: str, *, cache_dir: str | os.PathLike | None = None, timeout_s: float = 10.0,
              retries: int = 3, backoff_s: float = 0.5) -> bytes:
    """The body of `url`, from `cache_dir/<sha256(url)>` when cached, else fetched with a
    timeout and written there atomically. Transient failures (connection errors, timeouts,
    HTTP 408/429/5xx) are retried `retries` times with exponential backoff and jitter;
    what still fails raises `ImageFetchError` (permanent HTTP errors at once)."""
    cached = Path(cache_dir) / hashlib.sha256(url.encode()).hexdigest() if cache_dir else None
    if cached is not None and cached.is_file():
        return cached.read_bytes()
    attempt = 0
    while True:
        attempt += 1
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                data = response.read()
            break
        except urllib.error.HTTPError as e:
            error = ImageFetchError(f"cannot fetch image {url}: HTTP {e.code} {e.reason} (attempt {attempt})",
                                    transient=e.code in _TRANSIENT_HTTP, attempts=attempt)
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or e
            error = ImageFetchError(f"cannot fetch image {url} (timeout {timeout_s:g}s, attempt {attempt}): {why}; "
                                    "offline or unreachable? Pre-fetch the images or use a local copy of the dataset",
                                    transient=not isinstance(e, ValueError), attempts=attempt)
        if not error.transient or attempt > retries:
            raise error
        time.sleep(min(backoff_s * 2 ** (attempt - 1), 30.0) * (0.5 + random.random() / 2))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cached.name}-", dir=cached.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, cached)
    return data


def encode_png(img: Image.Image) -> bytes:
    """Lossless PNG bytes of `img`."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def encode_data_uri(img: Image.Image) -> str:
    """`img` as a `data:image/png;base64,...` URI (the form rollout engines receive)."""
    return "data:image/png;base64," + base64.b64encode(encode_png(img)).decode("ascii")


def fit_pixels(img: Image.Image, max_pixels: int) -> Image.Image:
    """`img` downscaled (aspect ratio kept) to at most `max_pixels` pixels; unchanged if smaller.

    The processor would resize it within its pixel bounds anyway; shrinking first keeps huge
    images from travelling through the pipeline (and to rollout engines) at full size.
    """
    w, h = img.size
    if w * h <= max_pixels:
        return img
    scale = (max_pixels / (w * h)) ** 0.5
    size = (max(1, int(w * scale)), max(1, int(h * scale)))
    return img.resize(size, Image.Resampling.BICUBIC)


def _check_size(size: tuple[int, int], max_megapixels: float | None) -> None:
    w, h = size
    if max_megapixels is not None and w * h > max_megapixels * 1e6:
        raise ImageTooLargeError(f"image of {w}x{h} = {w * h / 1e6:.1f} megapixels exceeds the limit of "
                                 f"{max_megapixels:g} (data.max_image_megapixels)")


def _decode_data_uri(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError(f"not a base64 data URI: {describe(uri)}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"bad base64 in data URI: {e}") from e


@contextmanager
def _pil_limit_lifted() -> Iterator[None]:
    """PIL's process-wide decompression-bomb limit lifted for a header read (callers check
    the size themselves). Serialised by a lock; the window is one `Image.open` call."""
    with _PIL_LIMIT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved
