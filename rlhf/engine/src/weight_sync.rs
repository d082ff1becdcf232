//! The collective weight sync: policy rank 0 and every engine form one collective group
//! (rank 0 is the policy, engines are ranks `1..`), and each sync broadcasts the policy's
//! parameters from rank 0 straight into the engines' parameter tensors, in buckets.
//!
//! The sender describes its parameters once as a list of [`WeightMeta`] (name, shape, dtype);
//! a receiver looks each name up in its own model, checks shape and dtype, and lets the
//! broadcast write into those tensors in place (the model's layers hold shallow clones of
//! them, so nothing is rebuilt). With the NCCL backend (rtrun's `cuda` feature) the bytes travel
//! GPU to GPU over NCCL; the CPU backend runs the same code over TCP, which is how it is tested
//! on machines without a GPU.

use rtrun::collective::{Backend, CollectiveConfig, Communicator};
use rtrun_rlhf_algo::GradientSyncConfig;
use rtrun_rlhf_model::CausalLm;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::EngineError;

/// One parameter as the sender has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightMeta {
    /// The parameter's name (Hugging Face naming).
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its dtype, as libtorch's kind name (`Float`, `BFloat16`, ...).
    pub dtype: String,
}

impl WeightMeta {
    /// Describes every parameter of `model`, in its registration order (the broadcast order).
    pub fn of_model(model: &CausalLm) -> Result<Vec<WeightMeta>, EngineError> {
        model
            .named_parameters()
            .map(|(name, t)| {
                Ok(WeightMeta {
                    name: name.to_owned(),
                    shape: t.size(),
                    dtype: format!("{:?}", t.f_kind()?),
                })
            })
            .collect()
    }
}

/// Where and how a member joins the weight-sync group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSyncGroup {
    /// The group's name (the same on every member).
    pub group_name: String,
    /// This member's rank: 0 for the policy, `1..` for the engines.
    pub rank: usize,
    /// Policy rank 0 plus the engines.
    pub world_size: usize,
    /// Address policy rank 0 listens on for the rendezvous.
    pub master_addr: String,
    /// Port policy rank 0 listens on for the rendezvous.
    pub master_port: u16,
    /// `Nccl` in a GPU run; `Cpu` carries the same protocol over TCP.
    pub backend: Backend,
}

impl WeightSyncGroup {
    /// Joins the group; returns once every member has (or the rendezvous timed out).
    pub fn join(&self) -> Result<Communicator, EngineError> {
        let config = CollectiveConfig::new(
            self.group_name.clone(),
            self.rank,
            self.world_size,
            self.master_addr.clone(),
            self.master_port,
        )
        .with_backend(self.backend);
        Communicator::init(config).map_err(|e| {
            EngineError::InvalidArgument(format!(
                "joining weight-sync group `{}` as rank {}: {e}",
                self.group_name, self.rank
            ))
        })
    }
}

/// Rank 0's half: broadcasts every parameter of `model` in registration order, in buckets of
/// about `bucket_bytes`. Returns the bytes sent.
pub fn send_weights(
    comm: &mut Communicator,
    model: &CausalLm,
    bucket_bytes: usize,
) -> Result<usize, EngineError> {
    let params: Vec<Tensor> = model.named_parameters().map(|(_, t)| t.shallow_clone()).collect();
    broadcast(comm, &params, bucket_bytes)
}

/// An engine's half: receives the parameters `metas` describes into `model`'s tensors of the
/// same names, in place. Every name must exist with the same shape and dtype (checked before
/// anything is received, so a mismatch leaves the weights untouched); a packed name of the
/// tensor-parallel name map (`…qkv_proj.*`, `…gate_up_proj.*`, what a rank of a
/// tensor-parallel engine is sent, see [`send_tensors`]) is received into a staging tensor and
/// split into its members after. Returns the bytes received.
pub fn receive_weights(
    comm: &mut Communicator,
    model: &CausalLm,
    metas: &[WeightMeta],
    bucket_bytes: usize,
) -> Result<usize, EngineError> {
    let mut staged = Vec::new();
    let mut targets = Vec::with_capacity(metas.len());
    for meta in metas {
        match model.params.get(&meta.name) {
            Some(_) => targets.push(matching_param(model, meta)?),
            None => {
                let members = packed_members(model, meta)?;
                let kind = crate::api::kind_from_debug(&meta.dtype).ok_or_else(|| {
                    EngineError::InvalidWeight {
                        name: meta.name.clone(),
                        message: format!("unknown dtype `{}`", meta.dtype),
                    }
                })?;
                let staging =
                    Tensor::f_empty(meta.shape.as_slice(), (kind, model.params.device()))?;
                targets.push(staging.shallow_clone());
                staged.push((staging, members));
            }
        }
    }
    let bytes = broadcast(comm, &targets, bucket_bytes)?;
    for (staging, members) in staged {
        let rows: Vec<i64> = members.iter().map(|(_, rows)| *rows).collect();
        for ((name, _), part) in members.iter().zip(crate::tp::reshard::unpack(&staging, &rows)?) {
            model.params.copy_into(name, &part)?;
        }
    }
    Ok(bytes)
}

/// The members (name, rows) a packed `meta` splits into on `model`, after checking that they
/// stack to the sent shape and dtype.
fn packed_members(model: &CausalLm, meta: &WeightMeta) -> Result<Vec<(String, i64)>, EngineError> {
    let invalid = |message: String| EngineError::InvalidWeight { name: meta.name.clone(), message };
    let names = crate::tp::reshard::unpacked_names(&meta.name)
        .ok_or_else(|| invalid("the engine's model has no parameter of this name".into()))?;
    let mut members = Vec::with_capacity(names.len());
    let mut stacked: Vec<i64> = Vec::new();
    for (_, name) in names {
        let param = model.params.get(&name).ok_or_else(|| {
            invalid(format!("the engine's model has no parameter `{name}` to unpack it into"))
        })?;
        let (size, dtype) = (param.size(), format!("{:?}", param.f_kind()?));
        if dtype != meta.dtype {
            return Err(invalid(format!(
                "expected {} as sent, found {dtype} in `{name}`",
                meta.dtype
            )));
        }
        match stacked.is_empty() {
            true => stacked = size.clone(),
            false => stacked[0] += size[0],
        }
        members.push((name, size[0]));
    }
    if stacked != meta.shape {
        return Err(invalid(format!(
            "expected {:?} as sent, found its members stacking to {stacked:?}",
            meta.shape
        )));
    }
    Ok(members)
}

/// Rank 0's half for tensor-parallel engines: broadcasts `tensors` (one engine rank's shard in
/// the engine layout, [`crate::tp::reshard::engine_tensors`]) in their order, in buckets of
/// about `bucket_bytes`. Returns the bytes sent.
pub fn send_tensors(
    comm: &mut Communicator,
    tensors: &[(String, Tensor)],
    bucket_bytes: usize,
) -> Result<usize, EngineError> {
    let params: Vec<Tensor> = tensors.iter().map(|(_, t)| t.shallow_clone()).collect();
    broadcast(comm, &params, bucket_bytes)
}

/// Describes `tensors` as [`WeightMeta`]s, in order.
pub fn metas_of(tensors: &[(String, Tensor)]) -> Result<Vec<WeightMeta>, EngineError> {
    tensors
        .iter()
        .map(|(name, t)| {
            Ok(WeightMeta {
                name: name.clone(),
                shape: t.size(),
                dtype: format!("{:?}", t.f_kind()?),
            })
        })
        .collect()
}

/// The engine's parameter `meta` names, after checking it has the sender's shape and dtype.
pub(crate) fn matching_param(model: &CausalLm, meta: &WeightMeta) -> Result<Tensor, EngineError> {
    let invalid = |message: String| EngineError::InvalidWeight { name: meta.name.clone(), message };
    let param = model
        .params
        .get(&meta.name)
        .ok_or_else(|| invalid("the engine's model has no parameter of this name".into()))?;
    let dtype = format!("{:?}", param.f_kind()?);
    if param.size() != meta.shape || dtype != meta.dtype {
        return Err(invalid(format!(
            "expected {:?} {} as sent, found {:?} {dtype} in the engine",
            meta.shape,
            meta.dtype,
            param.size()
        )));
    }
    Ok(param.shallow_clone())
}

fn broadcast(
    comm: &mut Communicator,
    params: &[Tensor],
    bucket_bytes: usize,
) -> Result<usize, EngineError> {
    let config = GradientSyncConfig { bucket_bytes: bucket_bytes.max(1) };
    rtrun_rlhf_algo::broadcast_parameters(comm, params, 0, &config)
        .map_err(|e| EngineError::InvalidArgument(format!("weight broadcast: {e}")))
}

#[cfg(test)]
mod tests {
    use rtrun_rlhf_model::ModelFamily;
    use rtrun_rlhf_model::tiny::{tiny_config, tiny_model};

    use super::*;

    fn group(rank: usize, port: u16) -> WeightSyncGroup {
        WeightSyncGroup {
            group_name: "weight-sync-test".into(),
            rank,
            world_size: 3,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            backend: Backend::Cpu,
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn receivers_end_with_the_senders_weights_bit_for_bit() {
        let config = tiny_config(ModelFamily::Llama);
        let port = free_port();
        let metas = WeightMeta::of_model(&tiny_model(&config, 1).unwrap()).unwrap();
        let receivers: Vec<_> = (1..3)
            .map(|rank| {
                let (config, metas) = (config.clone(), metas.clone());
                std::thread::spawn(move || {
                    let model = tiny_model(&config, 100 + rank as u64).unwrap();
                    let mut comm = group(rank, port).join().unwrap();
                    receive_weights(&mut comm, &model, &metas, 4096).unwrap();
                    model.named_parameters().map(|(_, t)| t.copy()).collect::<Vec<_>>()
                })
            })
            .collect();
        let sender = tiny_model(&config, 1).unwrap();
        let mut comm = group(0, port).join().unwrap();
        let sent = send_weights(&mut comm, &sender, 4096).unwrap();
        assert!(sent > 0);
        for receiver in receivers {
            let received = receiver.join().unwrap();
            for ((name, want), got) in sender.named_parameters().zip(&received) {
                assert!(want.equal(got), "{name} differs after the sync");
            }
        }
    }

    #[test]
    fn a_tensor_parallel_rank_receives_its_packed_shard_in_place() {
        let config = tiny_config(ModelFamily::Qwen2);
        let layout = crate::tp::TpLayout::new(&config, 2).unwrap();
        let sender = tiny_model(&config, 1).unwrap();
        let params: Vec<_> = sender.named_parameters().collect();
        let tensors = crate::tp::reshard::engine_tensors(&layout, 1, params).unwrap();
        let metas = metas_of(&tensors).unwrap();
        assert!(metas.iter().any(|m| m.name.ends_with("qkv_proj.weight")));
        let port = free_port();
        let receiver = std::thread::spawn({
            let (config, metas) = (config.clone(), metas.clone());
            move || {
                let whole = tiny_model(&config, 2).unwrap();
                let shard =
                    crate::tp::shard_model(&whole, &layout, 1, tch::Device::Cpu, tch::Kind::Float)
                        .unwrap();
                let mut comm = group2(1, port).join().unwrap();
                receive_weights(&mut comm, &shard, &metas, 4096).unwrap();
                shard.named_parameters().map(|(n, t)| (n.to_owned(), t.copy())).collect::<Vec<_>>()
            }
        });
        let mut comm = group2(0, port).join().unwrap();
        send_tensors(&mut comm, &tensors, 4096).unwrap();
        let want = crate::tp::shard_model(&sender, &layout, 1, tch::Device::Cpu, tch::Kind::Float)
            .unwrap();
        for (name, got) in receiver.join().unwrap() {
            assert!(want.params.get(&name).unwrap().equal(&got), "{name} differs after the sync");
        }
    }

    fn group2(rank: usize, port: u16) -> WeightSyncGroup {
        WeightSyncGroup { world_size: 2, ..group(rank, port) }
    }

    #[test]
    fn a_shape_mismatch_is_refused_before_anything_is_received() {
        let config = tiny_config(ModelFamily::Llama);
        let model = tiny_model(&config, 1).unwrap();
        let mut metas = WeightMeta::of_model(&model).unwrap();
        metas[0].shape.push(2);
        let mut comm = CollectiveConfig::new("solo", 0, 1, "127.0.0.1", free_port());
        comm.backend = Backend::Cpu;
        let mut comm = Communicator::init(comm).unwrap();
        let err = receive_weights(&mut comm, &model, &metas, 4096).unwrap_err();
        assert!(err.to_string().contains("expected"), "{err}");
    }
}
