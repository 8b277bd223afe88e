#!/usr/bin/env python3
"""Regenerate ``tests/fixtures/tiny-kimi-k25/``: a tiny Kimi K2.5 vision-language model and
transformers' own references for Caracal's MoonViT3d tower, projector and media splicing.

What it writes (everything under ``tests/fixtures/tiny-kimi-k25/``):

* ``images/``: ``a.png`` (84x56 ``testsrc2``), ``b.png`` (70x98 ``smptebars``) and
  ``clip-{0,1,2}.png`` (three consecutive 70x42 ``testsrc`` frames), made with the ``ffmpeg`` CLI.
* ``published/``: the checkpoint in the published Kimi-K2.5 layout: ``config.json`` with the
  ``vt_*`` vision keys, ``media_placeholder_token_id`` and a ``kimi_k2`` ``text_config``; tensors
  ``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.encoder.blocks.N.
  {norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}``, ``mm_projector.{pre_norm,proj.0,proj.2}``.
* ``transformers/``: the same weights as transformers 5.x ``save_pretrained`` writes them
  (its own config spelling: nested ``vision_config`` / ``text_config``, ``image_token_id``).
* ``media.safetensors``: per item the processor's ``pixel_values`` (f32) and ``grid_thw`` (i64),
  and the tower + projector output (f32, ``[tokens, text hidden]``) of that item encoded alone.
* ``expected.json``: prompts with the placeholders expanded and, per case (one image, two
  images of different sizes, one 3-frame chunk), the last-position logits and 16 greedy ids with
  their top-1/top-2 margins, computed by transformers in float32 from the saved bf16 files.
* ``k3_tower.safetensors`` (with ``--k3-dir``): the output of a plain K3 tower reference written
  here from the spec (RMSNorm, no biases, ``qkv_hidden_size`` != hidden, bilinear pos-emb,
  ``patchmergerv2``) on the synthesized default Kimi K3 (``caracal synth --out DIR``) for the
  same three items.

The plain reference (``plain_tower``) is also run on the K2.5 weights in their published layout
and must agree with transformers (this checks the reading of the published layout: fused
``wqkv``, interleaved-pair 2D RoPE, ``F.interpolate`` position embeddings).

Usage::

    /work/tfenv/bin/python tools/make_vision_fixtures.py [--k3-dir /tmp/k3-synth]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))
import make_fixtures as mf  # noqa: E402  (tiny deepseek_v3 config, tokenizer constants)

from transformers import (  # noqa: E402
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    Kimi_K25ImageProcessor,
    Kimi_K25VideoProcessor,
)

OUT = REPO_ROOT / "tests" / "fixtures" / "tiny-kimi-k25"
TEXT_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "tiny-deepseek-v3"
# Placeholder id: an ordinary id of the tiny 512-token vocabulary (the real models use 163605,
# `<|media_pad|>`); its embedding row is overwritten, so which id does not change the outputs.
PLACEHOLDER_ID = 500
VIDEO_ID = 501
SEED = 7
VISION = dict(
    patch_size=14,
    pos_emb_height=10,
    pos_emb_width=10,
    pos_emb_time=4,
    num_attention_heads=2,
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    hidden_act="gelu_pytorch_tanh",
    merge_kernel_size=[2, 2],
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)


# --------------------------------------------------------------------------------------------
# Media
# --------------------------------------------------------------------------------------------


def ffmpeg(args: list[str]) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args], check=True)


def make_images(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ffmpeg(["-f", "lavfi", "-i", "testsrc2=size=84x56:rate=1", "-frames:v", "1", str(folder / "a.png")])
    ffmpeg(["-f", "lavfi", "-i", "smptebars=size=70x98:rate=1", "-frames:v", "1", str(folder / "b.png")])
    # Three consecutive frames of a moving test pattern (frames 5, 6, 7 of a 10 fps clip).
    ffmpeg(
        [
            "-f", "lavfi", "-i", "testsrc=size=70x42:rate=10", "-vf", "select='between(n,5,7)'",
            "-vsync", "0", "-frames:v", "3", "-start_number", "0", str(folder / "clip-%d.png"),
        ]
    )


def rgb(path: Path) -> Image.Image:
    return Image.open(path).convert("RGB")


def process_media(folder: Path) -> list[dict]:
    """The processor outputs of the three items, as transformers computes them."""
    ip = Kimi_K25ImageProcessor()
    vp = Kimi_K25VideoProcessor()
    items = []
    for name in ["a", "b"]:
        out = ip(images=[rgb(folder / f"{name}.png")], return_tensors="pt")
        items.append(dict(name=name, pixel_values=out["pixel_values"].float(), grid_thw=out["image_grid_thw"][0]))
    frames = np.stack([np.asarray(rgb(folder / f"clip-{i}.png")) for i in range(3)])
    out = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert out["video_grid_thw"].shape[0] == 1, out["video_grid_thw"]
    items.append(dict(name="clip", pixel_values=out["pixel_values_videos"].float(), grid_thw=out["video_grid_thw"][0]))
    return items


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def hf_config() -> Kimi_K25Config:
    text = mf.deepseek_v3_config().to_dict()
    return Kimi_K25Config(
        architectures=["Kimi_K25ForConditionalGeneration"],
        text_config=text,
        vision_config=dict(VISION),
        projection_hidden_size=VISION["hidden_size"],
        projection_layer_norm_eps=1e-5,
        image_token_id=PLACEHOLDER_ID,
        video_token_id=VIDEO_ID,
        tie_word_embeddings=False,
    )


def redraw(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(t, mean, std):
        return (torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean).to(t.dtype)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            vision = "vision_tower" in name or "mm_projector" in name
            if name.endswith("norm.weight") or (vision and "norm" in name and name.endswith("weight")):
                p.copy_(normal(p, 1.0, 0.1))
            elif name.endswith("bias") and vision:
                p.copy_(normal(p, 0.0, 0.1))
            elif name.endswith("position_embeddings"):
                p.copy_(normal(p, 0.0, 0.5))
            elif name.endswith("patch_embed.proj.weight"):
                p.copy_(normal(p, 0.0, 1.0 / math.sqrt(3 * 14 * 14)))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(normal(p, 0.0, 1.0))
            elif name.endswith("lm_head.weight"):
                p.copy_(normal(p, 0.0, 0.3))
            elif vision:
                fan_in = p.shape[-1]
                p.copy_(normal(p, 0.0, 1.2 / math.sqrt(fan_in)))
            else:
                p.copy_(normal(p, 0.0, 0.15))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b, 0.0, 0.5))


def published_config(hf: dict) -> dict:
    """The published Kimi-K2.5 `config.json` spelling of the same model."""
    v = hf["vision_config"]
    text = dict(hf["text_config"])
    text["model_type"] = "kimi_k2"
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "media_placeholder_token_id": PLACEHOLDER_ID,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "bos_token_id": mf.BOS_ID,
        "eos_token_id": mf.EOS_ID,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "patch_size": v["patch_size"],
            "init_pos_emb_height": v["pos_emb_height"],
            "init_pos_emb_width": v["pos_emb_width"],
            "init_pos_emb_time": v["pos_emb_time"],
            "pos_emb_type": "divided_fixed",
            "merge_kernel_size": v["merge_kernel_size"],
            "merge_type": "sd2_tpool",
            "video_attn_type": "spatial_temporal",
            "vt_hidden_size": v["hidden_size"],
            "vt_num_hidden_layers": v["num_hidden_layers"],
            "vt_num_attention_heads": v["num_attention_heads"],
            "vt_intermediate_size": v["intermediate_size"],
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": v["hidden_size"],
            "projector_hidden_act": "gelu",
            "projector_ln_eps": hf["projection_layer_norm_eps"],
            "text_hidden_size": hf["text_config"]["hidden_size"],
        },
    }


def to_published_names(sd: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> the published checkpoint names (the inverse of its
    `kimi_k25` conversion mapping: q/k/v fused into `wqkv` with the RoPE permutation undone)."""
    out = {}
    blocks = {}
    for k, t in sd.items():
        if k.startswith("model.language_model."):
            out["language_model.model." + k[len("model.language_model."):]] = t
        elif k == "lm_head.weight":
            out["language_model.lm_head.weight"] = t
        elif k.startswith("model.mm_projector."):
            rest = k[len("model.mm_projector."):]
            rest = rest.replace("in_proj", "proj.0").replace("out_proj", "proj.2")
            out["mm_projector." + rest] = t
        elif k.startswith("model.vision_tower.patch_embed."):
            rest = k[len("model.vision_tower.patch_embed."):]
            rest = rest.replace("pos_emb.position_embeddings", "pos_emb.weight")
            out["vision_tower.patch_embed." + rest] = t
        elif k.startswith("model.vision_tower.final_layernorm."):
            out["vision_tower.encoder." + k[len("model.vision_tower."):]] = t
        elif k.startswith("model.vision_tower.layers."):
            i, rest = k[len("model.vision_tower.layers."):].split(".", 1)
            p = f"vision_tower.encoder.blocks.{i}"
            if rest.startswith("attn.q_proj") or rest.startswith("attn.k_proj") or rest.startswith("attn.v_proj"):
                blocks.setdefault((p, rest.split(".")[-1]), {})[rest.split(".")[1]] = t
                continue
            rest = {
                "norm1.weight": "norm0.weight", "norm1.bias": "norm0.bias",
                "norm2.weight": "norm1.weight", "norm2.bias": "norm1.bias",
                "mlp.fc1.weight": "mlp.fc0.weight", "mlp.fc1.bias": "mlp.fc0.bias",
                "mlp.fc2.weight": "mlp.fc1.weight", "mlp.fc2.bias": "mlp.fc1.bias",
                "attn.proj.weight": "wo.weight", "attn.proj.bias": "wo.bias",
            }[rest]
            out[f"{p}.{rest}"] = t
        else:
            raise KeyError(k)
    for (p, kind), qkv in blocks.items():
        def unpermute(x):
            # transformers row r*half + m holds the published row 2m + r (PermuteForRope).
            d0 = x.shape[0]
            half = d0 // heads // 2
            if x.ndim == 2:
                return x.view(heads, 2, half, x.shape[1]).transpose(1, 2).reshape(d0, x.shape[1])
            return x.view(heads, 2, half).transpose(1, 2).reshape(d0)
        out[f"{p}.wqkv.{kind}"] = torch.cat([unpermute(qkv["q_proj"]), unpermute(qkv["k_proj"]), qkv["v_proj"]])
    return out


# --------------------------------------------------------------------------------------------
# A plain tower written from the spec (used for K3, and checked against transformers on K2.5)
# --------------------------------------------------------------------------------------------


def plain_tower(w: dict, vc: dict, items: list[dict]) -> list[torch.Tensor]:
    """MoonViT3d + projector, one item at a time, from the published layout `w` (f32 tensors).

    `vc`: hidden, heads, qkv (q/k/v width), layers, norm ("layernorm"|"rmsnorm"), act
    ("gelu_tanh"|"gelu"), interp ("bicubic"|"bilinear"), projector ("patchmerger"|
    "patchmergerv2"), pos_time, eps.
    """
    d, heads, q_w, eps = vc["hidden"], vc["heads"], vc["qkv"], vc["eps"]
    hd = q_w // heads

    def norm(x, p):
        if vc["norm"] == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[p + ".weight"]
        return F.layer_norm(x, (x.shape[-1],), w[p + ".weight"], w.get(p + ".bias"), eps)

    def lin(x, p):
        y = x @ w[p + ".weight"].T
        return y + w[p + ".bias"] if p + ".bias" in w else y

    def act(x):
        return F.gelu(x, approximate="tanh") if vc["act"] == "gelu_tanh" else F.gelu(x)

    outs = []
    for it in items:
        t, h, wd = (int(v) for v in it["grid_thw"])
        px = it["pixel_values"].reshape(t * h * wd, -1)
        x = px @ w["vision_tower.patch_embed.proj.weight"].reshape(d, -1).T
        if "vision_tower.patch_embed.proj.bias" in w:
            x = x + w["vision_tower.patch_embed.proj.bias"]
        table = w["vision_tower.patch_embed.pos_emb.weight"]  # [H0, W0, d]
        pos = F.interpolate(table.permute(2, 0, 1)[None], size=(h, wd), mode=vc["interp"], align_corners=False)
        pos = pos[0].permute(1, 2, 0).reshape(h * wd, d)
        x = x.view(t, h * wd, d) + pos[None]
        if t > 1:
            omega = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            ang = torch.arange(t, dtype=torch.float64)[:, None] * omega[None]
            x = x + torch.cat([ang.sin(), ang.cos()], -1).float()[:, None, :]
        x = x.reshape(t * h * wd, d)
        # 2D RoPE: complex pair 2i rotates by col·f_i, pair 2i+1 by row·f_i, f_i = θ^(-4i/hd).
        f = 1.0 / 10000 ** (torch.arange(0, hd // 4, dtype=torch.float64) * 4 / hd)
        rows = torch.arange(h).repeat_interleave(wd).repeat(t).double()
        cols = torch.arange(wd).repeat(h).repeat(t).double()
        ang = torch.stack([cols[:, None] * f, rows[:, None] * f], -1).reshape(-1, hd // 2)
        rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)

        def rope(z):
            zc = torch.view_as_complex(z.reshape(-1, heads, hd // 2, 2).contiguous())
            return torch.view_as_real(zc * rot[:, None, :]).reshape(-1, heads, hd)

        for b in range(vc["layers"]):
            p = f"vision_tower.encoder.blocks.{b}"
            qkv = lin(norm(x, p + ".norm0"), p + ".wqkv")
            qq, kk, vv = qkv.split(q_w, -1)
            qq, kk = rope(qq), rope(kk)
            vv = vv.reshape(-1, heads, hd)
            att = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(hd)
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), vv).reshape(-1, q_w)
            x = x + lin(o, p + ".wo")
            x = x + lin(act(lin(norm(x, p + ".norm1"), p + ".mlp.fc0")), p + ".mlp.fc1")
        x = norm(x, "vision_tower.encoder.final_layernorm")
        # sd2_tpool: mean over t, then (2i,2j),(2i,2j+1),(2i+1,2j),(2i+1,2j+1) concatenated.
        x = x.view(t, h // 2, 2, wd // 2, 2, d).mean(0).permute(0, 2, 1, 3, 4).reshape(-1, 4, d)
        if vc["projector"] == "patchmerger":
            x = F.layer_norm(x, (d,), w["mm_projector.pre_norm.weight"], w["mm_projector.pre_norm.bias"], vc["proj_eps"])
        x = x.reshape(-1, 4 * d)
        x = lin(F.gelu(lin(x, "mm_projector.proj.0")), "mm_projector.proj.2")
        if vc["projector"] == "patchmergerv2":
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + vc["proj_eps"]) * w["mm_projector.post_norm.weight"]
        outs.append(x)
    return outs


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def expand(prompt: list[int], counts: list[int]) -> list[int]:
    """Each PLACEHOLDER_ID in `prompt` becomes `counts[i]` copies (in order)."""
    out, i = [], 0
    for t in prompt:
        if t == PLACEHOLDER_ID:
            out += [PLACEHOLDER_ID] * counts[i]
            i += 1
        else:
            out.append(t)
    assert i == len(counts)
    return out


def features(model, items: list[dict]) -> list[torch.Tensor]:
    """transformers' tower + projector on the packed items, split per item.

    `get_image_features` itself cannot be used for chunks with t > 1: transformers 5.23 splits
    its output by `t·h·w / 4` rows per item while the temporal pooling leaves `h·w / 4` (its
    processor counts `h·w / 4` tokens per chunk), so it raises for every multi-frame chunk. The
    same two modules are called here and the rows split by `h·w / 4`.
    """
    pv = torch.cat([it["pixel_values"] for it in items])
    grid = torch.stack([it["grid_thw"] for it in items])
    pooled = model.model.vision_tower(pv, grid_thw=grid).pooler_output
    rows = model.model.mm_projector(pooled).squeeze(1)
    return list(torch.split(rows, [int(g[1] * g[2] // 4) for g in grid]))


def greedy(model, ids: list[int], items: list[dict]) -> dict:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ids = list(ids)
    res = {"greedy_ids": [], "margins": []}
    with torch.no_grad():
        feats = features(model, items)
        for step in range(mf.GREEDY_STEPS):
            enc = {"image": BaseModelOutputWithPooling(pooler_output=feats)}
            logits = model(input_ids=torch.tensor([ids]), mm_encoder_outputs=enc, use_cache=False).logits[0, -1].float()
            if step == 0:
                res["last_logits"] = [float(x) for x in logits]
            vals, idx = torch.topk(logits, 2)
            res["greedy_ids"].append(int(idx[0]))
            res["margins"].append(float(vals[0] - vals[1]))
            ids.append(int(idx[0]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3-dir", type=Path, help="a synthesized default Kimi K3 (caracal synth --out DIR)")
    args = ap.parse_args()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    make_images(OUT / "images")
    items = process_media(OUT / "images")

    torch.manual_seed(SEED)
    config = hf_config()
    model = Kimi_K25ForConditionalGeneration(config).float()
    redraw(model, SEED + 1)
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    hf_dir = OUT / "transformers"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        bf16 = Kimi_K25ForConditionalGeneration.from_pretrained(tmp, dtype=torch.bfloat16)
        bf16.save_pretrained(hf_dir)
    ref = Kimi_K25ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    hf_cfg = json.loads((hf_dir / "config.json").read_text())

    # Published layout: from the reloaded model's own tensors (bf16 values, exact in f32).
    pub_dir = OUT / "published"
    pub_dir.mkdir()
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items() if "time_position" not in k}
    published = to_published_names(sd, VISION["num_attention_heads"])
    save_file(published, pub_dir / "model.safetensors", metadata={"format": "pt"})
    (pub_dir / "config.json").write_text(json.dumps(published_config(hf_cfg), indent=2) + "\n")
    for d in [hf_dir, pub_dir]:
        for f in mf.TOKENIZER_FILES:
            shutil.copy(TEXT_FIXTURE / f, d / f)
        for f in d.iterdir():
            f.chmod(0o644)

    # Tower + projector per item, alone, through transformers.
    media = {}
    with torch.no_grad():
        for it in items:
            it["embeds"] = features(ref, [it])[0].float()
            media[f"{it['name']}.pixel_values"] = it["pixel_values"].contiguous()
            media[f"{it['name']}.grid_thw"] = it["grid_thw"].to(torch.int64).contiguous()
            media[f"{it['name']}.embeds"] = it["embeds"].contiguous()
        # Packed into one call the images give the same rows (transformers cannot pack chunks of
        # different t: its temporal-merge index concatenates `[cells, t, 4]` blocks).
        stills = [it for it in items if int(it["grid_thw"][0]) == 1]
        for it, p in zip(stills, features(ref, stills)):
            assert torch.allclose(it["embeds"], p, atol=1e-5), (it["name"], (it["embeds"] - p).abs().max())

    # The plain reference on the published layout must match transformers.
    wf = {k: v.float() for k, v in published.items()}
    k25 = dict(hidden=32, heads=2, qkv=32, layers=2, norm="layernorm", act="gelu_tanh", interp="bicubic",
               projector="patchmerger", eps=1e-5, proj_eps=1e-5)
    with torch.no_grad():
        for it, p in zip(items, plain_tower(wf, k25, items)):
            err = (it["embeds"] - p).abs().max().item()
            assert err < 1e-4, (it["name"], err)
            print(f"plain tower vs transformers, {it['name']}: max |d| = {err:.2e}")
    save_file(media, OUT / "media.safetensors", metadata={"format": "pt"})

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TEXT_FIXTURE / "tokenizer.json"))
    text = tok.encode("The License is free software", add_special_tokens=False)
    tail = tok.encode(" for the program.", add_special_tokens=False)
    tokens = {it["name"]: int(it["grid_thw"][1] * it["grid_thw"][2] // 4) for it in items}
    cases = {
        "one_image": (["a"], text + [PLACEHOLDER_ID] + tail),
        "two_images": (["a", "b"], text[:2] + [PLACEHOLDER_ID] + text[2:] + [PLACEHOLDER_ID] + tail),
        "video_chunk": (["clip"], text + [PLACEHOLDER_ID] + tail),
    }
    by_name = {it["name"]: it for it in items}
    expected = {
        "placeholder_id": PLACEHOLDER_ID,
        "media_tokens": tokens,
        "grid_thw": {it["name"]: [int(x) for x in it["grid_thw"]] for it in items},
        "cases": {},
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    for name, (media_names, prompt) in cases.items():
        ids = expand(prompt, [tokens[m] for m in media_names])
        r = greedy(ref, ids, [by_name[m] for m in media_names])
        r.update(media=media_names, prompt_ids=prompt, expanded_ids=ids)
        expected["cases"][name] = r
        print(f"{name}: {len(ids)} tokens, greedy {r['greedy_ids']}, smallest margin {min(r['margins']):.3f}")
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")

    if args.k3_dir:
        k3_reference(args.k3_dir, items)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


def k3_reference(k3_dir: Path, items: list[dict]) -> None:
    cfg = json.loads((k3_dir / "config.json").read_text())
    v = cfg["vision_config"]
    w = {}
    for shard in sorted(k3_dir.glob("*.safetensors")):
        for k, t in load_file(shard).items():
            if k.startswith("vision_tower.") or k.startswith("mm_projector."):
                w[k] = t.float()
    vc = dict(hidden=v["vt_hidden_size"], heads=v["vt_num_attention_heads"], qkv=v["qkv_hidden_size"],
              layers=v["vt_num_hidden_layers"], norm=v["norm_type"], act="gelu_tanh",
              interp=v["pos_emb_interpolation_mode"], projector=v["mm_projector_type"], eps=1e-5,
              proj_eps=v["projector_ln_eps"])
    out = {}
    with torch.no_grad():
        for it, p in zip(items, plain_tower(w, vc, items)):
            out[f"{it['name']}.embeds"] = p.contiguous()
    save_file(out, OUT / "k3_tower.safetensors", metadata={"format": "pt", "synth_version": str(cfg.get("synth_version"))})
    print("k3 tower reference:", {k: tuple(t.shape) for k, t in out.items()})


if __name__ == "__main__":
    main()
