#!/usr/bin/env python3
"""Regenerate the tiny Hugging Face checkpoints under ``tests/fixtures/``.

Three architectures are written in the exact layout that ``transformers`` 5.x
``save_pretrained`` produces (bf16 safetensors, ``config.json``,
``generation_config.json``) plus a shared tiny byte-level BPE tokenizer:

* ``tiny-llama/``        ``LlamaForCausalLM`` (GQA, tied embeddings)
* ``tiny-deepseek-v3/``  ``DeepseekV3ForCausalLM`` (MLA with q LoRA, YaRN, noaux_tc MoE), sharded
* ``tiny-kimi-linear/``  ``KimiLinearForCausalLM`` (3 KDA : 1 NoPE-MLA, MoE)

Each folder also gets ``expected.json`` with reference logits and greedy
tokens computed by transformers in float32 from the *saved* bf16 files
(the checkpoint is loaded back with ``from_pretrained(dir, dtype=float32)``;
the in-memory model is never used for references, because casting it to
bf16 would also round buffers such as RoPE's ``inv_freq``).

One deviation from a plain ``save_pretrained``: for kimi_linear the dense
layer's MLP is renamed back from ``block_sparse_moe.*_proj`` to the published
``mlp.*_proj`` (see ``restore_kimi_dense_mlp_names``).

Everything is deterministic (fixed seeds, CPU only). Usage::

    /path/to/venv/bin/python tools/make_fixtures.py [--out tests/fixtures]

Needs ``pip install torch transformers tokenizers safetensors``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path

import safetensors
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    GenerationConfig,
    KimiLinearConfig,
    LlamaConfig,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_CANDIDATES = [
    Path("/usr/share/common-licenses/GPL-3"),
    Path("/usr/share/common-licenses/GPL-2"),
    Path("/usr/share/common-licenses/Apache-2.0"),
]

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROMPT = "The License is free software for the program."
CHAT_MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY_STEPS = 16
TOP_K = 5
MAX_FIXTURE_BYTES = 1_500_000
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def corpus_path() -> Path:
    for p in CORPUS_CANDIDATES:
        if p.is_file():
            return p
    sys.exit("no training text found (looked for " + ", ".join(map(str, CORPUS_CANDIDATES)) + ")")


def build_tokenizer(out: Path) -> None:
    """Train the shared byte-level BPE and write tokenizer.json / tokenizer_config.json / generation_config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path())], trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tok_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|im_start|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 256,
        "pad_token": "<|im_end|>",
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": "<|endoftext|>",
        "vocab_size": VOCAB_SIZE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(out)


# --------------------------------------------------------------------------------------------
# Model configs
# --------------------------------------------------------------------------------------------


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def deepseek_v3_config() -> DeepseekV3Config:
    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=96,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        # Written the way published DeepSeek/Kimi-K2 configs spell it; transformers 5 folds it
        # (and rope_theta) into `rope_parameters` on save.
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_theta=10000.0,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def kimi_linear_config() -> KimiLinearConfig:
    # Keys as in the published Kimi-Linear-48B-A3B config.json; KimiLinearConfig maps them via its
    # attribute_map (num_experts, num_experts_per_token, num_shared_experts, moe_renormalize,
    # num_expert_group, model_max_length) and __post_init__ (linear_attn_config, first_k_dense_replace).
    return KimiLinearConfig(
        architectures=["KimiLinearForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mla_use_nope=True,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=96,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=2.446,
        use_grouped_topk=True,
        num_expert_group=2,
        topk_group=1,
        num_nextn_predict_layers=0,
        model_max_length=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
        },
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
    )


# Per-fixture knobs: config factory, sharding, seed, std of the embedding / lm_head / other matrices.
# The seeds were picked from 1..30 for a large smallest top-1/top-2 margin over the 16 greedy steps
# (and a greedy run that does not collapse at once into one repeated token), so that a runtime with
# small numerical differences still reproduces greedy_ids exactly.
FIXTURES = {
    "tiny-llama": dict(config=llama_config, shard=None, seed=26, embed_std=0.5, head_std=None, lin_std=0.15),
    "tiny-deepseek-v3": dict(
        config=deepseek_v3_config, shard="200KB", seed=26, embed_std=1.0, head_std=0.3, lin_std=0.15
    ),
    "tiny-kimi-linear": dict(
        config=kimi_linear_config, shard=None, seed=15, embed_std=1.0, head_std=0.3, lin_std=0.15
    ),
}


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def redraw_weights(model: torch.nn.Module, seed: int, embed_std: float, head_std: float | None, lin_std: float) -> None:
    """Replace the init weights with larger random values so that logits are far from flat."""
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, mean: float, std: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean).to(t.dtype)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):  # every RMSNorm incl. q_a/kv_a_layernorm and KDA o_norm
                p.copy_(normal(p, 1.0, 0.1))
            elif name.endswith("A_log"):  # KDA: A = exp(A_log) ~ 1, per head
                p.copy_(normal(p, 0.0, 0.5))
            elif name.endswith("dt_bias"):  # KDA: shifts softplus down so decays stay in (e^-1, 1)
                p.copy_(normal(p, -1.5, 0.5))
            elif "conv1d" in name:  # KDA depthwise short conv
                p.copy_(normal(p, 0.0, 0.3))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(normal(p, 0.0, embed_std))
            elif name.endswith("lm_head.weight"):
                p.copy_(normal(p, 0.0, head_std if head_std is not None else lin_std))
            else:  # linear weights, router weight, packed expert weights
                p.copy_(normal(p, 0.0, lin_std))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b, 0.0, 0.5))


def save_fixture(name: str, spec: dict, out_root: Path, tok_dir: Path) -> Path:
    """Build, re-draw, save (bf16) one fixture; return its folder."""
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    config = spec["config"]()
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    redraw_weights(model, spec["seed"] + 1, spec["embed_std"], spec["head_std"], spec["lin_std"])
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with tempfile.TemporaryDirectory() as tmp:
        # Round trip through from_pretrained(dtype=bf16) so transformers itself decides which
        # tensors stay fp32 (`_keep_in_fp32_modules_strict`: router weight, e_score_correction_bias,
        # dt_bias) exactly as it would for a real bf16 checkpoint.
        model.save_pretrained(tmp)
        bf16 = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
        bf16.save_pretrained(out, **kwargs)
    if config.model_type == "kimi_linear":
        restore_kimi_dense_mlp_names(out, config)
    for f in TOKENIZER_FILES:
        shutil.copy(tok_dir / f, out / f)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600 files
    return out


def restore_kimi_dense_mlp_names(folder: Path, config: KimiLinearConfig) -> None:
    """Undo a transformers 5 save quirk for kimi_linear.

    Its checkpoint conversion renames ``.block_sparse_moe.`` -> ``.mlp.`` on load, and the reverse
    on save is applied to *every* ``.mlp.``, so the dense layers' MLP comes out as
    ``model.layers.{i}.block_sparse_moe.{gate,up,down}_proj.weight``. The published Kimi-Linear
    checkpoints (and the vLLM/sglang loaders) name it ``model.layers.{i}.mlp.*``; transformers loads
    both spellings, so the published one is restored here. Caracal reads both as well
    (``tests/configs.rs`` renames them back and compares logits).
    """
    dense = [i for i, t in enumerate(config.mlp_layer_types) if t == "dense"]
    pat = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")

    def rename(key: str) -> str:
        m = pat.match(key)
        if m and int(m.group(1)) in dense:
            return f"model.layers.{m.group(1)}.mlp.{m.group(2)}"
        return key

    renamed = 0
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        new = {rename(k): v for k, v in tensors.items()}
        renamed += sum(1 for k in tensors if rename(k) != k)
        save_file(new, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in sorted(data["weight_map"].items())}
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    assert renamed == 3 * len(dense), renamed


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def greedy_reference(model: torch.nn.Module, prompt_ids: list[int]) -> dict:
    """Greedy decode by repeated full forward passes (no KV cache), keeping logits per step."""
    ids = list(prompt_ids)
    greedy, margins, tops, all_max = [], [], [], 0.0
    last_logits = None
    with torch.no_grad():
        for step in range(GREEDY_STEPS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            if step == 0:
                last_logits = logits.clone()
            all_max = max(all_max, logits.abs().max().item())
            vals, idx = torch.topk(logits, TOP_K)
            greedy.append(int(idx[0]))
            margins.append(float(vals[0] - vals[1]))
            tops.append([[int(i), float(v)] for i, v in zip(idx, vals)])
            ids.append(int(idx[0]))
    return {
        "last_logits": [float(x) for x in last_logits],
        "greedy_ids": greedy,
        "margins": margins,
        "step_logits_top": tops,
        "max_abs_logit": all_max,
    }


def remote_code_router_forward(self, hidden_states):
    """Router as in Moonshot's bundled ``modeling_kimi.py`` (``KimiMoEGate``).

    There ``scores_for_choice = scores.view(...)`` followed by an in-place ``+=`` of the bias
    aliases ``scores``, so the returned expert *weights* include ``e_score_correction_bias``;
    non-selected groups are masked with 0.0 instead of -inf. transformers (and vLLM, DeepSeek)
    weight the experts with the unbiased sigmoid scores.
    """
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.sigmoid() + self.e_score_correction_bias
    group_scores = scores.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(-1, self.num_group, self.num_experts // self.num_group)
        .reshape(-1, self.num_experts)
    )
    tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
    topk_indices = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def reference_outputs(folder: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert prompt_ids == raw.encode(PROMPT, add_special_tokens=False).ids
    assert tok.decode(prompt_ids) == PROMPT
    chat = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = list(chat_ids)
    assert chat_ids == raw.encode(chat, add_special_tokens=False).ids

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(k), (folder.name, k, info[k])
    model.eval()

    ref = greedy_reference(model, prompt_ids)
    expected = {
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "chat_messages": CHAT_MESSAGES,
        "chat_prompt": chat,
        "chat_prompt_ids": chat_ids,
        **ref,
        "greedy_text": tok.decode(ref["greedy_ids"]),
    }
    if model.config.model_type == "kimi_linear":
        routers = [m for m in model.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
        assert routers
        for r in routers:
            r.forward = types.MethodType(remote_code_router_forward, r)
        expected["variant_router_bias_in_weights"] = {
            "note": "Same checkpoint, but with the router of Moonshot's bundled modeling_kimi.py: expert weights "
            "gathered from the bias-corrected scores (sigmoid + e_score_correction_bias) and masked groups "
            "filled with 0.0. The top-level references use transformers' router (unbiased sigmoid weights, "
            "-inf group mask), which matches vLLM and DeepSeek.",
            **greedy_reference(model, prompt_ids),
        }
    expected.update(
        {
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "tokenizers_version": tokenizers.__version__,
            "safetensors_version": safetensors.__version__,
            "reference_mode": "float32 compute on the bf16 checkpoint loaded with from_pretrained(dtype=float32), "
            "attn_implementation eager, full forward per step with use_cache=False",
        }
    )
    return expected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tok_tmp:
        tok_dir = Path(tok_tmp)
        build_tokenizer(tok_dir)
        for name, spec in FIXTURES.items():
            folder = save_fixture(name, spec, args.out, tok_dir)
            expected = reference_outputs(folder)
            (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
            size = sum(f.stat().st_size for f in folder.iterdir())
            assert size < MAX_FIXTURE_BYTES, (name, size)
            print(
                f"{name}: max|logit| {expected['max_abs_logit']:.4f}  min margin {min(expected['margins']):.5f}  "
                f"greedy {expected['greedy_ids']}  size {size} B"
            )
            assert math.isfinite(expected["max_abs_logit"])
            variant = expected.get("variant_router_bias_in_weights")
            if variant:
                print(
                    f"{name} (router bias in weights): max|logit| {variant['max_abs_logit']:.4f}  "
                    f"min margin {min(variant['margins']):.5f}  greedy {variant['greedy_ids']}"
                )


if __name__ == "__main__":
    main()
