#!/usr/bin/env python3
"""Training throughput of TRL's SFTTrainer on CPU: the anchor for `train --mode sft`.

It fine-tunes a Hugging Face checkpoint on a GSM8K-format JSONL file (`{"question", "answer"}`
per line) as conversational prompt/completion records, the loss on the completion only, the
batch shape of `deploy/examples/pipeline/sft-hf.yaml` as scripts/bench-rlhf.sh runs it (32 samples
per optimizer step as 4 micro-batches of 8, max_length 256, no packing: TRL's packing isolates
samples only under flash-attention, which a CPU does not have), fp32, no gradient checkpointing
(TRL turns it on by default), AdamW betas (0.9, 0.95), grad-norm clip 1.0. It times every
optimizer step (the first is warm-up and not timed) and prints, as JSON on the last line:

    {"trl_sft_version", "seconds_per_step_median", "tokens_per_s", "units_per_s",
     "mean_tokens_per_sample", "steps_timed", "loss_first", "loss_last", "losses", "lora_rank"}

With --lora-rank R it trains peft LoRA adapters instead (rank R, --lora-alpha, dropout 0, on
every linear projection of the decoder, peft's `all-linear`): the anchor of `model.lora`.

tokens_per_s counts every real (non-padding) token of the steps timed: the dataset's mean
tokenized length x samples per step x steps / their wall seconds.

    ~/.cache/rtrun/bench-venv/bin/python scripts/bench/trl_sft_anchor.py \\
        --model WT/model --data WT/data/train.jsonl --steps 30 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_common import Clock, training_args
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in open(args.data) if line.strip()]
    dataset = Dataset.from_list([
        {
            "prompt": [{"role": "user", "content": r["question"]}],
            "completion": [{"role": "assistant", "content": r["answer"]}],
        }
        for r in records
    ])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(packing=False, completion_only_loss=True, **training_args(args, out))
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
            peft_config=peft_config,
        )
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
        clock.start = time.perf_counter()
        trainer.train()
    mean_tokens = statistics.mean(lengths)
    print(json.dumps({"trl_sft_version": trl.__version__, "mean_tokens_per_sample": mean_tokens,
                      "lora_rank": args.lora_rank, "losses": clock.losses,
                      **clock.report(mean_tokens, args.batch)}))


if __name__ == "__main__":
    main()
