//! The trainers beside RL (`train --mode sft | rm | dpo`) as a user runs them: the real `train`
//! driver and its DP worker processes on a Hugging Face checkpoint written locally (an untrained
//! walkthrough model), GSM8K-format JSONL and preference pairs. The SFT loss falls and the
//! exported model holds what was trained; the reward model learns a learnable preference and its
//! export scores as the trainer measured; DPO's margin grows; packing and the number of DP ranks
//! change no number; a killed run resumes identically; bad records are errors naming their file
//! and line; the example chain SFT -> RM -> PPO (and -> DPO) runs on the example configs.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{run_to_end, train, walkthrough};
use rtrun_rlhf::config::Mode;
use rtrun_rlhf::demo::walkthrough::WalkthroughFiles;
use rtrun_rlhf::stage::StageConfig;
use rtrun_rlhf::stage::pack::{Sample, Unit};
use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_telemetry::StepMetrics;
use tch::Kind;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-stages-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An SFT config file over the walkthrough's files (`mode: sft` unless `with_mode` is false,
/// when the driver's `--mode sft` must say it).
fn write_config(dir: &Path, files: &WalkthroughFiles, with_mode: bool) -> PathBuf {
    let path = dir.join("sft.yaml");
    let yaml = format!(
        "{}seed: 5\n\
         model: {{pretrain: {}}}\n\
         data: {{train_data: {}, eval_data: {}, input_key: question, output_key: answer, apply_chat_template: true, max_len: 160}}\n\
         cluster: {{replicas: 2, threads_per_worker: 1}}\n\
         train: {{epochs: 1, batch_size: 16, micro_batch_size: 4, packing: true, lr: 0.003, lr_warmup_ratio: 0.1}}\n\
         eval: {{every_steps: 5}}\n",
        if with_mode { "mode: sft\n" } else { "" },
        files.model_dir.display(),
        files.train_data.display(),
        files.test_data.display(),
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A reward-model or DPO config file over the walkthrough's preference pairs.
fn write_pair_config(dir: &Path, files: &WalkthroughFiles, mode: &str) -> PathBuf {
    let path = dir.join(format!("{mode}.yaml"));
    let lr = if mode == "rm" { 0.003 } else { 0.001 };
    let yaml = format!(
        "mode: {mode}\nseed: 5\n\
         model: {{pretrain: {}}}\n\
         data: {{train_data: {}, eval_data: {}, input_key: question, chosen_key: chosen, rejected_key: rejected, apply_chat_template: true, max_len: 160}}\n\
         cluster: {{replicas: 2, threads_per_worker: 1}}\n\
         train: {{epochs: 1, batch_size: 16, micro_batch_size: 4, packing: true, lr: {lr}, lr_warmup_ratio: 0.05}}\n\
         dpo: {{beta: 0.1}}\n\
         eval: {{every_steps: 5}}\n",
        files.model_dir.display(),
        files.preference_train.display(),
        files.preference_test.display(),
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

fn metrics(run_dir: &Path) -> Vec<StepMetrics> {
    rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap()
}

/// Every step's metrics but timings and throughput.
fn comparable(run_dir: &Path) -> Vec<(u64, Vec<(String, f64)>)> {
    metrics(run_dir)
        .into_iter()
        .map(|m| {
            let values = m
                .scalars()
                .iter()
                .filter(|(name, _)| {
                    !name.starts_with("time/") && name != "wall_time" && name != "tokens_per_s"
                })
                .cloned()
                .collect();
            (m.step(), values)
        })
        .collect()
}

/// Mean NLL per response token of `samples` under the model in `dir`, computed here from the
/// exported files (not by the trainer).
fn held_out_loss(dir: &Path, units: &[Unit]) -> f64 {
    let model = CausalLm::from_pretrained(dir, tch::Device::Cpu, Kind::Float).unwrap();
    let (mut nll, mut tokens) = (0.0, 0);
    tch::no_grad(|| {
        for sample in units.iter().flatten() {
            let ids: Vec<i64> = sample.ids.iter().map(|&i| i64::from(i)).collect();
            let (len, prompt) = (ids.len() as i64, sample.prompt_len as i64);
            let t = tch::Tensor::from_slice(&ids).view([1, len]);
            let logits = model.forward(&t, &t.ones_like(), None).unwrap();
            // Positions prompt-1 .. len-2 predict the response tokens prompt .. len-1.
            let lp = rtrun_rlhf_model::logprobs::token_log_probs(
                &logits.narrow(1, prompt - 1, len - prompt),
                &t.narrow(1, prompt, len - prompt),
            )
            .unwrap();
            nll -= lp.sum(Kind::Float).double_value(&[]);
            tokens += sample.loss_tokens();
        }
    });
    nll / tokens as f64
}

#[test]
fn sft_over_two_dp_ranks_lowers_the_held_out_loss_and_exports_what_it_trained() {
    let dir = scratch("fit");
    let files = walkthrough(&dir);
    let config = write_config(&dir, &files, false);
    let run_dir = dir.join("run");
    // The config has no `mode:`: `--mode sft` picks the trainer.
    let mut cmd = train(&config, &run_dir, &["train.max_steps=12"]);
    cmd.args(["--mode", "sft"]);
    let stderr = run_to_end(&mut cmd);
    assert!(stderr.contains("sft: 2 rank(s)"), "{stderr}");
    let records = metrics(&run_dir);
    let eval: Vec<f64> = records.iter().filter_map(|m| m.get("eval/loss")).collect();
    assert_eq!(records.iter().map(|m| m.step()).max(), Some(12));
    assert!(eval.len() >= 3, "baseline, step 5, step 10 and the last: {eval:?}");
    let (baseline, last) = (eval[0], *eval.last().unwrap());
    assert!(last < 0.6 * baseline, "held-out loss {baseline} -> {last}: it must fall");
    let train_loss: Vec<f64> = records.iter().filter_map(|m| m.get("loss")).collect();
    assert!(train_loss[train_loss.len() - 1] < train_loss[0]);
    for file in
        ["loss.png", "summary.md", "final_policy/config.json", "final_policy/tokenizer.json"]
    {
        assert!(run_dir.join(file).exists(), "{file} missing");
    }
    // The effective config, with the mode the command line chose, reads back as what ran.
    let effective = std::fs::read_to_string(run_dir.join("config.yaml")).unwrap();
    let tree = rtrun_rlhf::config::ConfigTree::parse(&effective, "config.yaml", &[]).unwrap();
    assert_eq!(tree.mode, Mode::Sft);
    let ran: StageConfig = tree.typed().unwrap();
    assert_eq!(ran.cluster.replicas, 2);
    // The exported model is the trained one: its held-out loss, computed here from the files,
    // is the trainer's last.
    let stage = StageConfig::load_with_origin(&config, &["mode=sft".into()], 0).unwrap().0;
    let tokenizer = rtrun_rlhf::tokenizer::HfTokenizer::from_dir(&files.model_dir, true).unwrap();
    let samples =
        rtrun_rlhf::stage::data::load_samples(&stage.data, &tokenizer, 5, Mode::Sft).unwrap();
    let exported = held_out_loss(&run_dir.join("final_policy"), &samples.eval);
    assert!((exported - last).abs() < 1e-4, "exported model {exported} vs trainer {last}");
    let initial = held_out_loss(&files.model_dir, &samples.eval);
    assert!((initial - baseline).abs() < 1e-4, "initial model {initial} vs baseline {baseline}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SFT, reward-model and DPO runs: one rank without packing (each pair's prompt laid out twice)
/// and two ranks with packing (and prompts shared) give the same losses, accuracies, rewards,
/// gradient norms and held-out results (the loss is a mean over the whole batch whatever the
/// split, packed samples attend only themselves, a rejected response never sees the chosen one).
#[test]
fn packing_and_the_number_of_ranks_change_no_number() {
    let dir = scratch("layout");
    let files = walkthrough(&dir);
    for mode in ["sft", "rm", "dpo"] {
        let config = match mode {
            "sft" => write_config(&dir, &files, true),
            _ => write_pair_config(&dir, &files, mode),
        };
        let steps = ["train.max_steps=3", "eval.every_steps=0"];
        let one = dir.join(format!("{mode}-one-rank-unpacked"));
        let mut sets = steps.to_vec();
        sets.extend(["cluster.replicas=1", "train.packing=false", "train.share_prompt=false"]);
        run_to_end(&mut train(&config, &one, &sets));
        let two = dir.join(format!("{mode}-two-ranks-packed"));
        run_to_end(&mut train(&config, &two, &steps));
        let (a, b) = (comparable(&one), comparable(&two));
        assert_eq!(a.len(), b.len());
        for ((step, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(x.len(), y.len());
            for ((name, u), (other, v)) in x.iter().zip(y) {
                assert_eq!(name, other);
                let tolerance = 1e-4 * u.abs().max(1.0);
                assert!(
                    (u - v).abs() < tolerance,
                    "{mode} step {step} {name}: {u} (1 rank) vs {v} (2, packed)"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn killed_sft_rm_and_dpo_runs_resume_identically() {
    let dir = scratch("resume");
    let files = walkthrough(&dir);
    for mode in ["sft", "rm", "dpo"] {
        let config = match mode {
            "sft" => write_config(&dir, &files, true),
            _ => write_pair_config(&dir, &files, mode),
        };
        killed_run_resumes_identically(&dir.join(mode), &config);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `config` straight, and again killed (SIGKILL) after its step-2 checkpoint and rerun: the
/// rerun resumes and both leave the same metrics.
fn killed_run_resumes_identically(dir: &Path, config: &Path) {
    let sets = ["train.max_steps=10", "checkpoint.every_steps=1", "eval.every_steps=2"];
    let straight = dir.join("straight");
    run_to_end(&mut train(config, &straight, &sets));

    let resumed = dir.join("resumed");
    let mut child = train(config, &resumed, &sets).stderr(Stdio::null()).spawn().unwrap();
    let marker = resumed.join("checkpoints/step_000002/trainer_state.json");
    rtrun_tests::kill_once_written(&mut child, &marker, Duration::from_secs(120));
    let stderr = run_to_end(&mut train(config, &resumed, &sets));
    let resumed_from = rtrun_tests::resumed_from(&stderr)
        .unwrap_or_else(|| panic!("the second run did not resume: {stderr}"));
    assert!((2..10).contains(&resumed_from), "resumed from step {resumed_from}, expected 2..9");
    let (a, b) = (comparable(&straight), comparable(&resumed));
    assert_eq!(a.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (0..=10).collect::<Vec<u64>>());
    assert_eq!(a, b, "a resumed run must reproduce the uninterrupted run's metrics ({config:?})");
}

#[test]
fn bad_sft_data_and_configs_are_errors_naming_where() {
    let dir = scratch("bad");
    let files = walkthrough(&dir);
    let config = write_config(&dir, &files, true);
    let fails = |sets: &[&str]| -> String {
        let out = train(&config, &dir.join("run"), sets).output().unwrap();
        assert!(!out.status.success(), "{sets:?} must fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"question\": \"a\", \"answer\": \"b\"}\n{\"question\": \"c\", \"answer\": \"d\"}\n\
         {\"question\": \"e\", \"reply\": \"f\"}\n",
    )
    .unwrap();
    let train_data = format!("data.train_data={}", bad.display());
    let err = fails(&[&train_data]);
    assert!(err.contains("bad.jsonl:3") && err.contains("`answer`"), "{err}");
    std::fs::write(&bad, "{\"question\": \"a\", \"answer\": \"b\"}\nnot json\n").unwrap();
    let err = fails(&[&train_data]);
    assert!(err.contains("bad.jsonl:2") && err.contains("JSON"), "{err}");
    // A conversation without output_key must end with the assistant's message.
    std::fs::write(
        &bad,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n\
         {\"messages\": [{\"role\": \"assistant\", \"content\": \"yo\"}, {\"role\": \"user\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    let err = fails(&[&train_data, "data.input_key=messages", "data.output_key=null"]);
    assert!(err.contains("bad.jsonl:2") && err.contains("assistant"), "{err}");
    let err = fails(&["data.max_len=4"]);
    assert!(err.contains("data.max_len") && err.contains("raise"), "{err}");
    let err = fails(&["train.batch_size=4000"]);
    assert!(err.contains("train.batch_size"), "{err}");
    let err = fails(&["mode=ppo"]);
    assert!(err.contains("`mode`") && err.contains("`sft`"), "{err}");
    let err = fails(&["train.lr=-1"]);
    assert!(err.contains("train.lr"), "{err}");
    // A placement spec without this trainer's role.
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        "version: 1\nplacement_groups:\n  g:\n    bundles: [{count: 1, resources: {CPU: 1}}]\n\
         roles:\n  actor: {replicas: 1, resources: {CPU: 1}, placement_group: g}\n",
    )
    .unwrap();
    let err = fails(&[&format!("cluster.placement_spec={}", spec.display())]);
    assert!(err.contains("cluster.placement_spec") && err.contains("role `sft`"), "{err}");
    // Preference records: a missing side, and two sides answering different conversations.
    let pairs = write_pair_config(&dir, &files, "dpo");
    let pair_fails = |sets: &[&str]| -> String {
        let out = train(&pairs, &dir.join("run"), sets).output().unwrap();
        assert!(!out.status.success(), "{sets:?} must fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    std::fs::write(
        &bad,
        "{\"question\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n\
         {\"question\": \"a\", \"chosen\": \"b\"}\n",
    )
    .unwrap();
    let err = pair_fails(&[&train_data]);
    assert!(err.contains("bad.jsonl:2") && err.contains("`rejected`"), "{err}");
    std::fs::write(
        &bad,
        "{\"chosen\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}],          \"rejected\": [{\"role\": \"user\", \"content\": \"ho\"}, {\"role\": \"assistant\", \"content\": \"no\"}]}\n",
    )
    .unwrap();
    let err = pair_fails(&[&train_data]);
    assert!(err.contains("bad.jsonl:1") && err.contains("same prompt"), "{err}");
    let err = pair_fails(&["dpo.label_smoothing=0.7"]);
    assert!(err.contains("dpo.label_smoothing"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The example chain as the README runs it, on the example configs themselves: SFT of an
/// untrained walkthrough checkpoint; a reward model from the SFT model on the preference pairs;
/// PPO from the SFT model rewarded by that reward model (`reward.kind: model`); and DPO from the
/// SFT model. The SFT model already answers some held-out problems (the untrained one answers
/// none).
#[test]
fn the_example_chain_fine_tunes_then_trains_a_reward_model_ppo_and_dpo() {
    let dir = scratch("chain");
    walkthrough(&dir);
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/pipeline");
    let run = |config: &str, sets: &[&str]| -> String {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
        cmd.current_dir(&dir).arg("--config").arg(examples.join(config));
        cmd.args(["--set", "cluster.threads_per_worker=1"]);
        for s in sets {
            cmd.arg("--set").arg(s);
        }
        run_to_end(cmd.stdout(Stdio::null()).stderr(Stdio::piped()))
    };
    run("sft-hf.yaml", &["train.epochs=16"]);
    let sft = metrics(&dir.join("runs/sft-hf"));
    assert!(sft.iter().rev().find_map(|m| m.get("loss")).unwrap() < 1.5);
    let stderr = run(
        "grpo-from-sft.yaml",
        &["train.max_steps=1", "rollout.prompts_per_step=8", "eval.every_steps=0"],
    );
    assert!(stderr.contains("policy: runs/sft-hf/final_policy"), "{stderr}");
    let grpo = metrics(&dir.join("runs/grpo-from-sft"));
    let baseline = grpo[0].get("eval/reward").unwrap();
    assert!(baseline > 0.0, "the SFT model answers no held-out problem: {baseline}");
    run("rm-hf.yaml", &["train.max_steps=4", "eval.every_steps=0"]);
    assert!(dir.join("runs/rm-hf/final_reward_model/config.json").is_file());
    let stderr = run(
        "ppo-with-rm.yaml",
        &["train.max_steps=1", "rollout.prompts_per_step=8", "eval.every_steps=0"],
    );
    assert!(stderr.contains("policy: runs/sft-hf/final_policy"), "{stderr}");
    assert_eq!(metrics(&dir.join("runs/ppo-with-rm")).iter().map(|m| m.step()).max(), Some(1));
    run("dpo-hf.yaml", &["train.max_steps=2", "eval.every_steps=0"]);
    assert!(dir.join("runs/dpo-hf/final_policy/config.json").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The held-out accuracy and mean margin of the reward model in `dir` on `pairs`, scored here
/// from the exported files (the score at each sequence's last token).
fn reward_model_accuracy(dir: &Path, pairs: &[Unit]) -> (f64, f64) {
    let model =
        rtrun_rlhf_model::ScalarHeadModel::from_pretrained(dir, tch::Device::Cpu, Kind::Float, 0)
            .unwrap();
    let (mut correct, mut margin) = (0, 0.0);
    tch::no_grad(|| {
        for pair in pairs {
            let score = |sample: &Sample| {
                let ids: Vec<i64> = sample.ids.iter().map(|&i| i64::from(i)).collect();
                let t = tch::Tensor::from_slice(&ids).view([1, ids.len() as i64]);
                model.rewards(&t, &t.ones_like()).unwrap().double_value(&[0])
            };
            let (c, r) = (score(&pair[0]), score(&pair[1]));
            correct += usize::from(c > r);
            margin += c - r;
        }
    });
    (correct as f64 / pairs.len() as f64, margin / pairs.len() as f64)
}

#[test]
fn a_reward_model_learns_the_preference_and_its_export_scores_as_measured() {
    let dir = scratch("rm");
    let files = walkthrough(&dir);
    let config = write_pair_config(&dir, &files, "rm");
    let run_dir = dir.join("run");
    run_to_end(&mut train(&config, &run_dir, &["train.epochs=16", "eval.every_steps=60"]));
    let records = metrics(&run_dir);
    let accuracy: Vec<f64> = records.iter().filter_map(|m| m.get("eval/accuracy")).collect();
    let last = *accuracy.last().unwrap();
    assert!(last >= 0.75, "held-out pair accuracy {accuracy:?}: the preference is learnable");
    let exported = run_dir.join("final_reward_model");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(json["architectures"][0], "Qwen2ForSequenceClassification");
    assert!(exported.join("tokenizer.json").is_file());
    // The export scores the held-out pairs as the trainer measured.
    let stage = StageConfig::load_with_origin(&config, &[], 0).unwrap().0;
    let tokenizer = rtrun_rlhf::tokenizer::HfTokenizer::from_dir(&files.model_dir, true).unwrap();
    let pairs =
        rtrun_rlhf::stage::data::load_samples(&stage.data, &tokenizer, 5, Mode::Rm).unwrap();
    let (measured, margin) = reward_model_accuracy(&exported, &pairs.eval);
    let reported = records.iter().rev().find_map(|m| m.get("eval/reward/margin")).unwrap();
    assert_eq!(measured, last);
    assert!((margin - reported).abs() < 1e-3, "exported margin {margin} vs trainer {reported}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dpo_widens_the_margin_between_chosen_and_rejected() {
    let dir = scratch("dpo");
    let files = walkthrough(&dir);
    let config = write_pair_config(&dir, &files, "dpo");
    let run_dir = dir.join("run");
    run_to_end(&mut train(&config, &run_dir, &["train.epochs=4"]));
    let records = metrics(&run_dir);
    let margins: Vec<f64> = records.iter().filter_map(|m| m.get("eval/reward/margin")).collect();
    // The policy starts as its reference: every implicit reward is 0.
    assert_eq!(margins[0], 0.0);
    assert!(*margins.last().unwrap() > 0.01, "the held-out margin must grow: {margins:?}");
    // The training loss falls below its start, ln 2 (every pair's Δ is 0 at first).
    let losses: Vec<f64> = records.iter().filter_map(|m| m.get("loss")).collect();
    let tail = &losses[losses.len() - 10..];
    let mean = tail.iter().sum::<f64>() / tail.len() as f64;
    assert!(mean < std::f64::consts::LN_2 - 0.01, "{losses:?}");
    assert!(run_dir.join("final_policy/model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank's worker killed (SIGKILL) or stopped (SIGSTOP) mid-run ends the run with an error
/// naming the trainer's role and the rank.
#[test]
fn a_killed_or_stopped_rank_fails_the_run_naming_its_role_and_rank() {
    let dir = scratch("faults");
    let files = walkthrough(&dir);
    for (mode, signal, rank) in [("sft", libc::SIGKILL, 1), ("dpo", libc::SIGSTOP, 0)] {
        let config = match mode {
            "sft" => write_config(&dir, &files, true),
            _ => write_pair_config(&dir, &files, mode),
        };
        let run_dir = dir.join(format!("{mode}-run"));
        let sets = [
            "train.epochs=1000",
            "eval.every_steps=0",
            "cluster.call_timeout_s=6",
            "cluster.stall_warn_s=2",
        ];
        let mut child = train(&config, &run_dir, &sets).spawn().unwrap();
        let metrics = run_dir.join("metrics.jsonl");
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 3 {
            assert!(child.try_wait().unwrap().is_none(), "{mode}: the run ended early");
            assert!(Instant::now() < deadline, "{mode}: no step 2 within 120 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        let marker = format!("{mode}:{rank}");
        let pid = rtrun_tests::descendant_with_env(child.id(), "RTRUN_RLHF_ROLE", &marker)
            .unwrap_or_else(|| panic!("no worker process marked {marker}"));
        rtrun_tests::signal(pid, signal);
        let out = child.wait_with_output().unwrap();
        if signal == libc::SIGSTOP {
            // The stopped worker is resumed and killed.
            rtrun_tests::signal(pid, libc::SIGCONT);
            rtrun_tests::kill9(pid);
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode}: the run must fail: {err}");
        let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_default();
        if signal == libc::SIGKILL {
            // Either the dead rank is reported, or its peer, whose all-reduce lost it, first.
            let dead = format!("{mode} rank {rank} (actor-");
            let peer = format!("lost its connection to rank {rank}");
            assert!(line.contains(&dead) || line.contains(&peer), "{err}");
        } else {
            assert!(line.contains(&format!("{mode} rank {rank} (actor-")), "{err}");
            assert!(line.contains("cluster.call_timeout_s = 6"), "{err}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SFT, DPO and the reward model with LoRA (`model.lora`): the adapters train over a frozen
/// base on two DP ranks (SFT at ZeRO-3), the held-out SFT loss falls, the export is the merged
/// model (its held-out loss, computed here, is the trainer's last) with the peft adapter in
/// `adapter/`, DPO's reference is the model with its adapters off (its margin starts at 0 and
/// grows), and the reward model's pair accuracy rises with its export scoring as measured. Bad LoRA
/// settings are errors naming the key, and an adapter made for another base model names the
/// file and both shapes.
#[test]
fn sft_dpo_and_rm_with_lora_train_the_adapters_alone() {
    let dir = scratch("lora");
    let files = walkthrough(&dir);
    let config = write_config(&dir, &files, true);
    let run_dir = dir.join("run");
    let lora = ["model.lora.rank=16", "model.lora.alpha=32"];
    let sets: Vec<&str> =
        lora.iter().copied().chain(["train.max_steps=12", "train.zero_stage=3"]).collect();
    run_to_end(&mut train(&config, &run_dir, &sets));
    let records = metrics(&run_dir);
    let eval: Vec<f64> = records.iter().filter_map(|m| m.get("eval/loss")).collect();
    let (baseline, last) = (eval[0], *eval.last().unwrap());
    assert!(last < 0.8 * baseline, "held-out loss {baseline} -> {last}: it must fall");
    let stage = StageConfig::load_with_origin(&config, &[], 0).unwrap().0;
    let tokenizer = rtrun_rlhf::tokenizer::HfTokenizer::from_dir(&files.model_dir, true).unwrap();
    let samples =
        rtrun_rlhf::stage::data::load_samples(&stage.data, &tokenizer, 5, Mode::Sft).unwrap();
    let exported = held_out_loss(&run_dir.join("final_policy"), &samples.eval);
    assert!((exported - last).abs() < 1e-4, "exported model {exported} vs trainer {last}");
    let adapter = run_dir.join("final_policy/adapter");
    assert!(adapter.join("adapter_config.json").is_file());
    // Only the projections were adapted: every other weight is the base's.
    let base = CausalLm::from_pretrained(&files.model_dir, tch::Device::Cpu, Kind::Float).unwrap();
    let merged =
        CausalLm::from_pretrained(&run_dir.join("final_policy"), tch::Device::Cpu, Kind::Float)
            .unwrap();
    for (name, t) in merged.named_parameters() {
        let same = t.equal(base.params.get(name).unwrap());
        assert_eq!(same, !name.ends_with("_proj.weight"), "`{name}`");
    }

    let pairs = write_pair_config(&dir, &files, "dpo");
    let dpo_dir = dir.join("dpo");
    let dpo_sets: Vec<&str> = lora.iter().copied().chain(["train.epochs=2"]).collect();
    run_to_end(&mut train(&pairs, &dpo_dir, &dpo_sets));
    let margins: Vec<f64> =
        metrics(&dpo_dir).iter().filter_map(|m| m.get("eval/reward/margin")).collect();
    assert_eq!(margins[0], 0.0, "the policy starts as its reference");
    assert!(*margins.last().unwrap() > 0.0, "the held-out margin must grow: {margins:?}");

    // A reward model with LoRA: adapters on the trunk, the score head trained whole; the
    // merged export scores the held-out pairs as the trainer measured.
    let rm = write_pair_config(&dir, &files, "rm");
    let rm_dir = dir.join("rm");
    let rm_sets: Vec<&str> =
        lora.iter().copied().chain(["train.epochs=16", "eval.every_steps=60"]).collect();
    run_to_end(&mut train(&rm, &rm_dir, &rm_sets));
    let records = metrics(&rm_dir);
    let accuracy: Vec<f64> = records.iter().filter_map(|m| m.get("eval/accuracy")).collect();
    let rm_last = *accuracy.last().unwrap();
    assert!(rm_last > accuracy[0], "held-out pair accuracy {accuracy:?}");
    let exported = rm_dir.join("final_reward_model");
    assert!(exported.join("adapter/adapter_model.safetensors").is_file());
    let rm_stage = StageConfig::load_with_origin(&rm, &[], 0).unwrap().0;
    let pairs =
        rtrun_rlhf::stage::data::load_samples(&rm_stage.data, &tokenizer, 5, Mode::Rm).unwrap();
    let (measured, margin) = reward_model_accuracy(&exported, &pairs.eval);
    let reported = records.iter().rev().find_map(|m| m.get("eval/reward/margin")).unwrap();
    assert_eq!(measured, rm_last);
    assert!((margin - reported).abs() < 1e-3, "exported margin {margin} vs trainer {reported}");

    let fails = |sets: &[&str]| -> String {
        let out = train(&config, &dir.join("bad"), sets).output().unwrap();
        assert!(!out.status.success(), "{sets:?} must fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = fails(&["model.lora.rank=8", "model.lora.target_modules=[q_proj, qkv]"]);
    assert!(err.contains("model.lora") && err.contains("`qkv`") && err.contains("q_proj"), "{err}");
    let err = fails(&["model.lora.rank=0"]);
    assert!(err.contains("model.lora") && err.contains("rank should be positive"), "{err}");
    let err = fails(&["model.lora.rank=4096"]);
    assert!(err.contains("model.lora") && err.contains("at most"), "{err}");
    let err = fails(&["model.lora.rank=8", "model.lora.ranks=8"]);
    assert!(err.contains("ranks"), "{err}");
    // An adapter for another base model: a wider one's `A` does not fit.
    let other = dir.join("other-adapter");
    std::fs::create_dir_all(&other).unwrap();
    for name in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter.join(name), other.join(name)).unwrap();
    }
    let mut wide = rtrun_rlhf_model::tiny::tiny_model(
        &rtrun_rlhf_model::ModelConfig {
            hidden_size: 2 * base.config().hidden_size,
            ..base.config().clone()
        },
        1,
    )
    .unwrap();
    let settings = rtrun_rlhf_model::lora::read_adapter_config(&adapter).unwrap();
    wide.add_lora(&settings, 1).unwrap();
    wide.save_adapter(&other, "wide").unwrap();
    let err = fails(&[&format!("model.lora_adapter={}", other.display())]);
    assert!(
        err.contains("adapter_model.safetensors")
            && err.contains("has shape")
            && err.contains("another base model"),
        "{err}"
    );
    // The trained adapter resumes as `lora_adapter` (its settings from adapter_config.json).
    let again = dir.join("again");
    let from_adapter = format!("model.lora_adapter={}", adapter.display());
    run_to_end(&mut train(&config, &again, &[&from_adapter, "train.max_steps=1"]));
    let eval: Vec<f64> = metrics(&again).iter().filter_map(|m| m.get("eval/loss")).collect();
    assert!(
        (eval[0] - last).abs() < 1e-4,
        "starts where the adapter left off: {} vs {last}",
        eval[0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
