//! Data-parallel gradient all-reduce (`rtrun_rlhf_algo::all_reduce_gradients`) across two
//! worker processes: each rank computes gradients of a known loss on its own data, the ranks
//! average them, and every rank must end with the hand-computed mean.

use std::time::Duration;

use rtrun::collective::Communicator;
use rtrun::{ActorGroup, ActorOptions, Config};
use rtrun_rlhf_algo::{GradientSyncConfig, all_reduce_gradients, broadcast_parameters};
use tch::{Kind, Tensor};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

const LONG: Duration = Duration::from_secs(120);

/// The gradients a rank ends with (as f64 per parameter) and the sync statistics
/// (parameters, elements, buckets).
type Synced = (Vec<Vec<f64>>, (usize, usize, usize));

struct GradRank {
    comm: Option<Communicator>,
}

#[rtrun::actor]
impl GradRank {
    pub fn new() -> Self {
        GradRank { comm: None }
    }

    pub fn connect(&mut self) -> Result<usize, String> {
        let comm = Communicator::from_group_context().map_err(|e| e.to_string())?;
        let rank = comm.rank();
        self.comm = Some(comm);
        Ok(rank)
    }

    /// Backpropagates this rank's loss, all-reduces the gradients, returns them.
    pub fn sync(&mut self, bucket_bytes: usize) -> Result<Synced, String> {
        let comm = self.comm.as_mut().ok_or("connect first")?;
        let r = comm.rank() as f64;
        let w = Tensor::from_slice(&[0.1f32, 0.2, 0.3]).set_requires_grad(true);
        let m_values: Vec<f64> = (1..=8).map(|i| 0.5 * i as f64).collect();
        let m = Tensor::from_slice(&m_values).view([2, 4]).set_requires_grad(true);
        let h = Tensor::from_slice(&[1.0f32, 2.0]).to_kind(Kind::BFloat16).set_requires_grad(true);
        let unused = Tensor::from_slice(&[9.0f32]).set_requires_grad(true);
        // L = Σ c_r·w + (r + 1)·Σ m² + (r + 1)·Σ h, with c_r = [1, 2, 3] + 2r.
        let c = Tensor::from_slice(&[1.0f32, 2.0, 3.0]) + 2.0 * r;
        let loss = (&w * &c).sum(Kind::Float)
            + (&m * &m).sum(Kind::Double).to_kind(Kind::Float) * (r + 1.0)
            + h.to_kind(Kind::Float).sum(Kind::Float) * (r + 1.0);
        loss.backward();
        let params = [w, m, h, unused];
        let stats = all_reduce_gradients(comm, &params, &GradientSyncConfig { bucket_bytes })
            .map_err(|e| e.to_string())?;
        let grads = params[..3]
            .iter()
            .map(|p| Vec::<f64>::try_from(&p.grad().to_kind(Kind::Double).flatten(0, -1)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        Ok((grads, (stats.parameters, stats.elements, stats.buckets)))
    }

    /// Makes rank-dependent parameters (f32, f64, bf16), broadcasts `root`'s, returns them.
    pub fn broadcast_from(
        &mut self,
        root: usize,
        bucket_bytes: usize,
    ) -> Result<Vec<Vec<f64>>, String> {
        let comm = self.comm.as_mut().ok_or("connect first")?;
        let r = comm.rank() as f64;
        let params = [
            (Tensor::arange(6, (Kind::Float, tch::Device::Cpu)) + r)
                .view([2, 3])
                .set_requires_grad(true),
            Tensor::from_slice(&[0.1f64 + r, -r]),
            Tensor::from_slice(&[1.5f32 + r as f32]).to_kind(Kind::BFloat16),
        ];
        broadcast_parameters(comm, &params, root, &GradientSyncConfig { bucket_bytes })
            .map_err(|e| e.to_string())?;
        params
            .iter()
            .map(|p| Vec::<f64>::try_from(&p.to_kind(Kind::Double).flatten(0, -1)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())
    }
}

#[test]
fn two_ranks_end_with_the_mean_gradient() {
    rtrun::init_with(Config { num_cpus: Some(2.0), ..Default::default() }).expect("runtime starts");
    let group: ActorGroup<GradRank> =
        ActorGroup::create("dp", 2, ActorOptions::default(), |_, opts| GradRank::remote_with(opts))
            .unwrap();
    let ranks: Vec<_> =
        group.call_all(|m| m.connect()).iter().map(|r| r.get_timeout(LONG).unwrap()).collect();
    assert_eq!(ranks, vec![Ok(0), Ok(1)]);
    // Hand-computed means over r = 0, 1:
    //   dL/dw = c_r = [1, 2, 3] and [3, 4, 5]          → [2, 3, 4]
    //   dL/dm = 2(r + 1)·m = 2m and 4m                → 3m = 3·[0.5, 1, …, 4] = [1.5, 3, …, 12]
    //   dL/dh = (r + 1) = 1 and 2 (exact in bf16)     → 1.5
    let expected =
        vec![vec![2.0, 3.0, 4.0], vec![1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5, 12.0], vec![1.5, 1.5]];
    // 16-byte buckets: w (3 floats) alone, m (8 floats, over the cap) alone, h alone → 3
    // buckets; the default 25 MiB bucket takes all 13 elements at once.
    for (bucket_bytes, buckets) in [(16, 3), (GradientSyncConfig::default().bucket_bytes, 1)] {
        let results: Vec<_> = group
            .call_all(|m| m.sync(bucket_bytes))
            .iter()
            .map(|r| r.get_timeout(LONG).unwrap())
            .collect();
        for (rank, result) in results.into_iter().enumerate() {
            let (grads, stats) = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(grads, expected, "rank {rank}, bucket_bytes {bucket_bytes}");
            assert_eq!(stats, (3, 13, buckets), "rank {rank}: (parameters, elements, buckets)");
        }
    }
    // Broadcast from rank 1: everyone ends with rank 1's values, [1..6], [1.1, −1], [2.5]
    // (2.5 is exact in bf16), with one bucket per parameter and with one for all.
    let expected = vec![vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![1.1, -1.0], vec![2.5]];
    for bucket_bytes in [1, 1 << 20] {
        let results: Vec<_> = group
            .call_all(|m| m.broadcast_from(1, bucket_bytes))
            .iter()
            .map(|r| r.get_timeout(LONG).unwrap())
            .collect();
        assert_eq!(
            results,
            vec![Ok(expected.clone()), Ok(expected.clone())],
            "bucket_bytes {bucket_bytes}"
        );
    }
    group.kill().unwrap();
}
