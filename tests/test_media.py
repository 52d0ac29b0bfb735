"""Image and video projections on real JPEG, PNG and H.264 MP4 files made here with Pillow and PyAV."""

from __future__ import annotations

import io
import pickle
import tempfile
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image as PILImage

from spiral_lightning.core.media import (
    DecodeError,
    FrameIndices,
    FrameNeighborhood,
    FrameSlice,
    FrameTimes,
    Image,
    Video,
    Where,
)
from spiral_lightning.media.decode import Skipped, decode_clip, decode_image, project
from spiral_lightning.reading.tensors import to_torch

#: Frame ``i`` of a test video is solid gray ``LEVEL * i``, so its mean names its index.
LEVEL = 8
FRAMES = 30
FPS = 10


def gradient(width: int, height: int) -> np.ndarray[Any, Any]:
    """A smooth RGB pattern: red grows along x, green along y, blue constant."""
    x = np.linspace(0, 255, width, dtype=np.float64)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float64)[:, None].repeat(width, 1)
    return np.stack([x, y, np.full_like(x, 128)], axis=-1).astype(np.uint8)


def encode_image(pixels: np.ndarray[Any, Any], format: str, mode: str | None = None) -> bytes:
    image = PILImage.fromarray(pixels)
    if mode is not None:
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=format, **({"quality": 95} if format == "JPEG" else {}))
    return buffer.getvalue()


def encode_video(
    frames: int = FRAMES, b_frames: int = 0, size: tuple[int, int] = (64, 48), faststart: bool = False
) -> bytes:
    """An H.264 MP4 of ``frames`` solid gray frames at ``FPS``, a keyframe every 10 frames; with
    ``faststart`` the index (moov) comes before the frames instead of after them."""
    width, height = size
    with tempfile.TemporaryDirectory() as folder:
        # Moving the index to the front rewrites the file, which needs a real file to reopen.
        path = Path(folder) / "video.mp4"
        options = {"movflags": "faststart"} if faststart else {}
        with av.open(str(path), mode="w", format="mp4", options=options) as container:
            stream = container.add_stream("libx264", rate=FPS)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"bf": str(b_frames), "g": "10", "keyint_min": "10", "sc_threshold": "0", "crf": "10"}
            for index in range(frames):
                pixels = np.full((height, width, 3), LEVEL * index, np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            container.mux(stream.encode())
        return path.read_bytes()


def frame_numbers(clip: torch.Tensor, layout: str = "THWC") -> list[int]:
    """Which test frames a decoded clip holds, read from their gray levels."""
    return [round(float(frame.float().mean()) / LEVEL) for frame in clip]


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    return {"plain": encode_video(), "bframes": encode_video(b_frames=2)}


# ---- specs -----------------------------------------------------------------------------------


def test_specs_are_plain_values() -> None:
    image = Image("img", size=[224, 112], layout="CHW", dtype="float32", normalize="imagenet")  # type: ignore[arg-type]
    video = Video("clip", frames=FrameIndices([3, 1]), size=(32, 16), layout="TCHW")  # type: ignore[arg-type]
    assert image.size == (224, 112) and video.frames == FrameIndices((3, 1))
    # Sizes are (height, width), as in torchvision.
    assert image.shape == (3, 224, 112) and video.shape == (2, 3, 32, 16)
    assert Image("img", size=(64, 32)).shape == (64, 32, 3)
    assert Video("v", FrameSlice(0, 2), size=(48, 16)).shape == (2, 48, 16, 3)
    for spec in (image, video, FrameTimes([0, 1.5]), FrameNeighborhood(1, 3, 2), FrameSlice(0, 8, 2)):  # type: ignore[arg-type]
        assert pickle.loads(pickle.dumps(spec)) == spec
        assert hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    assert FrameTimes([0, 1]).seconds == (0.0, 1.0)  # type: ignore[arg-type]
    assert Video("v", FrameSlice(4)).length is None and Video("v", FrameSlice(0, 9, 4)).length == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Image("img", size=(0, 10)), "Image.size height must be a positive int"),
        (lambda: Image("img", size=(10, 0)), "Image.size width must be a positive int"),
        (lambda: Image("img", size=(10,)), r"Image.size must be \(height, width\)"),
        (lambda: Video("v", FrameSlice(0, 4), size=(4, 5, 6)), r"Video.size must be \(height, width\)"),
        (lambda: Image("img", layout="NHWC"), "Image.layout must be one of"),
        (lambda: Image("img", normalize="unit"), "needs dtype='float32'"),
        (lambda: Image("img", dtype="float16"), "Image.dtype must be one of"),
        (lambda: Image(""), "column name"),
        (lambda: Video("v", frames=(0, 4)), "Video.frames must be a FrameSlice"),
        (lambda: Video("v", FrameSlice(0, 4), layout="THWC3"), "Video.layout"),
        (lambda: FrameSlice(4, 4), r"stop \(4\) must be after start \(4\)"),
        (lambda: FrameSlice(0, 4, 0), "step must be a positive int"),
        (lambda: FrameSlice(-1, 4), "start must be a non-negative int"),
        (lambda: FrameIndices(()), "must be a non-empty list"),
        (lambda: FrameIndices((1, -2)), "a frame index must be a non-negative int"),
        (lambda: FrameTimes((0.5, -1.0)), "finite, non-negative number of seconds"),
        (lambda: FrameTimes((float("nan"),)), "finite, non-negative"),
        (lambda: FrameNeighborhood(1.0, 0), "count must be a positive int"),
    ],
)
def test_invalid_specs_raise(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# ---- images ----------------------------------------------------------------------------------


def test_png_decodes_exactly_in_each_layout_and_dtype() -> None:
    pixels = gradient(40, 30)
    data = encode_image(pixels, "PNG")
    hwc = decode_image(data, Image("img"))
    assert hwc.dtype == torch.uint8 and hwc.shape == (30, 40, 3)
    assert torch.equal(hwc, torch.from_numpy(pixels))
    chw = decode_image(data, Image("img", layout="CHW", dtype="float32"))
    assert chw.dtype == torch.float32 and chw.shape == (3, 30, 40) and chw.is_contiguous()
    assert torch.equal(chw, torch.from_numpy(pixels).permute(2, 0, 1).float())
    unit = decode_image(data, Image("img", layout="CHW", dtype="float32", normalize="unit"))
    torch.testing.assert_close(unit, chw / 255)
    imagenet = decode_image(data, Image("img", dtype="float32", normalize="imagenet"))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(imagenet, (torch.from_numpy(pixels).float() / 255 - mean) / std)


def test_jpeg_matches_a_direct_pillow_decode() -> None:
    pixels = gradient(64, 48)
    data = encode_image(pixels, "JPEG")
    with PILImage.open(io.BytesIO(data)) as direct:
        expected = torch.from_numpy(np.array(direct.convert("RGB")))
    decoded = decode_image(data, Image("img"))
    assert torch.equal(decoded, expected)
    assert (decoded.int() - torch.from_numpy(pixels).int()).abs().float().mean() < 2


def test_grayscale_and_transparent_images_become_rgb() -> None:
    pixels = gradient(20, 10)
    for mode in ("L", "RGBA", "P"):
        decoded = decode_image(encode_image(pixels, "PNG", mode), Image("img"))
        assert decoded.shape == (10, 20, 3)
    gray = decode_image(encode_image(pixels, "PNG", "L"), Image("img"))
    assert torch.equal(gray[..., 0], gray[..., 1]) and torch.equal(gray[..., 1], gray[..., 2])


def test_jpeg_downscale_uses_draft_mode_and_stays_close_to_a_full_decode() -> None:
    data = encode_image(gradient(400, 240), "JPEG")
    decoded = decode_image(data, Image("img", size=(30, 100)))
    assert decoded.shape == (30, 100, 3)
    with PILImage.open(io.BytesIO(data)) as draft:
        draft.draft("RGB", (100, 30))
        assert draft.size == (100, 60)  # decoded at 1/4 scale, the smallest still at least 100 x 30
        drafted = np.array(draft.convert("RGB").resize((100, 30), PILImage.Resampling.BILINEAR))
    assert torch.equal(decoded, torch.from_numpy(drafted))
    with PILImage.open(io.BytesIO(data)) as full:
        reference = np.array(full.convert("RGB").resize((100, 30), PILImage.Resampling.BILINEAR))
    difference = np.abs(decoded.numpy().astype(int) - reference.astype(int))
    assert difference.mean() < 2 and difference.max() <= 12


def test_png_upscale_and_resize_to_height_width() -> None:
    data = encode_image(gradient(16, 8), "PNG")
    decoded = decode_image(data, Image("img", size=(20, 50), layout="CHW"))
    assert decoded.shape == (3, 20, 50)
    with PILImage.open(io.BytesIO(data)) as direct:
        expected = np.array(direct.convert("RGB").resize((50, 20), PILImage.Resampling.BILINEAR))
    assert torch.equal(decoded, torch.from_numpy(expected).permute(2, 0, 1))


def test_image_size_is_height_then_width() -> None:
    # (64, 32) is 64 rows of 32 pixels, as in torchvision; red still grows along x, green along y.
    decoded = decode_image(encode_image(gradient(16, 8), "PNG"), Image("img", size=(64, 32), layout="CHW")).int()
    assert decoded.shape == (3, 64, 32)
    assert decoded[0, 0, -1] - decoded[0, 0, 0] > 200 and decoded[1, -1, 0] - decoded[1, 0, 0] > 200


@pytest.mark.parametrize(
    "data",
    [
        b"definitely not an image",
        encode_image(gradient(64, 48), "JPEG")[:300],
        encode_image(gradient(64, 48), "PNG")[:-40],
        b"",
    ],
    ids=["garbage", "truncated-jpeg", "truncated-png", "empty"],
)
def test_undecodable_images_raise_with_the_decoder_reason(data: bytes) -> None:
    with pytest.raises(DecodeError, match=r"not a readable image \(\w+"):
        decode_image(data, Image("img"))


# ---- video -----------------------------------------------------------------------------------


def test_the_b_frame_video_really_reorders_frames(videos: dict[str, bytes]) -> None:
    with av.open(io.BytesIO(videos["bframes"])) as container:
        pts = [packet.pts for packet in container.demux(video=0) if packet.size]
    assert len(pts) == FRAMES and pts != sorted(pts)


@pytest.mark.parametrize("name", ["plain", "bframes"])
@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (FrameSlice(0, 4), [0, 1, 2, 3]),
        (FrameSlice(12, 19, 3), [12, 15, 18]),
        (FrameSlice(9, 12), [9, 10, 11]),
        (FrameSlice(27), [27, 28, 29]),
        (FrameIndices((29, 0, 15, 15, 11)), [29, 0, 15, 15, 11]),
        (FrameTimes((0.0, 0.3, 1.05, 2.95)), [0, 3, 10, 29]),
        (FrameNeighborhood(1.5, 5), [13, 14, 15, 16, 17]),
        (FrameNeighborhood(1.5, 4, 3), [9, 12, 15, 18]),
        (FrameNeighborhood(0.1, 5, 2), [0, 2, 4, 6, 8]),
        (FrameNeighborhood(2.9, 3, 2), [25, 27, 29]),
    ],
)
def test_frame_selections_pick_the_right_frames(
    videos: dict[str, bytes], name: str, frames: Any, expected: list[int]
) -> None:
    clip = decode_clip(videos[name], Video("clip", frames=frames))
    assert clip.dtype == torch.uint8 and clip.shape == (len(expected), 48, 64, 3)
    assert frame_numbers(clip) == expected


@pytest.mark.parametrize("name", ["plain", "bframes"])
def test_a_clip_equals_a_direct_pyav_decode(videos: dict[str, bytes], name: str) -> None:
    with av.open(io.BytesIO(videos[name])) as container:
        direct = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    clip = decode_clip(videos[name], Video("clip", frames=FrameSlice(8, 23, 2)))
    assert torch.equal(clip, torch.from_numpy(np.stack(direct[8:23:2])))


def test_clip_layout_size_and_normalize(videos: dict[str, bytes]) -> None:
    spec = Video("clip", frames=FrameIndices((5, 6)), size=(16, 32), layout="TCHW", dtype="float32", normalize="unit")
    clip = decode_clip(videos["bframes"], spec)
    assert clip.dtype == torch.float32 and clip.shape == (2, 3, 16, 32) == spec.shape and clip.is_contiguous()
    uint8 = decode_clip(videos["bframes"], Video("clip", frames=FrameIndices((5, 6)), size=(16, 32)))
    torch.testing.assert_close(clip, uint8.permute(0, 3, 1, 2).float() / 255)
    assert frame_numbers(uint8) == [5, 6]


def test_clip_size_is_height_then_width(videos: dict[str, bytes]) -> None:
    # The frames are 64 wide and 48 high; a non-square size tells the two orders apart.
    spec = Video("clip", frames=FrameSlice(0, 2), size=(64, 32), layout="TCHW")
    assert decode_clip(videos["plain"], spec).shape == (2, 3, 64, 32) == spec.shape


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (FrameSlice(0, 31), "reaches past the end: the video has 30 frames"),
        (FrameSlice(30), "reaches past the end: the video has 30 frames"),
        (FrameIndices((3, 30, 99)), r"frames \[30, 99\] are past the end: the video has 30 frames"),
        (FrameTimes((1.0, 3.0)), r"time 3.0s is past the end of the video \(3.0s long\)"),
        (FrameNeighborhood(1.0, 16, 2), "spans 31 frames but the video has 30"),
    ],
)
def test_selections_past_the_end_raise(videos: dict[str, bytes], frames: Any, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode_clip(videos["bframes"], Video("clip", frames=frames))


def test_corrupt_and_truncated_videos_raise(videos: dict[str, bytes]) -> None:
    spec = Video("clip", frames=FrameSlice(0, 2))
    for data in (b"not a video at all" * 10, videos["plain"][: len(videos["plain"]) // 2]):
        with pytest.raises(DecodeError, match="not a readable video"):
            decode_clip(data, spec)
    # With the index at the front, a cut file still opens, and the index tells what is missing.
    faststart = encode_video(faststart=True)
    assert frame_numbers(decode_clip(faststart, spec)) == [0, 1]
    for cut in (len(faststart) // 2, len(faststart) - 100):
        with pytest.raises(DecodeError, match="the video is truncated: its container lists 30 frames, the data holds"):
            decode_clip(faststart[:cut], spec)
    with pytest.raises(DecodeError, match="no video stream"):
        decode_clip(audio_only(), spec)


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


# ---- project ---------------------------------------------------------------------------------


def image_batch(sizes: list[tuple[int, int]], bad: frozenset[int] = frozenset()) -> dict[str, Any]:
    """A collated batch as ``to_torch`` makes it: ``id`` a tensor, ``name`` and ``img`` lists."""
    images = [b"broken" if row in bad else encode_image(gradient(*size), "PNG") for row, size in enumerate(sizes)]
    names = [f"row{row}" for row in range(len(sizes))]
    arrow = pa.record_batch({"id": pa.array(range(len(sizes)), pa.int64()), "name": names, "img": images})
    return to_torch(arrow)


def test_project_stacks_same_sized_images_and_keeps_other_columns() -> None:
    batch = image_batch([(20, 10)] * 3)
    assert isinstance(batch["img"], list) and isinstance(batch["img"][0], bytes)
    projected, skipped = project(batch, [Image("img", layout="CHW")], Where("spiral:/t"))
    assert skipped == ()
    assert isinstance(projected["img"], torch.Tensor) and projected["img"].shape == (3, 3, 10, 20)
    assert torch.equal(projected["img"][1], torch.from_numpy(gradient(20, 10)).permute(2, 0, 1))
    assert projected["id"] is batch["id"] and projected["name"] is batch["name"]


def test_project_gives_a_list_for_mixed_sizes_unless_resized() -> None:
    batch = image_batch([(20, 10), (12, 12), (20, 10)])
    mixed = project(batch, [Image("img")], Where("spiral:/t")).batch["img"]
    assert isinstance(mixed, list) and [tuple(t.shape) for t in mixed] == [(10, 20, 3), (12, 12, 3), (10, 20, 3)]
    resized = project(batch, [Image("img", size=(6, 8))], Where("spiral:/t")).batch["img"]
    assert isinstance(resized, torch.Tensor) and resized.shape == (3, 6, 8, 3)


@pytest.mark.parametrize(
    "spec",
    [
        Image("img", size=(16, 24)),
        Image("img", size=(16, 24), layout="CHW", dtype="float32", normalize="unit"),
        Image("img", size=(16, 24), dtype="float32", normalize="imagenet"),
        Image("img", layout="CHW", dtype="float32"),
    ],
    ids=["uint8-HWC", "unit-CHW", "imagenet-HWC", "float-CHW-own-size"],
)
def test_project_converts_a_batch_exactly_as_each_row_alone(spec: Image) -> None:
    # project converts a batch's pixels in one pass; the values must be those of row-by-row decodes.
    generator = np.random.default_rng(3)
    images = [encode_image(generator.integers(0, 256, (30, 40, 3), dtype=np.uint8), "PNG") for _ in range(4)]
    projected = project({"img": images}, [spec], Where("spiral:/t")).batch["img"]
    assert torch.equal(projected, torch.stack([decode_image(data, spec) for data in images]))


@pytest.mark.parametrize(("source", "target"), [((61, 97), (20, 32)), ((30, 40), (64, 64)), ((250, 256), (64, 64))])
def test_resize_stays_within_one_level_of_pillow_bilinear(source: tuple[int, int], target: tuple[int, int]) -> None:
    # Sizes here are (height, width); Pillow's resize takes (width, height).
    noise = np.random.default_rng(4).integers(0, 256, (*source, 3), dtype=np.uint8)
    decoded = decode_image(encode_image(noise, "PNG"), Image("img", size=target)).numpy().astype(int)
    reference = np.array(PILImage.fromarray(noise).resize(target[::-1], PILImage.Resampling.BILINEAR)).astype(int)
    assert decoded.shape == (*target, 3)
    assert np.abs(decoded - reference).max() <= 1


def test_project_takes_an_arrow_binary_column() -> None:
    data = [encode_image(gradient(6, 4), "PNG")] * 2
    projected = project({"img": pa.array(data, pa.binary())}, [Image("img")], Where("spiral:/t")).batch
    assert projected["img"].shape == (2, 4, 6, 3)


def test_project_names_table_column_row_and_reason() -> None:
    batch = image_batch([(8, 8)] * 4, bad=frozenset({2}))
    with pytest.raises(DecodeError) as raised:
        project(batch, [Image("img")], Where("spiral:/data/t?resource_id=r&version_id=v", first_row=100))
    message = str(raised.value)
    assert "column 'img' of spiral:/data/t?resource_id=r&version_id=v, row 102 (position 2 of its batch)" in message
    assert "not a readable image (UnidentifiedImageError" in message and "on_error='skip'" in message


def test_project_skip_drops_bad_rows_from_every_column_and_reports_them(videos: dict[str, bytes]) -> None:
    batch = image_batch([(8, 8)] * 5, bad=frozenset({1}))
    batch["clip"] = [videos["plain"], videos["bframes"], videos["plain"], b"junk", videos["bframes"]]
    media = [Image("img"), Video("clip", frames=FrameSlice(2, 6, 2))]
    projected, skipped = project(batch, media, Where("spiral:/t"), on_error="skip")
    assert [row.position for row in skipped] == [1, 3]
    assert skipped[0] == Skipped(1, "img", skipped[0].reason) and "not a readable image" in skipped[0].reason
    assert skipped[1].column == "clip" and "not a readable video" in skipped[1].reason
    assert projected["id"].tolist() == [0, 2, 4] and projected["name"] == ["row0", "row2", "row4"]
    assert projected["img"].shape == (3, 8, 8, 3)
    assert projected["clip"].shape == (3, 2, 48, 64, 3)
    assert [frame_numbers(clip) for clip in projected["clip"]] == [[2, 4]] * 3
    again = project(batch, media, Where("spiral:/t"), on_error="skip")
    assert again.skipped == skipped and torch.equal(again.batch["clip"], projected["clip"])


def test_project_skip_of_every_row_keeps_the_declared_shape() -> None:
    batch = image_batch([(8, 8)] * 2, bad=frozenset({0, 1}))
    projected, skipped = project(batch, [Image("img", size=(2, 4), layout="CHW")], Where("t"), on_error="skip")
    assert len(skipped) == 2 and projected["img"].shape == (0, 3, 2, 4) and projected["id"].shape == (0,)
    unsized = project(batch, [Image("img")], Where("t"), on_error="skip").batch
    assert unsized["img"] == []


def test_project_stacks_clips_of_equal_length_only(videos: dict[str, bytes]) -> None:
    short = encode_video(frames=12)
    batch = {"clip": [videos["plain"], videos["bframes"], short]}
    stacked = project(batch, [Video("clip", frames=FrameSlice(0, 12, 3), layout="TCHW")], Where("t")).batch["clip"]
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (3, 4, 3, 48, 64)
    to_end = project(batch, [Video("clip", frames=FrameSlice(8))], Where("t")).batch["clip"]
    assert isinstance(to_end, list) and [len(clip) for clip in to_end] == [22, 22, 4]


def test_project_rejects_bad_inputs() -> None:
    batch = image_batch([(8, 8)] * 2)
    with pytest.raises(ValueError, match="media column 'photo' is not in the batch"):
        project(batch, [Image("photo")], Where("t"))
    with pytest.raises(TypeError, match="media column 'id' must hold encoded bytes per row"):
        project(batch, [Image("id")], Where("t"))
    with pytest.raises(ValueError, match="projected more than once"):
        project(batch, [Image("img"), Image("img", size=(2, 2))], Where("t"))
    with pytest.raises(ValueError, match="on_error must be one of"):
        project(batch, [Image("img")], Where("t"), on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match=r"row 1 .*the value is null"):
        project({"img": [batch["img"][0], None]}, [Image("img")], Where("t"))
