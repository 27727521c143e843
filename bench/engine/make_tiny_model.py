"""Build a tiny random-weight Llama model that vLLM's CPU build can serve (docs/real-engine.md).

No model hub is reachable here, so the model is made locally:

* a byte-level BPE tokenizer trained with ``tokenizers`` on the Python standard
  library's sources (vocab 8,192 with the ChatML specials), saved as
  ``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML ``chat_template``;
* a random ``LlamaForCausalLM`` (hidden 512, 4 layers, 8 heads, ~22M parameters),
  saved in bf16 with ``save_pretrained``.

The weights are random, so the text it generates is noise; what matters is that
prefill cost and the prefix cache behave as in a real engine.

Run with the engine's interpreter (it has torch):
    .engine/bin/python bench/engine/make_tiny_model.py --out .engine/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_texts(limit_bytes: int) -> Iterator[str]:
    """Python sources of the standard library, in a fixed order, up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def build_tokenizer(out: Path, corpus_bytes: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(corpus_bytes), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 8192,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def build_model(out: Path, seed: int) -> None:
    import torch  # type: ignore[import-not-found,unused-ignore]  # .engine only
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1536,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.1f}M parameters -> {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(".engine", "tiny-llama"))
    p.add_argument("--corpus-mb", type=float, default=8.0, help="stdlib text to train on")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build_tokenizer(out, int(args.corpus_mb * 1e6))
    print(f"tokenizer: {time.monotonic() - t0:.1f}s")
    build_model(out, args.seed)
    print(f"done in {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
