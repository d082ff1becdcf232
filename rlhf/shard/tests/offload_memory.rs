//! Offloading a stage-0 rank's training state releases what it copied: counted with the host
//! allocation tracker on a CPU rank (whose "device" buffers are host memory too), the bytes
//! held stay the same through Train → Infer → Train, where a buffer kept beside the copy (the
//! units' flat buffers of old) would add a second copy of the parameters. Alone in its test
//! binary: the tracker counts the whole process.

use rtrun_rlhf_model::ModelFamily;
use rtrun_rlhf_model::logprobs::token_log_probs;
use rtrun_rlhf_model::storage::{host_allocations, reset_host_peak, track_host_allocations};
use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
use rtrun_rlhf_model::train::OptimizerConfig;
use rtrun_rlhf_shard::manager::Mode;
use rtrun_rlhf_shard::{GroupComm, ShardConfig, ShardedModel};
use tch::{Kind, Tensor};

#[test]
fn offload_and_onload_hold_no_second_copy() {
    track_host_allocations().unwrap();
    let model = tiny_model(&tiny_config(ModelFamily::Llama), 7).unwrap();
    let optimizer = Some(OptimizerConfig::default());
    let mut sharded =
        ShardedModel::for_causal_lm(&model, ShardConfig::default(), GroupComm::solo(), optimizer)
            .unwrap();
    let backward = || {
        let flat: Vec<i64> = (0..16).map(|i| (i * 37 + 5) % 380 + 3).collect();
        let ids = Tensor::from_slice(&flat).view([2, 8]);
        let logits = model.forward(&ids, &ids.ones_like(), None).unwrap();
        let loss = token_log_probs(&logits.narrow(1, 0, 7), &ids.narrow(1, 1, 7))
            .unwrap()
            .sum(Kind::Float)
            .neg();
        model.backward(&loss).unwrap();
    };
    backward();
    sharded.step().unwrap();
    backward();
    let params = model.params.numel() as i64 * 4;
    let total = sharded.held_bytes().total() as i64;
    assert_eq!(total, 4 * params, "parameters, gradients and two moments");
    for mode in [Mode::Infer, Mode::Train, Mode::Infer, Mode::Train] {
        let before = host_allocations().current;
        reset_host_peak();
        let report = sharded.transition(mode).unwrap();
        let moved = (report.to_host.total() + report.to_device.total()) as i64;
        assert_eq!(moved, total, "{mode}: everything moves");
        let after = host_allocations();
        let grown = after.current - before;
        // Only the class in flight is held twice, and only while it is copied: the moments.
        let transient = after.peak - before;
        println!("{mode}: held {grown:+} bytes after, {transient} more at the peak");
        assert!(grown.abs() < params / 16, "{mode}: {grown:+} bytes still held (of {params})");
        assert!(transient <= 2 * params + params / 16, "{mode}: peak {transient} over");
    }
}
