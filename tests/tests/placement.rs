//! Placement groups, GPUs and colocation specs with real worker processes, on one node with 8
//! fake GPUs: every shipped 1 × 8 colocation example is deployed and each of its actors reports
//! the `CUDA_VISIBLE_DEVICES` and GPU UUIDs it was given; infeasible requests fail with the
//! missing resource; removal stops a group's actors and frees everything; a pending group is
//! created once another is removed. (The 2 × 8 examples need two nodes; they are checked at the
//! plan level in `placement/tests/examples.rs` until multi-node lands.)

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use rtrun::colocation::{DeployOptions, deploy_spec, load_spec};
use rtrun::placement_group::{BundleRef, GpuShare, Quantity, Strategy};
use rtrun::{
    ActorOptions, Config, Error, PlacementGroupOptions, PlacementGroupStatus, TaskOptions,
};
use rtrun_tests::wait_until;
use serde::{Deserialize, Serialize};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

const GPUS: usize = 8;
const CPUS: f64 = 128.0;
const LONG: Duration = Duration::from_secs(60);

fn init() {
    rtrun::init_with(Config {
        num_cpus: Some(CPUS),
        num_gpus: Some(GPUS as f64),
        resources: BTreeMap::from([("custom".to_owned(), 100.0)]),
        ..Default::default()
    })
    .expect("runtime starts");
}

/// What an actor sees of its placement.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Report {
    cuda_visible_devices: Option<String>,
    cuda_device_order: Option<String>,
    gpus: Vec<GpuShare>,
    bundle: Option<BundleRef>,
    node: Option<String>,
}

struct Probe;

#[rtrun::actor]
impl Probe {
    pub fn new() -> Self {
        Probe
    }

    pub fn report(&self) -> Result<Report, String> {
        let context = rtrun::context().map_err(|e| e.to_string())?;
        Ok(Report {
            cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
            cuda_device_order: std::env::var("CUDA_DEVICE_ORDER").ok(),
            gpus: context.gpus,
            bundle: context.bundle,
            node: context.placement_node,
        })
    }

    /// Blocks for `ms` milliseconds (a call that is still running when its group is removed).
    pub fn busy(&self, ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(ms));
        ms
    }

    /// Creates, waits for and removes a placement group from inside a worker process.
    pub fn group_from_worker(&self, gpus: usize) -> Result<Vec<Vec<u32>>, String> {
        let options =
            PlacementGroupOptions::uniform(gpus, &[("GPU", 1.0)]).map_err(|e| e.to_string())?;
        let group = rtrun::placement_group(options).map_err(|e| e.to_string())?;
        let table = group.ready().wait(Some(LONG)).map_err(|e| e.to_string())?;
        group.remove().map_err(|e| e.to_string())?;
        Ok(table.bundles.iter().map(|b| b.gpu_indices()).collect())
    }

    /// Creates a child actor with no placement of its own and returns what the child reports.
    pub fn child_report(&self) -> Result<Report, String> {
        let child = Probe::remote().map_err(|e| e.to_string())?;
        let report = child.report().get().map_err(|e| e.to_string())?;
        child.kill().map_err(|e| e.to_string())?;
        report
    }
}

#[rtrun::remote]
fn add_one(x: u64) -> u64 {
    x + 1
}

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/placement").join(name)
}

fn available(resource: &str) -> f64 {
    let info = rtrun::current().unwrap().cluster_info().unwrap();
    info.available.get(resource).copied().unwrap_or(0.0)
}

fn all_free() -> bool {
    available("GPU") == GPUS as f64 && available("CPU") == CPUS
}

/// Deploys a shipped 1 × 8 example, starts one probe per replica, and checks what each reports
/// against the bundle table; then removes the deployment and checks everything is free.
fn check_example(name: &str) {
    init();
    let spec = load_spec(example(name)).unwrap();
    let deployment = deploy_spec(&spec, &DeployOptions::default()).unwrap();
    let mut probes = Vec::new();
    for role in deployment.roles() {
        for replica in &role.replicas {
            let options = replica.apply_to(ActorOptions::default());
            probes.push((replica.clone(), Probe::remote_with(options).unwrap()));
        }
    }
    let mut per_gpu: BTreeMap<String, Quantity> = BTreeMap::new();
    for (replica, probe) in &probes {
        let report = probe.report().get_timeout(LONG).unwrap().unwrap();
        let who = format!("{name}: {} rank {}", replica.role, replica.rank);
        let ids: Vec<String> = report.gpus.iter().map(|s| s.gpu.index.to_string()).collect();
        assert!(!ids.is_empty(), "{who} got no GPU");
        assert_eq!(report.cuda_visible_devices.as_deref(), Some(ids.join(",").as_str()), "{who}");
        assert_eq!(report.cuda_device_order.as_deref(), Some("PCI_BUS_ID"), "{who}");
        let bundle = replica.bundle.as_ref().expect("every example role uses a group");
        let group = replica.group.as_ref().unwrap();
        assert_eq!(
            report.bundle,
            Some(BundleRef { group: group.id(), index: replica.bundle_index.unwrap() }),
            "{who}"
        );
        assert_eq!(report.node.as_deref(), Some(bundle.node.as_str()), "{who}");
        let bundle_uuids = bundle.gpu_uuids();
        for share in &report.gpus {
            assert!(bundle_uuids.contains(&share.gpu.uuid.as_str()), "{who}: {share:?}");
            let sum = per_gpu.entry(share.gpu.uuid.clone()).or_default();
            *sum = sum.checked_add(share.share).unwrap();
        }
        let asked = replica.resources.get("GPU");
        let given = report.gpus.iter().fold(Quantity::ZERO, |a, s| a.checked_add(s.share).unwrap());
        assert_eq!(given, asked, "{who}");
    }
    // Every GPU of the node is used, and the shares on each add up to exactly one GPU.
    assert_eq!(per_gpu.len(), GPUS, "{name}: {per_gpu:?}");
    for (uuid, sum) in &per_gpu {
        assert_eq!(*sum, Quantity::whole(1), "{name}: GPU {uuid}");
    }
    deployment.remove().unwrap();
    for (replica, probe) in &probes {
        let err = probe.report().get_timeout(LONG).unwrap_err();
        let who = format!("{name}: {} rank {}", replica.role, replica.rank);
        assert!(matches!(&err, Error::ActorDied { .. }), "{who}: {err}");
    }
    assert!(wait_until(LONG, all_free), "{name}: resources not freed");
    assert!(rtrun::list_placement_groups().unwrap().is_empty());
}

#[test]
fn separate_example_is_scheduled_with_its_gpus() {
    check_example("separate-1x8.yaml");
}

#[test]
fn actor_ref_colocated_example_is_scheduled_with_its_gpus() {
    check_example("actor-ref-colocated-1x8.yaml");
}

#[test]
fn critic_reward_colocated_example_is_scheduled_with_its_gpus() {
    check_example("critic-reward-colocated-1x8.yaml");
}

#[test]
fn hybrid_example_is_scheduled_with_its_gpus() {
    check_example("hybrid-1x8.yaml");
}

#[test]
fn infeasible_specs_groups_and_actors_fail_naming_what_is_missing() {
    init();
    let spec = load_spec(example("hybrid-2x8.yaml")).unwrap();
    let err = deploy_spec(&spec, &DeployOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "infeasible: placement group `hybrid` needs GPU: 16, cluster has 8",
        "{err:?}"
    );
    assert!(rtrun::list_placement_groups().unwrap().is_empty(), "a failed deploy keeps nothing");

    let options = PlacementGroupOptions::uniform(9, &[("GPU", 1.0)]).unwrap().name("nine");
    let err = rtrun::placement_group(options).unwrap_err();
    assert_eq!(err.to_string(), "infeasible: placement group `nine` needs GPU: 9, cluster has 8");
    let options = PlacementGroupOptions::uniform(2, &[("GPU", 4.0)])
        .unwrap()
        .strategy(Strategy::StrictSpread)
        .name("spread");
    let err = rtrun::placement_group(options).unwrap_err();
    assert!(matches!(&err, Error::Infeasible(m) if m.contains("2 distinct nodes")), "{err}");

    let pg = rtrun::placement_group(
        PlacementGroupOptions::uniform(2, &[("GPU", 1.0), ("CPU", 1.0)]).unwrap(),
    )
    .unwrap();
    let err = Probe::remote_with(ActorOptions::default().num_gpus(2.0).bundle(&pg, 1)).unwrap_err();
    assert!(
        matches!(&err, Error::Infeasible(m) if m.contains("needs GPU: 2, bundle 1 of") && m.contains("has 1")),
        "{err}"
    );
    let err = Probe::remote_with(ActorOptions::default().num_gpus(0.5).bundle(&pg, 2)).unwrap_err();
    assert!(matches!(&err, Error::Invalid(m) if m.contains("has 2 bundles, found bundle index 2")));
    let spec_error =
        rtrun::colocation::parse_spec("roles:\n  actor:\n    replicas: -1\n", "x.yaml")
            .unwrap_err()
            .to_string();
    assert!(spec_error.starts_with("x.yaml:3:15: expected"), "{spec_error}");
    pg.remove().unwrap();
    let err = pg.remove().unwrap_err();
    assert!(err.to_string().contains("removed or never existed"), "{err}");
    // Typed, so that a caller can tell "already gone" from a bad request without the text.
    assert!(matches!(err, Error::NotFound(rtrun::Missing::Group(id)) if id == pg.id()), "{err:?}");
}

#[test]
fn removal_stops_its_actors_and_frees_everything() {
    init();
    let pg = rtrun::placement_group(
        PlacementGroupOptions::uniform(GPUS, &[("GPU", 1.0), ("CPU", 2.0)]).unwrap().name("train"),
    )
    .unwrap();
    let table = pg.ready().wait(Some(LONG)).unwrap();
    let indices: Vec<Vec<u32>> = table.bundles.iter().map(|b| b.gpu_indices()).collect();
    assert_eq!(indices, (0..GPUS as u32).map(|i| vec![i]).collect::<Vec<_>>());
    assert_eq!(available("GPU"), 0.0);
    assert_eq!(available("CPU"), CPUS - 2.0 * GPUS as f64);
    // Five fifths of one bundle's GPU, and one actor holding all of another bundle.
    let share = ActorOptions::default().num_gpus(0.2).num_cpus(0.4);
    let fifths: Vec<_> =
        (0..5).map(|_| Probe::remote_with(share.clone().bundle(&pg, 3)).unwrap()).collect();
    let whole = Probe::remote_with(ActorOptions::default().num_gpus(1.0).bundle(&pg, 6)).unwrap();
    for probe in &fifths {
        let report = probe.report().get_timeout(LONG).unwrap().unwrap();
        assert_eq!(report.cuda_visible_devices.as_deref(), Some("3"));
        assert_eq!(report.gpus[0].gpu.uuid, table.bundles[3].gpus[0].gpu.uuid);
    }
    let report = whole.report().get_timeout(LONG).unwrap().unwrap();
    assert_eq!(report.cuda_visible_devices.as_deref(), Some("6"));
    // A sixth fifth does not fit bundle 3 now: it waits (and dies with the group).
    let sixth = Probe::remote_with(share.clone().bundle(&pg, 3)).unwrap();
    assert!(sixth.report().get_timeout(Duration::from_millis(300)).is_err());

    let state = pg.state().unwrap();
    assert_eq!(state.status, PlacementGroupStatus::Created);
    assert_eq!(rtrun::get_placement_group("train").unwrap(), pg);
    // A call in flight when the group goes learns the reason too, not just that its worker died.
    let in_flight = whole.busy(120_000);
    assert!(matches!(in_flight.get_timeout(Duration::from_millis(200)), Err(Error::Timeout(_))));
    pg.remove().unwrap();
    let err = in_flight.get_timeout(LONG).unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { reason, .. } if reason == "its placement group `train` was removed"),
        "{err}"
    );
    for probe in fifths.iter().chain([&whole]) {
        let err = probe.report().get_timeout(LONG).unwrap_err();
        assert!(matches!(&err, Error::ActorDied { .. }), "{err}");
    }
    // The actor that never started learns why from the control plane.
    let err = sixth.report().get_timeout(LONG).unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { reason, .. } if reason == "its placement group `train` was removed"),
        "{err}"
    );
    assert!(wait_until(LONG, all_free));
    assert!(wait_until(LONG, || rtrun::current().unwrap().cluster_info().unwrap().workers == 0));
    // A group needing every GPU and CPU of the node is created at once.
    let all = rtrun::placement_group(
        PlacementGroupOptions::uniform(GPUS, &[("GPU", 1.0), ("CPU", CPUS / GPUS as f64)])
            .unwrap()
            .strategy(Strategy::StrictPack),
    )
    .unwrap();
    assert!(all.wait(LONG).unwrap());
    assert_eq!(available("GPU"), 0.0);
    assert_eq!(available("CPU"), 0.0);
    all.remove().unwrap();
    assert!(all_free());
}

#[test]
fn pending_group_is_created_once_another_is_removed() {
    init();
    let first = rtrun::placement_group(
        PlacementGroupOptions::uniform(6, &[("GPU", 1.0)]).unwrap().name("first"),
    )
    .unwrap();
    assert!(first.wait(LONG).unwrap());
    let second = rtrun::placement_group(
        PlacementGroupOptions::uniform(4, &[("GPU", 1.0)]).unwrap().name("second"),
    )
    .unwrap();
    assert_eq!(second.state().unwrap().status, PlacementGroupStatus::Pending);
    assert!(second.bundle_table().unwrap().is_none());
    assert!(!second.wait(Duration::from_millis(200)).unwrap());
    // An actor placed into the pending group waits with it.
    let waiting =
        Probe::remote_with(ActorOptions::default().num_gpus(1.0).bundle(&second, 2)).unwrap();
    let ready = second.ready();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let awaited = std::thread::spawn(move || runtime.block_on(ready));
    first.remove().unwrap();
    let table = awaited.join().unwrap().unwrap();
    let indices: Vec<Vec<u32>> = table.bundles.iter().map(|b| b.gpu_indices()).collect();
    assert_eq!(indices, [[0], [1], [2], [3]]);
    let report = waiting.report().get_timeout(LONG).unwrap().unwrap();
    assert_eq!(report.cuda_visible_devices.as_deref(), Some("2"));
    assert_eq!(second.state().unwrap().status, PlacementGroupStatus::Created);

    // Removing a group that is still pending fails whoever waits for it.
    let third = rtrun::placement_group(
        PlacementGroupOptions::uniform(8, &[("GPU", 1.0)]).unwrap().name("third"),
    )
    .unwrap();
    let ready = third.ready();
    third.remove().unwrap();
    let err = ready.wait(Some(LONG)).unwrap_err();
    assert!(err.to_string().contains("`third` was removed before it was created"), "{err}");
    assert!(matches!(&err, Error::GroupRemoved { name, .. } if name == "third"), "{err:?}");
    second.remove().unwrap();
    assert!(wait_until(LONG, all_free));
}

#[test]
fn cuda_visible_devices_opt_out_and_captured_children() {
    init();
    let pg = rtrun::placement_group(
        PlacementGroupOptions::uniform(2, &[("GPU", 1.0), ("custom", 1.0)]).unwrap(),
    )
    .unwrap();
    assert!(pg.wait(LONG).unwrap());
    let kept = Probe::remote_with(
        ActorOptions::default()
            .num_gpus(0.5)
            .bundle(&pg, 1)
            .env(rtrun::NOSET_CUDA_VISIBLE_DEVICES_ENV, "1"),
    )
    .unwrap();
    let report = kept.report().get_timeout(LONG).unwrap().unwrap();
    assert_eq!(report.cuda_visible_devices, std::env::var("CUDA_VISIBLE_DEVICES").ok());
    assert_eq!(report.gpus.len(), 1, "the context still reports the assignment");
    assert_eq!(report.gpus[0].gpu.index, 1);

    let parent = Probe::remote_with(
        ActorOptions::default().num_gpus(0.5).placement(pg.bundle(0).capture_child_tasks()),
    )
    .unwrap();
    let child = parent.child_report().get_timeout(LONG).unwrap().unwrap();
    assert_eq!(child.bundle.map(|b| b.group), Some(pg.id()), "the child joined the group");
    assert!(child.gpus.is_empty());

    // Tasks run inside a bundle too, drawing on its reservation: the bundle's `custom: 1`
    // serves a task needing it although the node's own `custom` is not touched.
    let in_bundle = TaskOptions { num_cpus: 0.0, ..Default::default() }.placement(pg.bundle(1));
    let mut needs_custom = in_bundle.clone();
    needs_custom.resources.insert("custom".into(), 1.0);
    assert_eq!(add_one::remote_with(needs_custom.clone(), 41u64).get_timeout(LONG).unwrap(), 42);
    let mut too_much = needs_custom;
    too_much.resources.insert("custom".into(), 2.0);
    let err = add_one::remote_with(too_much, 1u64).get_timeout(LONG).unwrap_err();
    assert!(
        matches!(&err, Error::Infeasible(m) if m.contains("needs custom: 2, bundle 1 of") && m.contains("has 1")),
        "{err}"
    );
    pg.remove().unwrap();
    assert!(wait_until(LONG, all_free));
}

#[test]
fn deploy_is_all_or_nothing_and_gives_up_on_a_busy_cluster() {
    init();
    // The second group can never fit: the first one, already created, is removed again.
    let text = "placement_groups:\n  small:\n    bundles: [{resources: {GPU: 1}}]\n  \
                huge:\n    bundles: [{count: 9, resources: {GPU: 1}}]\nroles:\n  actor:\n    \
                replicas: 1\n    placement_group: small\n  ref:\n    replicas: 9\n    \
                placement_group: huge\n";
    let spec = rtrun::colocation::parse_spec(text, "two.yaml").unwrap();
    let err = deploy_spec(&spec, &DeployOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), "infeasible: placement group `huge` needs GPU: 9, cluster has 8");
    assert!(rtrun::list_placement_groups().unwrap().is_empty());
    assert!(all_free());

    // A spec that fits the cluster but not now times out and keeps nothing.
    let busy = rtrun::placement_group(PlacementGroupOptions::uniform(4, &[("GPU", 1.0)]).unwrap())
        .unwrap();
    assert!(busy.wait(LONG).unwrap());
    let spec = load_spec(example("hybrid-1x8.yaml")).unwrap();
    let options =
        DeployOptions { ready_timeout: Duration::from_millis(200), name_prefix: "a-".into() };
    let err = deploy_spec(&spec, &options).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
    assert_eq!(rtrun::list_placement_groups().unwrap().len(), 1, "only `busy` is left");
    busy.remove().unwrap();

    // With room, it deploys under the prefix, and the bundle table is grouped by GPU index.
    let deployment = deploy_spec(&spec, &options).unwrap();
    let group = deployment.group("hybrid").unwrap();
    assert_eq!(group.name(), "a-hybrid");
    let table = deployment.bundle_table("hybrid").unwrap();
    let indices: Vec<Vec<u32>> = table.bundles.iter().map(|b| b.gpu_indices()).collect();
    assert_eq!(indices, (0..GPUS as u32).map(|i| vec![i]).collect::<Vec<_>>());
    let actor = deployment.role("actor").unwrap();
    assert_eq!(actor.replicas.len(), 8);
    assert_eq!(actor.replicas[5].bundle_index, Some(5));
    assert_eq!(actor.replicas[5].world_size, 8);
    let options = actor.replicas[5].actor_options();
    assert_eq!((options.num_gpus, options.num_cpus), (Some(0.2), Some(1.0)));
    let base = ActorOptions::default().max_concurrency(2);
    let options = actor.options_for(5, base).unwrap();
    assert_eq!(options.max_concurrency, Some(2));
    assert_eq!(options.placement, Some(group.bundle(5)));
    let err = actor.options_for(8, ActorOptions::default()).unwrap_err();
    assert!(err.to_string().contains("has 8 replicas, found rank 8"), "{err}");
    let err = deployment.role("critc").unwrap_err();
    assert!(err.to_string().contains("found `critc`"), "{err}");
    deployment.remove().unwrap();
    deployment.remove().unwrap();
    assert!(all_free());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]

    /// Random creations and removals of groups: created groups never hold more than the node
    /// has, what the node reports as available is exactly what created groups leave, pending
    /// groups are created once room frees up, and removing everything frees everything.
    #[test]
    fn random_group_churn_never_oversubscribes(
        ops in proptest::collection::vec((0usize..4, 1usize..5, 0usize..4, proptest::bool::ANY), 1..24)
    ) {
        init();
        let mut live: Vec<rtrun::PlacementGroup> = Vec::new();
        for (gpus, count, strategy, remove) in ops {
            if remove && !live.is_empty() {
                live.remove(gpus % live.len()).remove().unwrap();
            } else {
                let strategy = [Strategy::Pack, Strategy::Spread, Strategy::StrictPack,
                                Strategy::StrictSpread][strategy];
                let bundle = [("GPU", gpus as f64), ("CPU", 1.0), ("custom", 0.5)];
                let options = PlacementGroupOptions::uniform(count, &bundle).unwrap().strategy(strategy);
                match rtrun::placement_group(options) {
                    Ok(group) => live.push(group),
                    Err(Error::Infeasible(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            let mut held = [0.0f64; 3];
            for state in rtrun::list_placement_groups().unwrap() {
                if state.status == PlacementGroupStatus::Created {
                    let table = state.table.expect("created groups have a table");
                    proptest::prop_assert_eq!(table.bundles.len(), state.bundles.len());
                    for bundle in &state.bundles {
                        held[0] += bundle.get("GPU").as_f64();
                        held[1] += bundle.get("CPU").as_f64();
                        held[2] += bundle.get("custom").as_f64();
                    }
                }
            }
            proptest::prop_assert!(held[0] <= GPUS as f64);
            proptest::prop_assert_eq!(available("GPU"), GPUS as f64 - held[0]);
            proptest::prop_assert_eq!(available("CPU"), CPUS - held[1]);
            proptest::prop_assert_eq!(available("custom"), 100.0 - held[2]);
        }
        // Removing the groups one by one lets every pending one be created on the way.
        while let Some(group) = live.pop() {
            let ready = group.ready();
            if live.is_empty() {
                proptest::prop_assert!(ready.wait(Some(LONG)).is_ok(), "the last group fits alone");
            }
            group.remove().unwrap();
        }
        proptest::prop_assert!(all_free());
        proptest::prop_assert!(rtrun::list_placement_groups().unwrap().is_empty());
    }
}

#[test]
fn gpus_outside_groups_restarts_and_groups_made_by_workers() {
    init();
    // Outside any group, fractions pack onto the lowest GPU and whole GPUs take the next free.
    let halves: Vec<_> = (0..2)
        .map(|_| Probe::remote_with(ActorOptions::default().num_gpus(0.5)).unwrap())
        .collect();
    let whole = Probe::remote_with(ActorOptions::default().num_gpus(1.0).max_restarts(1)).unwrap();
    for half in &halves {
        let report = half.report().get_timeout(LONG).unwrap().unwrap();
        assert_eq!(report.cuda_visible_devices.as_deref(), Some("0"));
        assert_eq!(report.bundle, None);
    }
    let before = whole.report().get_timeout(LONG).unwrap().unwrap();
    assert_eq!(before.cuda_visible_devices.as_deref(), Some("1"));
    // A restarted actor keeps its GPU.
    whole.kill_and_restart().unwrap();
    assert!(wait_until(LONG, || {
        whole.report().get_timeout(LONG).ok().and_then(Result::ok).is_some_and(|r| {
            r.cuda_visible_devices.as_deref() == Some("1") && r.gpus == before.gpus
        })
    }));
    assert_eq!(available("GPU"), (GPUS - 2) as f64);
    // A worker creates a group on the 6 GPUs left, and removes it.
    let tables = halves[0].group_from_worker(6).get_timeout(LONG).unwrap().unwrap();
    assert_eq!(tables, (2..GPUS as u32).map(|i| vec![i]).collect::<Vec<_>>());
    assert!(rtrun::list_placement_groups().unwrap().is_empty());
    for probe in halves.iter().chain([&whole]) {
        probe.kill().unwrap();
    }
    assert!(wait_until(LONG, all_free));
}
