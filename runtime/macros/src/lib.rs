//! Procedural macros.
