//! The error type of this crate: a tensor of the wrong shape, a configuration the maths cannot
//! use (a group estimator with one sample per prompt) or a failed collective becomes an
//! [`AlgoError`], never a panic.

/// Errors from the RL maths and the gradient all-reduce.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    /// A tensor has a shape other than the one expected.
    #[error("`{name}` should have shape {expected:?}, found {found:?}")]
    Shape {
        /// Which argument.
        name: &'static str,
        /// The expected shape.
        expected: Vec<i64>,
        /// The shape found.
        found: Vec<i64>,
    },
    /// A tensor has the wrong number of dimensions.
    #[error("`{name}` should have {expected} dimensions, found shape {found:?}")]
    Rank {
        /// Which argument.
        name: &'static str,
        /// The expected number of dimensions.
        expected: usize,
        /// The shape found.
        found: Vec<i64>,
    },
    /// A hyper-parameter or batch layout the maths cannot use.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A parameter's gradient cannot be all-reduced (unsupported dtype, shape changed, ...).
    #[error("gradient of parameter {index}: {message}")]
    Gradient {
        /// Position of the parameter in the list given.
        index: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The collective failed (a rank died, timed out or disagreed).
    #[error("collective failed: {0}")]
    Collective(#[from] rtrun::collective::CollectiveError),
    /// libtorch reported an error.
    #[error("libtorch error: {0}")]
    Torch(#[from] tch::TchError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = AlgoError> = std::result::Result<T, E>;
