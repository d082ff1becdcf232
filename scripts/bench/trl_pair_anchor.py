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

    {"trl_version", "trainer", "seconds_per_step_median", "tokens_per_s", "units_per_s",
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
                              AutoTokenizer)

    from trl_common import Clock, training_args

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

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        if args.trainer == "rm":
            from trl import RewardConfig, RewardTrainer

            model = AutoModelForSequenceClassification.from_pretrained(
                args.model, num_labels=1, dtype=torch.float32)
            model.config.pad_token_id = tokenizer.pad_token_id
            trainer = RewardTrainer(model=model, args=RewardConfig(**training_args(args, out)),
                                    train_dataset=dataset, processing_class=tokenizer,
                                    callbacks=[clock])
            data = trainer.train_dataset
            lengths = [len(c) + len(r) for c, r in zip(data["chosen_ids"], data["rejected_ids"])]
        else:
            from trl import DPOConfig, DPOTrainer

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            config = DPOConfig(beta=0.1, loss_type=["sigmoid"], **training_args(args, out))
            trainer = DPOTrainer(model=model, args=config, train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[clock])
            data = trainer.train_dataset
            # Responses without the prompt: each of the pair's two sequences holds it.
            lengths = [2 * len(p) + len(c) + len(r) for p, c, r in
                       zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])]
        clock.start = time.perf_counter()
        trainer.train()
    mean_tokens = statistics.mean(lengths)
    print(json.dumps({"trl_version": trl.__version__, "trainer": args.trainer,
                      "mean_tokens_per_pair": mean_tokens, **clock.report(mean_tokens, args.batch)}))


if __name__ == "__main__":
    main()
