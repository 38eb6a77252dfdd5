"""Image decoding in every form a row carries it, URL fetching and caching, size bounds."""

from __future__ import annotations

import base64
import io
import socket
import struct
import zlib

import pytest
from _http import FileServer
from PIL import Image

from vlmrl.data.images import (
    ImageError,
    ImageFetchError,
    ImageTooLargeError,
    decode_image,
    encode_data_uri,
    encode_png,
    fit_pixels,
    image_bytes,
)


def sample_image(size=(40, 30), colour=(200, 30, 60)) -> Image.Image:
    img = Image.new("RGB", size, colour)
    img.putpixel((3, 4), (0, 0, 255))
    return img


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes()


def png_with_header_size(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR claims `width` x `height` (pixels are never decoded)."""
    data = bytearray(encode_png(Image.new("L", (1, 1))))
    ihdr = 8 + 8  # signature, then IHDR's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4:ihdr + 13])))
    return bytes(data)


@pytest.fixture
def server():
    srv = FileServer({"/diagram.png": encode_png(sample_image())})
    yield srv
    srv.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/diagram.png"


# --------------------------------------------------------------------------- forms
def test_every_form_decodes_to_the_same_rgb_pixels(tmp_path, server):
    img = sample_image()
    png = encode_png(img)
    path = tmp_path / "diagram.png"
    path.write_bytes(png)
    forms = {
        "pil": img,
        "pil_rgba": img.convert("RGBA"),
        "bytes": png,
        "bytes_dict": {"bytes": png, "path": None},
        "path_dict": {"bytes": None, "path": str(path)},
        "file_path": str(path),
        "file_uri": f"file://{path}",
        "data_uri": encode_data_uri(img),
        "url": f"{server.url}/diagram.png",
    }
    for name, obj in forms.items():
        out = decode_image(obj, cache_dir=tmp_path / "cache", timeout_s=5)
        assert out.mode == "RGB", name
        assert same_pixels(out, img), name


def test_palette_and_grayscale_images_become_rgb():
    for mode in ("L", "P", "LA"):
        img = Image.new(mode, (5, 5))
        assert decode_image(encode_png(img)).mode == "RGB"


def test_data_uri_roundtrip_is_lossless_png():
    img = sample_image()
    uri = encode_data_uri(img)
    assert uri.startswith("data:image/png;base64,")
    assert same_pixels(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB"), img)


def test_image_bytes_returns_the_file_bytes(tmp_path):
    png = encode_png(sample_image())
    (tmp_path / "a.png").write_bytes(png)
    assert image_bytes({"bytes": None, "path": str(tmp_path / "a.png")}) == png
    assert image_bytes("data:image/png;base64," + base64.b64encode(png).decode()) == png


# --------------------------------------------------------------------------- URLs
def test_url_is_cached_on_disk_and_not_fetched_again(tmp_path, server):
    url = f"{server.url}/diagram.png"
    first = decode_image(url, cache_dir=tmp_path, timeout_s=5)
    second = decode_image(url, cache_dir=tmp_path, timeout_s=5)
    assert server.requests == ["/diagram.png"]  # the second read is a cache hit
    assert same_pixels(first, second)
    assert len(list(tmp_path.iterdir())) == 1


def test_url_without_cache_dir_is_fetched_each_time(server):
    url = f"{server.url}/diagram.png"
    decode_image(url, timeout_s=5)
    decode_image(url, timeout_s=5)
    assert len(server.requests) == 2


def test_unreachable_url_fails_clearly(tmp_path):
    url = closed_port_url()
    with pytest.raises(ImageFetchError, match="cannot fetch image http://127.0.0.1") as info:
        decode_image(url, cache_dir=tmp_path, timeout_s=2, retries=1)
    assert "offline or unreachable" in str(info.value) and "attempt 2" in str(info.value)
    assert info.value.reason == "image_fetch_failed" and info.value.transient and info.value.attempts == 2
    assert not any(tmp_path.iterdir())  # failures are not cached


def test_http_error_is_a_fetch_error_and_not_retried(server):
    with pytest.raises(ImageFetchError, match="HTTP 404") as info:
        decode_image(f"{server.url}/missing.png", timeout_s=5, retries=3)
    assert not info.value.transient and server.requests == ["/missing.png"]


def test_transient_fetch_failures_are_retried_with_backoff(server):
    import time

    server.fail["/diagram.png"] = 2  # two 503s, then the image
    t0 = time.perf_counter()
    img = decode_image(f"{server.url}/diagram.png", timeout_s=5, retries=3)
    assert same_pixels(img, sample_image()) and server.requests == ["/diagram.png"] * 3
    assert time.perf_counter() - t0 >= 0.5 * (0.5 + 1.0) * 0.5  # backoff 0.5 s, then 1 s, jittered 50-100%
    server.fail["/diagram.png"] = 5
    with pytest.raises(ImageFetchError, match="HTTP 503.*attempt 3") as info:
        decode_image(f"{server.url}/diagram.png", timeout_s=5, retries=2)
    assert info.value.transient


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("obj, match", [
    (b"not an image at all", "cannot decode image"),
    (encode_png(sample_image())[:60], "cannot decode image"),  # truncated
    ({"bytes": None, "path": None}, "neither bytes nor path"),
    ("/no/such/dir/x.png", "cannot read image file"),
    ("data:image/png;base64,@@@", "bad base64"),
    ("data:image/png,rawtext", "not a base64 data URI"),
    (12345, "unsupported image object of type int"),
])
def test_unreadable_images_raise_image_error(obj, match):
    with pytest.raises(ImageError, match=match) as info:
        decode_image(obj)
    assert info.value.reason == "unreadable_image"


def test_100_megapixel_image_is_rejected_from_its_header():
    data = png_with_header_size(10_000, 10_000)
    with pytest.raises(ImageTooLargeError, match=r"10000x10000 = 100.0 megapixels exceeds the limit of 50") as info:
        decode_image(data, max_megapixels=50)
    assert info.value.reason == "image_too_large"
    assert Image.MAX_IMAGE_PIXELS is not None  # PIL's own limit is restored


def test_pil_image_above_the_limit_is_rejected():
    with pytest.raises(ImageTooLargeError):
        decode_image(Image.new("RGB", (200, 100)), max_megapixels=0.01)


def test_fit_pixels_keeps_small_images_and_shrinks_large_ones():
    small = sample_image((100, 50))
    assert fit_pixels(small, 5000) is small
    big = fit_pixels(sample_image((400, 200)), 5000)
    assert big.width * big.height <= 5000
    assert abs(big.width / big.height - 2) < 0.05
