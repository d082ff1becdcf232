"""What the TRL anchors of scripts/bench-rlhf.sh share: the step clock and the training arguments
that match rtrun's runs (fp32 on the CPU, no gradient checkpointing, AdamW betas (0.9, 0.95),
grad-norm clip 1.0, cosine schedule with a 5 % warm-up, one log line per step), and the JSON
line each prints last."""

from __future__ import annotations

import statistics
import time

from transformers import TrainerCallback


class Clock(TrainerCallback):
    """The wall time at the end of every optimizer step and the logged losses."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.start = time.perf_counter()

    def on_step_end(self, _args, state, control, **kwargs):  # noqa: ANN001
        self.ends.append(time.perf_counter())

    def on_log(self, _args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def report(self, mean_tokens: float, batch: int) -> dict:
        """Seconds per step and tokens per second over every step but the first (warm-up)."""
        ends = [self.start] + self.ends
        steps = [b - a for a, b in zip(ends, ends[1:])][1:]
        seconds = sum(steps)
        return {
            "seconds_per_step_median": statistics.median(steps),
            "tokens_per_s": mean_tokens * batch * len(steps) / seconds,
            "units_per_s": batch * len(steps) / seconds,
            "steps_timed": len(steps),
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": self.losses[-1] if self.losses else None,
        }


def training_args(args, out: str) -> dict:  # noqa: ANN001
    """Keyword arguments of an SFT/Reward/DPO config for `args` (steps, batch, micro, lr, seed)."""
    return dict(
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
