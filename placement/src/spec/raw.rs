//! The spec file's shape as serde reads it, with source locations kept on every value that a
//! later check may need to point at. Nothing here is validated beyond YAML types and key names.

use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::cluster::Strategy;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSpec {
    #[serde(default)]
    pub version: Option<Spanned<u64>>,
    #[serde(default)]
    pub placement_groups: Option<OrderedMap<RawGroup>>,
    pub roles: Spanned<OrderedMap<RawRole>>,
}

/// One entry of `placement_groups`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawGroup {
    #[serde(default)]
    pub strategy: Option<Strategy>,
    pub bundles: Spanned<Vec<Spanned<RawBundle>>>,
}

/// One entry of a group's `bundles` list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBundle {
    #[serde(default)]
    pub count: Option<Spanned<u64>>,
    pub resources: Spanned<RawResources>,
}

/// One entry of `roles`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRole {
    pub replicas: Spanned<u64>,
    #[serde(default)]
    pub resources: Option<Spanned<RawResources>>,
    #[serde(default)]
    pub placement_group: Option<Spanned<String>>,
    #[serde(default)]
    pub bundles: Option<Spanned<RawSelection>>,
}

/// A resource map (`{GPU: 0.2, CPU: 1}`) in file order, with locations.
#[derive(Debug, Default)]
pub(crate) struct RawResources(pub Vec<(Spanned<String>, Spanned<f64>)>);

impl<'de> Deserialize<'de> for RawResources {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let entries = OrderedMap::<Spanned<f64>>::deserialize(deserializer)?;
        Ok(RawResources(entries.0))
    }
}

/// Which bundles of the group a role uses.
#[derive(Debug)]
pub(crate) enum RawSelection {
    /// `all` (the default when `bundles` is absent).
    All,
    /// `start..end`, end exclusive.
    Range { start: u64, end: u64 },
    /// `[0, 1, 2]`.
    List(Vec<Spanned<u64>>),
}

impl<'de> Deserialize<'de> for RawSelection {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(SelectionVisitor)
    }
}

struct SelectionVisitor;

impl<'de> Visitor<'de> for SelectionVisitor {
    type Value = RawSelection;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("`all`, a range `start..end` or a list of bundle indices")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<RawSelection, E> {
        if text == "all" {
            return Ok(RawSelection::All);
        }
        let parsed = text.split_once("..").and_then(|(start, end)| {
            Some((start.trim().parse::<u64>().ok()?, end.trim().parse::<u64>().ok()?))
        });
        match parsed {
            Some((start, end)) => Ok(RawSelection::Range { start, end }),
            None => Err(E::invalid_value(de::Unexpected::Str(text), &self)),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawSelection, A::Error> {
        let mut indices = Vec::new();
        while let Some(index) = seq.next_element::<Spanned<u64>>()? {
            indices.push(index);
        }
        Ok(RawSelection::List(indices))
    }
}

/// A YAML mapping kept in file order with each key's location, so groups are created and
/// roles ranked in the order the file lists them.
#[derive(Debug)]
pub(crate) struct OrderedMap<T>(pub Vec<(Spanned<String>, T)>);

impl<T> Default for OrderedMap<T> {
    fn default() -> Self {
        OrderedMap(Vec::new())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OrderedMap<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(OrderedMapVisitor(PhantomData))
    }
}

struct OrderedMapVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for OrderedMapVisitor<T> {
    type Value = OrderedMap<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping of names to entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedMap<T>, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            let value = map.next_value::<T>()?;
            entries.push((key, value));
        }
        Ok(OrderedMap(entries))
    }
}
