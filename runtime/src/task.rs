//! Remote functions (tasks): options, the spec the control plane schedules, and submission.

pub use rtrun_proto::task::{TaskOptions, TaskSpec};

use crate::error::Result;
use crate::object::ObjectRef;
use crate::protocol::Arg;
use crate::runtime;

/// Submits a registered function (used by generated code).
#[doc(hidden)]
pub fn submit_task<R>(
    function: &str,
    options: TaskOptions,
    args: Vec<Result<Arg>>,
) -> ObjectRef<R> {
    let runtime = match runtime::current() {
        Ok(runtime) => runtime,
        Err(e) => return crate::object::failed_ref(e),
    };
    let mut options = options;
    if options.placement.is_none() {
        options.placement = runtime.captured_placement();
    }
    match args.into_iter().collect::<Result<Vec<_>>>() {
        Ok(args) => runtime.submit_task(function.to_owned(), args, options),
        Err(e) => crate::object::failed_ref(e),
    }
}
