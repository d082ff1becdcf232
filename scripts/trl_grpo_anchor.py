#!/usr/bin/env python3
"""Wall time of one GRPO rollout step with TRL's GRPOTrainer on CPU: the anchor for rtrun-rlhf.

It trains a Hugging Face checkpoint on a GSM8K-format JSONL file (`{"question", "answer"}` per
line) with the same batch shape as `deploy/examples/rlhf/grpo-hf.yaml` (learning rate 3e-4 here and
in the rtrun run it is timed against: `--set train.actor_lr=0.0003`), times
every rollout (16 prompts x 8 samples = 128 completions, then 4 optimizer steps on them) and prints,
as JSON on the last line of stdout:

    {"trl_version", "seconds_per_rollout_mean", "seconds_per_rollout_median", "rollouts_timed",
     "reward_first5", "reward_last5", "seconds_per_rollout_min", "cpu_seconds_per_rollout_mean"}

The first rollout is warm-up and is not timed. Rewards are the mean `math_answer` reward of the
128 completions of each rollout (first and last 5 rollouts, warm-up included). The last two keys
help read a run on a shared machine, where other work inflates wall times: there the median and
the minimum are the better anchor, and process CPU time (all threads) is less disturbed. The lines
`rollout_seconds`, `rollout_cpu_seconds` and `rollout_rewards` before the JSON list every rollout.

Run it with a Python that has TRL 1.16 (transformers 5, torch 2, datasets), e.g.:

    nice -n 10 ~/.cache/rtrun/parity-venv/bin/python scripts/trl_grpo_anchor.py \\
        --model /tmp/wt-trl/model --data /tmp/wt/data/train.jsonl --steps 20

How our run maps onto TRL 1.16's batching (see `GRPOConfig.__post_init__` and
`GRPOTrainer._prepare_inputs` / `_get_train_sampler` in the installed trl):

    ours (grpo-hf.yaml)               TRL
    prompts_per_step 16, n_samples 8  num_generations=8, generation_batch_size=128
    micro_batch_size 32               per_device_train_batch_size=32 (completions, not prompts)
    train_batch_size 64               gradient_accumulation_steps=2 (2 x 32 = 64 per optimizer step)
    128 samples / 64 = 2 opt. steps   steps_per_generation=4 (128 / 32 micro-batches; TRL derives it
                                      from generation_batch_size, only one of the two may be set)
    max_epochs 2                      num_iterations=2 (mu: each generation batch is used twice)
    max_steps (rollouts)              max_steps = rollouts x 4 (TRL counts optimizer steps)

TRL regenerates every `steps_per_generation * num_iterations` = 8 micro-batches = 4 optimizer
steps, so one rollout of 128 completions is followed by 4 optimizer steps of 64 completions. The
Trainer's `global_step` (what `max_steps`, logging and `on_step_end` count) is one *optimizer*
step, not a rollout; the script converts: the time of rollout k is the time between the ends of
optimizer steps 4k and 4(k+1). Because `gradient_accumulation_steps` (2) is not a multiple of 8,
TRL computes the old-policy log-probs after generation, as we do for the clipped ratio.

Differences from our trainer that remain: TRL shuffles the 128 completions once per rollout and
reuses the same 4 micro-batches in both epochs (we may reshuffle per epoch); its group std gets
+1e-4 (ours +1e-9). Other settings matched: `loss_type="grpo"` (each sequence's token mean, then the
mean over sequences; closest to plain GRPO), `scale_rewards="group"` (group-normalised advantages),
`beta=0.001` with TRL's k3 KL as a loss term, clip eps 0.2, AdamW betas (0.9, 0.95), weight decay 0,
grad-norm clip 1.0, fp32, no activation checkpointing
(TRL turns it on by default), no vLLM, 2 torch threads.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time

import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

PROMPTS_PER_ROLLOUT = 16
SAMPLES_PER_PROMPT = 8
MICRO_BATCH = 32
TRAIN_BATCH = 64
EPOCHS = 2
COMPLETIONS_PER_ROLLOUT = PROMPTS_PER_ROLLOUT * SAMPLES_PER_PROMPT  # 128
OPTIMIZER_STEPS_PER_ROLLOUT = COMPLETIONS_PER_ROLLOUT // TRAIN_BATCH * EPOCHS  # 4


# --- math_answer: a line-by-line port of rlhf/train/src/reward.rs -------------------------------

# What Rust's `str::parse::<f64>` accepts (ASCII only, no `_`, no surrounding whitespace).
_RUST_FLOAT = re.compile(
    r"[+-]?(?:inf|infinity|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.IGNORECASE | re.ASCII
)


def _rust_f64(text: str) -> float | None:
    return float(text) if _RUST_FLOAT.fullmatch(text) else None


def last_number(text: str) -> str | None:
    """The last number-like run (`-1,234.5`, `3/4`) in `text`."""
    digits = "0123456789"
    end = len(text)
    while end > 0 and text[end - 1] not in digits:
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and (text[start - 1] in digits or text[start - 1] in ".,/"):
        start -= 1
    if start > 0 and text[start - 1] == "-":
        start -= 1
    return text[start:end].lstrip(",./")


def marked_answer(text: str) -> str | None:
    """The answer after the last `####` (its line's last number) or in the last `\\boxed{..}`."""
    i = text.rfind("####")
    if i >= 0:
        return last_number(text[i + 4 :].split("\n", 1)[0])
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    start = i + len("\\boxed{")
    depth = 1
    for offset, c in enumerate(text[start:]):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : start + offset].strip()
    return None


def final_answer(text: str) -> str | None:
    """After the last `####`, else the last `\\boxed{..}`, else the last number in the text."""
    marked = marked_answer(text)
    return marked if marked is not None else last_number(text)


def parse_number(text: str) -> float | None:
    """Thousands separators, `$`, a trailing `.` or `%`, simple fractions and decimals."""
    t = text.strip().lstrip("$").rstrip(".%")
    t = "".join(c for c in t if c not in ", $")
    for prefix in ("\\frac{", "\\dfrac{"):
        if t.startswith(prefix):
            rest = t[len(prefix) :].rstrip("}")
            if "}{" not in rest:
                return None
            num, den = rest.split("}{", 1)
            t = f"{num}/{den}"
            break
    if "/" in t:
        num, den = t.split("/", 1)
        n, d = _rust_f64(num), _rust_f64(den)
        if n is None or d is None or d == 0.0:
            return None
        return n / d
    x = _rust_f64(t)
    return x if x is not None and math.isfinite(x) else None


def math_answer_score(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label's (relative 1e-6), else 0.0."""
    expected = final_answer(label)
    expected = parse_number(expected) if expected is not None else None
    given = final_answer(response)
    given = parse_number(given) if given is not None else None
    if expected is None or given is None:
        return 0.0
    return 1.0 if abs(expected - given) <= 1e-6 * max(abs(expected), 1.0) else 0.0


def _self_test() -> None:
    label = "She has 3 + 4 = 7 apples.\n#### 7"
    cases = [
        ("3 + 4 = 7\n#### 7", label, 1.0),
        ("The answer is \\boxed{7}.", label, 1.0),
        ("so 7 apples", label, 1.0),
        ("3 + 4 = 7 #### 8", label, 0.0),
        ("no idea", label, 0.0),
        ("#### 1,234", "1234", 1.0),
        ("\\boxed{\\frac{3}{4}}", "#### 0.75", 1.0),
        ("#### 3/4", "0.75", 1.0),
        ("It costs $-5.", "#### -5", 1.0),
        ("#### 7", "no number", 0.0),
    ]
    for response, lab, want in cases:
        got = math_answer_score(response, lab)
        assert got == want, (response, lab, got, want)
    assert parse_number("1,000.") == 1000.0
    assert parse_number("1/0") is None


# --- the TRL run ---------------------------------------------------------------------------------

class RolloutRecorder:
    """The reward function: scores with `math_answer` and keeps each rollout's mean reward."""

    def __init__(self) -> None:
        self.rollout_rewards: list[float] = []
        self.__name__ = "math_answer"

    def __call__(self, prompts, completions, answer, **kwargs) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        rewards = [math_answer_score(t, label) for t, label in zip(texts, answer, strict=True)]
        self.rollout_rewards.append(sum(rewards) / len(rewards))
        return rewards


class StepTimer(TrainerCallback):
    """Wall and process CPU time at the start of training and the end of every optimizer step."""

    def __init__(self) -> None:
        self.start = (0.0, 0.0)
        self.step_ends: list[tuple[float, float]] = []

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(self._now())

    def rollout_seconds(self) -> tuple[list[float], list[float]]:
        """(wall, CPU) seconds of each rollout, i.e. of each OPTIMIZER_STEPS_PER_ROLLOUT steps."""
        per = OPTIMIZER_STEPS_PER_ROLLOUT
        ends = [self.start] + self.step_ends[per - 1 :: per]
        wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
        cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
        return wall, cpu


def load_prompts(path: str) -> Dataset:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                prompt = [{"role": "user", "content": record["question"]}]
                rows.append({"prompt": prompt, "answer": record["answer"]})
    return Dataset.from_list(rows)


def held_out_reward(model, tokenizer, path: str, max_new_tokens: int) -> float:
    """Mean `math_answer` reward of greedy answers to every prompt of `path`: what our trainer's
    `evaluate` reports as `eval/reward` (greedy, the chat template, stop at eos)."""
    records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    scores = []
    model.eval()
    for start in range(0, len(records), 64):
        chunk = records[start : start + 64]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["question"]}], tokenize=False,
                add_generation_prompt=True,
            )
            for r in chunk
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += [math_answer_score(a, r["answer"]) for a, r in zip(answers, chunk, strict=True)]
    tokenizer.padding_side = side
    model.train()
    return sum(scores) / max(len(scores), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--data", required=True, help="GSM8K-format JSONL: question, answer")
    parser.add_argument(
        "--steps", type=int, default=20, help="rollouts (our max_steps), warm-up included"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--eval-data", help="held-out JSONL: greedy reward before and after training"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first rollout is warm-up)")

    _self_test()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)

    reward = RolloutRecorder()
    timer = StepTimer()
    output_dir = tempfile.TemporaryDirectory(prefix="trl-grpo-anchor-")  # nothing is saved there
    config = GRPOConfig(
        output_dir=output_dir.name,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL defaults to True; we do not recompute activations
        # Batch shape: 128 completions per rollout, 4 optimizer steps of 64 on them (see docstring).
        num_generations=SAMPLES_PER_PROMPT,
        generation_batch_size=COMPLETIONS_PER_ROLLOUT,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=TRAIN_BATCH // MICRO_BATCH,
        num_iterations=EPOCHS,
        max_steps=args.steps * OPTIMIZER_STEPS_PER_ROLLOUT,
        # Generation.
        max_completion_length=24,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # Loss.
        loss_type="grpo",
        scale_rewards="group",
        beta=0.001,
        epsilon=0.2,
        # Optimizer.
        learning_rate=3e-4,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        # Ours is constant after warm-up (OpenRLHF's `constant_with_warmup`, no warm-up here).
        lr_scheduler_type="constant",
        # Bookkeeping.
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # What a user calls. For a `qwen2` config transformers 5 builds its code-defined
    # `Qwen2Tokenizer`; the walkthrough's tokenizer.json uses Qwen2's own pre-tokenizer, so it
    # tokenizes exactly as rtrun does (rlhf/train/tests/hf/walkthrough_tokens.json holds that).
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(
        model=args.model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=load_prompts(args.data),
        callbacks=[timer],
    )
    shape = {
        key: getattr(config, key)
        for key in (
            "generation_batch_size",
            "steps_per_generation",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_iterations",
            "max_steps",
        )
    }
    shape["eos_token_ids"] = trainer.eos_token_ids
    shape["pad_token_id"] = trainer.processing_class.pad_token_id
    shape["torch_threads"] = torch.get_num_threads()
    print("config " + json.dumps(shape), flush=True)
    evals = {}
    if args.eval_data:
        evals["heldout_reward_start"] = held_out_reward(
            trainer.model, trainer.processing_class, args.eval_data, config.max_completion_length
        )
    trainer.train()
    if args.eval_data:
        evals["heldout_reward_end"] = held_out_reward(
            trainer.model, trainer.processing_class, args.eval_data, config.max_completion_length
        )

    seconds, cpu_seconds = timer.rollout_seconds()
    if len(reward.rollout_rewards) != len(seconds):
        print(
            f"warning: {len(reward.rollout_rewards)} reward calls for {len(seconds)} rollouts",
            file=sys.stderr,
        )
    print("rollout_seconds " + json.dumps([round(s, 3) for s in seconds]), flush=True)
    print("rollout_cpu_seconds " + json.dumps([round(s, 3) for s in cpu_seconds]), flush=True)
    rewards = reward.rollout_rewards
    print("rollout_rewards " + json.dumps([round(r, 4) for r in rewards]), flush=True)
    timed = seconds[1:]
    result = {
        "trl_version": trl.__version__,
        "seconds_per_rollout_mean": statistics.mean(timed),
        "seconds_per_rollout_median": statistics.median(timed),
        "rollouts_timed": len(timed),
        "seconds_per_rollout_min": min(timed),
        "cpu_seconds_per_rollout_mean": statistics.mean(cpu_seconds[1:]),
        "reward_first5": statistics.mean(rewards[:5]),
        "reward_last5": statistics.mean(rewards[-5:]),
        **evals,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
