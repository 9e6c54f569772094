"""Write a config-only Hugging Face cache for the models vLLM's scheduler tests name.

vLLM's scheduler tests build a ``ModelConfig`` for a named model, which reads
that model's ``config.json`` from the Hugging Face hub; nothing loads weights or
(with ``skip_tokenizer_init``) a tokenizer.  Offline, ``huggingface_hub``
resolves ``ORG/NAME`` through its cache folder:

    HF_HOME/hub/models--ORG--NAME/refs/main            -> a revision id
    HF_HOME/hub/models--ORG--NAME/snapshots/<rev>/config.json

This script writes that layout, the ``config.json`` files generated from
``transformers``' own config classes with the architecture-defining fields of
the real checkpoints (layer counts, head counts, hidden sizes, context length,
dtype).  Then run with ``HF_HOME=DIR HF_HUB_OFFLINE=1``.

Usage::

    python hf_cache.py DIR          # writes DIR/hub/...
    python hf_cache.py --list       # the models it provides
"""

from __future__ import annotations

import json
import os
import sys

# A fixed, fake revision: the cache only needs refs/main to name a snapshot folder.
REVISION = "0" * 40


def _opt_125m():
    from transformers import OPTConfig

    return OPTConfig(architectures=["OPTForCausalLM"], hidden_size=768, num_hidden_layers=12,
                     ffn_dim=3072, num_attention_heads=12, word_embed_proj_dim=768,
                     max_position_embeddings=2048, vocab_size=50272, dtype="float16")


def _opt_350m():
    from transformers import OPTConfig

    return OPTConfig(architectures=["OPTForCausalLM"], hidden_size=1024, num_hidden_layers=24,
                     ffn_dim=4096, num_attention_heads=16, word_embed_proj_dim=512,
                     do_layer_norm_before=False, max_position_embeddings=2048,
                     vocab_size=50272, dtype="float16")


def _qwen3_0_6b():
    # vLLM's ModelConfig() default model.
    from transformers import Qwen3Config

    return Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                       dtype="bfloat16")


def _qwen1_5_7b():
    from transformers import Qwen2Config

    return Qwen2Config(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, max_position_embeddings=32768,
                       use_sliding_window=False, sliding_window=32768, max_window_layers=28,
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
                       dtype="bfloat16")


def _llava_1_5_7b():
    from transformers import LlavaConfig

    return LlavaConfig(architectures=["LlavaForConditionalGeneration"], image_token_index=32000,
                       text_config={"model_type": "llama", "vocab_size": 32064,
                                    "max_position_embeddings": 4096},
                       vision_config={"model_type": "clip_vision_model", "hidden_size": 1024,
                                      "intermediate_size": 4096, "num_hidden_layers": 24,
                                      "num_attention_heads": 16, "image_size": 336,
                                      "patch_size": 14, "projection_dim": 768},
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       dtype="float16")


def _qwen3_next_80b():
    # Hybrid (linear + full attention); transformers' defaults are this checkpoint's shape.
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], max_position_embeddings=262144,
                           dtype="bfloat16")


MODELS = {
    "facebook/opt-125m": _opt_125m,
    "facebook/opt-350m": _opt_350m,
    "Qwen/Qwen3-0.6B": _qwen3_0_6b,
    "Qwen/Qwen1.5-7B": _qwen1_5_7b,
    "llava-hf/llava-1.5-7b-hf": _llava_1_5_7b,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": _qwen3_next_80b,
}


def _write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_model(root: str, repo: str, config) -> str:
    base = os.path.join(root, "hub", "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", REVISION)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    _write_if_changed(os.path.join(base, "refs", "main"), REVISION)
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    path = os.path.join(snap, "config.json")
    _write_if_changed(path, text)
    return path


def write_cache(root: str) -> list[str]:
    return [write_model(root, repo, make()) for repo, make in MODELS.items()]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--list"]:
        print("\n".join(MODELS))
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    paths = write_cache(args[0])
    print(f"hf_cache: {len(paths)} model configs in {os.path.join(args[0], 'hub')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
