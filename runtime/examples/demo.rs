//! The runtime demo driver (the main job until the RLHF trainer lands): a small data-parallel
//! "training" loop on the embedded runtime that exercises every part of the programming model.
//!
//! A parameter-server actor holds a linear model `y = w·x + b`; a group of DP worker actors each
//! owns a shard of a synthetic regression data set, computes gradients on its shard
//! (dispatch → gather), and the server averages them and steps. Remote tasks evaluate the loss on
//! held-out chunks. The run prints the loss per step and checks that it fell.

use clap::Parser;
use rtrun::{ActorGroup, ActorOptions, ObjectRef};

/// The runtime demo: a small data-parallel training loop (a parameter-server actor, a group of
/// two gradient workers, remote tasks for the held-out loss) that prints the loss per step and
/// checks that it fell.
#[derive(Parser)]
struct Args {
    /// Training steps to run.
    #[arg(default_value_t = 30)]
    steps: u64,
}

const TRUE_W: [f64; 3] = [2.0, -1.0, 0.5];
const TRUE_B: f64 = 0.25;

/// A deterministic sample `i` of the synthetic data set.
fn sample(i: u64) -> ([f64; 3], f64) {
    let mut state = i.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0xD1B5_4A32_D192_ED03);
    let mut next = || {
        state ^= state >> 30;
        state = state.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        state ^= state >> 27;
        (state % 2000) as f64 / 1000.0 - 1.0
    };
    let x = [next(), next(), next()];
    let noise = next() * 0.01;
    let y = TRUE_W.iter().zip(&x).map(|(w, x)| w * x).sum::<f64>() + TRUE_B + noise;
    (x, y)
}

fn predict(params: &[f64; 4], x: &[f64; 3]) -> f64 {
    params[0] * x[0] + params[1] * x[1] + params[2] * x[2] + params[3]
}

/// Holds the model and applies averaged gradients.
struct ParameterServer {
    params: [f64; 4],
    lr: f64,
    steps: u64,
}

#[rtrun::actor]
impl ParameterServer {
    pub fn new(lr: f64) -> Self {
        ParameterServer { params: [0.0; 4], lr, steps: 0 }
    }

    pub fn params(&self) -> [f64; 4] {
        self.params
    }

    pub fn apply(&mut self, grads: Vec<[f64; 4]>) -> u64 {
        let n = grads.len().max(1) as f64;
        for g in &grads {
            for (p, d) in self.params.iter_mut().zip(g) {
                *p -= self.lr * d / n;
            }
        }
        self.steps += 1;
        self.steps
    }
}

/// A data-parallel worker: computes the gradient of the squared error on the sample ids it gets.
struct GradWorker;

#[rtrun::actor]
impl GradWorker {
    pub fn new() -> Self {
        GradWorker
    }

    pub fn gradients(&self, params: [f64; 4], ids: Vec<u64>) -> Vec<[f64; 4]> {
        let mut g = [0.0; 4];
        for &i in &ids {
            let (x, y) = sample(i);
            let err = predict(&params, &x) - y;
            for k in 0..3 {
                g[k] += 2.0 * err * x[k];
            }
            g[3] += 2.0 * err;
        }
        let n = ids.len().max(1) as f64;
        vec![g.map(|v| v / n)]
    }

    pub fn rank(&self) -> usize {
        rtrun::context().ok().and_then(|c| c.group).map(|g| g.rank).unwrap_or(0)
    }
}

/// Mean squared error on held-out samples `[start, start + count)`.
#[rtrun::remote]
fn eval_loss(params: [f64; 4], start: u64, count: u64) -> f64 {
    (start..start + count)
        .map(|i| {
            let (x, y) = sample(i);
            (predict(&params, &x) - y).powi(2)
        })
        .sum::<f64>()
        / count as f64
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let Args { steps } = Args::parse();
    rtrun::init()?;
    let server =
        ParameterServer::remote_with(ActorOptions::default().name("parameter-server"), 0.3)?;
    let group: ActorGroup<GradWorker> =
        ActorGroup::create("dp", 2, ActorOptions::default(), |_, opts| {
            GradWorker::remote_with(opts)
        })?;
    let ranks = rtrun::get_all(&group.call_all(|w| w.rank()))?;
    println!("dp group `{}`: ranks {ranks:?}", group.name());

    let eval = |params: [f64; 4]| -> anyhow::Result<f64> {
        let chunks: Vec<ObjectRef<f64>> =
            (0..4).map(|c| eval_loss::remote(params, 1_000_000 + c * 256, 256u64)).collect();
        Ok(rtrun::get_all(&chunks)?.iter().sum::<f64>() / 4.0)
    };
    let initial = eval(server.params().get()?)?;
    println!("step 0: held-out loss {initial:.5}");
    let batch_size = 512u64;
    for step in 0..steps {
        let params_ref = server.params();
        let params = params_ref.get()?;
        let ids: Vec<u64> = (step * batch_size..(step + 1) * batch_size).collect();
        let grads = group.dispatch_gather(ids, |w, chunk| w.gradients(params, chunk))?;
        server.apply(grads).get()?;
        if (step + 1) % 10 == 0 || step + 1 == steps {
            let loss = eval(server.params().get()?)?;
            println!("step {}: held-out loss {loss:.5}", step + 1);
        }
    }
    let final_params = server.params().get()?;
    let final_loss = eval(final_params)?;
    println!(
        "learned w = [{:.3}, {:.3}, {:.3}], b = {:.3} (true {TRUE_W:?}, {TRUE_B})",
        final_params[0], final_params[1], final_params[2], final_params[3]
    );
    let looked_up = rtrun::get_actor::<ParameterServer>("parameter-server", None)?;
    println!("named actor lookup: {} steps applied", looked_up.apply(Vec::new()).get()? - 1);
    rtrun::shutdown();
    anyhow::ensure!(final_loss < initial, "loss did not fall: {initial} -> {final_loss}");
    println!("ok: held-out loss {initial:.5} -> {final_loss:.5}");
    Ok(())
}
