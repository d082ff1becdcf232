//! Unit tests of spec parsing and checking: every error names `file:line:column` and says what
//! was expected and what was found.

use super::*;

const BASE: &str = "\
version: 1
placement_groups:
  shared:
    strategy: PACK
    bundles:
      - count: 2
        resources: {GPU: 1, CPU: 2}
roles:
  actor:
    replicas: 4
    resources: {GPU: 0.5, CPU: 1}
    placement_group: shared
";

fn error(text: &str) -> String {
    parse_spec(text, "spec.yaml").unwrap_err().to_string()
}

#[test]
fn unknown_keys_and_variants_point_at_the_key() {
    assert_eq!(
        error(&BASE.replace("    strategy: PACK\n", "    strategy: PACK\n    colour: blue\n")),
        "spec.yaml:5:5: expected one of strategy, bundles, found unknown field `colour`"
    );
    assert_eq!(
        error(&BASE.replace("strategy: PACK", "strategy: TIGHT")),
        "spec.yaml:4:15: expected one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, \
         found unknown variant `TIGHT`"
    );
}

#[test]
fn type_errors_quote_what_was_found() {
    assert_eq!(
        error(&BASE.replace("replicas: 4", "replicas: many")),
        "spec.yaml:10:15: expected a non-negative whole number, found `many`"
    );
    assert_eq!(
        error(""),
        "spec.yaml:1:1: expected a spec with a `roles` mapping, found the end of the file"
    );
    assert_eq!(error("roles: {}\n"), "spec.yaml:1:8: expected at least one role, found none");
    let err = parse_spec(&BASE.replace("{GPU: 1, CPU: 2}", "{GPU: 1, CPU: 2"), "f").unwrap_err();
    assert!(matches!(err, SpecError::Syntax { line: 7, .. }), "{err}");
}

#[test]
fn references_and_indices_are_checked() {
    assert_eq!(
        error(&BASE.replace("placement_group: shared", "placement_group: sharde")),
        "spec.yaml:12:22: expected one of the placement groups [`shared`], found `sharde`"
    );
    assert_eq!(
        error(&format!("{BASE}    bundles: [0, 2]\n")),
        "spec.yaml:13:18: expected bundle indices below 2 (group `shared` has 2), found 2"
    );
    assert_eq!(
        error(&format!("{BASE}    bundles: [1, 1]\n")),
        "spec.yaml:13:18: expected distinct bundle indices, found 1 twice"
    );
    assert_eq!(
        error(&format!("{BASE}    bundles: 0..3\n")),
        "spec.yaml:13:14: expected bundle indices below 2 (group `shared` has 2), found 0..3"
    );
    assert_eq!(
        error(&BASE.replace("    placement_group: shared\n", "    bundles: [0]\n")),
        "spec.yaml:12:14: expected `placement_group` next to `bundles`, found none"
    );
}

#[test]
fn replicas_must_match_bundles_and_bundles_must_not_be_over_committed() {
    assert_eq!(
        error(&BASE.replace("replicas: 4", "replicas: 3")),
        "spec.yaml:10:15: expected replicas to be a multiple of the 2 bundles used, found 3"
    );
    assert_eq!(
        error(&BASE.replace("GPU: 0.5, CPU: 1", "GPU: 0.6, CPU: 1")),
        "spec.yaml:11:16: expected the actors in bundle 0 of group `shared` to fit its \
         {CPU: 2, GPU: 1}, found GPU: 0.4 left, 0.6 needed (role `actor` rank 1 needs \
         {CPU: 1, GPU: 0.6})"
    );
    // A second role pushing a bundle over its share is caught at that role.
    let two = format!(
        "{BASE}  ref:\n    replicas: 2\n    resources: {{CPU: 1}}\n    placement_group: shared\n"
    );
    assert_eq!(
        error(&two),
        "spec.yaml:15:16: expected the actors in bundle 0 of group `shared` to fit its \
         {CPU: 2, GPU: 1}, found CPU: 0 left, 1 needed (role `ref` rank 0 needs {CPU: 1})"
    );
}

#[test]
fn amounts_versions_and_counts_are_checked() {
    let amount =
        |gpu: &str| error(&BASE.replace("GPU: 0.5, CPU: 1", &format!("GPU: {gpu}, CPU: 1")));
    assert_eq!(
        amount("-1"),
        "spec.yaml:11:22: expected a finite non-negative amount of `GPU`, found -1"
    );
    assert_eq!(
        amount("0.00001"),
        "spec.yaml:11:22: expected an amount in steps of 0.0001 of `GPU`, found 0.00001"
    );
    assert_eq!(
        amount("1.5"),
        "spec.yaml:11:22: expected a GPU fraction up to 1 or a whole number, found 1.5"
    );
    assert_eq!(
        error(&BASE.replace("version: 1", "version: 2")),
        "spec.yaml:1:10: expected version 1, found 2"
    );
    assert_eq!(
        error(&BASE.replace("count: 2", "count: 100000000000")),
        "spec.yaml:6:16: expected a bundle count from 1 to 4096 (at most 4096 bundles per \
         group), found 100000000000"
    );
    let limits = SpecLimits { max_bytes: 10, ..SpecLimits::default() };
    let err = parse_spec_with(BASE, "spec.yaml", &limits).unwrap_err();
    assert!(err.to_string().starts_with("spec.yaml:1:1: expected a spec of at most 10 bytes"));
}

#[test]
fn plan_maps_ranks_to_bundles_in_order() {
    let spec = parse_spec(BASE, "spec.yaml").unwrap();
    let plan = spec.plan();
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(plan.groups[0].bundles.len(), 2);
    let bundles: Vec<(usize, usize)> =
        plan.actors.iter().map(|a| (a.rank, a.bundle.as_ref().unwrap().index)).collect();
    assert_eq!(bundles, [(0, 0), (1, 0), (2, 1), (3, 1)]);
    assert!(plan.actors.iter().all(|a| a.world_size == 4 && a.role == "actor"));
}

#[test]
fn a_role_without_a_group_is_placed_anywhere() {
    let text = "roles:\n  reward_fn:\n    replicas: 2\n    resources: {CPU: 1}\n";
    let plan = parse_spec(text, "spec.yaml").unwrap().plan();
    assert!(plan.groups.is_empty());
    assert!(plan.actors.iter().all(|a| a.bundle.is_none()));
    let mut cluster = crate::ClusterState::with_fake_nodes(1, 4, 0);
    let scheduled = plan.schedule(&mut cluster).unwrap();
    assert_eq!(scheduled.actors.len(), 2);
}

#[test]
fn a_pending_group_rolls_the_whole_plan_back() {
    let mut cluster = crate::ClusterState::with_fake_nodes(1, 8, 2);
    let hog = crate::ResourceSet::from_floats([(crate::GPU, 2.0)]).unwrap();
    cluster.place(&hog, &crate::PlacementTarget::Anywhere).unwrap();
    let before = cluster.clone();
    let plan = parse_spec(BASE, "spec.yaml").unwrap().plan();
    let err = plan.schedule(&mut cluster).unwrap_err();
    assert_eq!(err.to_string(), "placement group `shared` is pending: expected a placed group");
    assert_eq!(cluster.nodes(), before.nodes());
    assert_eq!(cluster.groups().count(), 0);
}
