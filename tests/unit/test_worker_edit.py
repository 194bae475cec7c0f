"""Pure pieces of edits, previews and encoding: upload checks from headers, sizes,
preview steps, compression."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.worker.edit import EditSupport, check_edit, decode_image, fitted_size, upload_size
from dpserve.worker.encode import encode_image
from dpserve.worker.preview import preview_steps


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _refusal(
    edit: p.EditInput, blobs: list[bytes], support: EditSupport | None = None
) -> p.RequestError:
    with pytest.raises(p.RequestError) as err:
        check_edit(edit, blobs, support)
    return err.value


def test_uploads_are_checked_from_their_headers_naming_the_field() -> None:
    assert upload_size(_png((100, 70)), "image[0]") == (100, 70)
    bad = _refusal(
        p.EditInput(images=[0, 1]), [_png((8, 8)), b"GIF? no"], EditSupport(True, True, 2)
    )
    assert (bad.code, [f.field for f in bad.fields]) == (p.INVALID_REQUEST, ["image[1]"])
    assert "not a readable image" in str(bad)
    huge = _refusal(p.EditInput(images=[0]), [_png((5000, 4000), "L")])  # KiBs, 20 Mpx
    assert [f.field for f in huge.fields] == ["image[0]"] and "at most 4096x4096" in str(huge)
    big = _refusal(p.EditInput(images=[0]), [b"\0" * (pv.MAX_EDIT_IMAGE_BYTES + 1)])
    assert "at most 8 MiB" in str(big)
    mask = _refusal(p.EditInput(images=[0], mask=1), [_png((64, 64)), _png((32, 64), "L")])
    assert [f.field for f in mask.fields] == ["mask"] and "size of the first image" in str(mask)
    assert check_edit(p.EditInput(images=[0], mask=1), [_png((64, 48)), _png((64, 48))], None) == (
        64,
        48,
    )


def test_uploads_in_other_formats_than_png_jpeg_webp_are_refused_by_the_replica() -> None:
    """Pillow reads many more formats (GIF, BMP, TIFF, ICO, PSD, ...), each a decoder a
    hostile file could reach: the replica opens PNG, JPEG and WebP only."""
    for fmt in ("GIF", "BMP", "TIFF"):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16)).save(buf, format=fmt)
        for check in (upload_size, decode_image):
            with pytest.raises(p.RequestError) as refused:
                check(buf.getvalue(), "image[0]")
            assert "not a readable image (PNG, JPEG or WebP)" in str(refused.value), fmt
    for fmt in ("PNG", "JPEG", "WEBP"):
        buf = io.BytesIO()
        Image.new("RGB", (16, 8)).save(buf, format=fmt)
        assert upload_size(buf.getvalue(), "image[0]") == (16, 8)
        assert pv.upload_format(buf.getvalue()[:12]) == fmt


def test_unreadable_uploads_are_named_without_python_reprs() -> None:
    """Pillow's "cannot identify image file <_io.BytesIO object at 0x…>" is reworded, in
    the header check and in the decode (a broken PNG passes the first, not the second)."""
    truncated = _png((32, 32))[:60]
    for data in (b"\x89PNG\r\n\x1a\n" + b"not a png", b"GIF? no", truncated):
        for check in (upload_size, decode_image):
            with pytest.raises(p.RequestError) as refused:
                check(data, "image[0]")
            message = str(refused.value)
            assert "image[0] is not a readable image" in message
            assert "0x" not in message and "BytesIO" not in message, message


def test_edits_the_model_cannot_serve_are_unsupported_naming_the_limit() -> None:
    files = [_png((64, 64)), _png((64, 64))]
    none = _refusal(p.EditInput(images=[0]), files, EditSupport(False, False, 0))
    assert none.code == p.UNSUPPORTED and none.status == 400
    masked = _refusal(p.EditInput(images=[0], mask=1), files, EditSupport(True, False, 1))
    assert (masked.code, masked.fields[0].field) == (p.UNSUPPORTED, "mask")
    many = _refusal(p.EditInput(images=[0, 1]), files, EditSupport(True, True, 1))
    assert many.code == p.UNSUPPORTED and "at most 1 image" in str(many)


def test_the_size_an_image_gives() -> None:
    assert fitted_size((100, 70), 16) == (96, 64)
    assert fitted_size((10, 10), 16) == (16, 16)
    assert fitted_size((4000, 3000), 16, max_side=2048) == (2048, 1536)


def test_previews_are_evenly_spread_distinct_and_never_the_last_step() -> None:
    assert preview_steps(28, 2) == [8, 18]
    assert preview_steps(4, 2) == [0, 2]
    assert preview_steps(4, 3) == [0, 1, 2]
    assert preview_steps(2, 3) == [0]  # fewer steps than previews: fewer previews
    assert preview_steps(1, 1) == []


def test_output_compression_sets_jpeg_and_webp_quality() -> None:
    noise = Image.effect_noise((64, 64), 60).convert("RGB")
    for fmt in ("jpeg", "webp"):
        default, high, low = (encode_image(noise, fmt, c) for c in (None, 90, 10))
        assert len(low) < len(high) <= len(default)
        assert Image.open(io.BytesIO(low)).format == fmt.upper()
    assert Image.open(io.BytesIO(encode_image(noise, "png"))).format == "PNG"


def test_a_generation_without_images_is_refused_only_by_an_edit_only_model() -> None:
    from dpserve.worker.edit import check_generation

    check_generation(None)
    check_generation(EditSupport(True, True, 1))
    with pytest.raises(p.RequestError, match="only edits images") as refused:
        check_generation(EditSupport(True, False, 1, needs_image=True))
    assert refused.value.code == p.UNSUPPORTED
