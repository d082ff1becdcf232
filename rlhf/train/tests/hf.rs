//! The trainer on real files, as a user of OpenRLHF or verl runs it: a Hugging Face Qwen2
//! checkpoint written locally (byte-level BPE tokenizer, ChatML chat template, generation
//! config) and GSM8K-format JSONL / Parquet prompts. GRPO and PPO train it with real worker
//! processes; the exported policy reloads bit-identically and is accepted as `policy.pretrain`;
//! a resumed run continues identically; every bad input gets an error naming what and where.

// The shared walkthrough helper only; the driver helpers are for the command-line tests.
#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rtrun_rlhf::TrainConfig;
use rtrun_rlhf::demo::walkthrough::{WalkthroughConfig, WalkthroughFiles, write_walkthrough};
use rtrun_rlhf::experience::Sequence;
use rtrun_rlhf::run::{InitialPolicy, prepare};
use rtrun_rlhf::trainer::{NoProgress, RunPaths};
use rtrun_rlhf_model::CausalLm;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rtrun-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small walkthrough: 600 problems, a 120-step warm-up (it answers some, not all).
fn walkthrough(dir: &Path) -> WalkthroughFiles {
    // Tests run side by side on two cores: one libtorch thread per process keeps them from
    // oversubscribing (spinning OpenMP threads starve each other).
    tch::set_num_threads(1);
    let config = WalkthroughConfig {
        train_problems: 600,
        test_problems: 32,
        vocab_size: 400,
        warmup: rtrun_rlhf::config::WarmupConfig { steps: 120, batch_size: 32, lr: 3e-3 },
        ..WalkthroughConfig::default()
    };
    write_walkthrough(&dir.join("walkthrough"), &config).unwrap()
}

/// GRPO on the walkthrough's files, with `sets` applied as `--set` overrides.
fn hf_config(run_dir: &Path, files: &WalkthroughFiles, sets: &[&str]) -> TrainConfig {
    let yaml = format!(
        "seed: 3\nrun_dir: {}\n\
         policy: {{pretrain: {}}}\n\
         data: {{prompt_data: {}, eval_data: {}, input_key: question, label_key: answer, apply_chat_template: true, max_prompt_len: 96}}\n\
         rollout: {{prompts_per_step: 16, n_samples_per_prompt: 8, max_new_tokens: 16}}\n\
         algo: {{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.001}}\n\
         train: {{max_steps: 2, train_batch_size: 64, micro_batch_size: 64, max_epochs: 2, actor_lr: 0.0003, critic_lr: 0.0003}}\n\
         reward: {{kind: rule, name: math_answer}}\n\
         eval: {{every_steps: 0}}\n",
        run_dir.display(),
        files.model_dir.display(),
        files.train_data.display(),
        files.test_data.display(),
    );
    // One thread per process: tests run side by side (`auto` assumes the run has the machine).
    let mut overrides = vec![
        "cluster.num_cpus=16".to_owned(),
        "engine.threads=1".to_owned(),
        "cluster.threads_per_worker=1".to_owned(),
    ];
    overrides.extend(sets.iter().map(|s| s.to_string()));
    TrainConfig::from_yaml(&yaml, "hf.yaml", &overrides)
        .unwrap_or_else(|e| panic!("test config: {e}"))
}

fn metrics(run_dir: &Path) -> Vec<rtrun_rlhf_telemetry::StepMetrics> {
    rtrun_rlhf_telemetry::jsonl::read_jsonl(&run_dir.join("metrics.jsonl")).unwrap()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn assert_same_weights(a: &Path, b: &Path) {
    let a = CausalLm::from_pretrained(a, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let b = CausalLm::from_pretrained(b, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let names_a: Vec<&str> = a.named_parameters().map(|(n, _)| n).collect();
    let names_b: Vec<&str> = b.named_parameters().map(|(n, _)| n).collect();
    assert_eq!(names_a, names_b);
    for ((name, x), (_, y)) in a.named_parameters().zip(b.named_parameters()) {
        assert!(x.equal(y), "`{name}` differs");
    }
}

#[test]
fn grpo_trains_a_local_hf_checkpoint_and_exports_it() {
    let dir = scratch("grpo");
    let files = walkthrough(&dir);
    let run_dir = dir.join("run");
    let config = hf_config(
        &run_dir,
        &files,
        &["checkpoint.every_steps=5", "checkpoint.keep_last=2", "train.max_steps=30"],
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 30);
    // The engines stop on the checkpoint's EOS ids and generate with the policy's weights.
    assert_eq!(trainer.tokenizer.eos_token_ids(), vec![2, 0]);
    let records = metrics(&run_dir);
    for r in records.iter().filter(|r| r.step() > 0) {
        // fp32: `algo.old_logprobs: auto` takes the engine's log-probs as the old ones and has
        // the policy check them on steps 1 and 2 and every 10th step.
        let gap = r.get("engine_logprob_gap");
        assert_eq!(gap.is_some(), r.step() <= 2 || r.step() % 10 == 0, "step {}", r.step());
        assert!(
            gap.is_none_or(|g| g < 1e-4),
            "step {}: engine and policy differ by {gap:?}",
            r.step()
        );
        let response = r.get("response_length").unwrap();
        assert!(response <= 16.0);
        // OpenRLHF's `total_length`: the prompt's tokens come on top.
        assert!(r.get("total_length").is_some_and(|t| t > response), "step {}", r.step());
    }
    // The reward rises: the last third of the steps beats the first third.
    let train: Vec<f64> =
        records.iter().filter(|r| r.step() > 0).map(|r| r.get("reward").unwrap()).collect();
    let (first, last) = (mean(train[..10].iter().copied()), mean(train[20..].iter().copied()));
    assert!(last > first, "train reward {first:.3} -> {last:.3}");
    assert!(first > 0.0, "the warmed-up checkpoint answers some problems");

    // Export: an HF directory with the tokenizer files, bit-identical to the last checkpoint.
    let exported = report.exported.clone().unwrap();
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(exported.join(name).is_file(), "{name} missing from the export");
    }
    let paths = RunPaths::new(&run_dir);
    let checkpoints: Vec<String> = std::fs::read_dir(&paths.checkpoints)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut sorted = checkpoints.clone();
    sorted.sort();
    assert_eq!(sorted, vec!["step_000025", "step_000030"], "keep_last: 2");
    assert_same_weights(&exported, &paths.checkpoints.join("step_000030/actor"));
    // A checkpoint's actor directory is a loadable HF directory too (tokenizer files included).
    assert!(paths.checkpoints.join("step_000030/actor/tokenizer.json").is_file());
    trainer.roles.kill();
    rtrun::shutdown();

    // The export is accepted again as `policy.pretrain`.
    let again = TrainConfig::from_yaml(
        &format!("policy: {{pretrain: {}}}\n", exported.display()),
        "again.yaml",
        &[
            format!("data.prompt_data={}", files.train_data.display()),
            "data.input_key=question".into(),
            "data.label_key=answer".into(),
            "data.apply_chat_template=true".into(),
            "rollout.max_new_tokens=16".into(),
            format!("run_dir={}", dir.join("again").display()),
            "reward.name=math_answer".into(),
        ],
    )
    .unwrap();
    let prepared = prepare(&again, &RunPaths::new(&dir.join("again"))).unwrap();
    assert_eq!(prepared.initial, InitialPolicy::Pretrained(exported.clone()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GRPO from a Qwen3 checkpoint that transformers itself wrote (`rlhf/model/parity/
/// make_qwen3_hf.py`: per-head q/k norms, heads of 32 over a 64-wide residual, tied embeddings,
/// transformers 5's `rope_parameters`), with the walkthrough's tokenizer and data: the engine
/// (its own fused projections and CPU kernels) and the policy agree on every sampled token's
/// log-prob, the policy trains, and the export is a `qwen3` checkpoint that loads again.
#[test]
fn grpo_trains_a_qwen3_checkpoint_made_by_transformers() {
    let dir = scratch("qwen3");
    // Its tokenizer and data; its untrained model is not used.
    let walkthrough = common::walkthrough(&dir);
    let model_dir = dir.join("qwen3");
    std::fs::create_dir_all(&model_dir).unwrap();
    let made = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/parity/qwen3-hf");
    for (from, name) in [
        (&made, "config.json"),
        (&made, "model.safetensors"),
        (&walkthrough.model_dir, "tokenizer.json"),
        (&walkthrough.model_dir, "tokenizer_config.json"),
        (&walkthrough.model_dir, "generation_config.json"),
    ] {
        std::fs::copy(from.join(name), model_dir.join(name)).unwrap();
    }
    let files = WalkthroughFiles { model_dir: model_dir.clone(), ..walkthrough };
    let run_dir = dir.join("run");
    let sets = ["train.max_steps=3", "algo.old_logprobs=policy"];
    let (trainer, report) =
        rtrun_rlhf::run::run(&hf_config(&run_dir, &files, &sets), &mut NoProgress).unwrap();
    assert_eq!(report.steps, 3);
    for r in metrics(&run_dir).iter().filter(|r| r.step() > 0) {
        let gap = r.get("engine_logprob_gap").expect("measured on every step");
        assert!(gap < 1e-4, "step {}: engine and policy differ by {gap}", r.step());
        assert!(r.get("policy_loss").is_some_and(f64::is_finite), "step {}", r.step());
    }
    trainer.roles.kill();
    rtrun::shutdown();
    let exported = report.exported.unwrap();
    let text = std::fs::read_to_string(exported.join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["model_type"], "qwen3");
    assert_eq!(json["architectures"][0], "Qwen3ForCausalLM");
    let trained = CausalLm::from_pretrained(&exported, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let start = CausalLm::from_pretrained(&model_dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let changed = trained
        .named_parameters()
        .zip(start.named_parameters())
        .filter(|((_, a), (_, b))| !a.equal(b))
        .count();
    assert!(changed > 0, "three GRPO steps changed no weight");
    assert!(trained.named_parameters().any(|(name, _)| name.ends_with("self_attn.q_norm.weight")));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GRPO with engines of two tensor-parallel ranks (two processes each, a CPU ring between
/// them): every rank takes its own shard of each weight sync (less than the whole model), the
/// engine's log-probs equal the policy's within 1e-4 on every step, and the reward rises.
#[test]
fn grpo_with_tensor_parallel_engines_trains_and_matches_the_policy() {
    let dir = scratch("grpo-tp");
    let files = walkthrough(&dir);
    let run_dir = dir.join("run");
    // Three ranks cannot split the walkthrough's 4 query heads.
    let three = hf_config(&run_dir, &files, &["engine.tensor_parallel_size=3"]);
    let err = rtrun_rlhf::run::run(&three, &mut NoProgress).err().unwrap().to_string();
    assert!(
        err.contains("engine.tensor_parallel_size")
            && err.contains("tensor_parallel_size 3")
            && err.contains("4 query heads"),
        "{err}"
    );
    let sets = ["engine.tensor_parallel_size=2", "algo.old_logprobs=policy", "train.max_steps=24"];
    let config = hf_config(&run_dir, &files, &sets);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 24);
    assert_eq!(trainer.roles.engine_ranks.iter().map(Vec::len).collect::<Vec<_>>(), vec![2]);
    let whole: u64 =
        CausalLm::from_pretrained(&files.model_dir, tch::Device::Cpu, tch::Kind::Float)
            .unwrap()
            .named_parameters()
            .map(|(_, t)| (t.numel() * 4) as u64)
            .sum();
    let records = metrics(&run_dir);
    for r in records.iter().filter(|r| r.step() > 0) {
        let gap = r.get("engine_logprob_gap").unwrap();
        assert!(gap < 1e-4, "step {}: engine and policy differ by {gap}", r.step());
        for rank in 0..2 {
            let bytes = r.get(&format!("weight_sync/bytes_rank{rank}")).unwrap();
            assert!(bytes > 0.0 && bytes < whole as f64, "rank {rank} got {bytes} of {whole}");
        }
        assert!(r.get("time/sync_reshard").is_some_and(|s| s >= 0.0));
    }
    let train: Vec<f64> =
        records.iter().filter(|r| r.step() > 0).map(|r| r.get("reward").unwrap()).collect();
    let (first, last) = (mean(train[..8].iter().copied()), mean(train[16..].iter().copied()));
    let gaps = records.iter().filter_map(|r| r.get("engine_logprob_gap"));
    let bytes = records.last().and_then(|r| r.get("weight_sync/bytes_rank0")).unwrap();
    eprintln!(
        "tp=2: reward {first:.3} -> {last:.3}, largest engine/policy gap {:.2e}, rank 0 \
         receives {bytes} of {whole} bytes",
        gaps.fold(0.0, f64::max)
    );
    assert!(last > first, "train reward {first:.3} -> {last:.3}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ppo_with_a_critic_from_the_policy_body_and_resume_continues_identically() {
    let dir = scratch("ppo");
    let files = walkthrough(&dir);
    let ppo = [
        "algo.advantage_estimator=gae",
        "algo.use_kl_loss=false",
        "algo.lambd=0.95",
        "algo.init_kl_coef=0.01",
        "algo.kl_estimator=k1",
        "checkpoint.every_steps=1",
        "train.max_epochs=1",
    ];
    let with_steps = |steps: &'static str| -> Vec<&'static str> {
        ppo.iter().copied().chain(std::iter::once(steps)).collect()
    };
    let straight = dir.join("straight");
    let config = hf_config(&straight, &files, &with_steps("train.max_steps=3"));
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 3);
    assert!(trainer.roles.critic.is_some(), "GAE trains a critic");
    let last = metrics(&straight).pop().unwrap();
    assert!(last.get("critic_loss").is_some_and(|v| v.is_finite() && v > 0.0), "{last:?}");
    trainer.roles.kill();

    // The same run stopped after 2 steps, then resumed to 3, records the same metrics.
    let resumed = dir.join("resumed");
    let (trainer, _) = rtrun_rlhf::run::run(
        &hf_config(&resumed, &files, &with_steps("train.max_steps=2")),
        &mut NoProgress,
    )
    .unwrap();
    trainer.roles.kill();
    let (trainer, report) = rtrun_rlhf::run::run(
        &hf_config(&resumed, &files, &with_steps("train.max_steps=3")),
        &mut NoProgress,
    )
    .unwrap();
    assert_eq!(report.steps, 3);
    trainer.roles.kill();
    let strip =
        |records: Vec<rtrun_rlhf_telemetry::StepMetrics>| -> Vec<(u64, Vec<(String, u64)>)> {
            records
                .into_iter()
                .filter(|r| r.step() > 0)
                .map(|r| {
                    let values = r
                        .scalars()
                        .iter()
                        // Timings differ, and the first leg evaluates at its own last step.
                        .filter(|(k, _)| !k.starts_with("time/") && !k.starts_with("eval/"))
                        .map(|(k, v)| (k.clone(), v.to_bits()))
                        .collect();
                    (r.step(), values)
                })
                .collect()
        };
    assert_eq!(strip(metrics(&straight)), strip(metrics(&resumed)));
    assert_same_weights(&straight.join("final_policy"), &resumed.join("final_policy"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes a Parquet file with UTF-8 string columns.
fn write_parquet(path: &Path, columns: &[&str], rows: &[Vec<String>]) {
    let fields: Vec<String> =
        columns.iter().map(|c| format!("REQUIRED BYTE_ARRAY {c} (UTF8);")).collect();
    write_nested_parquet(path, &fields.join(" "), rows);
}

/// Writes a Parquet file from a schema's field list (`REQUIRED BYTE_ARRAY a (UTF8); REQUIRED
/// group g { … }`) and rows holding each leaf column's string, in schema order.
fn write_nested_parquet(path: &Path, fields: &str, rows: &[Vec<String>]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(&format!("message m {{ {fields} }}")).unwrap(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build()))
            .unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut c = 0;
    while let Some(mut column) = group.next_column().unwrap() {
        let values: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r[c].as_str())).collect();
        column.typed::<ByteArrayType>().write_batch(&values, None, None).unwrap();
        column.close().unwrap();
        c += 1;
    }
    group.close().unwrap();
    writer.close().unwrap();
}

/// The first `count` records of the walkthrough's training file.
fn training_records(files: &WalkthroughFiles, count: usize) -> Vec<serde_json::Value> {
    std::fs::read_to_string(&files.train_data)
        .unwrap()
        .lines()
        .take(count)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_verl_layout_parquet_file_trains_with_routed_rewards_a_template_and_mixed_files() {
    let dir = scratch("verl-layout");
    let files = walkthrough(&dir);
    let lines = training_records(&files, 60);
    let field = |v: &serde_json::Value, key: &str| v[key].as_str().unwrap().to_owned();
    // data_source, prompt, reward_model.{ground_truth, style}.
    let rows: Vec<Vec<String>> = lines[..40]
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let source = if i % 2 == 0 { "openai/gsm8k" } else { "exact" };
            vec![source.into(), field(v, "question"), field(v, "answer"), "rule".into()]
        })
        .collect();
    let parquet = dir.join("verl.parquet");
    write_nested_parquet(
        &parquet,
        "REQUIRED BYTE_ARRAY data_source (UTF8); REQUIRED BYTE_ARRAY prompt (UTF8); \
         REQUIRED group reward_model { REQUIRED BYTE_ARRAY ground_truth (UTF8); \
         REQUIRED BYTE_ARRAY style (UTF8); }",
        &rows,
    );
    let jsonl = dir.join("more.jsonl");
    let text: String = lines[40..]
        .iter()
        .map(|v| {
            serde_json::json!({"data_source": "more", "prompt": v["question"],
                               "reward_model": {"ground_truth": v["answer"]}})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&jsonl, text).unwrap();
    let run_dir = dir.join("run");
    let mut config = hf_config(&run_dir, &files, &["train.max_steps=2"]);
    config.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![parquet, jsonl]);
    config.data.eval_data = Default::default();
    config.data.eval_fraction = 0.1;
    config.data.input_key = "prompt".into();
    config.data.label_key = Some("reward_model.ground_truth".into());
    config.data.apply_chat_template = false;
    config.data.input_template = Some("Question: {}\nAnswer:".into());
    config.data.prompt_probs = Some(vec![0.75, 0.25]);
    config.reward.by_source = [("exact".to_owned(), "exact_match".to_owned())].into();
    config.validate().unwrap();
    let prepared = prepare(&config, &RunPaths::new(&run_dir)).unwrap();
    // 60 records, 6 held out; the 54 training prompts mixed 3:1 from the two files.
    assert_eq!((prepared.train_prompts(), prepared.eval_prompts()), (54, 6));
    let records = rtrun_rlhf::data::read_jsonl(&RunPaths::new(&run_dir).train_data).unwrap();
    assert!(records.iter().all(|r| r.prompt.starts_with("Question: ")
        && r.prompt.ends_with("\nAnswer:")
        && r.label.contains("####")));
    let from_parquet = records.iter().filter(|r| r.data_source != "more").count();
    assert!((30..=50).contains(&from_parquet), "{from_parquet} of 54 from the 0.75 file");
    assert!(records.iter().any(|r| r.data_source == "exact"));
    std::fs::remove_dir_all(&run_dir).unwrap();
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    assert!(metrics(&run_dir).iter().all(|r| r.get("reward").is_none_or(f64::is_finite)));
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompt_files_parquet_and_chat_messages_are_read_and_rendered() {
    let dir = scratch("data");
    let files = walkthrough(&dir);
    let lines = training_records(&files, 40);
    let rows: Vec<Vec<String>> = lines
        .iter()
        .map(|v| {
            vec![
                v["question"].as_str().unwrap().to_owned(),
                v["answer"].as_str().unwrap().to_owned(),
            ]
        })
        .collect();
    let parquet = dir.join("train.parquet");
    write_parquet(&parquet, &["question", "answer"], &rows);
    // Chat messages as input, with a system turn.
    let chat = dir.join("chat.jsonl");
    let text: String = lines
        .iter()
        .map(|v| {
            serde_json::json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": v["question"]}], "answer": v["answer"]}).to_string() + "\n"
        })
        .collect();
    std::fs::write(&chat, text).unwrap();
    let mut config = hf_config(&dir.join("run"), &files, &[]);
    config.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![parquet, chat.clone()]);
    config.data.eval_data = Default::default();
    config.data.eval_fraction = 0.1;
    config.data.max_samples = Some(70);
    config.validate().unwrap();
    // Chat messages need input_key `messages`; a per-file key is not a thing: use two runs.
    config.data.input_key = "question".into();
    let err = prepare(&config, &RunPaths::new(&dir.join("run"))).unwrap_err().to_string();
    assert!(err.contains("chat.jsonl:1") && err.contains("`question`"), "{err}");
    config.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![dir.join("train.parquet")]);
    let prepared = prepare(&config, &RunPaths::new(&dir.join("run"))).unwrap();
    assert_eq!(prepared.train_prompts() + prepared.eval_prompts(), 40);
    assert_eq!(prepared.eval_prompts(), 4);
    let records =
        rtrun_rlhf::data::read_jsonl(&RunPaths::new(&dir.join("run")).train_data).unwrap();
    assert!(records[0].prompt.starts_with(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    ));
    assert!(records[0].prompt.ends_with("<|im_start|>assistant\n"));
    assert!(records[0].label.contains("####"));
    config.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![chat]);
    config.data.input_key = "messages".into();
    config.run_dir = dir.join("chat-run");
    let prepared = prepare(&config, &RunPaths::new(&dir.join("chat-run"))).unwrap();
    assert_eq!(prepared.train_prompts() + prepared.eval_prompts(), 40);
    let records =
        rtrun_rlhf::data::read_jsonl(&RunPaths::new(&dir.join("chat-run")).train_data).unwrap();
    assert!(
        records[0].prompt.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"),
        "{}",
        records[0].prompt
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_inputs_get_errors_naming_what_and_where() {
    let dir = scratch("bad");
    let files = walkthrough(&dir);
    let base = hf_config(&dir.join("run"), &files, &[]);
    let prepare_err = |config: &TrainConfig| -> String {
        let run = config.run_dir.clone();
        let _ = std::fs::remove_dir_all(&run);
        prepare(config, &RunPaths::new(&run)).unwrap_err().to_string()
    };
    // A broken checkpoint directory: missing tokenizer.json, missing config.json, another
    // architecture.
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for entry in std::fs::read_dir(&files.model_dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), broken.join(entry.file_name())).unwrap();
    }
    std::fs::remove_file(broken.join("tokenizer.json")).unwrap();
    let mut c = base.clone();
    c.policy.pretrain = Some(broken.clone());
    let err = prepare_err(&c);
    assert!(err.contains("policy.pretrain") && err.contains("tokenizer.json"), "{err}");
    let config_json = std::fs::read_to_string(broken.join("config.json")).unwrap();
    std::fs::write(broken.join("config.json"), config_json.replace("\"qwen2\"", "\"gpt2\""))
        .unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("policy.pretrain") && err.contains("model_type") && err.contains("gpt2"),
        "{err}"
    );
    std::fs::remove_file(broken.join("config.json")).unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("policy.pretrain") && err.contains("config.json"), "{err}");

    // JSONL lines: not JSON, no input key, no label key.
    let bad = dir.join("bad.jsonl");
    let good = std::fs::read_to_string(&files.train_data).unwrap();
    let first: String = good.lines().take(3).map(|l| format!("{l}\n")).collect();
    let mut c = base.clone();
    c.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![bad.clone()]);
    std::fs::write(&bad, format!("{first}{{not json\n")).unwrap();
    let err = prepare_err(&c);
    assert!(err.contains("bad.jsonl:4") && err.contains("JSON"), "{err}");
    std::fs::write(&bad, format!("{first}{{\"q\": \"x\", \"answer\": \"#### 1\"}}\n")).unwrap();
    let err = prepare_err(&c);
    assert!(
        err.contains("bad.jsonl:4") && err.contains("`question`") && err.contains("`q`"),
        "{err}"
    );
    std::fs::write(&bad, format!("{first}{{\"question\": \"x\"}}\n")).unwrap();
    let err = prepare_err(&c);
    assert!(err.contains("bad.jsonl:4") && err.contains("`answer`"), "{err}");
    // A label needed but no label key.
    let err = TrainConfig::from_yaml(
        "",
        "x.yaml",
        &[
            format!("policy.pretrain={}", files.model_dir.display()),
            format!("data.prompt_data={}", files.train_data.display()),
            "rollout.max_new_tokens=8".into(),
            "reward.name=math_answer".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("data.label_key") && err.contains("math_answer"), "{err}");

    // A Parquet file without the column.
    let parquet = dir.join("bad.parquet");
    write_parquet(&parquet, &["prompt", "answer"], &[vec!["a".into(), "#### 1".into()]]);
    c.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![parquet]);
    let err = prepare_err(&c);
    assert!(err.contains("bad.parquet: row 1") && err.contains("`question`"), "{err}");

    // A chat template that refuses the messages.
    let chat = dir.join("robot.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}], \"answer\": \"1\"}\n",
    )
    .unwrap();
    c.data.prompt_data = rtrun_rlhf::data::OneOrMany(vec![chat]);
    c.data.input_key = "messages".into();
    let err = prepare_err(&c);
    assert!(err.contains("robot.jsonl:1") && err.contains("Unknown role: robot"), "{err}");

    // max_prompt_len dropping every prompt.
    let mut c = base.clone();
    c.data.max_prompt_len = 3;
    let err = prepare_err(&c);
    assert!(err.contains("data.max_prompt_len") && err.contains("longer than 3 tokens"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bf16_roles_and_engine_train_on_cpu() {
    let dir = scratch("bf16");
    let files = walkthrough(&dir);
    let run_dir = dir.join("run");
    let config = hf_config(
        &run_dir,
        &files,
        &["policy.dtype=bf16", "reference.dtype=bf16", "engine.dtype=bf16", "train.max_steps=2"],
    );
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 2);
    for r in metrics(&run_dir).iter().filter(|r| r.step() > 0) {
        // bf16 rounding, not a stale engine: fp32 runs stay below 1e-4.
        let gap = r.get("engine_logprob_gap").unwrap();
        assert!(gap.is_finite() && gap < 1e-2, "step {}: gap {gap}", r.step());
        assert!(r.get("actor_grad_norm").is_some_and(|g| g.is_finite() && g > 0.0));
    }
    // The export keeps the training precision.
    let exported = report.exported.unwrap();
    let model = CausalLm::from_pretrained(&exported, tch::Device::Cpu, tch::Kind::Float).unwrap();
    assert!(model.named_parameters().count() > 0);
    let bytes = std::fs::read(exported.join("model.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&bytes[8..8 + 4096.min(bytes.len() - 8)]).into_owned();
    assert!(header.contains("\"BF16\"") && !header.contains("\"F32\""), "{header}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reward_model_with_its_own_tokenizer_reads_retokenized_text() {
    let dir = scratch("rm");
    let files = walkthrough(&dir);
    // A reward model over a smaller vocabulary: the policy's ids (up to 400) would index past
    // its embeddings, so the run only works if prompt and response are re-tokenized for it.
    let rm_dir = dir.join("rm");
    std::fs::create_dir_all(&rm_dir).unwrap();
    let corpus = std::fs::read_to_string(&files.train_data).unwrap();
    let tokenizer = rtrun_rlhf_model::TextTokenizer::train_byte_level_bpe(
        corpus.lines(),
        300,
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    .unwrap();
    tokenizer.save_to_dir(&rm_dir).unwrap();
    std::fs::write(rm_dir.join("tokenizer_config.json"), r#"{"eos_token": "<|endoftext|>"}"#)
        .unwrap();
    let mut rm_config = rtrun_rlhf_model::ModelConfig::from_dir(&files.model_dir).unwrap();
    rm_config.vocab_size = tokenizer.vocab_size() as i64;
    let rm = rtrun_rlhf_model::ScalarHeadModel::new_random(
        &rm_config,
        tch::Device::Cpu,
        tch::Kind::Float,
        5,
    )
    .unwrap();
    rm.save_pretrained(&rm_dir, &Default::default()).unwrap();
    let run_dir = dir.join("run");
    let model_dir = format!("reward.model_dir={}", rm_dir.display());
    let config =
        hf_config(&run_dir, &files, &["reward.kind=model", &model_dir, "train.max_steps=1"]);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 1);
    assert!(trainer.reward_tokenizer.is_some(), "the reward model's tokenizer differs");
    let last = metrics(&run_dir).pop().unwrap();
    assert!(last.get("reward").is_some_and(f64::is_finite), "{last:?}");
    trainer.roles.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GRPO with LoRA (rank 16 on every projection) from the warmed-up walkthrough checkpoint:
/// no reference role is started (the policy with its adapters off is the reference, and its
/// log-probs equal the base checkpoint's), each sync sends only the merged projections and the
/// engines then agree with the policy on every sampled token, and the export is the merged checkpoint plus a peft adapter directory that rebuilds it. A rerun
/// with more steps resumes from the adapter checkpoint.
#[test]
fn grpo_with_lora_trains_the_adapters_and_exports_both_forms() {
    let dir = scratch("lora");
    let files = walkthrough(&dir);
    let run_dir = dir.join("run");
    let sets = [
        "policy.lora.rank=16",
        "policy.lora.alpha=32",
        "train.max_steps=30",
        "checkpoint.every_steps=10",
        "algo.old_logprobs=policy",
    ];
    let config = hf_config(&run_dir, &files, &sets);
    let (trainer, report) = rtrun_rlhf::run::run(&config, &mut NoProgress).unwrap();
    assert_eq!(report.steps, 30);
    assert!(trainer.roles.reference.is_none() && trainer.roles.reference_from_policy);
    let base =
        CausalLm::from_pretrained(&files.model_dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let whole: f64 = base.named_parameters().map(|(_, t)| (t.numel() * 4) as f64).sum();
    let projections: f64 = base
        .named_parameters()
        .filter(|(n, _)| n.ends_with("_proj.weight"))
        .map(|(_, t)| (t.numel() * 4) as f64)
        .sum();
    let records = metrics(&run_dir);
    for r in records.iter().filter(|r| r.step() > 0) {
        let gap = r.get("engine_logprob_gap").unwrap();
        assert!(gap < 1e-4, "step {}: engine and policy differ by {gap}", r.step());
        let bytes = r.get("weight_sync/bytes_per_rank").unwrap();
        assert_eq!(bytes, projections, "step {}: only the merged projections travel", r.step());
        assert!(r.get("kl").is_some_and(|kl| kl.is_finite() && kl >= 0.0), "step {}", r.step());
    }
    // Fresh adapters start at the reference (`B` = 0); the trained ones moved away from it.
    assert_eq!(records[1].get("kl"), Some(0.0));
    assert!(records.last().and_then(|r| r.get("kl")).is_some_and(|kl| kl > 0.0));
    // Thirty steps on 32 held-out problems say little about the reward (full fine-tuning moves
    // it either way here too); the main job's LoRA run is the benchmark of that.
    let (before, after) = (report.baseline.mean_reward, report.final_result.mean_reward);
    eprintln!(
        "lora: held-out reward {before:.3} -> {after:.3}; {projections} of {whole} bytes per sync"
    );

    // The reference is the base model: the policy ranks with their adapters off compute the
    // base checkpoint's log-probs; with them on, the trained policy's differ.
    let sequences: Vec<Sequence> = (0..4u32)
        .map(|i| Sequence::new(vec![1, 40 + i, 41, 42, 43], vec![50 + i, 60, 70, 2]))
        .collect();
    let rank0 = &trainer.roles.actor.members()[0];
    let reference = rank0.reference_log_probs(sequences.clone()).get().unwrap().unwrap();
    let policy = rank0.log_probs(sequences.clone()).get().unwrap().unwrap();
    let refs: Vec<&Sequence> = sequences.iter().collect();
    let batch = rtrun_rlhf::experience::response_batch(&refs, tch::Device::Cpu).unwrap();
    let expected = tch::no_grad(|| base.response_log_probs(&batch).unwrap());
    let expected = rtrun_rlhf::experience::unpad_rows(&expected, &[4, 4, 4, 4]).unwrap();
    let (mut ref_gap, mut policy_gap) = (0f32, 0f32);
    for ((r, p), e) in reference.iter().zip(&policy).zip(&expected) {
        for ((r, p), e) in r.iter().zip(p).zip(e) {
            ref_gap = ref_gap.max((r - e).abs());
            policy_gap = policy_gap.max((p - e).abs());
        }
    }
    assert!(ref_gap < 1e-5, "the reference differs from the base model by {ref_gap}");
    assert!(policy_gap > 1e-3, "the trained policy equals the base model ({policy_gap})");
    trainer.roles.kill();

    // Both forms: the merged checkpoint, and base + the peft adapter rebuilding it.
    let exported = report.exported.clone().unwrap();
    let adapter = exported.join(rtrun_rlhf::roles::lm::ADAPTER_DIR);
    assert!(adapter.join("adapter_config.json").is_file());
    assert!(adapter.join("adapter_model.safetensors").is_file());
    let merged = CausalLm::from_pretrained(&exported, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let mut rebuilt =
        CausalLm::from_pretrained(&files.model_dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    rebuilt.load_adapter(&adapter).unwrap();
    let mut changed = 0;
    for ((name, a), (_, b)) in merged.named_parameters().zip(rebuilt.merged_parameters().unwrap()) {
        let gap = (a - &b).abs().max().double_value(&[]);
        assert!(gap < 1e-6, "`{name}` differs from base + adapter by {gap}");
        changed += usize::from(!a.equal(base.params.get(name).unwrap()));
    }
    assert!(changed > 0, "no projection was changed by the adapters");
    for (name, t) in merged.named_parameters().filter(|(n, _)| !n.ends_with("_proj.weight")) {
        assert!(t.equal(base.params.get(name).unwrap()), "frozen `{name}` changed");
    }
    // The checkpoint holds the adapter and its optimizer state, not the model.
    let actor = RunPaths::new(&run_dir).checkpoints.join("step_000030/actor");
    assert!(actor.join("adapter_model.safetensors").is_file());
    assert!(actor.join("optimizer.safetensors").is_file());
    assert!(!actor.join("model.safetensors").exists());

    // A rerun with two more steps resumes from it.
    let more: Vec<&str> = sets.iter().copied().chain(["train.max_steps=32"]).collect();
    let (trainer, report) =
        rtrun_rlhf::run::run(&hf_config(&run_dir, &files, &more), &mut NoProgress).unwrap();
    assert_eq!(report.steps, 32);
    let resumed = metrics(&run_dir).iter().filter(|r| r.step() > 0).count();
    assert_eq!(resumed, 32, "steps 31 and 32 appended to the 30 before");
    trainer.roles.kill();
    rtrun::shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}
