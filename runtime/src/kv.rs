//! The head's key-value store (Ray's internal KV): small values that processes of a session or
//! cluster publish for each other, such as the address a collective group's rank 0 listens on.
//! Keys live until deleted or until the head stops; values are bytes.

use crate::error::Result;
use crate::protocol::{Ask, ByteBuf, ask};
use crate::runtime::To;

fn value(request: impl Ask<Reply = Option<ByteBuf>>) -> Result<Option<Vec<u8>>> {
    let value = crate::runtime::current()?.ask(To::Head, request)?;
    Ok(value.map(ByteBuf::into_vec))
}

/// Sets `key` to `value`, replacing any earlier value.
pub fn put(key: &str, value: &[u8]) -> Result<()> {
    crate::runtime::current()?
        .ask(To::Head, ask::KvPut { key: key.to_owned(), value: value.to_vec() })
}

/// The value of `key`, if it is set.
pub fn get(key: &str) -> Result<Option<Vec<u8>>> {
    value(ask::KvGet { key: key.to_owned() })
}

/// Removes `key`; returns the value it had.
pub fn delete(key: &str) -> Result<Option<Vec<u8>>> {
    value(ask::KvDelete { key: key.to_owned() })
}
