#!/usr/bin/env python3
"""Training throughput of TRL's SFTTrainer on CPU: the anchor for `train --mode sft`.

It fine-tunes a Hugging Face checkpoint on a GSM8K-format JSONL file (`{"question", "answer"}`
per line) as conversational prompt/completion records, the loss on the completion only, the
batch shape of `deploy/examples/pipeline/sft-hf.yaml` as scripts/bench-rlhf.sh runs it (32 samples
per optimizer step as 4 micro-batches of 8, max_length 256, no packing: TRL's packing isolates
samples only under flash-attention, which a CPU does not have), fp32, no gradient checkpointing
(TRL turns it on by default), AdamW betas (0.9, 0.95), grad-norm clip 1.0. It times every
optimizer step (the first is warm-up and not timed) and prints, as JSON on the last line:

    {"trl_sft_version", "seconds_per_step_median", "tokens_per_s", "samples_per_s",
     "mean_tokens_per_sample", "steps_timed", "loss_first", "loss_last"}

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
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
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

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_step_end(self, _args, state, control, **kwargs):  # noqa: ANN001
            self.ends.append(time.perf_counter())

        def on_log(self, _args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.batch // args.micro,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, round(0.05 * args.steps)),
            adam_beta1=0.9,
            adam_beta2=0.95,
            weight_decay=0.0,
            max_grad_norm=1.0,
            max_length=256,
            packing=False,
            completion_only_loss=True,
            gradient_checkpointing=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
        start = time.perf_counter()
        trainer.train()
    mean_tokens = statistics.mean(lengths)
    ends = [start] + clock.ends
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]
    seconds = sum(steps)
    print(json.dumps({
        "trl_sft_version": trl.__version__,
        "seconds_per_step_median": statistics.median(steps),
        "tokens_per_s": mean_tokens * args.batch * len(steps) / seconds,
        "samples_per_s": args.batch * len(steps) / seconds,
        "mean_tokens_per_sample": mean_tokens,
        "steps_timed": len(steps),
        "loss_first": clock.losses[0] if clock.losses else None,
        "loss_last": clock.losses[-1] if clock.losses else None,
    }))


if __name__ == "__main__":
    main()
