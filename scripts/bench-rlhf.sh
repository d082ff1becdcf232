#!/usr/bin/env bash
# rtrun's RLHF application against the tools its users would pick instead, back to back on this
# machine, printed as one table of ratios (issue 15's benchmark):
#
#   1. the generation engine vs Hugging Face `generate` (with its KV cache): the same random-weight
#      HF checkpoints (a ~0.5M and a ~27M Qwen2) and prompts, greedy, 64 new tokens, batch 1/16/64,
#      the same intra-op thread count, best of ROUNDS rounds each, the two sides alternating; the
#      engine's tokens are checked identical to HF's;
#   2. the main job's GRPO step vs TRL's GRPOTrainer, from the same initial checkpoint (the
#      no-download walkthrough policy) on the same data, reward and hyper-parameters, for SEEDS
#      seeds: wall seconds per rollout step (median, warm-up excluded) and the held-out greedy
#      reward before and after;
#   3. `train --mode sft` vs TRL's SFTTrainer, from the same untrained walkthrough checkpoint on
#      the same prompt/completion data (chat template, loss on the completion), 32 samples per
#      optimizer step in micro-batches of 8, for SEEDS seeds: training tokens per second, rtrun
#      as one rank unpacked (TRL's shape), one rank packed, and two DP ranks packed;
#   3b. (part `lora`) `train --mode sft` with `model.lora` vs TRL's SFTTrainer with a peft LoRA
#      config, same rank (16), alpha (32) and targets (every decoder projection), same checkpoint,
#      data and batch shape as 3, one rank unpacked: training tokens per second and both loss
#      curves;
#   4. `train --mode rm` vs TRL's RewardTrainer and `train --mode dpo` vs TRL's DPOTrainer, from
#      the same SFT'd walkthrough checkpoint on the same preference pairs, 32 pairs per step in
#      micro-batches of 8: training tokens per second (rtrun one rank unpacked, two ranks
#      packed); and the exported reward model loaded by transformers'
#      AutoModelForSequenceClassification, its held-out accuracy beside rtrun's.
#   5. (part `streamed`, issue 43) the main job's GRPO (deploy/examples/rlhf/grpo.yaml) three
#      ways from the same seed and data: sync, `rollout.mode: async` with `max_staleness: 1`
#      (held-out reward every 16 steps: the wall time at which async first reaches the sync
#      run's final reward, over the sync run's wall time), the same async run with
#      `train.pipeline: dock` (groups stream into the TransferDock), and with a long tail of responses
#      (3% of the prompts 100-200 digits long, `max_new_tokens` 256) with and without
#      `rollout.partial_threshold: 0.8` (mean step time). Each run's phase medians are
#      printed (the timeline that says what limits the overlap).
#   6. (part `tools`, issue 43) deploy/examples/rlhf/grpo-tools.yaml from the walkthrough
#      checkpoint warmed up to call the calculator (250 steps: it calls the tool but answers
#      most problems wrong, so the tool helps without solving the task), with the tool and
#      with `tools.enabled: []` (the same checkpoint answering alone): held-out accuracy
#      before, every 20 steps and after.
#
# Usage: scripts/bench-rlhf.sh [--quick]
#   --quick: 1 round, 1 seed, 12 rollout steps (a smoke run of the script; not a measurement).
# Environment: BENCH_DIR (default ~/.cache/rtrun/bench-rlhf), THREADS (default: every core),
#   ROUNDS (3), SEEDS ("1 2 3"), STEPS (40 rollout / SFT / RM / DPO steps per run), PARTS
#   ("engine grpo sft lora pairs streamed tools": which
#   halves to run; the report then covers those), BENCH_VENV (a venv that
#   already has them, e.g. the parity venv of rlhf/model/parity).
# Python side: transformers 5.23, TRL 1.16 and torch 2.13 from PyPI in ~/.cache/rtrun/bench-venv,
# installed on first use. Nothing else is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ROUNDS=${ROUNDS:-3}
SEEDS=${SEEDS:-"1 2 3"}
STEPS=${STEPS:-40}
if [[ "${1:-}" == "--quick" ]]; then
    ROUNDS=1 SEEDS=1 STEPS=12
fi
THREADS=${THREADS:-$(nproc)}
BENCH_DIR=${BENCH_DIR:-$HOME/.cache/rtrun/bench-rlhf}
VENV=${BENCH_VENV:-$HOME/.cache/rtrun/bench-venv}
PARTS=${PARTS:-"engine grpo sft lora pairs streamed tools"}
mkdir -p "$BENCH_DIR/runs"
REPORT=$BENCH_DIR/report.jsonl
: >"$REPORT"

# --- set-up ----------------------------------------------------------------------------------
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
if ! "$VENV/bin/python" -c "import transformers, trl, datasets" 2>/dev/null; then
    echo "bench: installing transformers and TRL into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0
    "$VENV/bin/pip" install --quiet "transformers==5.23.0" "trl==1.16.0" datasets accelerate safetensors
fi
if [[ " $PARTS " == *" lora "* ]] && ! "$VENV/bin/python" -c "import peft" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet "peft==0.21.2"
fi
PY=$VENV/bin/python
cargo build --release --quiet -p rtrun-rlhf-engine --example engine_bench
cargo build --release --quiet -p rtrun-rlhf --bin train --example make_walkthrough
ENGINE_BENCH=$ROOT/target/release/examples/engine_bench
TRAIN=$ROOT/target/release/train
echo "bench: $(nproc) cores, $THREADS threads per side, $ROUNDS rounds, seeds: $SEEDS" >&2

# --- 1. engine vs HF generate -------------------------------------------------------------------
if [[ " $PARTS " == *" engine "* ]]; then
GEN=$BENCH_DIR/generate
mkdir -p "$GEN"
"$PY" scripts/bench/hf_generate.py make "$GEN" >&2
for model in tiny 27m; do
    for _ in $(seq "$ROUNDS"); do
        # One round = one HF run and one engine run per batch size (the best of 2 inside each);
        # the engine run reads the tokens HF just wrote and checks its own against them.
        "$PY" scripts/bench/hf_generate.py generate "$GEN" "$model" 1,16,64 64 "$THREADS" 2 \
            2>/dev/null | grep '^{' >>"$REPORT"
        "$ENGINE_BENCH" --hf "$GEN" --models "$model" --batches 1,16,64 --max-tokens 64 \
            --threads "$THREADS" --repeats 2 >>"$REPORT"
    done
done
fi

# --- 2. GRPO step vs TRL GRPOTrainer ------------------------------------------------------------
if [[ " $PARTS " == *" grpo "* ]]; then
WT=$BENCH_DIR/walkthrough
if [[ ! -f $WT/model/config.json ]]; then
    "$ROOT/target/release/examples/make_walkthrough" "$WT" >&2
fi
for seed in $SEEDS; do
    run=$BENCH_DIR/runs/grpo-seed$seed
    rm -rf "$run"
    (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/rlhf/grpo-hf.yaml" \
        --set seed="$seed" --set run_dir="$run" \
        --set policy.pretrain="$WT/model" --set data.prompt_data="$WT/data/train.jsonl" \
        --set data.eval_data="$WT/data/test.jsonl" --set train.actor_lr=0.0003 \
        --set train.max_steps="$STEPS" --set eval.every_steps=0 --set checkpoint.every_steps=0 \
        >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
    "$PY" scripts/bench/summarize_run.py "$run" "$seed" >>"$REPORT"
    "$PY" scripts/trl_grpo_anchor.py --model "$WT/model" --data "$WT/data/train.jsonl" \
        --eval-data "$WT/data/test.jsonl" --steps "$STEPS" --threads "$THREADS" --seed "$seed" \
        2>"$BENCH_DIR/trl-seed$seed.log" | tail -1 | "$PY" -c \
        "import json,sys; r=json.load(sys.stdin); r['trl_seed']=$seed; print(json.dumps(r))" >>"$REPORT"
done
fi

# --- 3. SFT vs TRL SFTTrainer --------------------------------------------------------------------
if [[ " $PARTS " == *" sft "* ]]; then
SW=$BENCH_DIR/walkthrough-untrained
if [[ ! -f $SW/data/preference_train.jsonl ]]; then
    rm -rf "$SW" "$BENCH_DIR/runs/sft-for-pairs"
    "$ROOT/target/release/examples/make_walkthrough" "$SW" --warmup-steps 0 >&2
fi
for seed in $SEEDS; do
    "$PY" scripts/bench/trl_sft_anchor.py --model "$SW/model" --data "$SW/data/train.jsonl" \
        --steps "$STEPS" --threads "$THREADS" --seed "$seed" \
        2>"$BENCH_DIR/trl-sft-seed$seed.log" | tail -1 | "$PY" -c \
        "import json,sys; r=json.load(sys.stdin); r['trl_sft_seed']=$seed; print(json.dumps(r))" >>"$REPORT"
    for layout in "1 false" "1 true" "2 true"; do
        read -r ranks packing <<<"$layout"
        run=$BENCH_DIR/runs/sft-seed$seed-r$ranks-$packing
        rm -rf "$run"
        threads=$(( THREADS / ranks )); (( threads > 0 )) || threads=1
        (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/pipeline/sft-hf.yaml" \
            --set seed="$seed" --set run_dir="$run" --set model.pretrain="$SW/model" \
            --set data.train_data="$SW/data/train.jsonl" --set data.eval_data="$SW/data/test.jsonl" \
            --set cluster.replicas="$ranks" --set cluster.threads_per_worker="$threads" \
            --set train.packing="$packing" --set train.max_steps="$STEPS" \
            --set eval.every_steps=0 --set checkpoint.every_steps=0 \
            >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
        "$PY" scripts/bench/summarize_sft.py "$run" "$seed" "$ranks rank(s), packing $packing" >>"$REPORT"
    done
done
fi

# --- 3b. SFT with LoRA vs TRL's SFTTrainer with peft ---------------------------------------------
if [[ " $PARTS " == *" lora "* ]]; then
SW=$BENCH_DIR/walkthrough-untrained
if [[ ! -f $SW/data/preference_train.jsonl ]]; then
    rm -rf "$SW" "$BENCH_DIR/runs/sft-for-pairs"
    "$ROOT/target/release/examples/make_walkthrough" "$SW" --warmup-steps 0 >&2
fi
for seed in $SEEDS; do
    "$PY" scripts/bench/trl_sft_anchor.py --model "$SW/model" --data "$SW/data/train.jsonl" \
        --steps "$STEPS" --threads "$THREADS" --seed "$seed" --lora-rank 16 --lora-alpha 32 \
        2>"$BENCH_DIR/trl-lora-seed$seed.log" | tail -1 | "$PY" -c \
        "import json,sys; r=json.load(sys.stdin); r['trl_lora_seed']=$seed; print(json.dumps(r))" >>"$REPORT"
    run=$BENCH_DIR/runs/lora-seed$seed
    rm -rf "$run"
    (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/pipeline/sft-hf.yaml" \
        --set seed="$seed" --set run_dir="$run" --set model.pretrain="$SW/model" \
        --set data.train_data="$SW/data/train.jsonl" --set data.eval_data="$SW/data/test.jsonl" \
        --set cluster.replicas=1 --set cluster.threads_per_worker="$THREADS" \
        --set train.packing=false --set train.max_steps="$STEPS" \
        --set model.lora.rank=16 --set model.lora.alpha=32 \
        --set eval.every_steps=0 --set checkpoint.every_steps=0 \
        >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
    "$PY" scripts/bench/summarize_sft.py "$run" "$seed" "1 rank, LoRA r16" \
        | "$PY" -c "import json,sys; r=json.load(sys.stdin); r['lora']=True; print(json.dumps(r))" >>"$REPORT"
    # peft loads the exported adapter onto the base with the merged export's logits.
    "$PY" scripts/bench/peft_adapter_check.py "$run/final_policy" "$SW/model" | tail -1 >>"$REPORT"
done
fi

# --- 4. reward model and DPO vs TRL's RewardTrainer and DPOTrainer ------------------------------
if [[ " $PARTS " == *" pairs "* ]]; then
SW=$BENCH_DIR/walkthrough-untrained
if [[ ! -f $SW/data/preference_train.jsonl ]]; then
    rm -rf "$SW" "$BENCH_DIR/runs/sft-for-pairs"
    "$ROOT/target/release/examples/make_walkthrough" "$SW" --warmup-steps 0 >&2
fi
SFT=$BENCH_DIR/runs/sft-for-pairs
if [[ ! -f $SFT/final_policy/config.json ]]; then
    rm -rf "$SFT"
    (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/pipeline/sft-hf.yaml" \
        --set run_dir="$SFT" --set model.pretrain="$SW/model" \
        --set data.train_data="$SW/data/train.jsonl" --set data.eval_data="$SW/data/test.jsonl" \
        >"$SFT.log" 2>&1) || { tail -20 "$SFT.log" >&2; exit 1; }
fi
for mode in rm dpo; do
    lr=0.003; [[ $mode == dpo ]] && lr=0.001
    for seed in $SEEDS; do
        "$PY" scripts/bench/trl_pair_anchor.py --trainer "$mode" --model "$SFT/final_policy" \
            --data "$SW/data/preference_train.jsonl" --steps "$STEPS" --threads "$THREADS" \
            --seed "$seed" --lr "$lr" 2>"$BENCH_DIR/trl-$mode-seed$seed.log" | tail -1 | "$PY" -c \
            "import json,sys; r=json.load(sys.stdin); r['trl_pair_seed']=$seed; print(json.dumps(r))" >>"$REPORT"
        for layout in "1 false" "2 true"; do
            read -r ranks packing <<<"$layout"
            run=$BENCH_DIR/runs/$mode-seed$seed-r$ranks-$packing
            rm -rf "$run"
            threads=$(( THREADS / ranks )); (( threads > 0 )) || threads=1
            (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/pipeline/$mode-hf.yaml" \
                --set seed="$seed" --set run_dir="$run" --set model.pretrain="$SFT/final_policy" \
                --set data.train_data="$SW/data/preference_train.jsonl" \
                --set data.eval_data="$SW/data/preference_test.jsonl" \
                --set cluster.replicas="$ranks" --set cluster.threads_per_worker="$threads" \
                --set train.packing="$packing" --set train.max_steps="$STEPS" --set train.lr="$lr" \
                --set eval.every_steps=0 --set checkpoint.every_steps=0 \
                >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
            "$PY" scripts/bench/summarize_sft.py "$run" "$seed" "$ranks rank(s), packing $packing" \
                | "$PY" -c "import json,sys; r=json.load(sys.stdin); r['pair_mode']='$mode'; print(json.dumps(r))" >>"$REPORT"
        done
    done
    if [[ $mode == rm ]]; then
        "$PY" scripts/bench/hf_reward_model_check.py "$run/final_reward_model" \
            "$SW/data/preference_test.jsonl" "$run" 2>/dev/null | tail -1 >>"$REPORT"
    fi
done
fi

# --- 5. async and partial rollouts against the sync step ------------------------------------------
if [[ " $PARTS " == *" streamed "* ]]; then
STREAMED_STEPS=${STREAMED_STEPS:-256}
[[ "${1:-}" == "--quick" ]] && STREAMED_STEPS=24
for seed in $SEEDS; do
    for variant in sync async async-dock tail-sync tail-partial tail-sync-tokens tail-partial-tokens; do
        sets=(--set seed="$seed" --set train.max_steps="$STREAMED_STEPS" --set eval.every_steps=16
              --set checkpoint.every_steps=0)
        case $variant in
            async) sets+=(--set rollout.mode=async --set rollout.max_staleness=1) ;;
            # The same through the TransferDock: reward and reference stages score groups
            # while the policy trains.
            async-dock) sets+=(--set rollout.mode=async --set rollout.max_staleness=1
                               --set train.pipeline=dock) ;;
            tail-*) sets+=(--set rollout.max_new_tokens=256 --set data.synthetic.long_tail.share=0.03
                           --set data.synthetic.long_tail.min_digits=100
                           --set data.synthetic.long_tail.max_digits=200
                           --set train.max_steps=$(( STREAMED_STEPS / 4 )) --set eval.every_steps=0) ;;
        esac
        [[ $variant == tail-partial* ]] && sets+=(--set rollout.partial_threshold=0.8)
        # Micro-batches by token budget (a long group costs its own positions): both sides.
        [[ $variant == *-tokens ]] && sets+=(--set train.micro_batch_tokens=4096)
        run=$BENCH_DIR/runs/streamed-$variant-seed$seed
        rm -rf "$run"
        (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/rlhf/grpo.yaml" \
            --set run_dir="$run" "${sets[@]}" >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
        "$PY" scripts/bench/summarize_streamed.py "$run" "$seed" "$variant" >>"$REPORT"
    done
done
fi

# --- 6. tool use against the same checkpoint without tools -----------------------------------------
if [[ " $PARTS " == *" tools "* ]]; then
TW=$BENCH_DIR/walkthrough-tools-250
TOOL_STEPS=${TOOL_STEPS:-60}
[[ "${1:-}" == "--quick" ]] && TOOL_STEPS=12
if [[ ! -f $TW/model/config.json ]]; then
    "$ROOT/target/release/examples/make_walkthrough" "$TW" --tools --warmup-steps 250 >&2
fi
for seed in $SEEDS; do
    for variant in tools none; do
        run=$BENCH_DIR/runs/tools-$variant-seed$seed
        rm -rf "$run"
        sets=(--set seed="$seed" --set run_dir="$run" --set policy.pretrain="$TW/model"
              --set data.prompt_data="$TW/data/train.jsonl" --set data.eval_data="$TW/data/test.jsonl"
              --set train.max_steps="$TOOL_STEPS" --set eval.every_steps=20
              --set checkpoint.every_steps=0)
        [[ $variant == none ]] && sets+=(--set "tools.enabled=[]")
        (cd "$BENCH_DIR" && "$TRAIN" --config "$ROOT/deploy/examples/rlhf/grpo-tools.yaml" \
            "${sets[@]}" >"$run.log" 2>&1) || { tail -20 "$run.log" >&2; exit 1; }
        "$PY" scripts/bench/summarize_streamed.py "$run" "$seed" "tools-$variant" >>"$REPORT"
    done
done
fi

"$PY" scripts/bench/report.py "$REPORT"
