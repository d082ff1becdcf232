//! The rendezvous that turns `world_size` independent ranks into a ring of TCP connections.
//!
//! Rank 0 (the master) listens on the group's master address and port. Every other rank binds
//! a ring listener on the local address it reaches the master from, connects to the master
//! (retrying until the timeout, since the master may start later) and sends a [`Hello`] with
//! that listener's address. Once all ranks have joined, the master sends everyone the table of
//! ring addresses and a nonce; each rank then connects to its right neighbour and accepts its
//! left neighbour, both sides checking the nonce so a stray connection cannot join the ring.
//! Any rank missing at the deadline fails the whole rendezvous with an error naming it.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire::{Hello, MAGIC, MasterReply, RingHello, read_frame, write_frame};
use super::{CollectiveConfig, CollectiveError};

/// How often a listener without a pending connection is polled while waiting for ranks.
const ACCEPT_POLL_INTERVAL: Duration = Duration::from_millis(2);

/// The first and the longest pause between attempts to reach a master that is not listening
/// yet.
const CONNECT_RETRY_FIRST: Duration = Duration::from_millis(5);
const CONNECT_RETRY_MAX: Duration = Duration::from_millis(100);

/// The two ring connections of a rank: it writes to `right` (rank + 1) and reads from `left`
/// (rank − 1).
#[derive(Debug)]
pub(crate) struct Links {
    pub(crate) right: TcpStream,
    pub(crate) left: TcpStream,
}

/// Joins the group and returns the ring connections (`world_size` must be at least 2).
pub(crate) fn connect_ring(config: &CollectiveConfig) -> Result<Links, CollectiveError> {
    let deadline = Instant::now() + config.timeout;
    let fail = |message: String| CollectiveError::Rendezvous {
        group: config.group_name.clone(),
        rank: config.rank,
        message,
    };
    let (ring_listener, nonce, ring_addrs) =
        if config.rank == 0 { master(config, deadline) } else { join(config, deadline) }
            .map_err(fail)?;
    let n = config.world_size;
    let right_rank = (config.rank + 1) % n;
    let left_rank = (config.rank + n - 1) % n;
    let right_addr = parse_addr(&ring_addrs[right_rank]).map_err(fail)?;
    let right = connect_before(right_addr, deadline)
        .map_err(|e| fail(format!("cannot connect to rank {right_rank} at {right_addr}: {e}")))?;
    let hello =
        RingHello { magic: MAGIC, group: config.group_name.clone(), nonce, from_rank: config.rank };
    write_frame(&right, &hello).map_err(|e| fail(format!("rank {right_rank}: {e}")))?;
    let left = loop {
        let stream = accept_before(&ring_listener, deadline)
            .map_err(|e| fail(format!("accepting rank {left_rank}: {e}")))?
            .ok_or_else(|| {
                fail(format!("rank {left_rank} did not connect within {:?}", config.timeout))
            })?;
        set_deadline(&stream, deadline).map_err(fail)?;
        match read_frame::<RingHello>(&stream) {
            Ok(h) if h.magic == MAGIC && h.nonce == nonce && h.from_rank == left_rank => {
                break stream;
            }
            Ok(h) => tracing::debug!(
                from = h.from_rank,
                "ignoring a ring connection of another rendezvous"
            ),
            Err(e) => tracing::debug!(error = %e, "ignoring a malformed ring connection"),
        }
    };
    for stream in [&right, &left] {
        stream.set_nodelay(true).map_err(|e| fail(format!("cannot set TCP_NODELAY: {e}")))?;
        stream
            .set_read_timeout(Some(config.timeout))
            .and_then(|()| stream.set_write_timeout(Some(config.timeout)))
            .map_err(|e| fail(format!("cannot set socket timeouts: {e}")))?;
    }
    Ok(Links { right, left })
}

type Joined = (TcpListener, u64, Vec<String>);

/// The key of the head's key-value store rank 0 publishes its address under, when the
/// group has one and no fixed master port.
fn published_key(config: &CollectiveConfig) -> Option<&str> {
    config.rendezvous_key.as_deref().filter(|_| config.master_port == 0)
}

/// Rank 0: collects every rank's hello, then sends out the table. With a rendezvous key, it
/// listens on a port of its own and publishes the address first, and removes it once the
/// rendezvous is over either way.
fn master(config: &CollectiveConfig, deadline: Instant) -> Result<Joined, String> {
    // A given address may be a host name; an empty one is this node's IP.
    let host = match config.master_addr.as_str() {
        "" => crate::context()
            .map_err(|e| format!("finding this node's IP: {e}"))?
            .node_ip
            .to_string(),
        addr => addr.to_owned(),
    };
    let listener = TcpListener::bind((host.as_str(), config.master_port)).map_err(|e| {
        format!("cannot listen on master address {host}:{}: {e}", config.master_port)
    })?;
    let Some(key) = published_key(config) else { return accept_ranks(config, deadline, listener) };
    let published = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    crate::kv::put(key, published.as_bytes())
        .map_err(|e| format!("publishing the master address under `{key}`: {e}"))?;
    let joined = accept_ranks(config, deadline, listener);
    if let Err(e) = crate::kv::delete(key) {
        tracing::debug!(%e, key, "removing a rendezvous address failed");
    }
    joined
}

/// Rank 0's side once it listens.
fn accept_ranks(
    config: &CollectiveConfig,
    deadline: Instant,
    listener: TcpListener,
) -> Result<Joined, String> {
    let local_ip = listener.local_addr().map_err(|e| e.to_string())?.ip();
    let ring_listener = TcpListener::bind((local_ip, 0))
        .map_err(|e| format!("cannot bind a ring listener on {local_ip}: {e}"))?;
    let own_ring_addr = ring_listener.local_addr().map_err(|e| e.to_string())?.to_string();
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;

    let n = config.world_size;
    let mut ring_addrs = vec![String::new(); n];
    ring_addrs[0] = own_ring_addr;
    let mut joined: Vec<(usize, TcpStream)> = Vec::with_capacity(n - 1);
    let reject_all = |joined: &[(usize, TcpStream)], reason: &str| {
        for (_, stream) in joined {
            let _ = write_frame(stream, &MasterReply::Reject { reason: reason.to_owned() });
        }
    };
    while joined.len() < n - 1 {
        let Some(stream) = accept_before(&listener, deadline).map_err(|e| e.to_string())? else {
            let present: BTreeSet<usize> = joined.iter().map(|(r, _)| *r).collect();
            let missing: Vec<usize> = (1..n).filter(|r| !present.contains(r)).collect();
            let reason = format!("rank(s) {missing:?} did not join within {:?}", config.timeout);
            reject_all(&joined, &reason);
            return Err(reason);
        };
        set_deadline(&stream, deadline)?;
        let hello = match read_frame::<Hello>(&stream) {
            Ok(hello) if hello.magic == MAGIC && hello.group == config.group_name => hello,
            Ok(hello) => {
                let reason = format!(
                    "this is the master of group `{}`, not of group `{}`",
                    config.group_name, hello.group
                );
                let _ = write_frame(&stream, &MasterReply::Reject { reason });
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "ignoring a malformed rendezvous connection");
                continue;
            }
        };
        let conflict = if hello.world_size != n {
            Some(format!(
                "rank {} says world size {}, rank 0 says {n}",
                hello.rank, hello.world_size
            ))
        } else if hello.rank == 0 || hello.rank >= n {
            Some(format!("a rank announced itself as rank {} of {n}", hello.rank))
        } else if joined.iter().any(|(r, _)| *r == hello.rank) {
            Some(format!("rank {} joined twice", hello.rank))
        } else {
            None
        };
        if let Some(reason) = conflict {
            let _ = write_frame(&stream, &MasterReply::Reject { reason: reason.clone() });
            reject_all(&joined, &reason);
            return Err(reason);
        }
        ring_addrs[hello.rank] = hello.ring_addr;
        joined.push((hello.rank, stream));
    }
    let nonce = rendezvous_nonce(config);
    let table = MasterReply::Table { nonce, ring_addrs: ring_addrs.clone() };
    for (rank, stream) in &joined {
        write_frame(stream, &table)
            .map_err(|e| format!("rank {rank} left during the rendezvous: {e}"))?;
    }
    Ok((ring_listener, nonce, ring_addrs))
}

/// Ranks other than 0: announce themselves to the master and wait for the table.
fn join(config: &CollectiveConfig, deadline: Instant) -> Result<Joined, String> {
    let master_addr = match published_key(config) {
        Some(key) => published_address(key, deadline, config.timeout)?,
        None => (config.master_addr.as_str(), config.master_port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve master address {}: {e}", config.master_addr))?
            .next()
            .ok_or_else(|| format!("master address {} resolves to nothing", config.master_addr))?,
    };
    let stream = connect_before(master_addr, deadline)
        .map_err(|e| format!("cannot reach the master (rank 0) at {master_addr}: {e}"))?;
    let local_ip = stream.local_addr().map_err(|e| e.to_string())?.ip();
    let ring_listener = TcpListener::bind((local_ip, 0))
        .map_err(|e| format!("cannot bind a ring listener on {local_ip}: {e}"))?;
    let ring_addr = ring_listener.local_addr().map_err(|e| e.to_string())?.to_string();
    let hello = Hello {
        magic: MAGIC,
        group: config.group_name.clone(),
        rank: config.rank,
        world_size: config.world_size,
        ring_addr,
    };
    write_frame(&stream, &hello).map_err(|e| format!("master: {e}"))?;
    set_deadline(&stream, deadline)?;
    match read_frame::<MasterReply>(&stream) {
        Ok(MasterReply::Table { nonce, ring_addrs }) if ring_addrs.len() == config.world_size => {
            Ok((ring_listener, nonce, ring_addrs))
        }
        Ok(MasterReply::Table { ring_addrs, .. }) => Err(format!(
            "the master sent {} ring addresses for world size {}",
            ring_addrs.len(),
            config.world_size
        )),
        Ok(MasterReply::Reject { reason }) => {
            Err(format!("the master rejected the group: {reason}"))
        }
        Err(e) => Err(format!("no table from the master within {:?} ({e})", config.timeout)),
    }
}

/// The address rank 0 published under `key`, waited for until `deadline`.
fn published_address(
    key: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<SocketAddr, String> {
    let mut pause = CONNECT_RETRY_FIRST;
    loop {
        let value = crate::kv::get(key)
            .map_err(|e| format!("reading the master address under `{key}`: {e}"))?;
        if let Some(value) = value {
            let text = String::from_utf8_lossy(&value);
            return text
                .parse()
                .map_err(|e| format!("the master published `{text}` under `{key}`: {e}"));
        }
        if Instant::now() >= deadline {
            return Err(format!("rank 0 did not publish its address within {timeout:?}"));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(CONNECT_RETRY_MAX);
    }
}

/// Accepts one connection, or returns `None` once `deadline` has passed.
fn accept_before(listener: &TcpListener, deadline: Instant) -> std::io::Result<Option<TcpStream>> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(Some(stream));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(ACCEPT_POLL_INTERVAL);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connects to `addr`, retrying refused connections (the peer may not listen yet) until
/// `deadline`.
fn connect_before(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut pause = CONNECT_RETRY_FIRST;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "deadline passed"));
        }
        match TcpStream::connect_timeout(&addr, remaining) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() + pause >= deadline => return Err(e),
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(CONNECT_RETRY_MAX);
            }
        }
    }
}

/// Bounds the next reads and writes on `stream` by `deadline`.
fn set_deadline(stream: &TcpStream, deadline: Instant) -> Result<(), String> {
    let remaining =
        deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(remaining))
        .and_then(|()| stream.set_write_timeout(Some(remaining)))
        .map_err(|e| format!("cannot set socket timeouts: {e}"))
}

fn parse_addr(addr: &str) -> Result<SocketAddr, String> {
    addr.parse().map_err(|e| format!("the master sent an invalid ring address `{addr}`: {e}"))
}

/// A value that differs between rendezvous (time, process and port), so a connection left over
/// from an earlier ring of the same group is refused.
fn rendezvous_nonce(config: &CollectiveConfig) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ u64::from(config.master_port)
}
