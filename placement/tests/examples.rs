//! Every shipped colocation example (`deploy/examples/placement/*.yaml`) parses, schedules on a
//! simulated cluster of 8 fake GPUs per node, and hands out GPU shares that add up exactly.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rtrun_placement::spec::parse_spec;
use rtrun_placement::{ClusterState, GPU, Quantity};

fn examples() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/placement");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("reading {}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect();
    files.sort();
    files
}

#[test]
fn all_eight_colocation_modes_are_shipped() {
    let names: Vec<String> = examples().into_iter().map(|(name, _)| name).collect();
    for mode in ["separate", "actor-ref-colocated", "critic-reward-colocated", "hybrid"] {
        for shape in ["1x8", "2x8"] {
            let expected = format!("{mode}-{shape}.yaml");
            assert!(names.contains(&expected), "missing {expected} in {names:?}");
        }
    }
}

#[test]
fn every_example_schedules_and_gpu_shares_add_up() {
    for (name, text) in examples() {
        let nodes = if name.contains("2x8") { 2 } else { 1 };
        let spec = parse_spec(&text, &name).unwrap_or_else(|err| panic!("{err}"));
        let plan = spec.plan();
        let mut cluster = ClusterState::with_fake_nodes(nodes, 64, 8);
        let empty = cluster.clone();
        let scheduled = plan.schedule(&mut cluster).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(scheduled.actors.len(), plan.actors.len());

        // Shares per physical GPU (node, UUID) never exceed one, and every GPU handed out to a
        // bundle is used exactly to its capacity by the examples (they are sized to fill).
        let mut per_gpu: BTreeMap<(String, String), Quantity> = BTreeMap::new();
        for actor in &scheduled.actors {
            let allocation = &actor.allocation;
            let visible = allocation.cuda_visible_devices();
            let indices: Vec<String> =
                allocation.gpu_indices().iter().map(|i| i.to_string()).collect();
            assert_eq!(visible, indices.join(","), "{name}");
            let mut total = Quantity::ZERO;
            for share in &allocation.gpus {
                assert!(share.gpu.uuid.starts_with("GPU-"), "{name}: {}", share.gpu.uuid);
                let key = (allocation.node.to_string(), share.gpu.uuid.clone());
                let sum = per_gpu.entry(key).or_default();
                *sum = sum.checked_add(share.share).unwrap();
                total = total.checked_add(share.share).unwrap();
            }
            assert_eq!(total, actor.placement.resources.get(GPU), "{name}: {:?}", actor.placement);
            // The actor sits on the node and GPUs of the bundle it asked for.
            let bundle = actor.placement.bundle.as_ref().unwrap();
            let (_, group) = scheduled.groups.iter().find(|(n, _)| *n == bundle.group).unwrap();
            let table = cluster.bundle_table(*group).unwrap();
            let placement = &table.bundles[bundle.index];
            assert_eq!(placement.node, allocation.node, "{name}");
            for share in &allocation.gpus {
                assert!(placement.gpu_uuids().contains(&share.gpu.uuid.as_str()), "{name}");
            }
        }
        assert_eq!(per_gpu.len(), nodes * 8, "{name}: every GPU is used");
        for (gpu, sum) in &per_gpu {
            assert_eq!(*sum, Quantity::whole(1), "{name}: GPU {gpu:?} shares");
        }
        for node in cluster.nodes() {
            assert_eq!(node.available().get(GPU), Quantity::ZERO, "{name}: {}", node.id());
        }

        // Removing every group frees everything.
        for (_, id) in &scheduled.groups {
            cluster.remove_group(*id).unwrap();
        }
        assert_eq!(cluster.nodes(), empty.nodes(), "{name}");
        assert_eq!(cluster.allocations().count(), 0, "{name}");
    }
}

#[test]
fn two_node_hybrid_ranks_are_grouped_by_node() {
    let (name, text) = examples().into_iter().find(|(name, _)| name == "hybrid-2x8.yaml").unwrap();
    let plan = parse_spec(&text, &name).unwrap().plan();
    let mut cluster = ClusterState::with_fake_nodes(2, 64, 8);
    let scheduled = plan.schedule(&mut cluster).unwrap();
    let actor: Vec<(String, String)> = scheduled
        .actors
        .iter()
        .filter(|a| a.placement.role == "actor")
        .map(|a| (a.allocation.node.to_string(), a.allocation.cuda_visible_devices()))
        .collect();
    let expected: Vec<(String, String)> =
        (0..16).map(|rank| (format!("node-{}", rank / 8), (rank % 8).to_string())).collect();
    assert_eq!(actor, expected);
}

#[test]
fn a_two_node_example_is_infeasible_on_one_node_with_a_clear_error() {
    let (name, text) = examples().into_iter().find(|(name, _)| name == "hybrid-2x8.yaml").unwrap();
    let plan = parse_spec(&text, &name).unwrap().plan();
    let mut cluster = ClusterState::with_fake_nodes(1, 128, 8);
    let before = cluster.clone();
    let err = plan.schedule(&mut cluster).unwrap_err();
    assert_eq!(err.to_string(), "placement group `hybrid` needs GPU: 16, cluster has 8");
    assert_eq!(cluster.nodes(), before.nodes());
}
