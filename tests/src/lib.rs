//! Shared helpers for multi-process tests.
