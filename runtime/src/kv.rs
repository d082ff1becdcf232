//! The head's key-value store (Ray's internal KV): small values that processes of a session or
//! cluster publish for each other, such as the address a collective group's rank 0 listens on.
//! Keys live until deleted or until the head stops; values are bytes.

use crate::error::{Error, Result};
use crate::protocol::{Request, Response};

fn value(response: Response) -> Result<Option<Vec<u8>>> {
    match response {
        Response::KvValue(value) => Ok(value.map(serde_bytes::ByteBuf::into_vec)),
        other => Err(Error::Transport(format!("unexpected key-value response {other:?}"))),
    }
}

/// Sets `key` to `value`, replacing any earlier value.
pub fn put(key: &str, value: &[u8]) -> Result<()> {
    let runtime = crate::runtime::current()?;
    runtime.head_call(Request::KvPut { key: key.to_owned(), value: value.to_vec() }).map(|_| ())
}

/// The value of `key`, if it is set.
pub fn get(key: &str) -> Result<Option<Vec<u8>>> {
    let runtime = crate::runtime::current()?;
    value(runtime.head_call(Request::KvGet { key: key.to_owned() })?)
}

/// Removes `key`; returns the value it had.
pub fn delete(key: &str) -> Result<Option<Vec<u8>>> {
    let runtime = crate::runtime::current()?;
    value(runtime.head_call(Request::KvDelete { key: key.to_owned() })?)
}
