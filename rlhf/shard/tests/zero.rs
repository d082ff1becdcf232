//! ZeRO stages 0-3 with and without activation checkpointing, on ranks that are threads of
//! this process joined by the real TCP ring collective: the same losses and final weights as
//! one rank training on the whole batch, shards that really hold 1/N, and a lost rank that
//! fails its peers instead of hanging them. (Multi-process runs through the trainer's roles are
//! in `rlhf/train/tests/zero.rs`.)

use std::time::Duration;

use rtrun::collective::CollectiveConfig;
use rtrun_rlhf_model::logprobs::token_log_probs;
use rtrun_rlhf_model::lora::LoraConfig;
use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
use rtrun_rlhf_model::train::{OptimizerConfig, ScheduleConfig};
use rtrun_rlhf_model::{CausalLm, ModelFamily};
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel, ZeroStage};
use tch::{Kind, Tensor};

const STEPS: usize = 3;
const ROWS: usize = 5;
const SEQ: i64 = 12;
const MICRO: usize = 2;

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind an ephemeral port");
    listener.local_addr().expect("a bound listener has an address").port()
}

/// The rows of step `step`: `ROWS` sequences of `SEQ` token ids.
fn batch(step: usize) -> Vec<Vec<i64>> {
    (0..ROWS)
        .map(|r| {
            (0..SEQ).map(|t| ((step * 131 + r * 17 + t as usize * 7) % 380 + 3) as i64).collect()
        })
        .collect()
}

/// The summed next-token NLL of `rows`, through `model.forward`.
fn nll_sum(model: &CausalLm, rows: &[Vec<i64>]) -> Tensor {
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    let ids = Tensor::from_slice(&flat).view([rows.len() as i64, SEQ]);
    let logits = model.forward(&ids, &ids.ones_like(), None).unwrap();
    token_log_probs(&logits.narrow(1, 0, SEQ - 1), &ids.narrow(1, 1, SEQ - 1))
        .unwrap()
        .sum(Kind::Float)
        .neg()
}

/// Adam's `eps` is raised from 1e-8 so that gradients that are zero up to rounding (a
/// token's embedding row that cancels out) are not blown up to a full-size step whose sign is
/// the rounding's: with 1e-8 a few such elements differ by 2·lr between runs that sum in
/// another order, far beyond what the comparison can tell from a real fault. The gradients
/// themselves are compared exactly in `rtrun_rlhf_model::layerwise`'s tests.
fn optimizer() -> OptimizerConfig {
    OptimizerConfig {
        eps: 1e-5,
        schedule: ScheduleConfig { peak_lr: 1e-2, ..ScheduleConfig::default() },
        weight_decay: 0.1,
        max_grad_norm: 0.5,
        ..OptimizerConfig::default()
    }
}

/// What one rank saw: the loss of each step (its own summed NLL) and the final weights.
struct Outcome {
    losses: Vec<f64>,
    weights: Vec<(String, Vec<f32>)>,
    /// Gathers the prefetch ring had done before their layer asked.
    prefetched: u64,
}

/// Trains `STEPS` steps on `world` thread ranks; returns each rank's outcome.
fn train(family: ModelFamily, world: usize, config: ShardConfig) -> Vec<Outcome> {
    train_steps(family, world, config, 0..STEPS, None, None, None)
}

/// LoRA rank 4 on q, v and down (a fresh adapter's `B` is zero; `A` is drawn from seed 5).
fn lora() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: ["q_proj", "v_proj", "down_proj"].map(String::from).to_vec(),
    }
}

/// Trains steps `steps` on `world` thread ranks, first loading a sharded save from `load`,
/// at the end saving one into `save`.
fn train_steps(
    family: ModelFamily,
    world: usize,
    config: ShardConfig,
    steps: std::ops::Range<usize>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
    lora: Option<&LoraConfig>,
) -> Vec<Outcome> {
    let (port, prefetch_port) = (free_port(), free_port());
    let model_config = tiny_config(family);
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let model_config = model_config.clone();
                let steps = steps.clone();
                scope.spawn(move || {
                    let collective = CollectiveConfig::new("zero", rank, world, "127.0.0.1", port)
                        .with_timeout(Duration::from_secs(30));
                    // Stage 3 gathers the next layer on a second ring while one is computed.
                    let prefetch =
                        CollectiveConfig::new("zero-next", rank, world, "127.0.0.1", prefetch_port)
                            .with_timeout(Duration::from_secs(30));
                    let mut model = tiny_model(&model_config, 11).unwrap();
                    if let Some(lora) = lora {
                        model.add_lora(lora, 5).unwrap();
                    }
                    let mut sharded = ShardedModel::for_causal_lm(
                        &model,
                        config,
                        GroupComm::joining(collective).with_prefetch(prefetch),
                        Some(optimizer()),
                    )
                    .unwrap();
                    if let Some(dir) = load {
                        sharded.load_sharded(dir).unwrap();
                    }
                    let mut losses = Vec::new();
                    for step in steps {
                        let rows = batch(step);
                        // Uneven shares (5 rows): rank 0 of 2 has 3 rows in 2 micro-batches,
                        // rank 1 has 2 in one, so the balancing and idle passes are exercised.
                        let mine: Vec<Vec<i64>> =
                            rows.iter().skip(rank).step_by(world).cloned().collect();
                        let global_tokens = (ROWS as i64 * (SEQ - 1)) as f64;
                        let micro: Vec<&[Vec<i64>]> = mine.chunks(MICRO).collect();
                        let passes = sharded.balance(micro.len(), true).unwrap();
                        sharded.zero_grad().unwrap();
                        let mut total = 0.0;
                        for rows in &micro {
                            let nll = nll_sum(&model, rows);
                            total += nll.double_value(&[]);
                            model.backward(&(nll * (world as f64 / global_tokens))).unwrap();
                        }
                        for _ in micro.len()..passes {
                            sharded.idle_training_pass().unwrap();
                        }
                        sharded.step().unwrap();
                        losses.push(total);
                    }
                    if let Some(dir) = save {
                        sharded.save_sharded(dir).unwrap();
                    }
                    let prefetched = sharded.stats(false).prefetched_gathers;
                    sharded.gather_all().unwrap();
                    let adapters = model.lora_parameters().map(|p| p.named()).into_iter().flatten();
                    let weights = model
                        .named_parameters()
                        .chain(adapters)
                        .map(|(n, t)| {
                            (n.to_string(), Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
                        })
                        .collect();
                    sharded.release_all().unwrap();
                    Outcome { losses, weights, prefetched }
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().expect("rank thread")).collect()
    })
}

/// ‖a − b‖ / ‖b‖ over all parameters together, and the worst of the same per tensor (small
/// tensors such as biases that start at zero make the per-tensor ratio the looser one).
fn relative_gap(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f64, f64) {
    let (mut gap, mut norm, mut worst) = (0.0, 0.0, 0f64);
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let n = vb.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
        let g = va.iter().zip(vb).map(|(&x, &y)| f64::from(x - y).powi(2)).sum::<f64>();
        worst = worst.max(g.sqrt() / n.sqrt().max(1e-30));
        gap += g;
        norm += n;
    }
    (gap.sqrt() / norm.sqrt().max(1e-30), worst)
}

/// Stages 1-3, with and without checkpointing, against today's data parallelism (stage 0,
/// no checkpointing) on the same ranks: equal up to summation order (1e-6 relative), on 1, 2
/// and 4 ranks; and all of them against one rank on the whole batch (looser: a different
/// number of ranks sums each gradient in another order, and Adam divides near-zero gradients
/// by their own size).
#[test]
fn every_stage_trains_as_todays_data_parallelism() {
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let single = train(family, 1, ShardConfig::default()).remove(0);
        for world in [1, 2, 4] {
            let baseline = train(family, world, ShardConfig::default());
            for stage in [ZeroStage::Zero, ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
                for gradient_checkpointing in [false, true] {
                    let config = ShardConfig { stage, gradient_checkpointing };
                    let outcomes = train(family, world, config);
                    let what = format!("{family:?} world {world} {config:?}");
                    for step in 0..STEPS {
                        let sum: f64 = outcomes.iter().map(|o| o.losses[step]).sum();
                        let expected: f64 = baseline.iter().map(|o| o.losses[step]).sum();
                        assert!(
                            (sum - expected).abs() <= 1e-6 * expected.abs(),
                            "{what}: step {step} loss {sum} vs {expected}"
                        );
                        let alone = single.losses[step];
                        assert!(
                            (sum - alone).abs() <= 1e-5 * alone.abs(),
                            "{what}: {sum} vs {alone}"
                        );
                    }
                    for (rank, outcome) in outcomes.iter().enumerate() {
                        if stage == ZeroStage::Three && world > 1 {
                            // Forward L0 prefetches L1; backward L1 prefetches L0: per pass.
                            assert!(outcome.prefetched > 0, "{what}: rank {rank} never prefetched");
                        }
                        let (gap, worst) = relative_gap(&outcome.weights, &baseline[rank].weights);
                        // Recomputed layers sum a layer's output gradient in another order
                        // (its gradients agree to 1e-6, see the model crate), which three
                        // Adam steps carry into the weights a little further.
                        let bound = if gradient_checkpointing { 1e-5 } else { 1e-6 };
                        assert!(
                            gap < bound && worst < 1e-4,
                            "{what}: rank {rank} weights differ by {gap:e} (worst tensor {worst:e})"
                        );
                        let (gap, _) = relative_gap(&outcome.weights, &single.weights);
                        assert!(gap < 1e-5, "{what}: rank {rank} vs one rank: {gap:e}");
                    }
                }
            }
        }
    }
}

/// LoRA at every stage on 1 and 2 ranks trains the adapters as one rank at stage 0 does, and
/// leaves every base weight as loaded (frozen: no gradient, no optimizer state). A sharded
/// save holds the adapters and their moments only, and resumes on another number of ranks.
#[test]
fn lora_trains_the_adapters_alone_at_every_stage() {
    let family = ModelFamily::Qwen3;
    let lora = lora();
    let base = tiny_model(&tiny_config(family), 11).unwrap();
    let single = train_steps(family, 1, ShardConfig::default(), 0..STEPS, None, None, Some(&lora));
    let single = &single[0];
    let adapted = |o: &Outcome| -> Vec<(String, Vec<f32>)> {
        o.weights.iter().filter(|(n, _)| n.contains(".lora_")).cloned().collect()
    };
    // The adapters moved: `B` started at zero.
    let moved =
        adapted(single).iter().any(|(n, v)| n.contains("lora_B") && v.iter().any(|&x| x != 0.0));
    assert!(moved, "no adapter trained");
    for world in [1, 2] {
        for stage in [ZeroStage::Zero, ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
            for gradient_checkpointing in [false, true] {
                let config = ShardConfig { stage, gradient_checkpointing };
                let what = format!("world {world} {config:?}");
                let outcomes =
                    train_steps(family, world, config, 0..STEPS, None, None, Some(&lora));
                for outcome in &outcomes {
                    for (name, value) in
                        outcome.weights.iter().filter(|(n, _)| !n.contains(".lora_"))
                    {
                        let loaded: Vec<f32> =
                            Vec::try_from(&base.params.get(name).unwrap().reshape([-1])).unwrap();
                        assert!(value == &loaded, "{what}: frozen `{name}` changed");
                    }
                    let (gap, _) = relative_gap(&adapted(outcome), &adapted(single));
                    assert!(gap < 1e-5, "{what}: adapters differ from one rank's by {gap:e}");
                }
                for step in 0..STEPS {
                    let sum: f64 = outcomes.iter().map(|o| o.losses[step]).sum();
                    let alone = single.losses[step];
                    assert!((sum - alone).abs() <= 1e-5 * alone.abs(), "{what}: {sum} vs {alone}");
                }
            }
        }
    }
    // Save on 2 ranks at stage 3, resume on 1 at stage 1.
    let dir = tempfile::tempdir().unwrap();
    let three = ShardConfig { stage: ZeroStage::Three, gradient_checkpointing: false };
    let one = ShardConfig { stage: ZeroStage::One, gradient_checkpointing: false };
    train_steps(family, 2, three, 0..2, None, Some(dir.path()), Some(&lora));
    let manifest = rtrun_rlhf_shard::checkpoint::read_manifest(dir.path()).unwrap();
    assert!(manifest.units.iter().all(|u| u.trains && u.name.ends_with(".trained")));
    let saved: usize = manifest.units.iter().map(|u| u.numel).sum();
    let adapter_numel: usize = adapted(single).iter().map(|(_, v)| v.len()).sum();
    assert_eq!(saved, adapter_numel, "the save holds the adapters alone");
    let resumed = train_steps(family, 1, one, 2..STEPS, Some(dir.path()), None, Some(&lora));
    let (gap, _) = relative_gap(&adapted(&resumed[0]), &adapted(single));
    assert!(gap < 1e-5, "resumed adapters differ by {gap:e}");
}

/// Frozen base weights hold no gradient and no optimizer state: AdamW's moments are the
/// adapters' (two float32 per trained element, 1/N of them per rank at stages 1-3).
#[test]
fn lora_optimizer_state_is_the_adapters_alone() {
    let family = ModelFamily::Llama;
    let mut model = tiny_model(&tiny_config(family), 3).unwrap();
    model.add_lora(&lora(), 5).unwrap();
    let adapters = model.lora_parameters().unwrap().numel() as u64;
    for stage in [ZeroStage::Zero, ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let config = ShardConfig { stage, gradient_checkpointing: false };
        let mut sharded =
            ShardedModel::for_causal_lm(&model, config, GroupComm::solo(), Some(optimizer()))
                .unwrap();
        sharded.zero_grad().unwrap();
        let nll = nll_sum(&model, &batch(0));
        model.backward(&nll).unwrap();
        sharded.step().unwrap();
        let held = sharded.stats(false).now;
        assert_eq!(held.optimizer, 8 * adapters, "{stage}: moments of the adapters alone");
        for (name, t) in model.named_parameters() {
            assert!(!t.grad().defined(), "{stage}: frozen `{name}` has a gradient");
        }
        drop(sharded);
        model = tiny_model(&tiny_config(family), 3).unwrap();
        model.add_lora(&lora(), 5).unwrap();
    }
}

/// A save made on 4 ranks at stage 3 resumes on 2 (stage 3) and on 1 (stage 1) ranks: each
/// continuation equals the uninterrupted run on as many ranks as it continues on, as an
/// unsharded resume would.
#[test]
fn a_sharded_save_resumes_on_another_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let three = ShardConfig { stage: ZeroStage::Three, gradient_checkpointing: false };
    let one = ShardConfig { stage: ZeroStage::One, gradient_checkpointing: false };
    let family = ModelFamily::Qwen2;
    train_steps(family, 4, three, 0..2, None, Some(dir.path()), None);
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 5, "four shards and the manifest");
    for (world, config) in [(2, three), (1, one)] {
        let resumed = train_steps(family, world, config, 2..STEPS, Some(dir.path()), None, None);
        let whole = train(family, world, ShardConfig::default());
        for (rank, outcome) in resumed.iter().enumerate() {
            let (gap, _) = relative_gap(&outcome.weights, &whole[rank].weights);
            assert!(gap < 1e-5, "resumed on {world}: rank {rank} differs by {gap:e}");
        }
        let loss: f64 = resumed.iter().map(|o| o.losses[0]).sum();
        let expected: f64 = whole.iter().map(|o| o.losses[STEPS - 1]).sum();
        assert!((loss - expected).abs() < 1e-5 * expected, "{loss} vs {expected}");
    }
}

/// A save missing a shard, or loaded into another model, is refused with the file named.
#[test]
fn broken_sharded_saves_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let three = ShardConfig { stage: ZeroStage::Three, gradient_checkpointing: false };
    train_steps(ModelFamily::Llama, 2, three, 0..1, None, Some(dir.path()), None);
    let model = tiny_model(&tiny_config(ModelFamily::Qwen2), 1).unwrap();
    let mut sharded =
        ShardedModel::for_causal_lm(&model, three, GroupComm::solo(), Some(optimizer())).unwrap();
    let err = sharded.load_sharded(dir.path()).unwrap_err().to_string();
    assert!(err.contains("zero-manifest.json") && err.contains("does not match"), "{err}");
    std::fs::remove_file(dir.path().join(rtrun_rlhf_shard::checkpoint::shard_file(1, 2))).unwrap();
    let err = sharded.load_sharded(dir.path()).unwrap_err().to_string();
    assert!(err.contains("zero-shard-00001-of-00002") && err.contains("missing"), "{err}");
    std::fs::remove_file(dir.path().join(rtrun_rlhf_shard::checkpoint::MANIFEST_FILE)).unwrap();
    let err = sharded.load_sharded(dir.path()).unwrap_err().to_string();
    assert!(err.contains("incomplete save"), "{err}");
}

/// Stage 3 on N ranks holds at most 1/N of stage 0's parameters, gradients and moments plus
/// one unit gathered at a time (the head and a layer while both are read).
#[test]
fn stage_three_holds_a_shard_and_one_unit() {
    let family = ModelFamily::Llama;
    let peak = |world: usize, stage: ZeroStage| -> u64 {
        let config = ShardConfig { stage, gradient_checkpointing: false };
        let port = free_port();
        let model_config = tiny_config(family);
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..world)
                .map(|rank| {
                    let model_config = model_config.clone();
                    scope.spawn(move || {
                        let collective =
                            CollectiveConfig::new("mem", rank, world, "127.0.0.1", port);
                        let model = tiny_model(&model_config, 3).unwrap();
                        let mut sharded = ShardedModel::for_causal_lm(
                            &model,
                            config,
                            GroupComm::joining(collective),
                            Some(optimizer()),
                        )
                        .unwrap();
                        sharded.reset_peak();
                        let rows: Vec<Vec<i64>> = batch(0).into_iter().take(world).collect();
                        let nll = nll_sum(&model, &rows[rank..=rank]);
                        model.backward(&nll).unwrap();
                        sharded.step().unwrap();
                        sharded.peak_bytes().total()
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).max().unwrap()
        })
    };
    let model = tiny_model(&tiny_config(family), 3).unwrap();
    let numel = model.params.numel() as u64;
    let stage0 = peak(1, ZeroStage::Zero);
    assert_eq!(stage0, 16 * numel, "parameters, gradients and two moments, 4 bytes each");
    let plan = rtrun_rlhf_shard::plan::ShardPlan::new(
        &model.named_parameters().map(|(n, t)| (n.to_string(), t.size())).collect::<Vec<_>>(),
        1,
        false,
    )
    .unwrap();
    // A decoder layer and the head may be whole at once (the last layer's backward), each
    // with its full gradient until it is reduced.
    let head = plan.units.last().unwrap().padded as u64;
    let layer = plan.units[1].padded as u64;
    for world in [2u64, 4] {
        let stage3 = peak(world as usize, ZeroStage::Three);
        let bound = stage0 / world + 8 * (head + layer) + 64;
        assert!(stage3 <= bound, "{world} ranks: {stage3} > {bound} (stage 0: {stage0})");
    }
}

/// A rank that goes away mid-step (its sockets close, as when its process dies) fails the
/// others' next gather at once with an error naming the unit and the lost peer, instead of
/// hanging them.
#[test]
fn a_lost_rank_fails_the_gather_instead_of_hanging() {
    let port = free_port();
    let config = ShardConfig { stage: ZeroStage::Three, gradient_checkpointing: false };
    let started = std::time::Instant::now();
    let errors: Vec<Option<String>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                scope.spawn(move || {
                    let collective = CollectiveConfig::new("lost", rank, 2, "127.0.0.1", port)
                        .with_timeout(Duration::from_secs(60));
                    let model = tiny_model(&tiny_config(ModelFamily::Llama), 3).unwrap();
                    let sharded = ShardedModel::for_causal_lm(
                        &model,
                        config,
                        GroupComm::joining(collective),
                        None,
                    )
                    .unwrap();
                    sharded.balance(1, false).unwrap();
                    if rank == 1 {
                        return None; // Leaves: its communicator closes its sockets.
                    }
                    let ids = Tensor::from_slice(&[5i64, 6, 7]).view([1, 3]);
                    let err = tch::no_grad(|| model.forward(&ids, &ids.ones_like(), None));
                    Some(err.unwrap_err().to_string())
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let message = errors[0].as_ref().expect("rank 0 reports");
    assert!(message.contains("gathering `model.embed_tokens`"), "{message}");
    assert!(message.contains("rank 1"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}
