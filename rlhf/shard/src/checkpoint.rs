//! Sharded checkpoints (written in the next step).
