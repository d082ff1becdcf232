//! The sharding manager on a real (tiny, CPU) model after a real backward and AdamW step:
//! every parameter, gradient and moment comes back bit-identical from Train → Infer → Train
//! and Train → Forward → Train, the forward is unchanged, the bytes accounted are the model's,
//! and nothing is held in device buffers while offloaded. A stage-0 `ShardedModel` runs on it:
//! offloaded and back, it trains on bit for bit as a twin that never was.

use rtrun_rlhf_model::logprobs::token_log_probs;
use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};
use rtrun_rlhf_model::train::{AdamW, OptimizerConfig};
use rtrun_rlhf_model::{CausalLm, ModelFamily};
use rtrun_rlhf_shard::manager::{
    Action, ClassBytes, IdleGrads, ManagerConfig, Mode, Residency, ShardingManager, TensorClass,
};
use rtrun_rlhf_shard::{GroupComm, HeldBytes, ShardConfig, ShardedModel, ZeroStage};
use tch::{Device, Kind, Tensor};

const SEQ: i64 = 10;

fn ids() -> Tensor {
    let flat: Vec<i64> = (0..2 * SEQ).map(|i| (i * 37 + 5) % 380 + 3).collect();
    Tensor::from_slice(&flat).view([2, SEQ])
}

fn logits(model: &CausalLm) -> Tensor {
    let ids = ids();
    tch::no_grad(|| model.forward(&ids, &ids.ones_like(), None).unwrap())
}

/// Backpropagates the summed next-token NLL of a fixed batch.
fn backward(model: &CausalLm) {
    let ids = ids();
    let logits = model.forward(&ids, &ids.ones_like(), None).unwrap();
    let loss = token_log_probs(&logits.narrow(1, 0, SEQ - 1), &ids.narrow(1, 1, SEQ - 1))
        .unwrap()
        .sum(Kind::Float)
        .neg();
    model.backward(&loss).unwrap();
}

/// A tiny model after one AdamW step (non-zero moments) and one more backward (non-zero
/// gradients).
fn trained(family: ModelFamily) -> (CausalLm, AdamW) {
    let model = tiny_model(&tiny_config(family), 11).unwrap();
    let mut adamw = AdamW::new(model.named_parameters(), OptimizerConfig::default()).unwrap();
    backward(&model);
    adamw.step().unwrap();
    backward(&model);
    (model, adamw)
}

/// Copies of every parameter, gradient and moment, by name.
fn snapshot(model: &CausalLm, adamw: &AdamW) -> Vec<(String, Tensor)> {
    let mut all = Vec::new();
    for (name, param) in model.named_parameters() {
        all.push((name.to_string(), param.detach().copy()));
        all.push((format!("grad.{name}"), param.grad().copy()));
    }
    for (name, avg, avg_sq) in adamw.moments() {
        all.push((format!("exp_avg.{name}"), avg.copy()));
        all.push((format!("exp_avg_sq.{name}"), avg_sq.copy()));
    }
    all
}

fn assert_unchanged(before: &[(String, Tensor)], model: &CausalLm, adamw: &AdamW) {
    let now = snapshot(model, adamw);
    assert_eq!(now.len(), before.len());
    for ((name, was), (_, is)) in before.iter().zip(&now) {
        assert!(was.equal(is), "`{name}` changed");
    }
    let nonzero = |prefix: &str| {
        now.iter().any(|(n, t)| n.starts_with(prefix) && t.abs().max().double_value(&[]) > 0.0)
    };
    assert!(nonzero("grad.") && nonzero("exp_avg."), "the state compared is not trivial");
}

/// `sum(numel × element size)` of the model's parameters.
fn param_bytes(model: &CausalLm) -> u64 {
    model
        .named_parameters()
        .map(|(_, t)| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64)
        .sum()
}

fn data_range(t: &Tensor) -> std::ops::Range<usize> {
    let start = t.data_ptr() as usize;
    start..start + t.numel() * t.kind().elt_size_in_bytes()
}

#[test]
fn train_infer_train_and_train_forward_train_are_bit_identical() {
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let (model, mut adamw) = trained(family);
        let mut manager =
            ShardingManager::new(model.named_parameters(), Some(&adamw), ManagerConfig::default())
                .unwrap();
        let before = snapshot(&model, &adamw);
        let out = logits(&model);
        let bytes = param_bytes(&model);
        let all = ClassBytes { params: bytes, grads: bytes, optimizer: 2 * bytes };
        assert_eq!(manager.params().bytes(), bytes);
        assert_eq!(manager.held().device, all);
        assert_eq!(manager.held().host, ClassBytes::default());
        assert_unchanged(&before, &model, &adamw);

        // Train → Infer: the weights are synced while still resident, then everything leaves.
        let mut synced = 0;
        let report = manager
            .transition_with_sync(Mode::Infer, Some(&adamw), |params| {
                synced += params.device_bytes();
                Ok(())
            })
            .unwrap();
        assert_eq!(synced, bytes);
        assert_eq!(
            report.plan.actions,
            [
                Action::Offload(TensorClass::Optimizer),
                Action::Offload(TensorClass::Grads),
                Action::SyncWeights,
                Action::Offload(TensorClass::Params),
            ]
        );
        assert_eq!((report.to_host, report.to_device), (all, ClassBytes::default()));
        assert_eq!(manager.held().device.total(), 0, "device buffers hold nothing offloaded");
        assert_eq!(manager.held().host, all);
        // The parameters now read from the separate host buffer.
        let host = manager.params().buffer(Kind::Float).unwrap();
        let (_, embed) = model.named_parameters().next().unwrap();
        assert!(data_range(host).contains(&(embed.data_ptr() as usize)));
        assert_unchanged(&before, &model, &adamw);

        let report = manager.transition(Mode::Train, Some(&adamw)).unwrap();
        assert_eq!((report.to_device, report.to_host), (all, ClassBytes::default()));
        assert_eq!((manager.held().device, manager.held().host.total()), (all, 0));
        assert_unchanged(&before, &model, &adamw);
        assert!(logits(&model).equal(&out));

        // Train → Forward: parameters stay, gradients and moments leave.
        let report = manager.transition(Mode::Forward, Some(&adamw)).unwrap();
        assert_eq!(report.to_host, ClassBytes { params: 0, ..all });
        assert_eq!(manager.held().device, ClassBytes { params: bytes, grads: 0, optimizer: 0 });
        assert!(logits(&model).equal(&out), "forward mode runs the same forward");
        manager.transition(Mode::Train, Some(&adamw)).unwrap();
        assert_unchanged(&before, &model, &adamw);

        // Training goes on in the buffers: the backward accumulates into the gradient views.
        backward(&model);
        let grads: Vec<(String, Tensor)> =
            model.named_parameters().map(|(n, t)| (n.to_string(), t.grad())).collect();
        assert!(manager.grads().unwrap().is_laid_out(&grads));
        adamw.step().unwrap();
        assert!(!logits(&model).equal(&out));
    }
}

#[test]
fn every_dtype_has_its_own_buffer() {
    let dev = (Kind::Float, Device::Cpu);
    let w32 = Tensor::randn([3, 4], dev).set_requires_grad(true);
    let w64 = Tensor::randn([5], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let w16 = Tensor::randn([2, 2], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
    let named = [("w32", &w32), ("w64", &w64), ("w16", &w16)];
    let mut adamw = AdamW::new(named, OptimizerConfig::default()).unwrap();
    let loss = || {
        let sum = |t: &Tensor| t.square().sum(Kind::Float);
        sum(&w32) + sum(&w64) + sum(&w16)
    };
    loss().backward();
    adamw.step().unwrap();
    loss().backward();
    let mut manager = ShardingManager::new(named, Some(&adamw), ManagerConfig::default()).unwrap();
    let kinds = [Kind::Float, Kind::Double, Kind::BFloat16];
    assert_eq!(manager.params().kinds(), kinds);
    assert_eq!(manager.grads().unwrap().kinds(), kinds);
    assert_eq!(manager.moments().unwrap().kinds(), [Kind::Float], "moments are float32");
    assert_eq!(
        manager.params().bytes_by_kind(),
        [(Kind::Float, 48), (Kind::Double, 40), (Kind::BFloat16, 8)]
    );
    assert_eq!(manager.moments().unwrap().bytes(), 2 * 4 * (12 + 5 + 4));
    let copies = |ts: &[&Tensor]| -> Vec<Tensor> {
        ts.iter().flat_map(|t| [t.detach().copy(), t.grad().copy()]).collect()
    };
    let before = copies(&[&w32, &w64, &w16]);
    let moments: Vec<Tensor> = adamw.moments().flat_map(|(_, a, b)| [a.copy(), b.copy()]).collect();
    for mode in [Mode::Infer, Mode::Train, Mode::Forward, Mode::Infer, Mode::Forward, Mode::Train] {
        manager.transition(mode, Some(&adamw)).unwrap();
        for (was, is) in before.iter().zip(copies(&[&w32, &w64, &w16])) {
            assert!(was.equal(&is) && was.kind() == is.kind());
        }
        for (was, (_, a, b)) in moments.chunks(2).zip(adamw.moments()) {
            assert!(was[0].equal(a) && was[1].equal(b));
        }
    }
}

#[test]
fn buckets_are_slices_that_cover_every_parameter_once() {
    let (model, _) = trained(ModelFamily::Llama);
    let manager =
        ShardingManager::new(model.named_parameters(), None, ManagerConfig::default()).unwrap();
    for max_bytes in [1, 16 << 10, 64 << 10, 1 << 30] {
        let buckets = manager.params().bucket_slices(max_bytes).unwrap();
        let names: Vec<&str> =
            buckets.iter().flat_map(|b| b.tensors.iter().map(|m| m.name.as_str())).collect();
        let expected: Vec<&str> = model.named_parameters().map(|(n, _)| n).collect();
        assert_eq!(names, expected, "every parameter once, in order");
        let buffer = manager.params().buffer(Kind::Float).unwrap();
        for bucket in &buckets {
            let parts: Vec<Tensor> = bucket
                .tensors
                .iter()
                .map(|m| model.params.get(&m.name).unwrap().detach().reshape([-1]))
                .collect();
            assert!(bucket.view().equal(&Tensor::cat(&parts, 0)));
            assert_eq!(bucket.bytes(), parts.iter().map(|p| p.numel() as u64 * 4).sum::<u64>());
            assert!(bucket.bytes() <= max_bytes || bucket.tensors.len() == 1);
            // A view of the buffer, not a copy.
            let at = buffer.data_ptr() as usize + bucket.offset as usize * 4;
            assert_eq!(bucket.view().data_ptr() as usize, at);
        }
    }
}

#[test]
fn freed_gradients_come_back_from_the_next_backward() {
    let (model, mut adamw) = trained(ModelFamily::Qwen2);
    adamw.step().unwrap(); // Gradients are zero after a step: nothing to keep.
    let config = ManagerConfig { idle_grads: IdleGrads::Free };
    let mut manager = ShardingManager::new(model.named_parameters(), Some(&adamw), config).unwrap();
    let bytes = param_bytes(&model);
    let report = manager.transition(Mode::Forward, Some(&adamw)).unwrap();
    assert_eq!(report.freed.grads, bytes);
    assert_eq!(report.to_host, ClassBytes { params: 0, grads: 0, optimizer: 2 * bytes });
    assert!(model.named_parameters().all(|(_, t)| !t.grad().defined()));
    assert!(manager.grads().is_none());
    let report = manager.transition(Mode::Train, Some(&adamw)).unwrap();
    assert_eq!(
        report.plan.actions,
        [Action::Allocate(TensorClass::Grads), Action::Onload(TensorClass::Optimizer)]
    );
    // The backward makes new gradients, training goes on, and they are freed again.
    backward(&model);
    assert!(model.named_parameters().all(|(_, t)| t.grad().defined()));
    adamw.step().unwrap();
    let report = manager.transition(Mode::Infer, Some(&adamw)).unwrap();
    assert_eq!(report.freed.grads, bytes);
    assert!(model.named_parameters().all(|(_, t)| !t.grad().defined()));
}

#[test]
fn gradients_made_after_the_manager_are_laid_out_at_the_offload() {
    let model = tiny_model(&tiny_config(ModelFamily::Llama), 5).unwrap();
    let adamw = AdamW::new(model.named_parameters(), OptimizerConfig::default()).unwrap();
    let mut manager =
        ShardingManager::new(model.named_parameters(), Some(&adamw), ManagerConfig::default())
            .unwrap();
    assert!(manager.grads().is_none(), "no backward yet");
    backward(&model);
    let before = snapshot(&model, &adamw);
    manager.transition(Mode::Infer, Some(&adamw)).unwrap();
    assert_eq!(manager.held().host.grads, param_bytes(&model));
    manager.transition(Mode::Train, Some(&adamw)).unwrap();
    let now = snapshot(&model, &adamw);
    for ((name, was), (_, is)) in before.iter().zip(&now) {
        assert!(was.equal(is), "`{name}` changed");
    }
    let grads: Vec<(String, Tensor)> =
        model.named_parameters().map(|(n, t)| (n.to_string(), t.grad())).collect();
    assert!(manager.grads().unwrap().is_laid_out(&grads));
}

#[test]
fn a_frozen_rank_moves_its_parameters_only() {
    let model = tiny_model(&tiny_config(ModelFamily::Llama), 3).unwrap();
    model.params.set_requires_grad(false).unwrap();
    let out = logits(&model);
    let mut manager =
        ShardingManager::new(model.named_parameters(), None, ManagerConfig::default()).unwrap();
    let report = manager.transition(Mode::Infer, None).unwrap();
    assert_eq!(report.plan.actions, [Action::SyncWeights, Action::Offload(TensorClass::Params)]);
    assert_eq!(report.to_host, ClassBytes { params: param_bytes(&model), grads: 0, optimizer: 0 });
    assert!(manager.transition(Mode::Forward, None).unwrap().to_device.params > 0);
    assert!(logits(&model).equal(&out));
    assert!(manager.transition(Mode::Train, None).unwrap().plan.is_empty());
}

#[test]
fn a_rank_with_an_optimizer_needs_it_to_move() {
    let (model, adamw) = trained(ModelFamily::Llama);
    let mut manager =
        ShardingManager::new(model.named_parameters(), Some(&adamw), ManagerConfig::default())
            .unwrap();
    let err = manager.transition(Mode::Infer, None).unwrap_err().to_string();
    assert!(err.contains("AdamW"), "{err}");
    // Nothing was moved: the same transition with the optimizer does it all.
    let report = manager.transition(Mode::Infer, Some(&adamw)).unwrap();
    assert_eq!(report.plan.actions.len(), 4);
}

fn build_sharded(family: ModelFamily, stage: ZeroStage) -> (CausalLm, ShardedModel) {
    let model = tiny_model(&tiny_config(family), 11).unwrap();
    let config = ShardConfig { stage, gradient_checkpointing: false };
    let optimizer = Some(OptimizerConfig::default());
    let sharded =
        ShardedModel::for_causal_lm(&model, config, GroupComm::solo(), optimizer).unwrap();
    (model, sharded)
}

/// Whether every parameter and every gradient reads from `class`'s buffer now.
fn all_in(model: &CausalLm, sharded: &ShardedModel, class: TensorClass) -> bool {
    let manager = sharded.manager().unwrap();
    let buffers = match class {
        TensorClass::Params => manager.params(),
        TensorClass::Grads => manager.grads().unwrap(),
        TensorClass::Optimizer => manager.moments().unwrap(),
    };
    let range = data_range(buffers.buffer(Kind::Float).unwrap());
    model.named_parameters().all(|(_, t)| {
        let t = if class == TensorClass::Grads { t.grad() } else { t.shallow_clone() };
        range.contains(&(t.data_ptr() as usize))
    })
}

#[test]
fn a_stage_zero_model_offloads_and_trains_on_as_its_twin() {
    for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
        let (model, mut sharded) = build_sharded(family, ZeroStage::Zero);
        let (twin_model, mut twin) = build_sharded(family, ZeroStage::Zero);
        // One step and one more backward: non-zero moments and gradients.
        for (model, sharded) in [(&model, &mut sharded), (&twin_model, &mut twin)] {
            backward(model);
            sharded.step().unwrap();
            backward(model);
        }
        let bytes = param_bytes(&model);
        let all = ClassBytes { params: bytes, grads: bytes, optimizer: 2 * bytes };
        let held = HeldBytes { parameters: bytes, gradients: bytes, optimizer: 2 * bytes };
        assert_eq!(sharded.mode(), Some(Mode::Train));
        assert_eq!(sharded.held_bytes(), held);
        assert!(all_in(&model, &sharded, TensorClass::Params), "laid out at construction");
        let before = snapshot(&model, sharded.whole_optimizer().unwrap());

        let report = sharded.transition(Mode::Infer).unwrap();
        assert_eq!((report.to_host, report.to_device), (all, ClassBytes::default()));
        let residency = sharded.held_by_residency().unwrap();
        assert_eq!((residency.device.total(), residency.host), (0, all), "nothing on the device");
        assert_eq!(sharded.manager().unwrap().params().residency(), Residency::Host);
        // Counted once: the gradients are views of one buffer now, not one buffer each.
        assert_eq!(sharded.held_bytes(), held);
        assert_eq!(sharded.stats(false).offloaded, held);
        assert!(all_in(&model, &sharded, TensorClass::Params));
        assert!(all_in(&model, &sharded, TensorClass::Grads));
        assert_unchanged(&before, &model, sharded.whole_optimizer().unwrap());

        let report = sharded.transition(Mode::Train).unwrap();
        assert_eq!((report.to_device, report.to_host), (all, ClassBytes::default()));
        let residency = sharded.held_by_residency().unwrap();
        assert_eq!((residency.device, residency.host.total()), (all, 0));
        assert_eq!(
            (sharded.held_bytes(), sharded.stats(false).offloaded),
            (held, HeldBytes::default())
        );
        assert!(all_in(&model, &sharded, TensorClass::Params));
        assert!(all_in(&model, &sharded, TensorClass::Grads));
        assert_unchanged(&before, &model, sharded.whole_optimizer().unwrap());

        // Training goes on in the buffers exactly as on the twin that never moved.
        for (model, sharded) in [(&model, &mut sharded), (&twin_model, &mut twin)] {
            sharded.step().unwrap();
            sharded.zero_grad().unwrap();
            backward(model);
            sharded.step().unwrap();
        }
        assert!(all_in(&model, &sharded, TensorClass::Grads), "the backward wrote the views");
        let ours = snapshot(&model, sharded.whole_optimizer().unwrap());
        let theirs = snapshot(&twin_model, twin.whole_optimizer().unwrap());
        for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
            assert!(a.equal(b), "`{name}` differs from the twin's");
        }
        assert!(logits(&model).equal(&logits(&twin_model)));
        assert_eq!(sharded.steps_taken(), 3);
    }
}

#[test]
fn weight_buckets_are_slices_of_the_stage_zero_buffers_only() {
    let (model, sharded) = build_sharded(ModelFamily::Llama, ZeroStage::Zero);
    let buckets = sharded.param_buckets(64 << 10).unwrap().unwrap();
    let names: Vec<&str> =
        buckets.iter().flat_map(|b| b.tensors.iter().map(|m| m.name.as_str())).collect();
    assert_eq!(names, model.named_parameters().map(|(n, _)| n).collect::<Vec<_>>());
    // A parameter pointed elsewhere: the buckets would not read it, so there are none.
    let (_, first) = model.named_parameters().next().unwrap();
    first.shallow_clone().set_data(&first.detach().copy());
    assert!(sharded.param_buckets(64 << 10).unwrap().is_none());

    // Stages 1-3 have no manager: no buckets, and offloading is refused by name.
    let (_, mut one) = build_sharded(ModelFamily::Llama, ZeroStage::One);
    assert!(one.param_buckets(64 << 10).unwrap().is_none() && one.mode().is_none());
    let err = one.transition(Mode::Infer).unwrap_err().to_string();
    assert!(err.contains("needs zero_stage 0, found 1"), "{err}");
}

#[test]
fn moments_replaced_while_offloaded_are_laid_out_again() {
    let (model, mut sharded) = build_sharded(ModelFamily::Qwen2, ZeroStage::Zero);
    backward(&model);
    sharded.step().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    sharded.whole_optimizer().unwrap().save(&path).unwrap();
    let saved: Vec<Tensor> =
        sharded.whole_optimizer().unwrap().moments().map(|(_, a, _)| a.copy()).collect();
    sharded.transition(Mode::Infer).unwrap();
    // `AdamW::load` replaces the moments with new tensors (not views of any buffer).
    sharded.whole_optimizer().unwrap().load(&path).unwrap();
    let report = sharded.transition(Mode::Train).unwrap();
    assert_eq!(report.to_device.optimizer, 2 * param_bytes(&model));
    assert!(all_in(&model, &sharded, TensorClass::Params));
    let adamw = sharded.whole_optimizer().unwrap();
    for ((_, a, _), was) in adamw.moments().zip(&saved) {
        assert!(a.equal(was));
    }
    let moments: Vec<(String, Tensor)> = adamw
        .moments()
        .flat_map(|(n, a, b)| {
            let avg = (format!("exp_avg.{n}"), a.shallow_clone());
            [avg, (format!("exp_avg_sq.{n}"), b.shallow_clone())]
        })
        .collect();
    let buffers = sharded.manager().unwrap().moments().unwrap();
    assert_eq!(buffers.residency(), Residency::Device);
    assert!(buffers.is_laid_out(&moments), "the loaded moments are views of the buffers");
    // Replaced while training: `relayout` drops the stale buffers.
    sharded.whole_optimizer().unwrap().load(&path).unwrap();
    assert_eq!(sharded.relayout().unwrap(), 2 * param_bytes(&model));
    assert_eq!(sharded.relayout().unwrap(), 0, "nothing left to lay out");
    let err = sharded.save_sharded(dir.path()).unwrap_err().to_string();
    assert!(err.contains("needs zero_stage 1, 2 or 3, found 0"), "{err}");
}
