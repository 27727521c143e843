"""Build LoRA adapters for the tiny local model, so vLLM can serve them (``--enable-lora``).

The adapters are random (PEFT initialises ``lora_B`` to zero, here perturbed so an adapter
changes the model's output): what matters is that vLLM loads them, lists them in
``/v1/models`` and keys their KV cache apart from the base model's.

Run with the engine's interpreter (it has torch; ``pip install peft`` into it):
    .engine/bin/python bench/engine/make_lora.py --model .engine/tiny-llama \\
        --out .engine/lora-sql .engine/lora-chat
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="base model directory")
    p.add_argument("--out", nargs="+", required=True, help="one directory per adapter")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, out in enumerate(args.out):
        torch.manual_seed(1000 + i)
        base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        config = LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        model.save_pretrained(out)
        print(f"adapter {i}: rank {args.rank} -> {out}")


if __name__ == "__main__":
    main()
