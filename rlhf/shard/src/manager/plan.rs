//! The sharding manager's state machine: which tensor class (parameters, gradients, AdamW
//! state) lives where in each mode of a hybrid-engine rank, and the ordered actions that move
//! a rank from one mode to another. Pure: no tensors, no I/O, so every transition is tested
//! exhaustively ([`plan`] over every state and target).
//!
//! MindSpeed-RL's sharding manager is the model: a colocated trainer hands the device to the
//! inference engine while it generates and takes it back to train.
//!
//! Residency of each class in each [`Mode`] (`idle` is [`IdleGrads`]: host by default, freed
//! when the manager is told the gradients are not worth keeping):
//!
//! | mode      | parameters | gradients | AdamW moments | what runs                        |
//! |-----------|------------|-----------|---------------|----------------------------------|
//! | `Train`   | device     | device    | device        | forward, backward, optimizer step |
//! | `Infer`   | host       | idle      | host          | the engine generates             |
//! | `Forward` | device     | idle      | host          | reference / old-log-prob forward |
//!
//! The transitions, in the order [`plan`] emits their actions (every pair is legal; the same
//! mode again gives an empty plan):
//!
//! | from → to           | actions                                                          |
//! |---------------------|------------------------------------------------------------------|
//! | `Train → Infer`     | offload optimizer, offload grads, sync weights, offload params   |
//! | `Train → Forward`   | offload optimizer, offload grads                                 |
//! | `Infer → Train`     | onload params, onload grads, onload optimizer                    |
//! | `Infer → Forward`   | onload params                                                    |
//! | `Forward → Train`   | onload grads, onload optimizer                                   |
//! | `Forward → Infer`   | sync weights (only if trained since the last sync), offload params |
//!
//! With [`IdleGrads::Free`] "offload grads" is "free grads" (no copy) and "onload grads" is
//! "allocate grads". Memory leaves the device before anything is put on it: offloads come
//! first, then the weight sync (the engine wakes into the room the optimizer left, and the
//! parameters are still resident for it to read), then the parameters go, and onloads bring
//! the parameters back before the gradients and the optimizer state that update them.
//!
//! [`plan`] works from the residencies the state records, not from its mode alone: the
//! executor records every action as it completes, so after a failure part way the next plan
//! does only what is left. A class a rank does not have ([`Residency::Absent`]: a frozen
//! rank's gradients and optimizer) never moves.

use crate::error::{Result, ShardError};

/// What a rank is doing, which decides where its tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Training: parameters, gradients and AdamW state on the device.
    Train,
    /// The inference engine generates: everything of the trainer's is in host memory (or,
    /// for the gradients, freed).
    Infer,
    /// A forward pass only (reference or old log-probs): parameters on the device, gradients
    /// and optimizer state off it.
    Forward,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 3] = [Mode::Train, Mode::Infer, Mode::Forward];

    /// Where `class` lives in this mode on a rank that has it, with idle gradients `idle`.
    pub fn residency(self, class: TensorClass, idle: IdleGrads) -> Residency {
        let idle_grads = match idle {
            IdleGrads::Offload => Residency::Host,
            IdleGrads::Free => Residency::Freed,
        };
        match (self, class) {
            (Mode::Train, _) => Residency::Device,
            (Mode::Infer, TensorClass::Params) => Residency::Host,
            (Mode::Forward, TensorClass::Params) => Residency::Device,
            (Mode::Infer | Mode::Forward, TensorClass::Grads) => idle_grads,
            (Mode::Infer | Mode::Forward, TensorClass::Optimizer) => Residency::Host,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Train => "train",
            Mode::Infer => "infer",
            Mode::Forward => "forward",
        })
    }
}

/// A class of tensors the manager moves as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorClass {
    /// The model's parameters.
    Params,
    /// Their gradients (`.grad`).
    Grads,
    /// AdamW's two moments.
    Optimizer,
}

impl TensorClass {
    /// Every class.
    pub const ALL: [TensorClass; 3] =
        [TensorClass::Params, TensorClass::Grads, TensorClass::Optimizer];
}

impl std::fmt::Display for TensorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TensorClass::Params => "parameters",
            TensorClass::Grads => "gradients",
            TensorClass::Optimizer => "optimizer state",
        })
    }
}

/// Where a class of tensors is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Residency {
    /// In the device buffer (the training device; on a CPU rank, its own host allocation).
    Device,
    /// In a separate host buffer (pinned when the device is a GPU); no device memory held.
    Host,
    /// Released without a copy (gradients only): the next backward allocates them again.
    Freed,
    /// The rank has none (a frozen rank's gradients and optimizer).
    Absent,
}

/// What happens to the gradients outside `Train`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum IdleGrads {
    /// Copied to host memory and back, values kept (a transition in the middle of gradient
    /// accumulation loses nothing).
    #[default]
    Offload,
    /// Dropped: right after an optimizer step they are zero, so nothing is lost and no copy
    /// is made; the next backward allocates them again.
    Free,
}

/// The manager's record of where everything is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ManagerState {
    /// The mode last entered (the one a failed transition was leaving, until one succeeds).
    pub mode: Mode,
    /// The parameters: [`Residency::Device`] or [`Residency::Host`].
    pub params: Residency,
    /// The gradients.
    pub grads: Residency,
    /// AdamW's moments: not [`Residency::Freed`].
    pub optimizer: Residency,
    /// Whether the parameters may differ from the engine's copy: set on entering `Train`,
    /// cleared by [`Action::SyncWeights`].
    pub weights_dirty: bool,
    /// What happens to the gradients outside `Train`.
    pub idle_grads: IdleGrads,
}

impl ManagerState {
    /// A rank in `Train` with everything on the device and weights not yet synced; a rank
    /// without gradients or optimizer (frozen) has them [`Residency::Absent`].
    pub fn training(has_grads: bool, has_optimizer: bool, idle_grads: IdleGrads) -> Self {
        let present = |has: bool| if has { Residency::Device } else { Residency::Absent };
        Self {
            mode: Mode::Train,
            params: Residency::Device,
            grads: present(has_grads),
            optimizer: present(has_optimizer),
            weights_dirty: true,
            idle_grads,
        }
    }

    /// Where `class` is.
    pub fn residency(&self, class: TensorClass) -> Residency {
        match class {
            TensorClass::Params => self.params,
            TensorClass::Grads => self.grads,
            TensorClass::Optimizer => self.optimizer,
        }
    }

    fn residency_mut(&mut self, class: TensorClass) -> &mut Residency {
        match class {
            TensorClass::Params => &mut self.params,
            TensorClass::Grads => &mut self.grads,
            TensorClass::Optimizer => &mut self.optimizer,
        }
    }

    /// Where `class` should be in `mode` on this rank.
    pub fn target(&self, class: TensorClass, mode: Mode) -> Residency {
        match self.residency(class) {
            Residency::Absent => Residency::Absent,
            _ => mode.residency(class, self.idle_grads),
        }
    }

    /// Whether every class is where `mode` wants it.
    pub fn is_settled_in(&self, mode: Mode) -> bool {
        TensorClass::ALL.iter().all(|&c| self.residency(c) == self.target(c, mode))
    }

    /// Checks the residencies a class can have: parameters are never freed nor absent, the
    /// optimizer state is never freed.
    pub fn validate(&self) -> Result<()> {
        let bad = |class: TensorClass, found: Residency| {
            Err(ShardError::Config(format!(
                "the sharding manager's {class} should be on the device or on the host, \
                 found {found:?}"
            )))
        };
        match (self.params, self.optimizer) {
            (Residency::Freed | Residency::Absent, _) => bad(TensorClass::Params, self.params),
            (_, Residency::Freed) => bad(TensorClass::Optimizer, self.optimizer),
            _ => Ok(()),
        }
    }
}

/// One step of a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Copy the class's device buffers into new host buffers (pinned on a GPU), point its
    /// tensors at the host copies and free the device buffers.
    Offload(TensorClass),
    /// Allocate device buffers, copy the host buffers in, point the tensors at the device
    /// buffers and free the host buffers.
    Onload(TensorClass),
    /// Drop the class's buffers without a copy (gradients only).
    Free(TensorClass),
    /// Make freed tensors resident again (gradients: libtorch allocates them at the next
    /// backward, and the manager lays them out in its buffer at the next transition).
    Allocate(TensorClass),
    /// The inference engine takes the current parameters (they are still resident).
    SyncWeights,
}

impl Action {
    /// The class it moves and where that class is after it; `None` for the weight sync.
    pub fn effect(self) -> Option<(TensorClass, Residency)> {
        match self {
            Action::Offload(c) => Some((c, Residency::Host)),
            Action::Onload(c) | Action::Allocate(c) => Some((c, Residency::Device)),
            Action::Free(c) => Some((c, Residency::Freed)),
            Action::SyncWeights => None,
        }
    }

    /// Records the action's effect in `state`.
    pub fn apply_to(self, state: &mut ManagerState) {
        match self.effect() {
            Some((class, to)) => *state.residency_mut(class) = to,
            None => state.weights_dirty = false,
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Offload(c) => write!(f, "offload {c}"),
            Action::Onload(c) => write!(f, "onload {c}"),
            Action::Free(c) => write!(f, "free {c}"),
            Action::Allocate(c) => write!(f, "allocate {c}"),
            Action::SyncWeights => f.write_str("sync weights"),
        }
    }
}

/// The ordered actions that take a rank from one mode to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The mode the rank was in.
    pub from: Mode,
    /// The mode it will be in.
    pub to: Mode,
    /// What to do, in order.
    pub actions: Vec<Action>,
}

impl Plan {
    /// Whether nothing has to move.
    pub fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// `state` after every action and the mode change (entering `Train` marks the weights
    /// dirty: training changes them).
    pub fn apply(&self, state: &ManagerState) -> ManagerState {
        let mut next = *state;
        for action in &self.actions {
            action.apply_to(&mut next);
        }
        Self::enter(&mut next, self.to);
        next
    }

    /// Records that `state` is now in `mode`.
    pub(crate) fn enter(state: &mut ManagerState, mode: Mode) {
        if mode == Mode::Train && state.mode != Mode::Train {
            state.weights_dirty = true;
        }
        state.mode = mode;
    }
}

/// The action moving `class` from `from` to `to`, or an error where that cannot be done.
fn move_class(class: TensorClass, from: Residency, to: Residency) -> Result<Option<Action>> {
    use Residency::{Absent, Device, Freed, Host};
    Ok(match (from, to) {
        _ if from == to => None,
        (Device, Host) => Some(Action::Offload(class)),
        (Host, Device) => Some(Action::Onload(class)),
        (Device | Host, Freed) => Some(Action::Free(class)),
        (Freed, Device) => Some(Action::Allocate(class)),
        (Freed, Host) => {
            return Err(ShardError::Config(format!(
                "the {class} were freed: they can only come back on the device (train mode), \
                 not on the host"
            )));
        }
        (Absent, _) | (_, Absent) => None,
        (Device | Host | Freed, _) => None,
    })
}

/// The ordered actions taking `current` to `target` (module doc: the table and the order).
/// Empty when every class already is where `target` wants it and no weight sync is due;
/// an error for a state no transition can come from (parameters freed, optimizer freed) or a
/// move that cannot be made (freed gradients to the host).
pub fn plan(current: &ManagerState, target: Mode) -> Result<Plan> {
    current.validate()?;
    let step = |class| move_class(class, current.residency(class), current.target(class, target));
    let (params, grads, optimizer) =
        (step(TensorClass::Params)?, step(TensorClass::Grads)?, step(TensorClass::Optimizer)?);
    let leaving = |a: &Option<Action>| matches!(a, Some(Action::Offload(_) | Action::Free(_)));
    let mut actions = Vec::new();
    // Free device memory first: the optimizer state is the largest.
    actions.extend([optimizer, grads].into_iter().flatten().filter(|a| leaving(&Some(*a))));
    if target == Mode::Infer && current.weights_dirty {
        actions.push(Action::SyncWeights);
    }
    // Then the parameters go (or come: the gradients and moments that update them follow).
    actions.extend(params);
    actions.extend([grads, optimizer].into_iter().flatten().filter(|a| !leaving(&Some(*a))));
    Ok(Plan { from: current.mode, to: target, actions })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;
    use TensorClass::*;

    /// Every state a rank can be in (valid or not), with every policy.
    fn all_states() -> Vec<ManagerState> {
        use Residency::*;
        let all = [Device, Host, Freed, Absent];
        let mut states = Vec::new();
        for mode in Mode::ALL {
            for params in all {
                for grads in all {
                    for optimizer in all {
                        for weights_dirty in [false, true] {
                            for idle_grads in [IdleGrads::Offload, IdleGrads::Free] {
                                states.push(ManagerState {
                                    mode,
                                    params,
                                    grads,
                                    optimizer,
                                    weights_dirty,
                                    idle_grads,
                                });
                            }
                        }
                    }
                }
            }
        }
        states
    }

    fn settled(mode: Mode, idle: IdleGrads, has_grads: bool, has_opt: bool) -> ManagerState {
        let training = ManagerState::training(has_grads, has_opt, idle);
        let mut state = plan(&training, mode).unwrap().apply(&training);
        state.weights_dirty = mode == Mode::Train;
        state
    }

    #[test]
    fn the_table_of_the_module_doc() {
        let offload = IdleGrads::Offload;
        let actions = |from, to| plan(&settled(from, offload, true, true), to).unwrap().actions;
        use Mode::*;
        assert_eq!(
            actions(Train, Infer),
            [Offload(Optimizer), Offload(Grads), SyncWeights, Offload(Params)]
        );
        assert_eq!(actions(Train, Forward), [Offload(Optimizer), Offload(Grads)]);
        assert_eq!(actions(Infer, Train), [Onload(Params), Onload(Grads), Onload(Optimizer)]);
        assert_eq!(actions(Infer, Forward), [Onload(Params)]);
        assert_eq!(actions(Forward, Train), [Onload(Grads), Onload(Optimizer)]);
        assert_eq!(actions(Forward, Infer), [Offload(Params)]);
        let mut dirty = settled(Forward, offload, true, true);
        dirty.weights_dirty = true;
        assert_eq!(plan(&dirty, Infer).unwrap().actions, [SyncWeights, Offload(Params)]);
        for mode in Mode::ALL {
            assert!(plan(&settled(mode, offload, true, true), mode).unwrap().is_empty());
        }
        // Freed gradients: dropped and allocated, never copied.
        let free = |from, to| plan(&settled(from, IdleGrads::Free, true, true), to).unwrap();
        assert_eq!(free(Train, Forward).actions, [Offload(Optimizer), Free(Grads)]);
        assert_eq!(
            free(Infer, Train).actions,
            [Onload(Params), Allocate(Grads), Onload(Optimizer)]
        );
        // A frozen rank moves its parameters only.
        let frozen = |from, to| plan(&settled(from, offload, false, false), to).unwrap();
        assert_eq!(frozen(Train, Infer).actions, [SyncWeights, Offload(Params)]);
        assert!(frozen(Train, Forward).is_empty());
    }

    #[test]
    fn every_plan_reaches_its_target_and_frees_before_it_allocates() {
        let mut planned = 0;
        for state in all_states() {
            for target in Mode::ALL {
                let Ok(plan) = plan(&state, target) else {
                    continue;
                };
                planned += 1;
                let after = plan.apply(&state);
                assert!(after.is_settled_in(target), "{state:?} → {target}: {after:?}");
                assert_eq!(after.mode, target);
                // Absent classes never move, present ones never become absent.
                for class in TensorClass::ALL {
                    let absent = state.residency(class) == Residency::Absent;
                    assert_eq!(absent, after.residency(class) == Residency::Absent);
                }
                // Each class moves at most once; nothing is put on the device before every
                // class that leaves it has left.
                let moved: Vec<_> = plan.actions.iter().filter_map(|a| a.effect()).collect();
                for class in TensorClass::ALL {
                    assert!(moved.iter().filter(|(c, _)| *c == class).count() <= 1);
                }
                let first_on = moved.iter().position(|(_, to)| *to == Residency::Device);
                let last_off = moved.iter().rposition(|(_, to)| *to != Residency::Device);
                if let (Some(on), Some(off)) = (first_on, last_off) {
                    assert!(off < on, "{state:?} → {target}: {:?}", plan.actions);
                }
                // The weights are synced exactly when entering Infer with changed weights, and
                // while the parameters are still resident if they were.
                let sync = plan.actions.iter().position(|a| *a == SyncWeights);
                assert_eq!(sync.is_some(), target == Mode::Infer && state.weights_dirty);
                let params_off = plan.actions.iter().position(|a| *a == Offload(Params));
                if let (Some(sync), Some(off)) = (sync, params_off) {
                    assert!(sync < off);
                }
                assert!(!after.weights_dirty || target == Mode::Train || state.weights_dirty);
                // Planning again from where it ended has nothing left to do.
                assert!(super::plan(&after, target).unwrap().is_empty());
            }
        }
        assert!(planned > 100, "{planned}");
    }

    #[test]
    fn impossible_states_and_moves_are_errors() {
        let mut state = ManagerState::training(true, true, IdleGrads::Offload);
        state.params = Residency::Freed;
        let err = plan(&state, Mode::Infer).unwrap_err().to_string();
        assert!(err.contains("parameters") && err.contains("Freed"), "{err}");
        state.params = Residency::Device;
        state.optimizer = Residency::Freed;
        assert!(plan(&state, Mode::Train).unwrap_err().to_string().contains("optimizer"));
        // Freed gradients cannot be put on the host.
        let mut state = ManagerState::training(true, true, IdleGrads::Offload);
        state.grads = Residency::Freed;
        let err = plan(&state, Mode::Infer).unwrap_err().to_string();
        assert!(err.contains("freed") && err.contains("train mode"), "{err}");
        assert_eq!(
            plan(&state, Mode::Train).unwrap().actions,
            [Allocate(Grads)],
            "but they can come back for training"
        );
    }

    #[test]
    fn a_transition_cut_short_plans_only_what_is_left() {
        let start = ManagerState::training(true, true, IdleGrads::Offload);
        let full = plan(&start, Mode::Infer).unwrap();
        for done in 0..full.actions.len() {
            let mut state = start;
            for action in &full.actions[..done] {
                action.apply_to(&mut state);
            }
            assert_eq!(plan(&state, Mode::Infer).unwrap().actions, full.actions[done..]);
        }
    }
}
