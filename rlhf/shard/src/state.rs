//! A rank's flat units: where each parameter lives at each stage, gathering and releasing
//! them around the segments that read them, and reducing their gradients into the rank's
//! shard.
//!
//! | stage | parameters                   | gradients                         | AdamW moments |
//! |-------|------------------------------|-----------------------------------|---------------|
//! | 0     | whole, flat per dtype        | whole (`.grad`), all-reduced      | whole         |
//! | 1     | whole                        | whole until the step, then shard  | shard         |
//! | 2     | whole                        | shard, reduced per segment        | shard         |
//! | 3     | shard; a unit whole while read | shard, reduced per segment      | shard         |
//!
//! At stages 1-3 every parameter of the model is a view into its unit's flat buffer (`full`),
//! set once with `set_data`, so the layers read it in place. At stage 3 `full`'s storage is
//! freed after each use and allocated again (in place, so autograd's saved views follow)
//! before the next. At stage 0 the units hold no buffer: the parameters are views of the
//! rank's [`crate::manager::ShardingManager`]'s per-dtype buffers (its gradients and AdamW's
//! moments too), which it moves between the device and host memory.

use tch::{Device, Kind, Tensor};

use rtrun::collective::ReduceOp;
use rtrun_rlhf_model::layerwise::{Segment, SegmentHooks};
use rtrun_rlhf_model::storage::{allocate_storage, clear_grad, free_storage, storage_bytes};

use crate::ZeroStage;
use crate::comm::GroupComm;
use crate::error::{Result, ShardError};
use crate::plan::{ShardPlan, UnitPlan};

/// Tensor bytes a rank holds for a model, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldBytes {
    /// Parameters: whole units, shards and gathered units.
    pub parameters: u64,
    /// Gradients: full `.grad` tensors and gradient shards.
    pub gradients: u64,
    /// AdamW's two moments.
    pub optimizer: u64,
}

/// What a rank's sharded model held and exchanged (for benchmarks and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardStats {
    /// Bytes held now.
    pub now: HeldBytes,
    /// The most bytes held at a measured point since the last reset.
    pub peak: HeldBytes,
    /// Seconds spent in the model's collectives since construction.
    pub collective_seconds: f64,
    /// Payload bytes of those collectives.
    pub collective_bytes: u64,
    /// Gathers served by the prefetch (already done when their layer needed them).
    pub prefetched_gathers: u64,
    /// The part of `now` in host buffers (stage 0 with the training state offloaded: the
    /// sharding manager's; zero otherwise).
    #[serde(default)]
    pub offloaded: HeldBytes,
}

impl HeldBytes {
    /// The sum of the three.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// `numel × element size` of `tensor` (its own bytes, not its storage's).
fn tensor_bytes(tensor: &Tensor) -> u64 {
    tensor.numel() as u64 * tensor.kind().elt_size_in_bytes() as u64
}

/// One flat unit of a rank.
pub(crate) struct Unit {
    pub(crate) plan: UnitPlan,
    /// The model's parameters (shallow clones), by member.
    pub(crate) params: Vec<Tensor>,
    /// `[padded]` in the parameters' dtype; at stage 3 its storage exists only while gathered;
    /// empty at stage 0, where the sharding manager's buffers hold the parameters.
    pub(crate) full: Tensor,
    /// This rank's `[shard_len]` slice: a view of `full` at stages 1-2, its own storage at 3;
    /// empty at stage 0.
    pub(crate) shard: Tensor,
    /// The reduced gradient of the shard, float32 (stages 1-3 of a trained model).
    pub(crate) grad_shard: Option<Tensor>,
    /// Whether `full` holds the current parameters (always below stage 3).
    pub(crate) gathered: bool,
}

/// Everything a rank holds of one sharded model.
pub(crate) struct ZeroState {
    pub(crate) stage: ZeroStage,
    pub(crate) plan: ShardPlan,
    pub(crate) units: Vec<Unit>,
    pub(crate) comm: GroupComm,
    /// Whether the model trains (has gradients and an optimizer).
    pub(crate) trains: bool,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
    /// Seconds spent in collectives, and their payload bytes.
    pub(crate) comm_seconds: f64,
    pub(crate) comm_bytes: u64,
    /// The most bytes held at any measured point since the last reset.
    pub(crate) peak: HeldBytes,
    /// Bytes of the optimizer's moments (kept here so every measurement counts them).
    pub(crate) optimizer_bytes: u64,
    /// Whether the head's units were gathered and not yet released.
    pub(crate) head_gathered: bool,
    /// Stage 3's gathers of the next layer, on a ring and thread of their own.
    prefetch: Option<Prefetcher>,
    /// The decoder layer gathered last (which way the passes run, for the prefetch).
    last_layer: Option<usize>,
    /// Gathers the prefetch served.
    pub(crate) prefetched_gathers: u64,
}

/// A thread that all-gathers units on the prefetch ring while the model computes, one at a
/// time, in the order they were asked for (the same on every rank: the hooks are).
struct Prefetcher {
    jobs: std::sync::mpsc::Sender<(String, Vec<u8>)>,
    done: std::sync::mpsc::Receiver<Result<Vec<u8>>>,
    /// The unit whose gather is in flight.
    pending: Option<usize>,
}

impl Prefetcher {
    fn start(comm: GroupComm) -> Result<Self> {
        let (jobs, inbox) = std::sync::mpsc::channel::<(String, Vec<u8>)>();
        let (outbox, done) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("zero-prefetch".into())
            .spawn(move || {
                for (name, mut host) in inbox {
                    let gathered = comm
                        .run(|| format!("prefetching `{name}`"), |c| c.all_gather_into(&mut host))
                        .map(|()| host);
                    if outbox.send(gathered).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| ShardError::Config(format!("starting the prefetch thread: {e}")))?;
        Ok(Self { jobs, done, pending: None })
    }

    /// Waits for the gather in flight, if any.
    fn finish(&mut self) -> Option<(usize, Result<Vec<u8>>)> {
        let unit = self.pending.take()?;
        let result = self.done.recv().unwrap_or_else(|_| {
            Err(ShardError::Config("the prefetch thread ended (a collective failed)".into()))
        });
        Some((unit, result))
    }
}

impl ZeroState {
    /// Lays the model's parameters (`named`, in registration order) out in flat units and
    /// keeps this rank's shards.
    pub(crate) fn new(
        named: &[(String, Tensor)],
        tied: bool,
        stage: ZeroStage,
        trains: bool,
        comm: GroupComm,
    ) -> Result<Self> {
        let shapes: Vec<(String, Vec<i64>)> =
            named.iter().map(|(n, t)| (n.clone(), t.size())).collect();
        // A trained model's parameters that need no gradient (LoRA's frozen base) stay out of
        // the trained units; a frozen model is one kind throughout.
        let frozen: std::collections::HashSet<&str> = named
            .iter()
            .filter(|(_, t)| trains && !t.requires_grad())
            .map(|(n, _)| n.as_str())
            .collect();
        if trains && frozen.len() == named.len() {
            return Err(ShardError::Config(
                "the model has an optimizer but no parameter that trains (every one is frozen)"
                    .into(),
            ));
        }
        let plan =
            ShardPlan::with_frozen(&shapes, &|n| frozen.contains(n), comm.world_size(), tied)?;
        let (first_name, first) = named
            .first()
            .ok_or_else(|| ShardError::Config("the model has no parameters".into()))?;
        let (kind, device) = (first.f_kind()?, first.device());
        if let Some((name, t)) =
            named.iter().find(|(_, t)| t.kind() != kind || t.device() != device)
        {
            return Err(ShardError::Config(format!(
                "flat units need one dtype and device: `{first_name}` is {kind:?} on {device:?}, \
                 `{name}` is {:?} on {:?}",
                t.kind(),
                t.device()
            )));
        }
        let by_name: std::collections::HashMap<&str, &Tensor> =
            named.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut units = Vec::with_capacity(plan.units.len());
        for unit_plan in &plan.units {
            let params: Vec<Tensor> = unit_plan
                .members
                .iter()
                .map(|m| by_name[m.name.as_str()].shallow_clone())
                .collect();
            let range = unit_plan.shard_range(world, rank);
            let (full, shard, gathered) = if stage == ZeroStage::Zero {
                // Stage 0's parameters are laid out by the rank's sharding manager (one buffer
                // per dtype that moves between the device and host memory as one): a unit
                // buffer beside it would hold a second copy, and keep the device memory of an
                // offloaded model.
                let empty = Tensor::f_empty([0], (kind, device))?;
                (empty.shallow_clone(), empty, true)
            } else {
                let full = Tensor::f_zeros([unit_plan.padded as i64], (kind, device))?;
                tch::no_grad(|| -> Result<()> {
                    for (member, param) in unit_plan.members.iter().zip(&params) {
                        let view = full.f_narrow(0, member.offset as i64, member.numel as i64)?;
                        view.shallow_clone().f_copy_(&param.f_reshape([-1])?)?;
                        param.shallow_clone().f_set_data(&view.f_view(member.shape.as_slice())?)?;
                    }
                    Ok(())
                })?;
                let own = full.f_narrow(0, range.start as i64, range.len() as i64)?;
                if stage == ZeroStage::Three {
                    let shard = Tensor::f_empty([range.len() as i64], (kind, device))?;
                    tch::no_grad(|| shard.shallow_clone().f_copy_(&own))?;
                    free_storage(&full)?;
                    (full, shard, false)
                } else {
                    (full, own, true)
                }
            };
            // Stage 1 reduces only at the step: its gradient shards exist from then until the
            // update, not beside the whole gradients during the backward.
            let grad_shard =
                if trains && unit_plan.trains && matches!(stage, ZeroStage::Two | ZeroStage::Three)
                {
                    Some(Tensor::f_zeros([range.len() as i64], (Kind::Float, device))?)
                } else {
                    None
                };
            units.push(Unit { plan: unit_plan.clone(), params, full, shard, grad_shard, gathered });
        }
        Ok(Self {
            stage,
            plan,
            units,
            comm,
            trains,
            kind,
            device,
            comm_seconds: 0.0,
            comm_bytes: 0,
            peak: HeldBytes::default(),
            optimizer_bytes: 0,
            head_gathered: false,
            prefetch: None,
            last_layer: None,
            prefetched_gathers: 0,
        })
    }

    /// Starts prefetching (stage 3 on several ranks, when the group has a prefetch ring).
    pub(crate) fn start_prefetch(&mut self) -> Result<()> {
        if self.stage == ZeroStage::Three
            && self.comm.world_size() > 1
            && let Some(group) = self.comm.take_prefetch_group()
        {
            self.prefetch = Some(Prefetcher::start(group)?);
        }
        tracing::debug!(
            stage = %self.stage,
            world = self.comm.world_size(),
            prefetch = self.prefetch.is_some(),
            "sharded model ready"
        );
        Ok(())
    }

    /// Waits out (and drops) a prefetch in flight: before the shards change, or when the next
    /// gather is not the one prefetched.
    pub(crate) fn drain_prefetch(&mut self) -> Result<()> {
        if let Some(prefetch) = &mut self.prefetch
            && let Some((_, result)) = prefetch.finish()
        {
            result?;
        }
        Ok(())
    }

    /// This rank's shard of unit `index` in a host buffer of the unit's whole size.
    fn staged_shard(&self, index: usize) -> Result<Vec<u8>> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let unit = &self.units[index];
        let element = self.kind.elt_size_in_bytes();
        let range = unit.plan.shard_range(world, rank);
        let mut host = vec![0u8; unit.plan.padded * element];
        let shard = unit.shard.f_to_device(Device::Cpu)?;
        shard.f_copy_data_u8(&mut host[range.start * element..range.end * element], range.len())?;
        Ok(host)
    }

    /// After decoder layer `layer` was gathered: starts gathering the layer the passes read
    /// next (the following one going forward, the previous one going backward).
    fn prefetch_after(&mut self, layer: usize) -> Result<()> {
        let previous = self.last_layer.replace(layer);
        let Some(prefetch) = &self.prefetch else { return Ok(()) };
        if prefetch.pending.is_some() {
            return Ok(());
        }
        let count = self.plan.layers();
        let backward = match previous {
            Some(p) if p == layer + 1 => true,
            Some(p) if p == layer => layer + 1 == count,
            _ => false,
        };
        let next =
            if backward { layer.checked_sub(1) } else { Some(layer + 1).filter(|&n| n < count) };
        let Some(next) = next else { return Ok(()) };
        let Some(&unit) = self.plan.units_of(Segment::Layer(next)).first() else { return Ok(()) };
        if self.units[unit].gathered {
            return Ok(());
        }
        let host = self.staged_shard(unit)?;
        let name = self.units[unit].plan.name.clone();
        if let Some(prefetch) = &mut self.prefetch {
            prefetch.jobs.send((name, host)).map_err(|_| {
                ShardError::Config("the prefetch thread ended (a collective failed)".into())
            })?;
            prefetch.pending = Some(unit);
        }
        Ok(())
    }

    /// Makes unit `index` whole (stage 3: allocate and all-gather; otherwise it already is).
    pub(crate) fn gather_unit(&mut self, index: usize) -> Result<()> {
        if self.units[index].gathered {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let world = self.comm.world_size();
        let element = self.kind.elt_size_in_bytes();
        let padded = self.units[index].plan.padded;
        // A prefetch of another unit stays in flight on its own ring until its unit is
        // gathered or the shards change (`release_all_units`).
        let prefetched = match self.prefetch.as_mut().filter(|p| p.pending == Some(index)) {
            Some(prefetch) => prefetch.finish().map(|(_, result)| result).transpose()?,
            None => None,
        };
        let host = match prefetched {
            Some(host) => {
                self.prefetched_gathers += 1;
                host
            }
            None => {
                let mut host = self.staged_shard(index)?;
                if world > 1 {
                    let name = &self.units[index].plan.name;
                    self.comm
                        .run(|| format!("gathering `{name}`"), |c| c.all_gather_into(&mut host))?;
                }
                host
            }
        };
        let unit = &self.units[index];
        allocate_storage(&unit.full, padded * element)?;
        let value = Tensor::f_from_data_size(&host, &[padded as i64], self.kind)?;
        tch::no_grad(|| unit.full.shallow_clone().f_copy_(&value.f_to_device(self.device)?))?;
        self.units[index].gathered = true;
        self.comm_seconds += started.elapsed().as_secs_f64();
        self.comm_bytes += (padded * element) as u64;
        self.measure();
        Ok(())
    }

    /// Frees unit `index`'s whole parameters (stage 3 only).
    pub(crate) fn release_unit(&mut self, index: usize) -> Result<()> {
        let unit = &mut self.units[index];
        if self.stage == ZeroStage::Three && unit.gathered {
            free_storage(&unit.full)?;
            unit.gathered = false;
        }
        Ok(())
    }

    /// Frees every gathered unit (stage 3), the head's too, and drops a prefetch in flight.
    pub(crate) fn release_all_units(&mut self) -> Result<()> {
        self.drain_prefetch()?;
        self.last_layer = None;
        for index in 0..self.units.len() {
            self.release_unit(index)?;
        }
        self.head_gathered = false;
        Ok(())
    }

    /// Reduce-scatters (mean over ranks) the `.grad` of unit `index`'s parameters into its
    /// gradient shard and drops them. Members without a gradient count as zeros, so every
    /// rank issues the same collective.
    pub(crate) fn reduce_unit(&mut self, index: usize) -> Result<()> {
        self.measure();
        let started = std::time::Instant::now();
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        if !self.trains || self.stage == ZeroStage::Zero || !self.units[index].plan.trains {
            return Ok(());
        }
        let range = self.units[index].plan.shard_range(world, rank);
        if self.units[index].grad_shard.is_none() {
            let zeros = Tensor::f_zeros([range.len() as i64], (Kind::Float, self.device))?;
            self.units[index].grad_shard = Some(zeros);
        }
        let unit = &self.units[index];
        let Some(grad_shard) = &unit.grad_shard else {
            return Ok(());
        };
        let mut host = vec![0f32; unit.plan.padded];
        for (member, param) in unit.plan.members.iter().zip(&unit.params) {
            let grad = param.grad();
            if grad.defined() {
                let flat = grad.f_detach()?.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)?;
                flat.f_reshape([-1])?.f_copy_data(&mut host[member.range()], member.numel)?;
            }
        }
        if world > 1 {
            let name = &unit.plan.name;
            self.comm.run(
                || format!("reducing the gradients of `{name}`"),
                |c| c.reduce_scatter_f32(&mut host, ReduceOp::Mean),
            )?;
        }
        let reduced = Tensor::f_from_slice(&host[range])?.f_to_device(self.device)?;
        let _ = tch::no_grad(|| grad_shard.shallow_clone().f_add_(&reduced))?;
        for param in &unit.params {
            clear_grad(param)?;
        }
        self.comm_seconds += started.elapsed().as_secs_f64();
        self.comm_bytes += (unit.plan.padded * 4) as u64;
        Ok(())
    }

    /// All-gathers a trained unit's full buffer from the ranks' shards in place (stages 1 and
    /// 2, after the optimizer updated this rank's shard, which is a view of `full`).
    pub(crate) fn refresh_full(&mut self, index: usize) -> Result<()> {
        let world = self.comm.world_size();
        // Frozen units never change.
        if world == 1 || !self.units[index].plan.trains {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let unit = &self.units[index];
        let element = self.kind.elt_size_in_bytes();
        let padded = unit.plan.padded;
        let mut host = vec![0u8; padded * element];
        unit.full.f_to_device(Device::Cpu)?.f_copy_data_u8(&mut host, padded)?;
        let name = &unit.plan.name;
        self.comm.run(|| format!("gathering `{name}`"), |c| c.all_gather_into(&mut host))?;
        let value = Tensor::f_from_data_size(&host, &[padded as i64], self.kind)?;
        tch::no_grad(|| unit.full.shallow_clone().f_copy_(&value.f_to_device(self.device)?))?;
        self.comm_seconds += started.elapsed().as_secs_f64();
        self.comm_bytes += (padded * element) as u64;
        Ok(())
    }

    /// The bytes held now.
    pub(crate) fn held(&self) -> HeldBytes {
        let mut held = HeldBytes { optimizer: self.optimizer_bytes, ..HeldBytes::default() };
        for unit in &self.units {
            if self.stage == ZeroStage::Zero {
                // Views of the sharding manager's flat buffers, gradients too once it laid
                // them out: each counts its own elements, not its storage (the whole buffer,
                // which would be counted once per parameter), wherever it is now.
                for param in &unit.params {
                    held.parameters += tensor_bytes(param);
                    let grad = param.grad();
                    if grad.defined() {
                        held.gradients += tensor_bytes(&grad);
                    }
                }
                continue;
            }
            held.parameters += storage_bytes(&unit.full) as u64;
            if self.stage == ZeroStage::Three {
                held.parameters += storage_bytes(&unit.shard) as u64;
            }
            if let Some(g) = &unit.grad_shard {
                held.gradients += storage_bytes(g) as u64;
            }
            for param in &unit.params {
                let grad = param.grad();
                if grad.defined() {
                    held.gradients += storage_bytes(&grad) as u64;
                }
            }
        }
        held
    }

    /// Records the bytes held now into the peak.
    pub(crate) fn measure(&mut self) {
        let now = self.held();
        if now.total() > self.peak.total() {
            self.peak = now;
        }
    }

    /// Runs `f` on each unit a segment reads.
    fn each_unit(&mut self, segment: Segment, f: fn(&mut Self, usize) -> Result<()>) -> Result<()> {
        for index in self.plan.units_of(segment) {
            f(self, index)?;
        }
        Ok(())
    }

    /// Whether gradients are reduced per segment during the backward (stages 2 and 3).
    pub(crate) fn reduces_per_segment(&self) -> bool {
        self.trains && matches!(self.stage, ZeroStage::Two | ZeroStage::Three)
    }
}

impl SegmentHooks for SharedState {
    fn gather(&mut self, segment: Segment) -> rtrun_rlhf_model::Result<()> {
        let mut state = self.lock();
        state.each_unit(segment, ZeroState::gather_unit)?;
        match segment {
            Segment::Head => state.head_gathered = true,
            Segment::Layer(layer) => state.prefetch_after(layer)?,
            Segment::Embedding => {}
        }
        Ok(())
    }

    fn release(&mut self, segment: Segment) -> rtrun_rlhf_model::Result<()> {
        let mut state = self.lock();
        let head = state.plan.units_of(Segment::Head);
        for index in state.plan.units_of(segment) {
            // While the head is gathered, autograd may hold views of its units (a tied
            // embedding read by the LM head of a pass still to be backpropagated): they stay
            // until the head itself is released.
            if segment != Segment::Head && state.head_gathered && head.contains(&index) {
                continue;
            }
            state.release_unit(index)?;
        }
        if segment == Segment::Head {
            state.head_gathered = false;
        }
        Ok(())
    }

    fn reduce(&mut self, segment: Segment) -> rtrun_rlhf_model::Result<()> {
        let mut state = self.lock();
        if !state.reduces_per_segment() {
            return Ok(());
        }
        Ok(state.each_unit(segment, ZeroState::reduce_unit)?)
    }
}

/// The state shared by the model's hooks and the rank's [`crate::ShardedModel`].
#[derive(Clone)]
pub(crate) struct SharedState(pub(crate) std::sync::Arc<std::sync::Mutex<ZeroState>>);

impl SharedState {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, ZeroState> {
        // A panic mid-collective leaves the communicator poisoned, which reports itself; the
        // tensors stay consistent enough to report errors, so a poisoned lock is taken over.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
