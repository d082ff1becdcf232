//! Unit and property tests of the store core.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

const OWNER: HolderId = HolderId(1);
const READER: HolderId = HolderId(2);

fn id(n: u64) -> ObjectId {
    ObjectId::new(7, n)
}

fn allocated(placement: Placement) -> Allocation {
    match placement {
        Placement::Allocated(allocation) => allocation,
        other => panic!("expected an allocation, found {other:?}"),
    }
}

/// Creates and seals an object, carrying out any spills the core asks for.
fn put(core: &mut StoreCore, object: ObjectId, size: u64) -> Vec<Victim> {
    let mut done = Vec::new();
    loop {
        match core.create(object, size, OWNER, CopyKind::Primary).unwrap() {
            Placement::Allocated(_) => break,
            Placement::MakeRoom(victims) => {
                for victim in victims {
                    core.spilled(victim.id).unwrap();
                    done.push(victim);
                }
            }
        }
    }
    core.seal(object).unwrap();
    done
}

#[test]
fn victims_are_the_least_recently_used_unpinned_objects() {
    let mut core = StoreCore::new(4 * 1024);
    for n in 0..4 {
        put(&mut core, id(n), 1024);
    }
    // Object 0 is used again, object 1 is pinned: 2 is the oldest candidate.
    assert!(matches!(core.pin(id(0), READER).unwrap(), PinOutcome::Pinned(_)));
    core.unpin(id(0), READER).unwrap();
    core.pin(id(1), READER).unwrap();
    let spilled = put(&mut core, id(9), 1024);
    assert_eq!(spilled.iter().map(|v| v.id).collect::<Vec<_>>(), vec![id(2)]);
    assert_eq!(core.pin(id(2), READER).unwrap(), PinOutcome::RestoreFirst);
    let stats = core.stats();
    assert_eq!((stats.spilled_objects, stats.bytes_spilled), (1, 1024));
    assert_eq!((stats.transfers.spills, stats.transfers.spilled_bytes), (1, 1024));
    assert_eq!(stats.transfers.restores, 0);
    let text = stats.to_string();
    assert!(text.contains("5 objects"), "{text}");
    assert!(text.contains(&format!("{} 1024 B spilled owner 1 holders 1 pins 0", id(2))), "{text}");
}

#[test]
fn everything_pinned_or_unsealed_is_a_store_full_error() {
    let mut core = StoreCore::new(2048);
    put(&mut core, id(0), 1024);
    core.pin(id(0), READER).unwrap();
    allocated(core.create(id(1), 1024, OWNER, CopyKind::Primary).unwrap());
    let error = core.create(id(2), 64, OWNER, CopyKind::Primary).unwrap_err();
    assert!(matches!(error, StoreError::StoreFull { needed: 64, capacity: 2048, pinned: 2048 }));
    assert!(error.to_string().contains("2048 bytes are pinned"));
    assert!(matches!(
        core.create(id(3), 4096, OWNER, CopyKind::Primary),
        Err(StoreError::TooLarge { size: 4096, capacity: 2048 })
    ));
}

#[test]
fn secondary_copies_are_evicted_not_spilled() {
    let mut core = StoreCore::new(1024);
    allocated(core.create(id(0), 1024, OWNER, CopyKind::Secondary).unwrap());
    core.seal(id(0)).unwrap();
    let Placement::MakeRoom(victims) = core.create(id(1), 512, OWNER, CopyKind::Primary).unwrap()
    else {
        panic!("expected victims")
    };
    assert_eq!(victims[0].action, VictimAction::Evict);
    core.evicted(id(0)).unwrap();
    assert!(!core.contains(id(0)));
}

#[test]
fn the_last_holder_frees_but_memory_waits_for_the_last_reader() {
    let mut core = StoreCore::new(4096);
    put(&mut core, id(0), 100);
    core.add_holder(id(0), HolderId(3)).unwrap();
    core.pin(id(0), READER).unwrap();
    assert_eq!(core.remove_holder(id(0), OWNER).unwrap(), None);
    assert_eq!(core.remove_holder(id(0), HolderId(3)).unwrap(), None);
    assert!(!core.contains(id(0)));
    assert!(matches!(core.pin(id(0), READER), Err(StoreError::ObjectFreed(_))));
    assert_eq!(core.stats().used_bytes, 128);
    let freed = core.unpin(id(0), READER).unwrap();
    assert_eq!(freed, Some(Freed { id: id(0), had_spill_file: false }));
    assert_eq!(core.stats().used_bytes, 0);
    assert!(matches!(core.unpin(id(0), READER), Err(StoreError::ObjectNotFound(_))));
}

#[test]
fn a_removal_that_overtakes_its_addition_keeps_the_object_until_both_arrive() {
    let mut core = StoreCore::new(4096);
    put(&mut core, id(0), 100);
    let borrower = HolderId(5);
    // The borrower dropped its reference before the owner's addition on its behalf arrived.
    assert_eq!(core.remove_holder(id(0), borrower).unwrap(), None);
    assert_eq!(core.holder_counts(id(0)).unwrap()[&borrower], -1);
    assert!(core.contains(id(0)));
    assert_eq!(core.add_holder(id(0), borrower).unwrap(), None);
    assert!(!core.holder_counts(id(0)).unwrap().contains_key(&borrower));
    // Two counts of one holder need two removals.
    core.add_holder(id(0), OWNER).unwrap();
    assert_eq!(core.remove_holder(id(0), OWNER).unwrap(), None);
    assert_eq!(
        core.remove_holder(id(0), OWNER).unwrap(),
        Some(Freed { id: id(0), had_spill_file: false })
    );
}

#[test]
fn a_crashed_process_loses_its_holds_pins_and_unsealed_objects() {
    let mut core = StoreCore::new(4096);
    let crashed = HolderId(9);
    put(&mut core, id(0), 100);
    core.add_holder(id(0), crashed).unwrap();
    core.pin(id(0), crashed).unwrap();
    allocated(core.create(id(1), 100, crashed, CopyKind::Primary).unwrap());
    core.add_holder(id(1), OWNER).unwrap();
    let freed = core.release_process(crashed);
    assert_eq!(freed, vec![Freed { id: id(1), had_spill_file: false }]);
    assert!(core.contains(id(0)));
    assert_eq!(core.stats().pinned_objects, 0);
    assert_eq!(core.release_process(OWNER), vec![Freed { id: id(0), had_spill_file: false }]);
    assert_eq!(core.stats().used_bytes, 0);
}

#[test]
fn restore_brings_a_spilled_object_back() {
    let mut core = StoreCore::new(1024);
    put(&mut core, id(0), 1024);
    put(&mut core, id(1), 1024);
    assert_eq!(core.pin(id(0), READER).unwrap(), PinOutcome::RestoreFirst);
    let Placement::MakeRoom(victims) = core.restore(id(0)).unwrap() else { panic!("victims") };
    assert_eq!(victims[0].id, id(1));
    core.spilled(id(1)).unwrap();
    let allocation = allocated(core.restore(id(0)).unwrap());
    assert_eq!(core.stats().per_object[0].state, ObjectState::Restoring);
    core.restored(id(0)).unwrap();
    assert_eq!(core.pin(id(0), READER).unwrap(), PinOutcome::Pinned(allocation));
    let freed = core.free(id(1)).unwrap();
    assert_eq!(freed, Some(Freed { id: id(1), had_spill_file: true }));
}

#[test]
fn state_errors_name_what_was_expected() {
    let mut core = StoreCore::new(4096);
    allocated(core.create(id(0), 10, OWNER, CopyKind::Primary).unwrap());
    let error = core.pin(id(0), READER).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("object {} is being created, expected a sealed object", id(0))
    );
    assert!(matches!(
        core.create(id(0), 10, OWNER, CopyKind::Primary),
        Err(StoreError::ObjectExists(_))
    ));
    core.seal(id(0)).unwrap();
    assert!(matches!(core.seal(id(0)), Err(StoreError::NotCreating { .. })));
    assert!(matches!(core.unpin(id(0), READER), Err(StoreError::NotPinned { .. })));
    assert!(matches!(core.spilled(id(5)), Err(StoreError::ObjectNotFound(_))));
}

#[derive(Debug, Clone)]
enum Op {
    Put { object: u8, size: u16, secondary: bool },
    CreateOnly { object: u8, size: u16, holder: u8 },
    Pin { object: u8, reader: u8 },
    Unpin { object: u8, reader: u8 },
    AddHolder { object: u8, holder: u8 },
    RemoveHolder { object: u8, holder: u8 },
    Crash { holder: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, 0u16..3000, any::<bool>())
            .prop_map(|(object, size, secondary)| Op::Put { object, size, secondary }),
        1 => (0u8..24, 0u16..3000, 0u8..4)
            .prop_map(|(object, size, holder)| Op::CreateOnly { object, size, holder }),
        3 => (0u8..24, 0u8..4).prop_map(|(object, reader)| Op::Pin { object, reader }),
        3 => (0u8..24, 0u8..4).prop_map(|(object, reader)| Op::Unpin { object, reader }),
        1 => (0u8..24, 0u8..4).prop_map(|(object, holder)| Op::AddHolder { object, holder }),
        2 => (0u8..24, 0u8..4).prop_map(|(object, holder)| Op::RemoveHolder { object, holder }),
        1 => (0u8..4).prop_map(|holder| Op::Crash { holder }),
    ]
}

/// A model executor: carries out decisions, checking that victims are always sealed and
/// unpinned, and tracks which objects must still exist (in memory or spilled).
struct Model {
    core: StoreCore,
    pins: BTreeMap<(ObjectId, HolderId), u32>,
    secondary: BTreeSet<ObjectId>,
}

impl Model {
    fn make_room(&mut self, victims: Vec<Victim>) -> Result<(), TestCaseError> {
        for victim in victims {
            prop_assert!(!self.pins.keys().any(|(object, _)| *object == victim.id));
            match victim.action {
                VictimAction::Spill => self.core.spilled(victim.id).unwrap(),
                VictimAction::Evict => {
                    prop_assert!(self.secondary.contains(&victim.id));
                    self.core.evicted(victim.id).unwrap();
                }
            }
        }
        Ok(())
    }

    fn create(
        &mut self,
        object: ObjectId,
        size: u64,
        owner: HolderId,
        copy: CopyKind,
    ) -> Result<bool, TestCaseError> {
        loop {
            match self.core.create(object, size, owner, copy) {
                Ok(Placement::Allocated(_)) => return Ok(true),
                Ok(Placement::MakeRoom(victims)) => self.make_room(victims)?,
                Err(
                    StoreError::ObjectExists(_)
                    | StoreError::StoreFull { .. }
                    | StoreError::TooLarge { .. },
                ) => {
                    return Ok(false);
                }
                Err(other) => return Err(TestCaseError::fail(format!("create: {other}"))),
            }
        }
    }

    fn pin(&mut self, object: ObjectId, reader: HolderId) -> Result<(), TestCaseError> {
        loop {
            match self.core.pin(object, reader) {
                Ok(PinOutcome::Pinned(_)) => {
                    *self.pins.entry((object, reader)).or_insert(0) += 1;
                    return Ok(());
                }
                Ok(PinOutcome::RestoreFirst) => match self.core.restore(object) {
                    Ok(Placement::Allocated(_)) => self.core.restored(object).unwrap(),
                    Ok(Placement::MakeRoom(victims)) => self.make_room(victims)?,
                    Err(StoreError::StoreFull { .. }) => return Ok(()),
                    Err(other) => return Err(TestCaseError::fail(format!("restore: {other}"))),
                },
                Err(
                    StoreError::ObjectNotFound(_)
                    | StoreError::ObjectFreed(_)
                    | StoreError::NotSealed { .. },
                ) => {
                    return Ok(());
                }
                Err(other) => return Err(TestCaseError::fail(format!("pin: {other}"))),
            }
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let stats = self.core.stats();
        let mut reserved = 0;
        let mut spilled = 0;
        let mut ranges = Vec::new();
        for (id, entry) in &self.core.objects {
            match entry.residency {
                Residency::InMemory(a) | Residency::Restoring(a) => {
                    reserved += a.reserved_len();
                    ranges.push((a.offset, a.reserved_end()));
                }
                Residency::Spilled => spilled += entry.size,
            }
            let in_lru = entry.lru_tick.is_some_and(|tick| self.core.lru.get(&tick) == Some(id));
            let should = entry.sealed && matches!(entry.residency, Residency::InMemory(_));
            prop_assert_eq!(in_lru, should);
            prop_assert!(entry.freed == entry.holders.is_empty());
            prop_assert!(
                !entry.freed || !entry.pins.is_empty(),
                "a freed unpinned entry must be gone"
            );
        }
        ranges.sort();
        for pair in ranges.windows(2) {
            prop_assert!(pair[0].1 <= pair[1].0, "allocations overlap");
        }
        prop_assert_eq!(
            self.core.lru.len(),
            self.core.objects.values().filter(|e| e.lru_tick.is_some()).count()
        );
        prop_assert_eq!(reserved, stats.used_bytes);
        prop_assert_eq!(spilled, stats.bytes_spilled);
        // What is on disk now was spilled and neither restored nor freed since.
        let t = stats.transfers;
        prop_assert!(t.restores <= t.spills && t.restored_bytes <= t.spilled_bytes);
        prop_assert!(stats.bytes_spilled <= t.spilled_bytes - t.restored_bytes);
        prop_assert!(stats.used_bytes <= stats.capacity);
        for ((object, reader), count) in &self.pins {
            let entry = &self.core.objects[object];
            prop_assert_eq!(entry.pins.get(reader), Some(count));
        }
        Ok(())
    }
}

proptest! {
    #[test]
    fn the_core_keeps_its_invariants_under_any_operation_sequence(ops in prop::collection::vec(op(), 0..150)) {
        let mut model = Model { core: StoreCore::new(8 * 1024), pins: BTreeMap::new(), secondary: BTreeSet::new() };
        for op in ops {
            match op {
                Op::Put { object, size, secondary } => {
                    let copy = if secondary { CopyKind::Secondary } else { CopyKind::Primary };
                    if model.create(id(object.into()), size.into(), OWNER, copy)? {
                        model.core.seal(id(object.into())).unwrap();
                        if secondary {
                            model.secondary.insert(id(object.into()));
                        }
                    }
                }
                Op::CreateOnly { object, size, holder } => {
                    model.create(id(object.into()), size.into(), HolderId(holder.into()), CopyKind::Primary)?;
                }
                Op::Pin { object, reader } => model.pin(id(object.into()), HolderId(reader.into()))?,
                Op::Unpin { object, reader } => {
                    let key = (id(object.into()), HolderId(reader.into()));
                    let result = model.core.unpin(key.0, key.1);
                    match model.pins.get_mut(&key) {
                        Some(count) => {
                            prop_assert!(result.is_ok());
                            *count -= 1;
                            if *count == 0 {
                                model.pins.remove(&key);
                            }
                        }
                        None => prop_assert!(result.is_err()),
                    }
                }
                Op::AddHolder { object, holder } => {
                    let _ = model.core.add_holder(id(object.into()), HolderId(holder.into()));
                }
                Op::RemoveHolder { object, holder } => {
                    let _ = model.core.remove_holder(id(object.into()), HolderId(holder.into()));
                }
                Op::Crash { holder } => {
                    let holder = HolderId(holder.into());
                    model.core.release_process(holder);
                    model.pins.retain(|(_, reader), _| *reader != holder);
                }
            }
            model.secondary.retain(|object| model.core.objects.contains_key(object));
            model.check()?;
        }
        // Dropping every holder and pin empties the store completely.
        for holder in 0..4 {
            model.core.release_process(HolderId(holder));
        }
        let stats = model.core.stats();
        prop_assert_eq!((stats.objects, stats.used_bytes, stats.bytes_spilled), (0, 0, 0));
        prop_assert_eq!(model.core.allocator.free_extents().collect::<Vec<_>>(), vec![(0, 8 * 1024)]);
    }
}
