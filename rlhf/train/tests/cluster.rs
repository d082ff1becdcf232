//! GRPO on a real three-node cluster on loopback (`rtrun head` and two `rtrun join` processes
//! with fake GPUs): the placement spec puts the policy and reference on one node and the
//! engines on the other (custom node resources make that certain), weights cross nodes every
//! step through the object store, the held-out reward rises, and a run whose driver is killed
//! resumes from its last checkpoint on the cluster. A node lost mid-run (its daemon and every
//! worker on it killed, as when a machine dies) fails the run with an error naming the role
//! and the node, and a rerun on a replacement node resumes from the last checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rtrun_tests::cluster::{Cluster, NodeSpec, start_cluster_with};

/// The head holds no GPU; `train` and `rollout` each have 2 fake GPUs and a resource naming
/// them, which the spec's bundles ask for.
fn start(name: &str) -> Cluster {
    start_cluster_with(
        name,
        "3",
        &NodeSpec { name: "head", cpus: 1, gpus: 0, resources: None },
        &[node("train", r#"{"train_node": 1}"#), node("rollout", r#"{"rollout_node": 1}"#)],
    )
}

/// A joined node with 4 CPUs, 2 fake GPUs and `resources`.
fn node(name: &'static str, resources: &'static str) -> NodeSpec {
    NodeSpec { name, cpus: 4, gpus: 2, resources: Some(resources) }
}

const SPEC: &str = "version: 1
placement_groups:
  train:
    bundles: [{count: 2, resources: {GPU: 1, CPU: 1, train_node: 0.5}}]
  rollout:
    bundles: [{count: 2, resources: {GPU: 1, CPU: 1, rollout_node: 0.5}}]
roles:
  actor: {replicas: 2, resources: {GPU: 0.5, CPU: 0.5}, placement_group: train}
  ref: {replicas: 2, resources: {GPU: 0.5, CPU: 0.5}, placement_group: train}
  critic: {replicas: 1, resources: {GPU: 0.5}, placement_group: rollout, bundles: 0..1}
  reward: {replicas: 1, resources: {GPU: 0.5}, placement_group: rollout, bundles: 1..2}
  vllm_engine: {replicas: 2, resources: {GPU: 0.5, CPU: 0.5}, placement_group: rollout}
";

/// The main job's task, model and data, shortened to 150 steps of 16 prompts × 8 samples, with
/// two policy ranks (DP all-reduce across their processes) and two engines.
fn write_config(dir: &Path) -> PathBuf {
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, SPEC).unwrap();
    let path = dir.join("grpo.yaml");
    let yaml = format!(
        "seed: 42\n\
         run_dir: {run}\n\
         data: {{synthetic: {{kind: reverse_digits, min_digits: 3, max_digits: 5, train_size: 4096, eval_size: 64}}}}\n\
         model: {{hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, intermediate_size: 128}}\n\
         warmup: {{steps: 80, batch_size: 64, lr: 0.003}}\n\
         cluster: {{placement_spec: {spec}, threads_per_worker: 1}}\n\
         rollout: {{prompts_per_step: 16, n_samples_per_prompt: 8}}\n\
         algo: {{advantage_estimator: group_norm, use_kl_loss: true, kl_estimator: k3, init_kl_coef: 0.001}}\n\
         train: {{max_steps: 150, train_batch_size: 64, micro_batch_size: 64, max_epochs: 2, actor_lr: 0.0003}}\n\
         reward: {{kind: rule, name: char_match}}\n\
         eval: {{every_steps: 50}}\n\
         checkpoint: {{every_steps: 50, keep_last: 2}}\n",
        run = dir.join("run").display(),
        spec = spec.display(),
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// `train --address` against the cluster, with the head's credentials; stderr to a file (a
/// pipe nobody reads could fill and block it).
fn train(cluster: &Cluster, config: &Path, stderr: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(config).args(["--address", &cluster.address]);
    cmd.env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"));
    cmd.stdout(Stdio::null()).stderr(std::fs::File::create(stderr).unwrap());
    cmd
}

/// `(step, eval/reward)` of every record of `metrics.jsonl` that has a held-out reward.
fn held_out(run: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|r| Some((r.get("step")?.as_u64()?, r.get("eval/reward")?.as_f64()?)))
        .collect()
}

/// Waits until the run at `run` has done 60 steps (past its step-50 checkpoint).
fn wait_for_steps(child: &mut std::process::Child, run: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(240);
    while steps_done(run) < 60 {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended early ({status}):\n{text}");
        }
        assert!(Instant::now() < deadline, "60 steps within 240 s:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn steps_done(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |text| text.lines().count())
}

/// A fresh cluster named `name` and the job's directory in it: its config and run directory.
fn job_on(name: &str) -> (Cluster, PathBuf, PathBuf, PathBuf) {
    let cluster = start(name);
    let dir = cluster.dir.join("job");
    std::fs::create_dir_all(&dir).unwrap();
    let config = write_config(&dir);
    let run = dir.join("run");
    (cluster, dir, config, run)
}

#[test]
fn grpo_places_roles_across_nodes_learns_and_resumes_after_its_driver_is_killed() {
    let (cluster, dir, config, run) = job_on("grpo");

    // First attempt: killed (SIGKILL) once it is past its first checkpoint (step 50). Its
    // trainer actor goes on until the head declares the driver gone (3 s of silence): on a
    // quiet machine that is another hundred steps or more, so the run is long enough that the
    // trainer is stopped before it ends (with 150 steps it finished first and the rerun had
    // nothing to resume).
    // (4096 prompts of 16 per step last 256 steps: twice as many for 400.)
    const STEPS: u64 = 400;
    let steps = format!("train.max_steps={STEPS}");
    let prompts = "data.synthetic.train_size=8192";
    let first_log = dir.join("first.log");
    let mut first = train(&cluster, &config, &first_log)
        .args(["--set", &steps, "--set", prompts])
        .spawn()
        .unwrap();
    wait_for_steps(&mut first, &run, &first_log);
    first.kill().unwrap();
    first.wait().unwrap();
    let log = std::fs::read_to_string(&first_log).unwrap();
    for line in [
        "actor: 0 → train GPU [0], 1 → train GPU [1]",
        "ref: 0 → train GPU [0], 1 → train GPU [1]",
        "vllm_engine: 0 → rollout GPU [0], 1 → rollout GPU [1]",
    ] {
        assert!(log.contains(line), "placement line `{line}` in:\n{log}");
    }

    // The rerun resumes from the newest checkpoint (once the killed driver's trainer actor,
    // roles and placement groups are gone: the head declares the driver gone after its
    // heartbeat timeout, and the trainer may have passed more checkpoints by then) and
    // finishes.
    let second_log = dir.join("second.log");
    let status = train(&cluster, &config, &second_log)
        .args(["--set", &steps, "--set", prompts])
        .status()
        .unwrap();
    let log = std::fs::read_to_string(&second_log).unwrap();
    assert!(status.success(), "the resumed run failed:\n{log}");
    let resumed = rtrun_tests::resumed_from(&log);
    eprintln!("resumed from step {resumed:?}");
    assert!(resumed.is_some_and(|step| step >= 50 && step % 50 == 0 && step < STEPS), "{log}");
    let evals = held_out(&run);
    let (first_eval, last_eval) = (evals.first().unwrap(), evals.last().unwrap());
    assert_eq!(last_eval.0, STEPS, "held-out rewards {evals:?}");
    eprintln!("held-out reward {evals:?}");
    assert!(last_eval.1 > first_eval.1 + 0.05, "held-out reward did not rise: {evals:?}");
}

/// Kills node `victim` (`train`: the policy's ranks, rank 0 among them; `rollout`: the
/// engines) with all its workers after step 60, checks the run's error, then joins a
/// replacement node with the same resources and reruns: the rerun resumes from step 50 and
/// finishes.
fn node_lost_mid_run(victim: &'static str, resources: &'static str, roles: &[&str]) {
    let (mut cluster, dir, config, run) = job_on(&format!("loss-{victim}"));
    let log = dir.join("first.log");
    let mut first = train(&cluster, &config, &log).spawn().unwrap();
    wait_for_steps(&mut first, &run, &log);
    let index = if victim == "train" { 0 } else { 1 };
    cluster.kill_node_tree(index);
    let killed = Instant::now();
    let status = loop {
        if let Some(status) = first.try_wait().unwrap() {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = first.kill();
            panic!(
                "the run outlived its {victim} node by 60 s:\n{}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    let error = text.lines().find(|l| l.starts_with("Error: ")).unwrap_or_else(|| panic!("{text}"));
    eprintln!("{victim} node killed; the run ended after {:?}: {error}", killed.elapsed());
    assert!(!status.success(), "{text}");
    assert!(roles.iter().any(|role| error.contains(role)), "a role of {roles:?}: {error}");
    assert!(error.contains(&format!("({victim})")), "the node's name: {error}");

    cluster.join(&node(if victim == "train" { "train2" } else { "rollout2" }, resources));
    let rerun_log = dir.join("rerun.log");
    let status = train(&cluster, &config, &rerun_log).status().unwrap();
    let text = std::fs::read_to_string(&rerun_log).unwrap();
    assert!(status.success(), "the rerun failed:\n{text}");
    assert!(text.contains("resuming from ") && text.contains("step_000050"), "{text}");
    assert_eq!(held_out(&run).last().map(|(step, _)| *step), Some(150), "{text}");
}

#[test]
fn losing_the_engines_node_fails_the_run_naming_it_and_a_rerun_on_a_new_node_resumes() {
    node_lost_mid_run("rollout", r#"{"rollout_node": 1}"#, &["vllm_engine"]);
}

#[test]
fn losing_the_policy_node_fails_the_run_naming_it_and_a_rerun_on_a_new_node_resumes() {
    node_lost_mid_run("train", r#"{"train_node": 1}"#, &["actor", "ref"]);
}

/// `train.pipeline: dock` on the cluster: the step's stages (rollout on the engines' node,
/// reward, reference and old log-probs on the policy's node, advantages, training) stream
/// prompt groups through the TransferDock actor, whose rows cross nodes; the run finishes with
/// every stage's timeline in its metrics.
#[test]
fn grpo_in_dock_mode_streams_its_stages_across_nodes() {
    let (cluster, dir, config, run) = job_on("dock");
    let log = dir.join("dock.log");
    let status = train(&cluster, &config, &log)
        .args(["--set", "train.pipeline=dock", "--set", "train.max_steps=12"])
        .args(["--set", "eval.every_steps=12", "--set", "checkpoint.every_steps=12"])
        .status()
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "the dock-mode run failed:\n{text}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["step"], 12, "{metrics}");
    for stage in ["rollout", "reward", "ref_log_prob", "old_log_prob", "actor_train"] {
        let key = last
            .as_object()
            .unwrap()
            .keys()
            .find(|k| k.starts_with("pipeline/") && k.contains(stage))
            .cloned();
        assert!(key.is_some(), "no pipeline metric for {stage}: {last}");
    }
    assert!(last["eval/reward"].as_f64().is_some_and(f64::is_finite), "{last}");
}

/// SFT on the cluster (`train --mode sft --address`): a placement spec spreads the two DP
/// ranks over two nodes (one bundle each, `STRICT_SPREAD`), their gradients all-reduce across
/// the nodes, the held-out loss falls and the model is exported.
#[test]
fn sft_spreads_its_dp_ranks_over_two_nodes_with_a_placement_spec() {
    let plain = |name| NodeSpec { name, cpus: 2, gpus: 0, resources: None };
    let head = NodeSpec { name: "head", cpus: 1, gpus: 0, resources: None };
    let cluster = start_cluster_with("sft", "3", &head, &[plain("a"), plain("b")]);
    let dir = cluster.dir.join("job");
    std::fs::create_dir_all(&dir).unwrap();
    tch::set_num_threads(1);
    let files = rtrun_rlhf::demo::walkthrough::write_walkthrough(
        &dir.join("walkthrough"),
        &rtrun_rlhf::demo::walkthrough::WalkthroughConfig {
            train_problems: 240,
            test_problems: 24,
            vocab_size: 400,
            warmup: rtrun_rlhf::config::WarmupConfig { steps: 0, batch_size: 1, lr: 1e-3 },
            ..Default::default()
        },
    )
    .unwrap();
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        "version: 1\n\
         placement_groups:\n  ranks:\n    strategy: STRICT_SPREAD\n    bundles: [{count: 2, resources: {CPU: 2}}]\n\
         roles:\n  sft: {replicas: 2, resources: {CPU: 1}, placement_group: ranks}\n",
    )
    .unwrap();
    let config = dir.join("sft.yaml");
    let run = dir.join("run");
    std::fs::write(
        &config,
        format!(
            "mode: sft\nrun_dir: {}\nmodel: {{pretrain: {}}}\n\
             data: {{train_data: {}, eval_data: {}, input_key: question, output_key: answer, apply_chat_template: true, max_len: 160}}\n\
             cluster: {{placement_spec: {}, threads_per_worker: 1}}\n\
             train: {{epochs: 2, batch_size: 16, micro_batch_size: 4, lr: 0.003}}\n\
             eval: {{every_steps: 10}}\n",
            run.display(),
            files.model_dir.display(),
            files.train_data.display(),
            files.test_data.display(),
            spec.display()
        ),
    )
    .unwrap();
    let log = dir.join("sft.log");
    let status = train(&cluster, &config, &log).status().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "the SFT run failed:\n{text}");
    let placed = text.lines().find(|l| l.trim_start().starts_with("sft: ")).unwrap_or_default();
    let nodes: Vec<&str> = placed.split(", ").filter_map(|r| r.split(" → ").nth(1)).collect();
    assert_eq!(nodes.len(), 2, "{text}");
    let nodes: Vec<&str> = nodes.iter().map(|n| n.split(' ').next().unwrap()).collect();
    assert!(nodes[0] != nodes[1] && !nodes.contains(&"head"), "ranks on {nodes:?}:\n{text}");
    let loss: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["eval/loss"].as_f64())
        .collect();
    assert!(loss.last().unwrap() < &(0.8 * loss[0]), "held-out loss {loss:?}");
    assert!(run.join("final_policy/model.safetensors").is_file());
}

/// `train --detach`: the driver is killed mid-run and the run goes on in its trainer actor
/// (detached, on the cluster); `train --attach RUN` follows it to its end and prints its
/// summary, and the actor and its roles are gone afterwards. A second `--detach` run in the
/// same directory while the first trains is refused, pointing to `--attach`.
#[test]
fn a_detached_run_outlives_its_driver_and_train_attach_follows_it_to_the_end() {
    let (cluster, dir, config, run) = job_on("detach");
    // Long enough that the run is still training after the second driver's refusal and the
    // heartbeat timeout, with margin: a step of this job takes ~50-100 ms on the 2-core
    // machine, so the 240 steps left after the first 6 records take 12 s or more (the 4096
    // training prompts make 256 steps of 16).
    const STEPS: usize = 250;
    let sets = [
        "--set".to_owned(),
        "cluster.placement_spec=null".to_owned(),
        "--set".to_owned(),
        format!("train.max_steps={STEPS}"),
        "--set".to_owned(),
        "checkpoint.every_steps=100".to_owned(),
        "--set".to_owned(),
        "eval.every_steps=100".to_owned(),
    ];
    let records = STEPS + 1; // step 0's evaluation, then one per step
    let log = dir.join("detached.log");
    let mut driver = train(&cluster, &config, &log).args(&sets).arg("--detach").spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    while steps_done(&run) < 6 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(driver.try_wait().unwrap().is_none(), "the run ended early:\n{text}");
        assert!(Instant::now() < deadline, "6 records within 240 s:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("detached: the run goes on") && text.contains("--attach"), "{text}");

    // Another detached run in the same directory is refused while this one trains.
    let second_log = dir.join("second.log");
    let out = train(&cluster, &config, &second_log).args(&sets).arg("--detach").output().unwrap();
    let text = std::fs::read_to_string(&second_log).unwrap();
    assert!(steps_done(&run) < records, "the run ended before the second driver was refused");
    assert!(!out.status.success() && text.contains("already training"), "{text}");
    assert!(text.contains("train --attach"), "{text}");

    driver.kill().unwrap();
    driver.wait().unwrap();
    // Past the heartbeat timeout (3 s) the head has declared the driver gone; steps go on.
    std::thread::sleep(Duration::from_secs(5));
    let after_gone = steps_done(&run);
    assert!(after_gone < records, "the run ended before its driver was declared gone");
    let deadline = Instant::now() + Duration::from_secs(120);
    while steps_done(&run) < (after_gone + 3).min(records) {
        assert!(Instant::now() < deadline, "no step after the driver left ({after_gone} records)");
        std::thread::sleep(Duration::from_millis(50));
    }

    let attach_log = dir.join("attach.log");
    let out = Command::new(env!("CARGO_BIN_EXE_train"))
        .arg("--attach")
        .arg(&run)
        .args(["--address", &cluster.address])
        .env("RTRUN_CREDENTIALS_DIR", cluster.dir.join("head-credentials"))
        .stderr(std::fs::File::create(&attach_log).unwrap())
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&attach_log).unwrap();
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "attach failed:\n{text}");
    assert!(text.contains("attached to the run in"), "{text}");
    assert!(
        summary.contains(&format!("{STEPS} steps")) && summary.contains("mean reward"),
        "{summary}"
    );
    let steps: Vec<u64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect();
    assert_eq!(steps, (0..=STEPS as u64).collect::<Vec<u64>>(), "one record per step, none twice");
    assert!(run.join("final_policy/model.safetensors").is_file());
    assert!(run.join("summary.md").is_file() && run.join("reward.png").is_file());

    // The trainer actor and its roles are gone; attaching again finds nothing.
    let credentials = cluster.dir.join("head-credentials");
    let alive = || {
        let listed = rtrun_tests::cluster::rtrun(&cluster, &["list", "actors"], &credentials);
        let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
        listed.lines().filter(|l| l.contains("ALIVE")).map(str::to_owned).collect::<Vec<_>>()
    };
    assert!(
        rtrun_tests::wait_until(Duration::from_secs(30), || alive().is_empty()),
        "{:?}",
        alive()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_train"))
        .arg("--attach")
        .arg(&run)
        .args(["--address", &cluster.address])
        .env("RTRUN_CREDENTIALS_DIR", &credentials)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("no run is training in"), "{text}");
}

/// The metrics of a run without its timings, per step.
fn comparable(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let mut record: serde_json::Value = serde_json::from_str(line).unwrap();
            if let Some(fields) = record.as_object_mut() {
                fields.retain(|name, _| !name.starts_with("time/") && name != "wall_time");
            }
            record
        })
        .collect()
}

/// `train --detach` on a cluster whose head persists its state (`--state-dir`): the head is
/// SIGKILLed mid-run and started again on its directory. The trainer actor and its roles run
/// on through the restart (the trainer's reward tasks and actor watches wait for the new head
/// and are sent again), the driver following it reconnects and prints the summary, and every
/// step's metrics equal those of the same run done before without an interruption.
#[test]
fn a_detached_run_lives_through_a_head_restart_and_matches_an_uninterrupted_run() {
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    let mut cluster = rtrun_tests::cluster::start_cluster_with_args(
        "headrestart",
        "3",
        &NodeSpec { name: "head", cpus: 1, gpus: 0, resources: None },
        &["--state-dir", &state_dir, "--reconnect-window", "30"],
        &[node("train", r#"{"train_node": 1}"#), node("rollout", r#"{"rollout_node": 1}"#)],
    );
    let dir = cluster.dir.join("job");
    std::fs::create_dir_all(&dir).unwrap();
    let config = write_config(&dir);
    const STEPS: usize = 60;
    let sets = |run: &Path| {
        [
            "--set".to_owned(),
            format!("run_dir={}", run.display()),
            "--set".to_owned(),
            format!("train.max_steps={STEPS}"),
            "--set".to_owned(),
            "checkpoint.every_steps=100".to_owned(),
            "--set".to_owned(),
            "eval.every_steps=20".to_owned(),
        ]
    };
    let straight = dir.join("straight");
    let log = dir.join("straight.log");
    let status = train(&cluster, &config, &log).args(sets(&straight)).status().unwrap();
    assert!(status.success(), "{}", std::fs::read_to_string(&log).unwrap());

    let run = dir.join("run");
    let log = dir.join("detached.log");
    let mut driver =
        train(&cluster, &config, &log).args(sets(&run)).arg("--detach").spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(240);
    while steps_done(&run) < 8 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(driver.try_wait().unwrap().is_none(), "the run ended early:\n{text}");
        assert!(Instant::now() < deadline, "8 records within 240 s:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    rtrun_tests::kill9(cluster.head.id());
    let _ = cluster.head.wait();
    let killed_at = steps_done(&run);
    cluster.restart_head(&[]);
    let status = rtrun_tests::cluster::wait_exit(&mut driver, Duration::from_secs(240))
        .expect("the detached run ends");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "the run across the head restart failed:\n{text}");
    assert!(killed_at < STEPS + 1, "the run ended before the head was killed");
    eprintln!("head killed after {killed_at} of {} records", STEPS + 1);
    assert!(text.contains("reconnected to the restarted cluster head"), "{text}");
    assert_eq!(comparable(&run), comparable(&straight), "the run across the restart differs");
    assert!(run.join("final_policy/model.safetensors").is_file());
}
