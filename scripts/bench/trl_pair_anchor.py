#!/usr/bin/env python3
"""Training throughput of TRL's RewardTrainer or DPOTrainer on CPU: the anchors for
`train --mode rm` and `train --mode dpo`.

It trains a Hugging Face checkpoint on the walkthrough's preference pairs (`{"question",
"chosen", "rejected"}` per line) as conversational preference records, with the batch shape of
`deploy/examples/pipeline/rm-hf.yaml` / `dpo-hf.yaml` as scripts/bench-rlhf.sh runs them: 32 pairs
per optimizer step as 4 micro-batches of 8 pairs, max_length 256, fp32, no gradient checkpointing
(TRL turns it on by default), AdamW betas (0.9, 0.95), grad-norm clip 1.0; DPO with beta 0.1, the
sigmoid loss and a reference model evaluated every step (as rtrun's ranks do; no precomputed
reference log-probs). The reward model is `AutoModelForSequenceClassification` with one label
on the same checkpoint (a fresh score head). It times every optimizer step (the first is warm-up
and not timed) and prints, as JSON on the last line:

    {"trl_version", "trainer", "seconds_per_step_median", "tokens_per_s", "pairs_per_s",
     "mean_tokens_per_pair", "steps_timed", "loss_first", "loss_last"}

tokens_per_s counts both sequences of every pair (prompt and response each): the tokenized
dataset's mean per pair x pairs per step x steps / their wall seconds.

    ~/.cache/rtrun/bench-venv/bin/python scripts/bench/trl_pair_anchor.py --trainer dpo \\
        --model WT/model --data WT/data/preference_train.jsonl --steps 30 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["rm", "dpo"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer, TrainerCallback)

    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in open(args.data) if line.strip()]
    dataset = Dataset.from_list([
        {
            "prompt": [{"role": "user", "content": r["question"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in records
    ])
    tokenizer = AutoTokenizer.from_pretrained(args.model)

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
    common = dict(
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
    with tempfile.TemporaryDirectory() as out:
        if args.trainer == "rm":
            from trl import RewardConfig, RewardTrainer

            model = AutoModelForSequenceClassification.from_pretrained(
                args.model, num_labels=1, dtype=torch.float32)
            model.config.pad_token_id = tokenizer.pad_token_id
            trainer = RewardTrainer(model=model, args=RewardConfig(output_dir=out, **common),
                                    train_dataset=dataset, processing_class=tokenizer,
                                    callbacks=[clock])
            data = trainer.train_dataset
            lengths = [len(c) + len(r) for c, r in zip(data["chosen_ids"], data["rejected_ids"])]
        else:
            from trl import DPOConfig, DPOTrainer

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            config = DPOConfig(output_dir=out, beta=0.1, loss_type=["sigmoid"], **common)
            trainer = DPOTrainer(model=model, args=config, train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[clock])
            data = trainer.train_dataset
            # Responses without the prompt: each of the pair's two sequences holds it.
            lengths = [2 * len(p) + len(c) + len(r) for p, c, r in
                       zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])]
        start = time.perf_counter()
        trainer.train()
    mean_tokens = statistics.mean(lengths)
    ends = [start] + clock.ends
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]
    seconds = sum(steps)
    print(json.dumps({
        "trl_version": trl.__version__,
        "trainer": args.trainer,
        "seconds_per_step_median": statistics.median(steps),
        "tokens_per_s": mean_tokens * args.batch * len(steps) / seconds,
        "pairs_per_s": args.batch * len(steps) / seconds,
        "mean_tokens_per_pair": mean_tokens,
        "steps_timed": len(steps),
        "loss_first": clock.losses[0] if clock.losses else None,
        "loss_last": clock.losses[-1] if clock.losses else None,
    }))


if __name__ == "__main__":
    main()
