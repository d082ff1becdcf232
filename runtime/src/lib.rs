//! Placeholder until the runtime lands in this session.
