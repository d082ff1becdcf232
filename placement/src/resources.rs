//! Fixed-point resource quantities and named resource sets.
//!
//! Fractional amounts (0.2 GPU for each actor of a hybrid engine) must add up exactly, so a
//! quantity is an integer count of 1/10,000ths of a unit, never a float.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The CPU resource name.
pub const CPU: &str = "CPU";
/// The GPU resource name.
pub const GPU: &str = "GPU";
/// The memory resource name (bytes).
pub const MEMORY: &str = "memory";

/// An amount of a resource, as an integer number of 1/[`Quantity::SCALE`] units.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Quantity(u64);

/// A resource amount that cannot be represented as a [`Quantity`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantityError {
    /// The amount was negative, NaN or infinite.
    #[error("resource amount must be a finite non-negative number, found {0}")]
    NotFiniteNonNegative(f64),
    /// The amount has more precision than 1/10,000 of a unit.
    #[error("resource amount {0} is finer than the 0.0001 resolution")]
    TooFine(f64),
    /// The amount is too large to be represented.
    #[error("resource amount {0} is too large")]
    TooLarge(f64),
}

impl Quantity {
    /// Units are counted in 1/SCALE steps.
    pub const SCALE: u64 = 10_000;
    /// Zero of anything.
    pub const ZERO: Quantity = Quantity(0);

    /// A whole number of units.
    pub const fn whole(units: u64) -> Quantity {
        Quantity(units * Self::SCALE)
    }

    /// A whole number of units, saturating at the largest quantity instead of overflowing (for
    /// counts that come from users, such as `--num-cpus`).
    pub const fn saturating_whole(units: u64) -> Quantity {
        Quantity(units.saturating_mul(Self::SCALE))
    }

    /// The raw count of 1/SCALE steps.
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// A quantity from raw 1/SCALE steps.
    pub const fn from_raw(raw: u64) -> Quantity {
        Quantity(raw)
    }

    /// Converts a user-facing float (`0.2`, `1`, `0.001`) to a quantity, rejecting amounts that
    /// are negative, not finite, or finer than the resolution.
    pub fn from_f64(amount: f64) -> Result<Quantity, QuantityError> {
        if !amount.is_finite() || amount < 0.0 {
            return Err(QuantityError::NotFiniteNonNegative(amount));
        }
        let scaled = amount * Self::SCALE as f64;
        if scaled > (u64::MAX / 2) as f64 {
            return Err(QuantityError::TooLarge(amount));
        }
        let rounded = scaled.round();
        if (scaled - rounded).abs() > 1e-6 * scaled.max(1.0) {
            return Err(QuantityError::TooFine(amount));
        }
        Ok(Quantity(rounded as u64))
    }

    /// The amount as a float, for display and for users.
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / Self::SCALE as f64
    }

    /// Whether this is a whole number of units.
    pub const fn is_whole(self) -> bool {
        self.0.is_multiple_of(Self::SCALE)
    }

    /// Addition that reports overflow instead of wrapping.
    pub fn checked_add(self, other: Quantity) -> Option<Quantity> {
        self.0.checked_add(other.0).map(Quantity)
    }

    /// Subtraction that reports underflow instead of wrapping.
    pub fn checked_sub(self, other: Quantity) -> Option<Quantity> {
        self.0.checked_sub(other.0).map(Quantity)
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whole = self.0 / Self::SCALE;
        let frac = self.0 % Self::SCALE;
        if frac == 0 {
            write!(f, "{whole}")
        } else {
            let digits = format!("{frac:04}");
            write!(f, "{whole}.{}", digits.trim_end_matches('0'))
        }
    }
}

/// A set of named resource amounts (`{CPU: 1, GPU: 0.2, custom: 0.001}`). Zero entries are
/// never stored, so two sets with the same non-zero amounts compare equal.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceSet {
    amounts: BTreeMap<String, Quantity>,
}

impl ResourceSet {
    /// The empty set.
    pub fn new() -> ResourceSet {
        ResourceSet::default()
    }

    /// Builds a set from `(name, amount)` pairs given as floats.
    pub fn from_floats<'a>(
        pairs: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<ResourceSet, QuantityError> {
        let mut set = ResourceSet::new();
        for (name, amount) in pairs {
            set.set(name, Quantity::from_f64(amount)?);
        }
        Ok(set)
    }

    /// Sets `name` to `amount` (removing it when zero).
    pub fn set(&mut self, name: &str, amount: Quantity) {
        if amount == Quantity::ZERO {
            self.amounts.remove(name);
        } else {
            self.amounts.insert(name.to_owned(), amount);
        }
    }

    /// The amount of `name` (zero when absent).
    pub fn get(&self, name: &str) -> Quantity {
        self.amounts.get(name).copied().unwrap_or(Quantity::ZERO)
    }

    /// Whether the set holds nothing.
    pub fn is_empty(&self) -> bool {
        self.amounts.is_empty()
    }

    /// The non-zero entries, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Quantity)> {
        self.amounts.iter().map(|(name, q)| (name.as_str(), *q))
    }

    /// Whether every amount in `demand` is available here.
    pub fn contains(&self, demand: &ResourceSet) -> bool {
        self.first_shortfall(demand).is_none()
    }

    /// The first resource (in name order) that `demand` needs more of than this set holds, as
    /// `(name, needed, available)`.
    pub fn first_shortfall(&self, demand: &ResourceSet) -> Option<(String, Quantity, Quantity)> {
        demand
            .iter()
            .find(|(name, needed)| self.get(name) < *needed)
            .map(|(name, needed)| (name.to_owned(), needed, self.get(name)))
    }

    /// Adds every amount of `other` to this set.
    pub fn add(&mut self, other: &ResourceSet) {
        for (name, amount) in other.iter() {
            let sum = self.get(name).checked_add(amount).unwrap_or(Quantity(u64::MAX));
            self.set(name, sum);
        }
    }

    /// Subtracts `other`, failing (and changing nothing) when any amount would go negative.
    pub fn try_subtract(
        &mut self,
        other: &ResourceSet,
    ) -> Result<(), (String, Quantity, Quantity)> {
        if let Some(shortfall) = self.first_shortfall(other) {
            return Err(shortfall);
        }
        for (name, amount) in other.iter() {
            // The shortfall check above guarantees the subtraction cannot underflow.
            let left = self.get(name).checked_sub(amount).unwrap_or(Quantity::ZERO);
            self.set(name, left);
        }
        Ok(())
    }
}

impl fmt::Display for ResourceSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (name, amount)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}: {amount}")?;
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fifth_gpus_add_up_to_one() {
        let fifth = Quantity::from_f64(0.2).unwrap();
        let mut total = Quantity::ZERO;
        for _ in 0..5 {
            total = total.checked_add(fifth).unwrap();
        }
        assert_eq!(total, Quantity::whole(1));
        assert_eq!(fifth.to_string(), "0.2");
    }

    #[test]
    fn rejects_bad_amounts() {
        assert!(matches!(Quantity::from_f64(-1.0), Err(QuantityError::NotFiniteNonNegative(_))));
        assert!(matches!(
            Quantity::from_f64(f64::NAN),
            Err(QuantityError::NotFiniteNonNegative(_))
        ));
        assert!(matches!(Quantity::from_f64(0.00001), Err(QuantityError::TooFine(_))));
    }

    #[test]
    fn subtract_is_all_or_nothing() {
        let mut have = ResourceSet::from_floats([(CPU, 2.0), (GPU, 1.0)]).unwrap();
        let want = ResourceSet::from_floats([(CPU, 1.0), (GPU, 1.5)]).unwrap();
        let err = have.try_subtract(&want).unwrap_err();
        assert_eq!(err.0, GPU);
        assert_eq!(have.get(CPU), Quantity::whole(2));
    }

    proptest! {
        #[test]
        fn add_then_subtract_restores(a in 0u64..1_000_000, b in 0u64..1_000_000) {
            let mut set = ResourceSet::new();
            set.set(GPU, Quantity::from_raw(a));
            let delta = {
                let mut d = ResourceSet::new();
                d.set(GPU, Quantity::from_raw(b));
                d
            };
            let before = set.clone();
            set.add(&delta);
            set.try_subtract(&delta).unwrap();
            prop_assert_eq!(set, before);
        }
    }
}
