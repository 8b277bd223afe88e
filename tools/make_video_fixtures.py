#!/usr/bin/env python3
"""Write the video fixtures under ``media/tests/fixtures/video/`` and their reference answers.

Clips are made by the ``ffmpeg`` CLI from the ``testsrc`` pattern at 64x48 pixels:

* ``cfr24.mp4``, ``cfr25.mp4``, ``cfr30.mp4``, ``cfr60.mp4``: constant frame rate H.264
  (libx264, B-frames on, so decode order differs from presentation order);
* ``vfr.mp4``: variable frame rate, 30 frames 1/30 s apart then 30 frames 1/10 s apart
  (``setpts`` with a piecewise expression, ``-fps_mode passthrough``);
* ``faststart.mp4``: 2 s at 30 fps with the index before the data (``+faststart``),
  so a truncated copy still declares its frame count;
* live containers of one 2 s, 30 fps clip: ``live.ts`` (MPEG-TS), ``live_frag.mp4``
  (fragmented MP4, ``empty_moov``), ``live.webm`` (VP8 in WebM written as a live stream,
  as a browser's MediaRecorder sends it), ``live.h264`` (raw H.264 Annex B, no B-frames);
* ``frame.png`` and ``frame.jpg``: single frames for the image path;
* ``bframes.mp4`` and ``vfr_bframes.mp4``: 120 frames of ``testsrc2`` at 160x96 with
  ``-bf 3 -b_strategy 0 -b-pyramid normal`` (so some B-frames are references), at 30 fps
  and at a variable rate (40 frames at 30 fps, 40 at 10, 40 at 15), for the test that
  skipping untaken non-reference frames changes no taken frame (``video_skip.rs``; no
  reference answers, the test compares the decoder with and without the skip).

``reference.json`` holds, per clip, what transformers 5.23's ``Kimi_K25VideoProcessor``
selects when it decodes the file with PyAV, exactly as ``transformers.video_utils.
read_video_pyav`` does (``total_num_frames = stream.frames``, ``fps = stream.average_rate``):
``sample_frames(metadata, fps=F)`` indices and ``metadata.timestamps`` for several ``F``,
plus the Moonshot reference sampler's indices (``sample_fps = min(F, src_fps)``,
``n = max(round(N * sample_fps / src_fps), 1)``, ``linspace(0, N-1, n).round()``) and each
frame's presentation time from PyAV (``frame.time``).

Pixel references (``cfr25_rgb.bin``, ``cfr25_resized.bin``): the RGB24 of the frames that
transformers selects at 2 fps from ``cfr25.mp4`` as PyAV gives them (``to_ndarray("rgb24")``)
and the same frames resized with Pillow bicubic to the size the K2.5 resize rule gives
under a 6-patch limit (so that a 64x48 frame is actually resized).

Usage: ``/work/tfenv/bin/python tools/make_video_fixtures.py`` from the repository root.
The tests only read the committed outputs; they never run Python.
"""

import json
import math
import subprocess
from pathlib import Path

import av
import numpy as np
from PIL import Image
from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor
from transformers.video_utils import VideoMetadata

OUT = Path(__file__).resolve().parent.parent / "media" / "tests" / "fixtures" / "video"
SIZE = "64x48"
FPS_CHOICES = [0.5, 1.0, 2.0, 3.0, 5.0]
# Patch limit for the resize reference: 64x48 has (64//14)*(48//14) = 12 patches.
RESIZE_PATCH_LIMIT = 6


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def testsrc(rate: int, duration: float) -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc=duration={duration}:size={SIZE}:rate={rate}"]


X264 = ["-c:v", "libx264", "-preset", "medium", "-pix_fmt", "yuv420p"]


def make_clips() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for rate, duration in [(24, 3), (25, 3), (30, 2), (60, 2)]:
        ffmpeg(*testsrc(rate, duration), *X264, str(OUT / f"cfr{rate}.mp4"))
    ffmpeg(
        *testsrc(30, 2),
        "-vf",
        "setpts='if(lt(N,30),N/30,1+(N-30)/10)/TB'",
        "-fps_mode",
        "passthrough",
        *X264,
        str(OUT / "vfr.mp4"),
    )
    # The index (moov) first, as web servers prefer: a cut file keeps its frame count.
    ffmpeg(*testsrc(30, 2), *X264, "-movflags", "+faststart", str(OUT / "faststart.mp4"))
    ffmpeg(*testsrc(30, 2), *X264, "-f", "mpegts", str(OUT / "live.ts"))
    ffmpeg(
        *testsrc(30, 2),
        *X264,
        "-movflags",
        "frag_keyframe+empty_moov+default_base_moof",
        "-g",
        "15",
        str(OUT / "live_frag.mp4"),
    )
    ffmpeg(
        *testsrc(30, 2),
        "-c:v",
        "libvpx",
        "-b:v",
        "200k",
        "-g",
        "30",
        "-f",
        "webm",
        "-live",
        "1",
        str(OUT / "live.webm"),
    )
    ffmpeg(*testsrc(30, 2), *X264, "-bf", "0", "-g", "30", "-f", "h264", str(OUT / "live.h264"))
    ffmpeg(*testsrc(1, 1), "-frames:v", "1", str(OUT / "frame.png"))
    ffmpeg(*testsrc(1, 1), "-frames:v", "1", "-q:v", "3", str(OUT / "frame.jpg"))
    pyramid = [*X264, "-bf", "3", "-b_strategy", "0", "-b-pyramid", "normal", "-g", "60"]
    src2 = ["-f", "lavfi", "-i", "testsrc2=duration=4:size=160x96:rate=30"]
    ffmpeg(*src2, *pyramid, str(OUT / "bframes.mp4"))
    ffmpeg(
        *src2,
        "-vf",
        "setpts='if(lt(N,40),N/30,if(lt(N,80),4/3+(N-40)/10,16/3+(N-80)/15))/TB'",
        "-fps_mode",
        "passthrough",
        *pyramid,
        str(OUT / "vfr_bframes.mp4"),
    )


def moonshot_indices(total: int, src_fps: float, fps: float) -> list[int]:
    sample_fps = min(fps, src_fps)
    n = max(round(total * sample_fps / src_fps), 1)
    return [int(i) for i in np.linspace(0, total - 1, n).round()]


def describe(path: Path, processor: Kimi_K25VideoProcessor) -> dict:
    container = av.open(str(path))
    stream = container.streams.video[0]
    total = int(stream.frames)
    src_fps = float(stream.average_rate)
    frame_times = [float(f.time) for f in container.decode(video=0)]
    container.close()
    entry = {
        "total_num_frames": total,
        "decoded_frames": len(frame_times),
        "fps": src_fps,
        "frame_times": frame_times,
        "transformers": {},
        "moonshot": {},
    }
    for fps in FPS_CHOICES:
        metadata = VideoMetadata(
            total_num_frames=total,
            fps=src_fps,
            duration=total / src_fps,
            video_backend="pyav",
            height=stream.height,
            width=stream.width,
        )
        try:
            indices = processor.sample_frames(metadata, fps=fps)
        except ValueError as e:
            # Fragmented MP4 carries no frame count (stream.frames == 0): transformers
            # refuses it. Recorded so the tests can say what caracal does instead.
            entry["transformers_error"] = str(e)
            entry["transformers"] = None
            break
        metadata.frames_indices = indices
        entry["transformers"][str(fps)] = {
            "indices": [int(i) for i in indices],
            "timestamps": [float(t) for t in metadata.timestamps],
        }
    for fps in FPS_CHOICES:
        if total > 0:
            entry["moonshot"][str(fps)] = moonshot_indices(total, src_fps, fps)
    return entry


def navit_size(width: int, height: int, limit: int) -> tuple[int, int]:
    patches = max(1, width // 14) * max(1, height // 14)
    scale = min(1.0, math.sqrt(limit / patches), 7168 / width, 7168 / height)
    return max(1, int(width * scale)), max(1, int(height * scale))


def pixel_references(reference: dict) -> None:
    indices = reference["clips"]["cfr25.mp4"]["transformers"]["2.0"]["indices"]
    container = av.open(str(OUT / "cfr25.mp4"))
    frames = [
        f.to_ndarray(format="rgb24")
        for i, f in enumerate(container.decode(video=0))
        if i in set(indices)
    ]
    container.close()
    rgb = np.stack(frames)
    (OUT / "cfr25_rgb.bin").write_bytes(rgb.tobytes())
    height, width = rgb.shape[1:3]
    rw, rh = navit_size(width, height, RESIZE_PATCH_LIMIT)
    resized = np.stack(
        [np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC)) for f in frames]
    )
    (OUT / "cfr25_resized.bin").write_bytes(resized.tobytes())
    reference["pixels"] = {
        "clip": "cfr25.mp4",
        "fps": 2.0,
        "indices": indices,
        "width": width,
        "height": height,
        "rgb": "cfr25_rgb.bin",
        "resize_patch_limit": RESIZE_PATCH_LIMIT,
        "resized_width": rw,
        "resized_height": rh,
        "resized": "cfr25_resized.bin",
    }


def main() -> None:
    make_clips()
    processor = Kimi_K25VideoProcessor()
    clips = ["cfr24.mp4", "cfr25.mp4", "cfr30.mp4", "cfr60.mp4", "vfr.mp4", "live_frag.mp4"]
    reference = {
        "generator": "tools/make_video_fixtures.py",
        "transformers": __import__("transformers").__version__,
        "pyav": av.__version__,
        "clips": {name: describe(OUT / name, processor) for name in clips},
    }
    pixel_references(reference)
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(list(OUT.iterdir()))} files, {total} bytes, to {OUT}")


if __name__ == "__main__":
    main()
