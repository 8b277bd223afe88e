#!/usr/bin/env python3
"""Write the tiny Kimi K3 fixture ``tests/fixtures/tiny-kimi-k3/`` and its reference outputs.

transformers has no ``kimi_k3`` model, so the reference forward is assembled here from
transformers' ``kimi_linear`` modules (MLA attention ``KimiLinearAttention``, KDA
``KimiLinearDeltaAttention`` with its pure-torch chunked kernel and causal conv, RMSNorm
``KimiLinearRMSNorm``, router ``KimiLinearTopkRouter``) plus the K3 pieces written from the
formulas of ``/work/shared/reference/kimi-architecture.md``:

* KDA forget gate with a lower bound (§1.2): ``g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))``;
* KDA full-rank output gate ``g_proj: hidden -> heads*head_dim`` (§1.2);
* MLA sigmoid output gate ``attn_out *= sigmoid(g_proj(x))`` before ``o_proj`` (§1.4);
* SiTU-GLU ``[b*tanh(g/b)*sigmoid(g)] * [bl*tanh(u/bl)]`` for every MLP (§4.1);
* latent MoE: router on x, experts on ``routed_expert_down_proj(x)``, ``routed_expert_norm``,
  ``routed_expert_up_proj``, plus shared experts on x (§4.1);
* Block Attention Residuals with the exact §2.3 dataflow (snapshots at ``l % B == 0``, a mix before
  every sublayer and before the final norm).

Routed experts are quantized to MXFP4 with a small numpy encoder (OCP MX: E8M0 scale
``floor(log2(amax)) - 2`` clamped to [-127, 127], elements rounded to the nearest E2M1 value, ties
to the even code, saturating at 6; low nibble = even element) and stored in the compressed-tensors
layout ``…experts.{e}.{w1,w2,w3}.weight_packed`` (u8 ``[rows, cols/2]``) + ``.weight_scale`` (u8
``[rows, cols/32]``). Everything else is bf16 except ``A_log``, ``dt_bias`` and
``e_score_correction_bias`` (f32). ``A_log`` is stored the way TokenSpeed describes K3's: a
``[head_dim]`` buffer whose first ``num_heads`` entries hold the per-head values, the rest zero.

References are computed in float32 from the tensors **reloaded from disk** (bf16 widened to f32,
MXFP4 experts dequantized from the saved bytes), with a full forward per greedy step (no cache).

Usage::

    /work/venv-ref/bin/python tools/k3_reference.py [--out tests/fixtures/tiny-kimi-k3]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import KimiLinearConfig
from transformers.models.kimi_linear import modeling_kimi_linear as kl

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_SRC = REPO_ROOT / "tests" / "fixtures" / "tiny-llama"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
PROMPT = "The License is free software for the program."
GREEDY_STEPS = 16
TOP_K = 5
MAX_FIXTURE_BYTES = 1_500_000
ROOT = "language_model."  # K3's multimodal wrapper prefix

# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

L = 8
FULL_ATTN = list(range(4, L, 4)) + [L]  # 1-based, as K3's range(4, 93, 4) + [93]
KDA_LAYERS = [i for i in range(1, L + 1) if i not in FULL_ATTN]

TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": L,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 3,
    "linear_attn_config": {
        "kda_layers": KDA_LAYERS,
        "full_attn_layers": FULL_ATTN,
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": TEXT_CONFIG,
    # A stand-in: the runtime loads only the text path. Key names as K3's MoonViT3d.
    "vision_config": {
        "model_type": "moonvit3d",
        "patch_size": 14,
        "vt_hidden_size": 32,
        "vt_num_hidden_layers": 1,
        "vt_num_attention_heads": 2,
        "vt_intermediate_size": 64,
        "text_hidden_size": 64,
    },
    "media_placeholder_token_id": 163605,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "note": "routed experts only (block_sparse_moe.experts.*): weight_packed u8 [rows, cols/2] "
        "(low nibble = even element) + weight_scale u8 [rows, cols/32] (E8M0)",
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

SEED = 24  # picked from 1..30 for the largest smallest greedy margin (see --search)
EMBED_STD, HEAD_STD, LIN_STD, MLP_STD, RES_PROJ_STD = 1.0, 0.3, 0.15, 0.5, 0.3

# ---------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols] f32 -> (packed u8 [rows, cols/2], scales u8 [rows, cols/32])."""
    rows, cols = w.shape
    assert cols % 32 == 0
    blocks = w.astype(np.float32).reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, 0)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1.0), exp)[..., None]
    mag = np.abs(scaled)
    dist = np.abs(mag[..., None] - E2M1[:8])  # [..., 8]
    best = dist.argmin(axis=-1)  # first minimum: the lower code on a tie
    nxt = np.minimum(best + 1, 7)
    tie = (np.take_along_axis(dist, nxt[..., None], -1)[..., 0] == np.take_along_axis(dist, best[..., None], -1)[..., 0]) & (
        best % 2 == 1
    ) & (nxt != best)
    best = np.where(tie, nxt, best)  # ties to the even code
    code = (best | np.where(np.signbit(scaled), 8, 0)).astype(np.uint8).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    scales = (exp + 127).astype(np.uint8).reshape(rows, cols // 32)
    return packed, scales


def mxfp4_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows = packed.shape[0]
    cols = packed.shape[1] * 2
    code = np.empty((rows, cols), dtype=np.uint8)
    code[:, 0::2] = packed & 0xF
    code[:, 1::2] = packed >> 4
    vals = E2M1[code].reshape(rows, cols // 32, 32)
    assert not np.any(scales == 0xFF)
    return (vals * np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]).reshape(rows, cols).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def draw_weights(seed: int) -> dict[str, np.ndarray | tuple]:
    """Random tensors in the K3 checkpoint layout. MXFP4 experts are (packed, scales) tuples."""
    c = TEXT_CONFIG
    g = np.random.default_rng(seed)
    d, vocab = c["hidden_size"], c["vocab_size"]
    la = c["linear_attn_config"]
    H, D, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = H * D
    nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    E, inter, lat = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
    shared_inter = inter * c["num_shared_experts"]

    def n(shape, std, mean=0.0):
        return (g.standard_normal(shape) * std + mean).astype(np.float32)

    t: dict = {}
    m = f"{ROOT}model"
    t[f"{m}.embed_tokens.weight"] = n((vocab, d), EMBED_STD)
    t[f"{ROOT}lm_head.weight"] = n((vocab, d), HEAD_STD)
    t[f"{m}.norm.weight"] = n((d,), 0.1, 1.0)
    t[f"{m}.output_attn_res_norm.weight"] = n((d,), 0.1, 1.0)
    t[f"{m}.output_attn_res_proj.weight"] = n((1, d), RES_PROJ_STD)
    for i in range(L):
        p = f"{m}.layers.{i}"
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[f"{p}.{nm}.weight"] = n((d,), 0.1, 1.0)
        t[f"{p}.self_attention_res_proj.weight"] = n((1, d), RES_PROJ_STD)
        t[f"{p}.mlp_res_proj.weight"] = n((1, d), RES_PROJ_STD)
        a = f"{p}.self_attn"
        if (i + 1) in KDA_LAYERS:
            for nm in ("q_proj", "k_proj", "v_proj", "g_proj"):
                t[f"{a}.{nm}.weight"] = n((P, d), LIN_STD)
            for nm in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[f"{a}.{nm}.weight"] = n((P, 1, W), 0.3)
            t[f"{a}.f_a_proj.weight"] = n((D, d), LIN_STD)
            t[f"{a}.f_b_proj.weight"] = n((P, D), LIN_STD)
            t[f"{a}.dt_bias"] = n((P,), 0.5, -3.0)
            a_log = np.zeros((D,), np.float32)  # [head_dim] buffer, first H entries per head
            a_log[:H] = n((H,), 0.5)
            t[f"{a}.A_log"] = a_log
            t[f"{a}.b_proj.weight"] = n((H, d), LIN_STD)
            t[f"{a}.o_norm.weight"] = n((D,), 0.1, 1.0)
            t[f"{a}.o_proj.weight"] = n((d, P), LIN_STD)
        else:
            t[f"{a}.q_a_proj.weight"] = n((qr, d), LIN_STD)
            t[f"{a}.q_a_layernorm.weight"] = n((qr,), 0.1, 1.0)
            t[f"{a}.q_b_proj.weight"] = n((nh * (nope + rope), qr), LIN_STD)
            t[f"{a}.kv_a_proj_with_mqa.weight"] = n((kvr + rope, d), LIN_STD)
            t[f"{a}.kv_a_layernorm.weight"] = n((kvr,), 0.1, 1.0)
            t[f"{a}.kv_b_proj.weight"] = n((nh * (nope + vd), kvr), LIN_STD)
            t[f"{a}.g_proj.weight"] = n((nh * vd, d), LIN_STD)
            t[f"{a}.o_proj.weight"] = n((d, nh * vd), LIN_STD)
        if i < c["first_k_dense_replace"]:
            f = f"{p}.mlp"
            t[f"{f}.gate_proj.weight"] = n((c["intermediate_size"], d), MLP_STD)
            t[f"{f}.up_proj.weight"] = n((c["intermediate_size"], d), MLP_STD)
            t[f"{f}.down_proj.weight"] = n((d, c["intermediate_size"]), LIN_STD)
        else:
            f = f"{p}.block_sparse_moe"
            t[f"{f}.gate.weight"] = n((E, d), LIN_STD)
            t[f"{f}.gate.e_score_correction_bias"] = n((E,), 0.5)
            t[f"{f}.routed_expert_down_proj.weight"] = n((lat, d), LIN_STD)
            t[f"{f}.routed_expert_up_proj.weight"] = n((d, lat), LIN_STD)
            t[f"{f}.routed_expert_norm.weight"] = n((lat,), 0.1, 1.0)
            for e in range(E):
                for nm, shape, std in (("w1", (inter, lat), MLP_STD), ("w3", (inter, lat), MLP_STD), ("w2", (lat, inter), LIN_STD)):
                    t[f"{f}.experts.{e}.{nm}"] = mxfp4_encode(n(shape, std))
            t[f"{f}.shared_experts.gate_proj.weight"] = n((shared_inter, d), MLP_STD)
            t[f"{f}.shared_experts.up_proj.weight"] = n((shared_inter, d), MLP_STD)
            t[f"{f}.shared_experts.down_proj.weight"] = n((d, shared_inter), LIN_STD)
    return t


F32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias")


def save_checkpoint(tensors: dict, out: Path) -> None:
    st = {}
    for name, v in tensors.items():
        if isinstance(v, tuple):
            st[f"{name}.weight_packed"] = torch.from_numpy(v[0])
            st[f"{name}.weight_scale"] = torch.from_numpy(v[1])
        elif name.endswith(F32_SUFFIXES):
            st[name] = torch.from_numpy(v)
        else:
            st[name] = torch.from_numpy(v).to(torch.bfloat16)
    save_file(dict(sorted(st.items())), out / "model.safetensors", metadata={"format": "pt"})


def load_checkpoint_f32(out: Path) -> dict[str, torch.Tensor]:
    """Reload the saved file: floats widened to f32, MXFP4 pairs dequantized to `{base}.weight`."""
    raw = load_file(out / "model.safetensors")
    w = {}
    for name, v in raw.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            dq = mxfp4_decode(v.numpy(), raw[f"{base}.weight_scale"].numpy())
            w[f"{base}.weight"] = torch.from_numpy(dq)
        elif name.endswith(".weight_scale"):
            continue
        else:
            w[name] = v.to(torch.float32)
    return w


# ---------------------------------------------------------------------------------------------
# K3 modules around transformers' kimi_linear pieces
# ---------------------------------------------------------------------------------------------


def hf_config() -> KimiLinearConfig:
    c = TEXT_CONFIG
    cfg = KimiLinearConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=L,
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        mla_use_nope=True,
        num_experts=c["num_experts"],
        num_experts_per_token=c["num_experts_per_token"],
        num_shared_experts=c["num_shared_experts"],
        moe_intermediate_size=c["moe_intermediate_size"],
        intermediate_size=c["intermediate_size"],
        first_k_dense_replace=1,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=c["routed_scaling_factor"],
        num_expert_group=1,
        topk_group=1,
        rms_norm_eps=c["rms_norm_eps"],
        # The KDA short conv's activation is SiLU in K3 too; SiTU is used by the MLPs below only.
        hidden_act="silu",
        linear_attn_config={k: v for k, v in c["linear_attn_config"].items() if k in ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")},
        model_max_length=c["max_position_embeddings"],
    )
    cfg._attn_implementation = "eager"
    return cfg


class LowerBoundForgetGate(nn.Module):
    """K3 KDA gate: g = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias))."""

    def __init__(self, w: dict, p: str, heads: int, head_dim: int, lower_bound: float):
        super().__init__()
        self.f_a, self.f_b = w[f"{p}.f_a_proj.weight"], w[f"{p}.f_b_proj.weight"]
        self.dt_bias = w[f"{p}.dt_bias"]
        self.a_log = w[f"{p}.A_log"][:heads]  # first `heads` entries of the [head_dim] buffer
        self.heads, self.head_dim, self.lb = heads, head_dim, lower_bound

    def forward(self, x):
        z = nn.functional.linear(nn.functional.linear(x, self.f_a), self.f_b) + self.dt_bias
        z = z.view(*x.shape[:2], self.heads, self.head_dim)
        return self.lb * torch.sigmoid(torch.exp(self.a_log).view(1, 1, -1, 1) * z)


def linear(weight: torch.Tensor) -> nn.Linear:
    m = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    m.weight.data.copy_(weight)
    return m


def rms_norm(weight: torch.Tensor, eps: float) -> kl.KimiLinearRMSNorm:
    m = kl.KimiLinearRMSNorm(weight.shape[0], eps)
    m.weight.data.copy_(weight)
    return m


def k3_kda(cfg, w: dict, p: str, i: int) -> nn.Module:
    la = TEXT_CONFIG["linear_attn_config"]
    m = kl.KimiLinearDeltaAttention(cfg, i)
    for nm in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"):
        getattr(m, nm).weight.data.copy_(w[f"{p}.{nm}.weight"])
    m.conv1d.weight.data.copy_(torch.cat([w[f"{p}.{x}_conv1d.weight"] for x in "qkv"], 0))
    m.o_norm.weight.data.copy_(w[f"{p}.o_norm.weight"])
    m.forget_gate = LowerBoundForgetGate(w, p, la["num_heads"], la["head_dim"], la["gate_lower_bound"])
    # Full-rank output gate: g_b_proj(g_a_proj(x)) becomes g_proj(x).
    m.g_a_proj = nn.Identity()
    m.g_b_proj = linear(w[f"{p}.g_proj.weight"])
    return m


class GatedOProj(nn.Module):
    """o_proj(attn_out * sigmoid(gate)), the gate set by GatedMla before each call."""

    def __init__(self, o_proj):
        super().__init__()
        self.o_proj, self.gate = o_proj, None

    def forward(self, x):
        return self.o_proj(x * torch.sigmoid(self.gate))


class GatedMla(nn.Module):
    def __init__(self, cfg, w: dict, p: str, i: int):
        super().__init__()
        self.attn = kl.KimiLinearAttention(cfg, i)
        for nm in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            getattr(self.attn, nm).weight.data.copy_(w[f"{p}.{nm}.weight"])
        for nm in ("q_a_layernorm", "kv_a_layernorm"):
            getattr(self.attn, nm).weight.data.copy_(w[f"{p}.{nm}.weight"])
            getattr(self.attn, nm).variance_epsilon = 1e-6  # Moonshot builds them with the default eps
        self.attn.o_proj = GatedOProj(self.attn.o_proj)
        self.g_proj = linear(w[f"{p}.g_proj.weight"])

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        self.attn.o_proj.gate = self.g_proj(x)
        out, _ = self.attn(hidden_states=x, attention_mask=mask)
        return out


def situ(gate, up):
    c = TEXT_CONFIG
    b, bl = c["activation_situ_beta"], c["activation_situ_linear_beta"]
    return b * torch.tanh(gate / b) * torch.sigmoid(gate) * (bl * torch.tanh(up / bl))


class SituMlp(nn.Module):
    def __init__(self, w: dict, p: str, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.gate, self.up, self.down = (w[f"{p}.{n}.weight"] for n in names)

    def forward(self, x):
        f = nn.functional.linear
        return f(situ(f(x, self.gate), f(x, self.up)), self.down)


class LatentMoe(nn.Module):
    def __init__(self, cfg, w: dict, p: str):
        super().__init__()
        c = TEXT_CONFIG
        self.router = kl.KimiLinearTopkRouter(cfg)
        self.router.weight.data.copy_(w[f"{p}.gate.weight"])
        self.router.e_score_correction_bias.data.copy_(w[f"{p}.gate.e_score_correction_bias"])
        self.down = w[f"{p}.routed_expert_down_proj.weight"]
        self.up = w[f"{p}.routed_expert_up_proj.weight"]
        self.norm = rms_norm(w[f"{p}.routed_expert_norm.weight"], c["rms_norm_eps"])
        self.experts = [SituMlp(w, f"{p}.experts.{e}", ("w1", "w3", "w2")) for e in range(c["num_experts"])]
        self.shared = SituMlp(w, f"{p}.shared_experts")

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, idx = self.router(flat)
        z = nn.functional.linear(flat, self.down)
        y = torch.zeros(flat.shape[0], z.shape[1])
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if len(tok):
                y.index_add_(0, tok, expert(z[tok]) * weights[tok, slot, None])
        y = nn.functional.linear(self.norm(y), self.up)
        return y.view(shape) + self.shared(x)


def attn_res(blocks: list[torch.Tensor], prefix: torch.Tensor, norm_w, proj_w, eps) -> torch.Tensor:
    """Mix(blocks + [prefix]) per token, in f32 (§2.3; Moonshot's _apply_attn_res)."""
    v = torch.stack(blocks + [prefix], dim=-2)  # [B, T, n, d]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    scores = (k * (norm_w * proj_w.reshape(-1))).sum(-1)
    return (scores.softmax(-1).unsqueeze(-1) * v).sum(-2)


class K3Model(nn.Module):
    def __init__(self, w: dict):
        super().__init__()
        c = TEXT_CONFIG
        cfg = hf_config()
        eps = c["rms_norm_eps"]
        m = f"{ROOT}model"
        self.w, self.eps, self.block = w, eps, c["attn_res_block_size"]
        self.embed = w[f"{m}.embed_tokens.weight"]
        self.layers = []
        for i in range(L):
            p = f"{m}.layers.{i}"
            mixer = k3_kda(cfg, w, f"{p}.self_attn", i) if (i + 1) in KDA_LAYERS else GatedMla(cfg, w, f"{p}.self_attn", i)
            ffn = SituMlp(w, f"{p}.mlp") if i < c["first_k_dense_replace"] else LatentMoe(cfg, w, f"{p}.block_sparse_moe")
            self.layers.append(
                dict(
                    p=p,
                    mixer=mixer,
                    ffn=ffn,
                    input_layernorm=rms_norm(w[f"{p}.input_layernorm.weight"], eps),
                    post_attention_layernorm=rms_norm(w[f"{p}.post_attention_layernorm.weight"], eps),
                )
            )
        self.norm = rms_norm(w[f"{m}.norm.weight"], eps)
        self.lm_head = w[f"{ROOT}lm_head.weight"]

    def forward(self, ids: list[int]) -> torch.Tensor:
        w, eps, m = self.w, self.eps, f"{ROOT}model"
        prefix = self.embed[torch.tensor([ids])]
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            p = layer["p"]
            h = attn_res(blocks, prefix, w[f"{p}.self_attention_res_norm.weight"], w[f"{p}.self_attention_res_proj.weight"], eps)
            a = layer["mixer"](layer["input_layernorm"](h))
            if i % self.block == 0:
                blocks.append(prefix)
                prefix = a
            else:
                prefix = prefix + a
            h = attn_res(blocks, prefix, w[f"{p}.mlp_res_norm.weight"], w[f"{p}.mlp_res_proj.weight"], eps)
            prefix = prefix + layer["ffn"](layer["post_attention_layernorm"](h))
        out = attn_res(blocks, prefix, w[f"{m}.output_attn_res_norm.weight"], w[f"{m}.output_attn_res_proj.weight"], eps)
        return nn.functional.linear(self.norm(out), self.lm_head)[0]


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def greedy_reference(model: K3Model, prompt_ids: list[int]) -> dict:
    ids = list(prompt_ids)
    greedy, margins, tops, all_max, last = [], [], [], 0.0, None
    with torch.no_grad():
        for step in range(GREEDY_STEPS):
            logits = model(ids)[-1]
            if step == 0:
                last = logits.clone()
            all_max = max(all_max, logits.abs().max().item())
            vals, idx = torch.topk(logits, TOP_K)
            greedy.append(int(idx[0]))
            margins.append(float(vals[0] - vals[1]))
            tops.append([[int(i), float(v)] for i, v in zip(idx, vals)])
            ids.append(int(idx[0]))
    return {
        "last_logits": [float(x) for x in last],
        "greedy_ids": greedy,
        "margins": margins,
        "step_logits_top": tops,
        "max_abs_logit": all_max,
    }


def build(out: Path, seed: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_checkpoint(draw_weights(seed), out)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_SRC / f, out / f)
    for f in out.iterdir():
        f.chmod(0o644)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False).ids
    model = K3Model(load_checkpoint_f32(out))
    ref = greedy_reference(model, prompt_ids)
    return {
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        **ref,
        "greedy_text": tok.decode(ref["greedy_ids"]),
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
        "reference_mode": "tools/k3_reference.py: transformers kimi_linear modules (MLA, KDA chunked torch kernel, "
        "RMSNorm, router) + K3 pieces from the formulas; float32 on the saved bf16 tensors, MXFP4 experts "
        "dequantized from the saved bytes; full forward per step, no cache",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "tiny-kimi-k3")
    ap.add_argument("--search", type=int, default=0, help="try seeds 1..N and report their smallest margins")
    ap.add_argument("--search-from", type=int, default=1, help="first seed of --search")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if args.search:
        for s in range(args.search_from, args.search + 1):
            exp = build(args.out, s)
            print(f"seed {s}: min margin {min(exp['margins']):.4f}  greedy {exp['greedy_ids']}")
        return
    exp = build(args.out, SEED)
    (args.out / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    assert size < MAX_FIXTURE_BYTES, size
    assert math.isfinite(exp["max_abs_logit"])
    print(f"tiny-kimi-k3: max|logit| {exp['max_abs_logit']:.4f}  min margin {min(exp['margins']):.5f}  greedy {exp['greedy_ids']}  size {size} B")


if __name__ == "__main__":
    main()
