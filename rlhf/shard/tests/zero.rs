//! ZeRO stages 0-3 with and without activation checkpointing, on ranks that are threads of
//! this process joined by the real TCP ring collective: the same losses and final weights as
//! one rank training on the whole batch, shards that really hold 1/N, and a lost rank that
//! fails its peers instead of hanging them. (Multi-process runs through the trainer's roles are
//! in `rlhf/train/tests/zero.rs`.)

use std::time::Duration;

use rtrun::collective::CollectiveConfig;
use rtrun_rlhf_model::logprobs::token_log_probs;
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
        .map(|r| (0..SEQ).map(|t| ((step * 131 + r * 17 + t as usize * 7) % 380 + 3) as i64).collect())
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
}

/// Trains `STEPS` steps on `world` thread ranks; returns each rank's outcome.
fn train(family: ModelFamily, world: usize, config: ShardConfig) -> Vec<Outcome> {
    let port = free_port();
    let model_config = tiny_config(family);
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let model_config = model_config.clone();
                scope.spawn(move || {
                    let collective = CollectiveConfig::new("zero", rank, world, "127.0.0.1", port)
                        .with_timeout(Duration::from_secs(30));
                    let model = tiny_model(&model_config, 11).unwrap();
                    let named: Vec<(String, Tensor)> = model
                        .named_parameters()
                        .map(|(n, t)| (n.to_string(), t.shallow_clone()))
                        .collect();
                    let mut sharded = ShardedModel::new(
                        &model.backbone,
                        &named,
                        model.lm_head.is_none(),
                        config,
                        GroupComm::joining(collective),
                        Some(optimizer()),
                    )
                    .unwrap();
                    let layers = model.config().num_hidden_layers as usize;
                    let mut losses = Vec::new();
                    for step in 0..STEPS {
                        let rows = batch(step);
                        // Uneven shares (5 rows): rank 0 of 2 has 3 rows in 2 micro-batches,
                        // rank 1 has 2 in one, so the balancing and idle passes are exercised.
                        let mine: Vec<Vec<i64>> =
                            rows.iter().skip(rank).step_by(world).cloned().collect();
                        let global_tokens = (ROWS as i64 * (SEQ - 1)) as f64;
                        let micro: Vec<&[Vec<i64>]> = mine.chunks(MICRO).collect();
                        let passes = sharded.balance(micro.len()).unwrap();
                        sharded.zero_grad().unwrap();
                        let mut total = 0.0;
                        for rows in &micro {
                            let nll = nll_sum(&model, rows);
                            total += nll.double_value(&[]);
                            model.backward(&(nll * (world as f64 / global_tokens))).unwrap();
                        }
                        for _ in micro.len()..passes {
                            sharded.idle_training_pass(layers).unwrap();
                        }
                        sharded.step().unwrap();
                        losses.push(total);
                    }
                    sharded.gather_all().unwrap();
                    let weights = model
                        .named_parameters()
                        .map(|(n, t)| (n.to_string(), Vec::<f32>::try_from(&t.reshape([-1])).unwrap()))
                        .collect();
                    sharded.release_all().unwrap();
                    Outcome { losses, weights }
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
    for family in [ModelFamily::Llama, ModelFamily::Qwen2] {
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
                        assert!((sum - alone).abs() <= 1e-5 * alone.abs(), "{what}: {sum} vs {alone}");
                    }
                    for (rank, outcome) in outcomes.iter().enumerate() {
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
