#!/usr/bin/env python3
"""Makes media/tests/fixtures/: real images and video frames rendered with the ffmpeg CLI,
run through Hugging Face transformers' Kimi K2.5 image and video processors, with their
outputs written as raw little-endian f32 so that the Rust tests need no Python.

Run with the fixture virtualenv (transformers 5.23, torch, torchvision, Pillow):

    /work/tfenv/bin/python tools/make_media_fixtures.py

Reference implementations: transformers/models/kimi_k25/image_processing_kimi_k25.py
(`Kimi_K25ImageProcessor`, a TorchvisionBackend: uint8 antialiased bicubic resize,
zero pad to multiples of 28, fused rescale+normalise) and video_processing_kimi_k25.py
(`Kimi_K25VideoProcessor`: chunks of `temporal_patch_size` frames, the same per-frame
resize with `max_patches` = 4096 by default, patches frame-major). The chunk prompt's
timestamp follows processing_kimi_k25.py (`replace_video_token`).

Layout written:
    manifest.json            every case: source files, kwargs, expected shapes and counts
    images/*.png|jpg         the encoded images (inputs)
    video/<clip>/frame_*.png decoded RGB frames of clips encoded with libx264 (inputs)
    video/<clip>/clip.mp4    the encoded clip the frames came from (provenance)
    out/<case>.f32           pixel_values, little-endian f32, C order
    out/<case>.rgb           JPEG cases: the image as Pillow decoded it (RGB8, row-major),
                             to check the decoder separately from the processor
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import PIL
import torch
import torchvision
import transformers
from PIL import Image
from transformers.models.kimi_k25.image_processing_kimi_k25 import (
    Kimi_K25ImageProcessor,
    navit_resize,
)
from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "media", "tests", "fixtures")


def ffmpeg(*args):
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def render_image(name, source, size, codec_args, crop=None):
    """One frame of an ffmpeg lavfi source, written as PNG or JPEG; `crop` ("W:H") cuts the
    top-left corner (testsrc2 rounds odd sizes to even ones)."""
    path = os.path.join(ROOT, "images", name)
    filters = ["-vf", f"format=rgb24,crop={crop}:0:0"] if crop else []
    ffmpeg("-f", "lavfi", "-i", f"{source}=size={size}:rate=1", "-frames:v", "1", *filters, *codec_args, path)
    return path


def write_f32(name, tensor):
    array = tensor.detach().cpu().numpy().astype("<f4", copy=False)
    path = os.path.join(ROOT, "out", name + ".f32")
    array.tofile(path)
    return os.path.relpath(path, ROOT)


def write_rgb(name, image):
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    path = os.path.join(ROOT, "out", name + ".rgb")
    array.tofile(path)
    return os.path.relpath(path, ROOT)


def resize_plan(height, width, kwargs, default_max_patches):
    side = kwargs.get("size", {"max_height": 512})["max_height"]
    (rh, rw), (ph, pw) = navit_resize(
        height,
        width,
        patch_size=kwargs.get("patch_size", 14),
        merge_kernel_size=kwargs.get("merge_size", 2),
        max_patches=kwargs.get("max_patches", default_max_patches),
        max_size_per_side=side,
    )
    return [rw, rh], [pw, ph]


def image_case(name, path, kwargs):
    image = Image.open(path)
    processor = Kimi_K25ImageProcessor()
    out = processor(images=[image], return_tensors="pt", **kwargs)
    pixel_values = out["pixel_values"]
    grid = [int(v) for v in out["image_grid_thw"][0]]
    merge = kwargs.get("merge_size", processor.merge_size)
    resized, padded = resize_plan(image.height, image.width, kwargs, processor.max_patches)
    case = {
        "name": name,
        "source": os.path.relpath(path, ROOT),
        "format": image.format,
        "width": image.width,
        "height": image.height,
        "kwargs": kwargs,
        "resized": resized,
        "padded": padded,
        "grid_thw": grid,
        "num_tokens": grid[0] * grid[1] * grid[2] // (merge * merge),
        "pixel_values_shape": list(pixel_values.shape),
        "pixel_values": write_f32(name, pixel_values),
    }
    if image.format == "JPEG":
        # JPEG decoders differ; PNG decoding is exact and is checked through the bytes.
        case["decoded_rgb"] = write_rgb(name, image)
    return case


def timestamp_text(timestamp):
    """The chunk timestamp exactly as processing_kimi_k25.py's replace_video_token writes it."""
    return time.strftime("%H:%M:%S", time.gmtime(timestamp)) + f".{int(timestamp % 1 * 1000):03d}"


def video_case(name, clip, size, fps, frame_indices, kwargs):
    """Encodes a testsrc2 clip with libx264, decodes chosen frames to PNG with ffmpeg, and
    runs the video processor on those frames with sampling disabled."""
    folder = os.path.join(ROOT, "video", clip)
    os.makedirs(folder, exist_ok=True)
    mp4 = os.path.join(folder, "clip.mp4")
    total = max(frame_indices) + 1
    ffmpeg(
        "-f", "lavfi", "-i", f"testsrc2=size={size}:rate={fps}", "-frames:v", str(total),
        "-c:v", "libx264", "-preset", "veryfast", "-crf", "23", "-pix_fmt", "yuv420p", mp4,
    )
    select = "+".join(f"eq(n\\,{i})" for i in frame_indices)
    ffmpeg("-i", mp4, "-vf", f"select='{select}'", "-vsync", "0", "-pix_fmt", "rgb24",
           os.path.join(folder, "frame_%02d.png"))
    frame_files = sorted(f for f in os.listdir(folder) if f.startswith("frame_"))
    assert len(frame_files) == len(frame_indices), frame_files
    frames = np.stack([np.asarray(Image.open(os.path.join(folder, f)).convert("RGB")) for f in frame_files])
    timestamps = [i / fps for i in frame_indices]

    processor = Kimi_K25VideoProcessor()
    out = processor(videos=[frames], do_sample_frames=False, return_tensors="pt", **kwargs)
    temporal = kwargs.get("temporal_patch_size", processor.temporal_patch_size)
    merge = kwargs.get("merge_size", processor.merge_size)
    grids = [[int(v) for v in row] for row in out["video_grid_thw"]]
    chunks = []
    for c, grid in enumerate(grids):
        first = timestamps[c * temporal]
        chunks.append({
            "grid_thw": grid,
            "num_tokens": grid[1] * grid[2] // (merge * merge),
            "timestamp": first,
            "timestamp_text": timestamp_text(first),
        })
    assert int(out["num_chunks_per_video"][0]) == len(chunks)
    resized, padded = resize_plan(frames.shape[1], frames.shape[2], kwargs, processor.max_patches)
    pixel_values = out["pixel_values_videos"]
    return {
        "name": name,
        "frames": [os.path.relpath(os.path.join(folder, f), ROOT) for f in frame_files],
        "width": int(frames.shape[2]),
        "height": int(frames.shape[1]),
        "fps": fps,
        "frame_indices": frame_indices,
        "timestamps": timestamps,
        "kwargs": kwargs,
        "resized": resized,
        "padded": padded,
        "chunks": chunks,
        "pixel_values_shape": list(pixel_values.shape),
        "pixel_values": write_f32(name, pixel_values),
    }


def main():
    for sub in ("images", "video", "out"):
        shutil.rmtree(os.path.join(ROOT, sub), ignore_errors=True)
        os.makedirs(os.path.join(ROOT, sub))
    png = ["-pix_fmt", "rgb24"]
    jpeg420 = ["-c:v", "mjpeg", "-q:v", "3", "-pix_fmt", "yuvj420p"]
    jpeg444 = ["-c:v", "mjpeg", "-q:v", "2", "-pix_fmt", "yuvj444p"]

    testsrc = render_image("testsrc2_320x240.png", "testsrc2", "320x240", png)
    bars = render_image("smptebars_160x120.jpg", "smptebars", "160x120", jpeg420)
    mandel = render_image("mandelbrot_37x301.png", "mandelbrot", "37x301", png)
    odd = render_image("testsrc2_97x61.jpg", "testsrc2", "98x62", jpeg444, crop="97:61")
    wide = render_image("smptebars_250x90.png", "smptebars", "250x90", png)
    odd420 = render_image("mandelbrot_75x45.jpg", "mandelbrot", "75x45", jpeg420)

    images = [
        # Downscaled by a small patch budget: 22x17 = 374 patches > 64.
        image_case("testsrc2_320x240_max64", testsrc, {"max_patches": 64}),
        # The default budget (16384): moderate size, no resize, padded to 168x140.
        image_case("smptebars_160x120_default", bars, {}),
        # Odd aspect ratio, no resize: padded to 56x308.
        image_case("mandelbrot_37x301_default", mandel, {}),
        # Odd aspect ratio downscaled in both directions (scale < 2 on each side).
        image_case("mandelbrot_37x301_max16", mandel, {"max_patches": 16}),
        # Neither side a multiple of 28; a 4:4:4 JPEG.
        image_case("testsrc2_97x61_default", odd, {}),
        # The per-side cap (`size`: 8 patches per side = 112 px) decides the scale.
        image_case("smptebars_250x90_side8", wide, {"max_patches": 4096, "size": {"max_height": 8, "max_width": 8}}),
        # A 4:2:0 JPEG with odd sides, downscaled.
        image_case("mandelbrot_75x45_max8", odd420, {"max_patches": 8}),
    ]
    videos = [
        # Seven frames of a 30 fps clip (as a 2 fps sampler might pick them): chunks of 4 and 3,
        # each frame downscaled by a small per-frame budget.
        video_case("clip160_max16", "testsrc2_160x120", "160x120", 30, [0, 13, 26, 39, 52, 65, 78],
                   {"max_patches": 16}),
        # Five frames at the default per-frame budget (4096): no resize, chunks of 4 and 1.
        video_case("clip64_default", "testsrc2_64x48", "64x48", 25, [0, 12, 25, 37, 50], {}),
    ]
    timestamps = [0.0, 0.0005, 0.9999, 1.7333333333333334, 2.6, 59.999, 61.0, 3599.9996, 3600.0,
                  86399.9999, 86400.0, 90061.25, 1000000.123]
    manifest = {
        "generator": "tools/make_media_fixtures.py",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "pillow": PIL.__version__,
            "numpy": np.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "ffmpeg": subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True).stdout.split("\n")[0],
        },
        "images": images,
        "videos": videos,
        "timestamps": [{"seconds": t, "text": timestamp_text(t)} for t in timestamps],
    }
    with open(os.path.join(ROOT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    total = 0
    for dirpath, _, files in os.walk(ROOT):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    print(f"wrote {len(images)} image cases, {len(videos)} video cases, {total / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
