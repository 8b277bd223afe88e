#!/work/tfenv/bin/python
"""Vision tower + projector throughput, Caracal vs transformers, side by side in one run.

The tower has the width of a real one at reduced depth: Kimi K2.5's published MoonViT3d
(hidden 1152, 16 heads of 72, MLP 4304, patch 14, 64x64 learnable position grid, 4 frames,
2x2 `sd2_tpool` merge, `patchmerger` projector 4608 -> 4608 -> text hidden) with `--depth`
blocks (default 4; the real tower has 27) and the tiny text model of
tests/fixtures/tiny-deepseek-v3 (hidden 64; the projector's last matrix is 4608 x 64 instead of
4608 x 7168). K2.5's shape rather than K3's: transformers' MoonViT3d ties the q/k/v width to
the hidden size, so K3's qkv 1536 != hidden 1024 cannot be built there, and a K3 width with
qkv = 3 x hidden is no published tower at all; K2.5's is both real and exactly expressible.

What it does, in one run:

  * builds the checkpoint once (random weights drawn like tools/make_vision_fixtures.py, f32
    for both engines), cached under bench/.work/vision/ in two spellings of the same tensors:
    transformers' `save_pretrained` layout and the published Kimi-K2.5 layout Caracal loads;
  * makes `--images` real images with the ffmpeg CLI (testsrc2 and mandelbrot, 448x448 and
    644x364: 1024 and 1196 patches, multiples of the 28-pixel merge cell, so neither
    processor resizes);
  * Caracal: `examples/vision_bench.rs` (release build), which loads the checkpoint with
    `caracal::models::load`, preprocesses with `caracal_media`, and times
    `vision().encode` with one image per call and all images packed into one call;
  * transformers 5.23 in float32 (`sdpa` attention, which runs each item's attention
    separately): `Kimi_K25ImageProcessor` pixel_values, then `model.get_image_features`
    (tower + projector) with one image per call and all images packed;
  * both on the same `--threads` (`torch.set_num_threads` / a rayon pool of that size,
    `RAYON_NUM_THREADS` set too), warm-up then `--reps` repetitions, each repetition timing
    one-at-a-time then packed; reports the median and the best as images/s;
  * checks that both engines produce the same embeddings: per image, max |a - b| of the
    packed rows against transformers' rows, which must stay within
    TOLERANCE x max |transformers| (f32 on both sides; only the summation order differs), and
    that Caracal's patches equal the processor's pixel_values.

Prints a table with the ratios Caracal / transformers and packed / one-at-a-time, the CPU
pressure at start and end, and writes bench/.work/vision/results.json; `--json` prints that
JSON on stdout instead of the table.

Usage: bench/vision.py [--depth 4] [--images 4] [--threads 2] [--warmup 1] [--reps 3] [--json]
(needs /work/tfenv or any Python with torch + transformers 5.23, and cargo for the example)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "vision"
# Max |Caracal - transformers| over max |transformers|, per image.
TOLERANCE = 1e-3
SEED = 7
# Kimi K2.5's published tower (config.json `vision_config` of moonshotai/Kimi-K2.5).
K25_TOWER = dict(
    patch_size=14,
    pos_emb_height=64,
    pos_emb_width=64,
    pos_emb_time=4,
    num_attention_heads=16,
    hidden_size=1152,
    intermediate_size=4304,
    hidden_act="gelu_pytorch_tanh",
    merge_kernel_size=[2, 2],
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
# (ffmpeg source, width, height), cycled for --images.
IMAGES = [("testsrc2", 448, 448), ("mandelbrot", 644, 364), ("testsrc2", 644, 364), ("mandelbrot", 448, 448)]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, env=None):
    log("$", " ".join(str(c) for c in cmd))
    p = subprocess.run([str(c) for c in cmd], env=dict(os.environ, **(env or {})), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.returncode != 0:
        log(p.stdout, p.stderr)
        raise SystemExit(f"command failed ({p.returncode}): {cmd[0]}")
    return p


def cpu_pressure():
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(re.search(r"avg10=([\d.]+)", line).group(1))
    except Exception:
        return None


def summary(seconds: list[float], n: int) -> dict:
    med, best = statistics.median(seconds), min(seconds)
    return {"seconds": seconds, "median_s": med, "best_s": best,
            "images_per_s": n / med, "images_per_s_best": n / best}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def make_images(n: int) -> list[Path]:
    folder = WORK / "images"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        src, w, h = IMAGES[i % len(IMAGES)]
        # Later cycles take a later frame of the same source, so no two images are equal.
        path = folder / f"{i}-{src}-{w}x{h}.png"
        if not path.exists():
            run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", f"{src}=size={w}x{h}:rate=10",
                 "-vf", f"select='eq(n,{3 * (i // len(IMAGES)) + 2})'", "-vsync", "0", "-frames:v", "1",
                 str(path)])
        paths.append(path)
    return paths


def build_checkpoint(depth: int) -> tuple[Path, Path]:
    """(transformers dir, published dir) of the K2.5-width tower with `depth` blocks."""
    base = WORK / f"k25-tower-d{depth}"
    tf_dir, pub_dir = base / "transformers", base / "published"
    stamp = base / "stamp.json"
    want = json.dumps({"tower": K25_TOWER, "depth": depth, "seed": SEED, "dtype": "float32"}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return tf_dir, pub_dir

    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf
    import make_vision_fixtures as mvf

    log(f"building the depth-{depth} tower checkpoint under {base} (once)")
    if base.exists():
        shutil.rmtree(base)
    vision = dict(K25_TOWER, num_hidden_layers=depth)
    config = Kimi_K25Config(
        architectures=["Kimi_K25ForConditionalGeneration"],
        text_config=mf.deepseek_v3_config().to_dict(),
        vision_config=vision,
        projection_hidden_size=vision["hidden_size"],
        projection_layer_norm_eps=1e-5,
        image_token_id=mvf.PLACEHOLDER_ID,
        video_token_id=mvf.VIDEO_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = Kimi_K25ForConditionalGeneration(config).float()
    mvf.redraw(model, SEED + 1)
    model.save_pretrained(tf_dir)
    hf_cfg = json.loads((tf_dir / "config.json").read_text())
    sd = {k: v.float().contiguous() for k, v in model.state_dict().items() if "time_position" not in k}
    published = {k: v.contiguous() for k, v in mvf.to_published_names(sd, vision["num_attention_heads"]).items()}
    pub_dir.mkdir(parents=True)
    save_file(published, pub_dir / "model.safetensors", metadata={"format": "pt"})
    (pub_dir / "config.json").write_text(json.dumps(mvf.published_config(hf_cfg), indent=2) + "\n")
    for d in [tf_dir, pub_dir]:
        for f in mf.TOKENIZER_FILES:
            shutil.copy(mvf.TEXT_FIXTURE / f, d / f)
    stamp.write_text(want)
    return tf_dir, pub_dir


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


def caracal_side(pub_dir: Path, images: list[Path], threads: int, warmup: int, reps: int) -> dict:
    run(["cargo", "build", "--release", "--example", "vision_bench"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "release" / "examples" / "vision_bench"
    dump = WORK / "caracal-dump"
    p = run([exe, "--model", pub_dir, "--threads", threads, "--warmup", warmup, "--reps", reps,
             "--dump", dump, *images], env={"RAYON_NUM_THREADS": str(threads)})
    out = json.loads(p.stdout)
    out["dump"] = str(dump)
    return out


def transformers_side(tf_dir: Path, images: list[Path], threads: int, warmup: int, reps: int):
    import torch
    import transformers
    from PIL import Image
    from transformers import Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = Kimi_K25ForConditionalGeneration.from_pretrained(tf_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    load_s = time.perf_counter() - t0
    proc = Kimi_K25ImageProcessor()
    t0 = time.perf_counter()
    items = []
    for path in images:
        out = proc(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        items.append((out["pixel_values"].float(), out["image_grid_thw"]))
    preprocess_s = time.perf_counter() - t0
    pv_all = torch.cat([pv for pv, _ in items])
    grid_all = torch.cat([g for _, g in items])

    def one_at_a_time():
        return [model.get_image_features(pv, g).pooler_output[0] for pv, g in items]

    def packed():
        return list(model.get_image_features(pv_all, grid_all).pooler_output)

    single_s, packed_s = [], []
    with torch.inference_mode():
        for _ in range(warmup):
            one_at_a_time()
            packed()
        for _ in range(reps):
            t = time.perf_counter()
            single_rows = one_at_a_time()
            single_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            packed_rows = packed()
            packed_s.append(time.perf_counter() - t)
    pack_diff = max(float((a - b).abs().max()) for a, b in zip(single_rows, packed_rows))
    n = len(items)
    report = {
        "engine": "transformers",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config.vision_config._attn_implementation,
        "load_s": load_s,
        "preprocess_s": preprocess_s,
        "warmup": warmup,
        "reps": reps,
        "single": summary(single_s, n),
        "packed": summary(packed_s, n),
        "packing_max_abs_diff": pack_diff,
    }
    return report, [pv for pv, _ in items], single_rows


def compare(car: dict, pixels, rows) -> list[dict]:
    import numpy as np

    dump = Path(car["dump"])
    out = []
    for i, (pv, ref) in enumerate(zip(pixels, rows)):
        cp = np.fromfile(dump / f"{i}.pixels.f32", dtype="<f4")
        ce = np.fromfile(dump / f"{i}.embeds.f32", dtype="<f4")
        ref = ref.float().numpy().reshape(-1)
        pv = pv.numpy().reshape(-1)
        if cp.shape != pv.shape or ce.shape != ref.shape:
            raise SystemExit(f"image {i}: shapes differ (pixels {cp.shape} vs {pv.shape}, "
                             f"embeddings {ce.shape} vs {ref.shape})")
        d = float(np.abs(ce - ref).max())
        scale = float(np.abs(ref).max())
        out.append({"image": i, "pixels_max_abs_diff": float(np.abs(cp - pv).max()),
                    "embeds_max_abs_diff": d, "embeds_max_abs": scale, "embeds_rel": d / scale,
                    "ok": d <= TOLERANCE * scale})
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def render(r: dict) -> str:
    c, t = r["caracal"], r["transformers"]
    lines = [
        f"Vision tower + projector, Kimi K2.5 width (hidden 1152, 16 heads, MLP 4304) at depth {r['depth']}, "
        f"f32, {r['threads']} threads; {c['images']} images ({c['patches']} patches, {c['tokens']} LM tokens), "
        f"{r['reps']} reps after {r['warmup']} warm-up (median, best)",
        "",
        f"{'mode':<16}{'Caracal img/s':>22}{'transformers img/s':>24}{'Caracal / tf':>16}",
    ]
    for mode, name in [("single", "one at a time"), ("packed", "packed")]:
        a, b = c[mode], t[mode]
        lines.append(f"{name:<16}{a['images_per_s']:>12.3f} ({a['images_per_s_best']:.3f})"
                     f"{b['images_per_s']:>14.3f} ({b['images_per_s_best']:.3f})"
                     f"{a['images_per_s'] / b['images_per_s']:>15.2f}x")
    lines += [
        "",
        f"packed / one at a time: Caracal {r['ratios']['caracal_packed_over_single']:.2f}x, "
        f"transformers {r['ratios']['transformers_packed_over_single']:.2f}x",
        f"preprocessing (all images): caracal_media {c['preprocess_s'] * 1e3:.1f} ms, "
        f"Kimi_K25ImageProcessor {t['preprocess_s'] * 1e3:.1f} ms",
        f"same embeddings: max |Caracal - transformers| per image "
        + ", ".join(f"{x['embeds_max_abs_diff']:.1e} ({x['embeds_rel']:.1e} rel)" for x in r["agreement"])
        + f" (tolerance {TOLERANCE:g} x max |ref|); pixels max |d| "
        + f"{max(x['pixels_max_abs_diff'] for x in r['agreement']):.1e}; packing changes rows by "
        + f"{c['packing_max_abs_diff']:.1e} (Caracal), {t['packing_max_abs_diff']:.1e} (transformers)",
        f"CPU pressure avg10: start {r['cpu_pressure_avg10_start']}%, end {r['cpu_pressure_avg10_end']}%"
        f" ({os.cpu_count()} CPUs)",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=4, help="tower blocks (the real tower has 27)")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    args = ap.parse_args()
    if args.images < 1 or args.reps < 1 or args.depth < 1:
        raise SystemExit("--images, --reps and --depth must be at least 1")

    tf_dir, pub_dir = build_checkpoint(args.depth)
    images = make_images(args.images)
    psi0 = cpu_pressure()
    if psi0 is not None and psi0 > 30:
        log(f"warning: CPU pressure avg10={psi0}% (busy machine); speed figures will be noisy")
    car = caracal_side(pub_dir, images, args.threads, args.warmup, args.reps)
    log(f"caracal done; CPU pressure avg10 {cpu_pressure()}%")
    tf, pixels, rows = transformers_side(tf_dir, images, args.threads, args.warmup, args.reps)
    agreement = compare(car, pixels, rows)
    results = {
        "depth": args.depth,
        "threads": args.threads,
        "warmup": args.warmup,
        "reps": args.reps,
        "tower": dict(K25_TOWER, num_hidden_layers=args.depth),
        "images": [p.name for p in images],
        "caracal": car,
        "transformers": tf,
        "ratios": {
            "single_caracal_over_transformers": car["single"]["images_per_s"] / tf["single"]["images_per_s"],
            "packed_caracal_over_transformers": car["packed"]["images_per_s"] / tf["packed"]["images_per_s"],
            "caracal_packed_over_single": car["packed"]["images_per_s"] / car["single"]["images_per_s"],
            "transformers_packed_over_single": tf["packed"]["images_per_s"] / tf["single"]["images_per_s"],
        },
        "agreement": agreement,
        "tolerance_rel": TOLERANCE,
        "cpu_pressure_avg10_start": psi0,
        "cpu_pressure_avg10_end": cpu_pressure(),
    }
    (WORK / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else render(results))
    if not all(x["ok"] for x in agreement):
        raise SystemExit("Caracal and transformers disagree beyond the tolerance")


if __name__ == "__main__":
    main()
