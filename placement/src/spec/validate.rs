//! Checks a raw spec and turns it into a [`PlacementSpec`]: versions, amounts, group
//! references, bundle indices, replicas against bundles, and that no bundle is over-committed
//! by the actors assigned to it (fractional GPU shares are packed exactly as the cluster would).

use serde_saphyr::Spanned;

use crate::gpu::{GpuInstance, GpuPool, GpuShare};
use crate::resources::{GPU, Quantity, QuantityError, ResourceSet};
use crate::spec::raw::{RawResources, RawSelection, RawSpec};
use crate::spec::{GroupSpec, PlacementSpec, RolePlacement, RoleSpec, SpecError, SpecLimits};

/// The only spec format version so far.
const VERSION: u64 = 1;

struct Checker<'a> {
    file: &'a str,
}

impl Checker<'_> {
    fn at<T>(&self, spanned: &Spanned<T>, message: String) -> SpecError {
        SpecError::Invalid {
            file: self.file.to_owned(),
            line: spanned.referenced.line(),
            column: spanned.referenced.column(),
            message,
        }
    }

    fn resources(&self, raw: &Spanned<RawResources>) -> Result<ResourceSet, SpecError> {
        let mut set = ResourceSet::new();
        for (name, amount) in &raw.value.0 {
            if name.value.is_empty() {
                return Err(self.at(name, "expected a resource name, found ``".to_owned()));
            }
            let quantity = Quantity::from_f64(amount.value).map_err(|err| {
                let expected = match err {
                    QuantityError::NotFiniteNonNegative(_) => "a finite non-negative amount",
                    QuantityError::TooFine(_) => "an amount in steps of 0.0001",
                    QuantityError::TooLarge(_) => "a smaller amount",
                };
                self.at(
                    amount,
                    format!("expected {expected} of `{}`, found {}", name.value, amount.value),
                )
            })?;
            if name.value == GPU && GpuPool::check_demand(quantity).is_err() {
                return Err(self.at(
                    amount,
                    format!("expected a GPU fraction up to 1 or a whole number, found {quantity}"),
                ));
            }
            set.set(&name.value, quantity);
        }
        Ok(set)
    }
}

pub(crate) fn validate(
    raw: RawSpec,
    file: &str,
    limits: &SpecLimits,
) -> Result<PlacementSpec, SpecError> {
    let check = Checker { file };
    if let Some(version) = &raw.version
        && version.value != VERSION
    {
        return Err(
            check.at(version, format!("expected version {VERSION}, found {}", version.value))
        );
    }
    let mut groups: Vec<GroupSpec> = Vec::new();
    for (name, group) in raw.placement_groups.unwrap_or_default().0 {
        if name.value.is_empty() {
            return Err(check.at(&name, "expected a group name, found ``".to_owned()));
        }
        let mut bundles = Vec::new();
        for bundle in &group.bundles.value {
            let resources = check.resources(&bundle.value.resources)?;
            if resources.is_empty() {
                return Err(check.at(
                    &bundle.value.resources,
                    "expected at least one non-zero resource in a bundle, found none".to_owned(),
                ));
            }
            if resources.get(GPU)
                > Quantity::from_raw(limits.max_gpus_per_bundle.saturating_mul(Quantity::SCALE))
            {
                return Err(check.at(
                    &bundle.value.resources,
                    format!(
                        "expected at most GPU: {} in a bundle, found GPU: {}",
                        limits.max_gpus_per_bundle,
                        resources.get(GPU)
                    ),
                ));
            }
            let count = bundle.value.count.as_ref().map_or(1, |count| count.value);
            let room = limits.max_bundles_per_group.saturating_sub(bundles.len() as u64);
            if let Some(at) = &bundle.value.count
                && (count == 0 || count > room)
            {
                return Err(check.at(
                    at,
                    format!(
                        "expected a bundle count from 1 to {room} (at most {} bundles per group), \
                         found {count}",
                        limits.max_bundles_per_group
                    ),
                ));
            }
            for _ in 0..count {
                bundles.push(resources.clone());
            }
        }
        if bundles.is_empty() {
            return Err(check.at(
                &group.bundles,
                format!("expected at least one bundle in group `{}`, found none", name.value),
            ));
        }
        if bundles.len() as u64 > limits.max_bundles_per_group {
            return Err(check.at(
                &group.bundles,
                format!(
                    "expected at most {} bundles per group, found {}",
                    limits.max_bundles_per_group,
                    bundles.len()
                ),
            ));
        }
        groups.push(GroupSpec {
            name: name.value,
            strategy: group.strategy.unwrap_or_default(),
            bundles,
        });
    }

    // Every bundle's free resources and GPUs, to catch over-committed bundles exactly.
    let mut free: Vec<Vec<(ResourceSet, GpuPool)>> =
        groups.iter().map(|group| group.bundles.iter().map(virtual_bundle).collect()).collect();
    let mut roles = Vec::new();
    if raw.roles.value.0.is_empty() {
        return Err(check.at(&raw.roles, "expected at least one role, found none".to_owned()));
    }
    for (name, role) in raw.roles.value.0 {
        if name.value.is_empty() {
            return Err(check.at(&name, "expected a role name, found ``".to_owned()));
        }
        let replicas = role.replicas.value;
        if replicas == 0 || replicas > limits.max_replicas {
            return Err(check.at(
                &role.replicas,
                format!("expected replicas from 1 to {}, found {replicas}", limits.max_replicas),
            ));
        }
        // Invariant: `max_replicas` is a u64 bound checked above; on a 32-bit target a larger
        // value is rejected here rather than truncated.
        let replicas = usize::try_from(replicas).map_err(|_| {
            check.at(&role.replicas, format!("expected fewer replicas, found {replicas}"))
        })?;
        let resources = match &role.resources {
            Some(raw) => check.resources(raw)?,
            None => ResourceSet::new(),
        };
        let placement = match &role.placement_group {
            None => {
                if let Some(bundles) = &role.bundles {
                    return Err(check.at(
                        bundles,
                        "expected `placement_group` next to `bundles`, found none".to_owned(),
                    ));
                }
                None
            }
            Some(group_name) => {
                let Some(group) = groups.iter().position(|g| g.name == group_name.value) else {
                    let known: Vec<String> =
                        groups.iter().map(|g| format!("`{}`", g.name)).collect();
                    return Err(check.at(
                        group_name,
                        format!(
                            "expected one of the placement groups [{}], found `{}`",
                            known.join(", "),
                            group_name.value
                        ),
                    ));
                };
                let count = groups[group].bundles.len();
                let bundles = select(&check, role.bundles.as_ref(), count, &group_name.value)?;
                if replicas % bundles.len() != 0 {
                    let at = role.bundles.as_ref().map_or_else(
                        || check.at(&role.replicas, String::new()),
                        |b| check.at(b, String::new()),
                    );
                    return Err(with_message(
                        at,
                        format!(
                            "expected replicas to be a multiple of the {} bundles used, found {}",
                            bundles.len(),
                            replicas
                        ),
                    ));
                }
                let placement = RolePlacement { group: group_name.value.clone(), bundles };
                for rank in 0..replicas {
                    let Some(index) = placement.bundle_of_rank(rank, replicas) else {
                        continue;
                    };
                    let (available, gpus) = &mut free[group][index];
                    let over = |found: String| {
                        let where_ = format!("bundle {index} of group `{}`", group_name.value);
                        let at = role.resources.as_ref().map_or_else(
                            || check.at(&role.replicas, String::new()),
                            |r| check.at(r, String::new()),
                        );
                        with_message(
                            at,
                            format!(
                                "expected the actors in {where_} to fit its {}, found {found} \
                                 (role `{}` rank {rank} needs {resources})",
                                groups[group].bundles[index], name.value
                            ),
                        )
                    };
                    if let Err((resource, needed, left)) = available.try_subtract(&resources) {
                        return Err(over(format!("{resource}: {left} left, {needed} needed")));
                    }
                    if gpus.take(resources.get(GPU)).is_none() {
                        return Err(over(format!(
                            "no single GPU with GPU: {} free",
                            resources.get(GPU)
                        )));
                    }
                }
                Some(placement)
            }
        };
        roles.push(RoleSpec { name: name.value, replicas, resources, placement });
    }
    Ok(PlacementSpec { groups, roles })
}

fn with_message(error: SpecError, text: String) -> SpecError {
    match error {
        SpecError::Invalid { file, line, column, .. }
        | SpecError::Syntax { file, line, column, .. } => {
            SpecError::Invalid { file, line, column, message: text }
        }
    }
}

/// Resolves a role's `bundles` against a group of `count` bundles.
fn select(
    check: &Checker<'_>,
    selection: Option<&Spanned<RawSelection>>,
    count: usize,
    group: &str,
) -> Result<Vec<usize>, SpecError> {
    let out_of_range = |found: String| {
        format!(
            "expected bundle indices below {count} (group `{group}` has {count}), found {found}"
        )
    };
    let Some(spanned) = selection else {
        return Ok((0..count).collect());
    };
    match &spanned.value {
        RawSelection::All => Ok((0..count).collect()),
        RawSelection::Range { start, end } => {
            if start >= end {
                return Err(check.at(
                    spanned,
                    format!("expected a non-empty range start..end, found {start}..{end}"),
                ));
            }
            if *end > count as u64 {
                return Err(check.at(spanned, out_of_range(format!("{start}..{end}"))));
            }
            // Both ends are below `count`, a usize, so they convert.
            Ok((*start as usize..*end as usize).collect())
        }
        RawSelection::List(indices) => {
            if indices.is_empty() {
                return Err(check.at(
                    spanned,
                    "expected at least one bundle index, found an empty list".to_owned(),
                ));
            }
            let mut chosen: Vec<usize> = Vec::with_capacity(indices.len());
            for index in indices {
                let value = usize::try_from(index.value).ok().filter(|&v| v < count);
                let Some(value) = value else {
                    return Err(check.at(index, out_of_range(index.value.to_string())));
                };
                if chosen.contains(&value) {
                    return Err(check.at(
                        index,
                        format!("expected distinct bundle indices, found {value} twice"),
                    ));
                }
                chosen.push(value);
            }
            Ok(chosen)
        }
    }
}

/// A bundle's resources and a GPU pool shaped like the GPUs it will reserve: whole GPUs for a
/// whole amount, one partial GPU for a fraction. Only shapes matter here, so the GPUs are
/// placeholders.
fn virtual_bundle(bundle: &ResourceSet) -> (ResourceSet, GpuPool) {
    let gpu = bundle.get(GPU);
    let shares: Vec<GpuShare> = if gpu.is_whole() {
        (0..gpu.raw() / Quantity::SCALE)
            .map(|i| GpuShare {
                gpu: GpuInstance::new(u32::try_from(i).unwrap_or(u32::MAX), ""),
                share: Quantity::whole(1),
            })
            .collect()
    } else {
        vec![GpuShare { gpu: GpuInstance::new(0, ""), share: gpu }]
    };
    (bundle.clone(), GpuPool::from_shares(&shares))
}
