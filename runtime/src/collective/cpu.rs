//! The CPU backend: every collective over the ring of TCP connections the rendezvous built.
//!
//! - all-reduce: the buffer is cut into `world_size` chunks; `n − 1` reduce-scatter steps leave
//!   rank `r` with the fully reduced chunk `r`, `n − 1` all-gather steps hand it around. Each rank
//!   sends `2(n − 1)/n` of the buffer, the bandwidth optimum. Within a step the chunk travels in
//!   segments, written by a scoped thread while the calling thread reads and reduces the
//!   incoming ones, so sending, receiving and reducing overlap and no step can deadlock.
//! - broadcast: the root's bytes are forwarded rank to rank around the ring, segment by
//!   segment, so the ranks form a pipeline.
//! - all-gather (and the barrier, an all-gather of nothing): `n − 1` steps, each passing one
//!   rank's block to the right.
//! - reduce-scatter and the in-place all-gather of a buffer's chunks (ZeRO's two halves): the
//!   two halves of the all-reduce on their own, indexed so that rank `r` ends owning (or
//!   starts from) chunk `r`.
//!
//! On any failure the communicator shuts its sockets down (so its neighbours fail at once
//! instead of waiting for the timeout) and refuses further use.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use super::rendezvous::{Links, connect_ring};
use super::wire::{HEADER_BYTES, Header, Op};
use super::{CollectiveConfig, CollectiveError, ReduceElement, ReduceOp};

/// The largest block an all-gather accepts from a peer (a sanity bound against a corrupted
/// length; real payloads are far smaller).
const MAX_BLOCK_BYTES: u64 = 1 << 40;

/// Where a broadcast lands on the receiving ranks.
pub(crate) enum BroadcastTarget<'a> {
    /// Exactly this many bytes are expected.
    Fixed(&'a mut [u8]),
    /// Resized to the root's length.
    Resizable(&'a mut Vec<u8>),
}

/// Identity of one collective call, carried by all its messages.
#[derive(Clone, Copy)]
struct Call<'a> {
    group: &'a str,
    rank: usize,
    left: usize,
    right: usize,
    world: usize,
    op: Op,
    seq: u64,
    timeout: Duration,
}

impl Call<'_> {
    fn io_error(&self, peer: usize, error: std::io::Error) -> CollectiveError {
        if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            CollectiveError::Timeout {
                group: self.group.to_owned(),
                rank: self.rank,
                peer,
                op: self.op.name(),
                timeout: self.timeout,
            }
        } else {
            let error = if error.kind() == ErrorKind::UnexpectedEof {
                std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the connection closed (the peer died or its collective failed)",
                )
            } else {
                error
            };
            CollectiveError::PeerLost {
                group: self.group.to_owned(),
                rank: self.rank,
                peer,
                op: self.op.name(),
                source: error,
            }
        }
    }

    fn protocol(&self, message: String) -> CollectiveError {
        CollectiveError::Protocol { group: self.group.to_owned(), rank: self.rank, message }
    }

    /// Writes one message (header and payload) to the right neighbour.
    fn send(&self, mut right: &TcpStream, payload: &[u8]) -> Result<(), CollectiveError> {
        let header = Header { op: self.op, seq: self.seq, len: payload.len() as u64 }.encode();
        right
            .write_all(&header)
            .and_then(|()| right.write_all(payload))
            .map_err(|e| self.io_error(self.right, e))
    }

    /// Reads the next header from the left neighbour and checks it belongs to this call;
    /// returns the payload length.
    fn receive_header(&self, mut left: &TcpStream) -> Result<u64, CollectiveError> {
        let mut raw = [0u8; HEADER_BYTES];
        left.read_exact(&mut raw).map_err(|e| self.io_error(self.left, e))?;
        let header = Header::decode(&raw)
            .map_err(|m| self.protocol(format!("from rank {}: {m}", self.left)))?;
        if header.op != self.op || header.seq != self.seq {
            return Err(self.protocol(format!(
                "rank {} sent {} #{} while this rank runs {} #{} (ranks must issue the same \
                 collectives in the same order)",
                self.left,
                header.op.name(),
                header.seq,
                self.op.name(),
                self.seq
            )));
        }
        Ok(header.len)
    }

    /// Reads a payload of exactly `expected` bytes into `out`.
    fn receive_exact(
        &self,
        left: &TcpStream,
        out: &mut [u8],
        what: &str,
    ) -> Result<(), CollectiveError> {
        let len = self.receive_header(left)?;
        if len != out.len() as u64 {
            return Err(self.protocol(format!(
                "rank {} sent {len} bytes for {what}, this rank expects {} (buffers of different \
                 lengths?)",
                self.left,
                out.len()
            )));
        }
        let mut reader = left;
        reader.read_exact(out).map_err(|e| self.io_error(self.left, e))
    }
}

/// A rank's end of the ring.
pub(crate) struct Ring {
    group: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    segment_bytes: usize,
    /// `None` for a group of one.
    links: Option<Links>,
    /// Number of collectives issued so far; tags every message.
    seq: u64,
    /// The first failure, after which the ring is unusable.
    poisoned: Option<String>,
}

impl Ring {
    /// Joins the group (no sockets for a group of one).
    pub(crate) fn connect(config: &CollectiveConfig) -> Result<Ring, CollectiveError> {
        let links = if config.world_size > 1 { Some(connect_ring(config)?) } else { None };
        tracing::debug!(group = %config.group_name, rank = config.rank, world_size = config.world_size, "collective ring ready");
        Ok(Ring {
            group: config.group_name.clone(),
            rank: config.rank,
            world_size: config.world_size,
            timeout: config.timeout,
            segment_bytes: config.segment_bytes,
            links,
            seq: 0,
            poisoned: None,
        })
    }

    pub(crate) fn group(&self) -> &str {
        &self.group
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    /// Checks the ring is usable and opens a new call.
    fn begin(&mut self, op: Op) -> Result<Option<(Call<'_>, &Links)>, CollectiveError> {
        if let Some(cause) = &self.poisoned {
            return Err(CollectiveError::Poisoned {
                group: self.group.clone(),
                rank: self.rank,
                cause: cause.clone(),
            });
        }
        self.seq += 1;
        let n = self.world_size;
        let call = Call {
            group: &self.group,
            rank: self.rank,
            left: (self.rank + n - 1) % n,
            right: (self.rank + 1) % n,
            world: n,
            op,
            seq: self.seq,
            timeout: self.timeout,
        };
        Ok(self.links.as_ref().map(|links| (call, links)))
    }

    /// Records the first failure and shuts the sockets down so the neighbours fail promptly.
    fn poison<T>(&mut self, result: Result<T, CollectiveError>) -> Result<T, CollectiveError> {
        if let Err(error) = &result {
            tracing::warn!(group = %self.group, rank = self.rank, %error, "collective failed");
            if self.poisoned.is_none() {
                self.poisoned = Some(error.to_string());
            }
            if let Some(links) = &self.links {
                let _ = links.right.shutdown(Shutdown::Both);
                let _ = links.left.shutdown(Shutdown::Both);
            }
        }
        result
    }

    /// Ring all-reduce of `buffer` in place.
    pub(crate) fn all_reduce<T: ReduceElement>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let segment_elements = (self.segment_bytes / T::SIZE).max(1);
        let Some((call, links)) = self.begin(Op::AllReduce)? else {
            return Ok(()); // A group of one: the buffer already is the result (mean of one).
        };
        let result = ring_all_reduce(call, links, buffer, op, segment_elements);
        self.poison(result)
    }

    /// Pipelined broadcast from `root` around the ring.
    pub(crate) fn broadcast(
        &mut self,
        target: BroadcastTarget<'_>,
        root: usize,
    ) -> Result<(), CollectiveError> {
        let segment_bytes = self.segment_bytes;
        let Some((call, links)) = self.begin(Op::Broadcast)? else {
            return Ok(());
        };
        let result = ring_broadcast(call, links, target, root, segment_bytes);
        self.poison(result)
    }

    /// Ring reduce-scatter of `buffer` in place: afterwards `buffer[chunk_range(len, n, r)]`
    /// holds the combination of every rank's chunk `r` (the rest holds partial sums).
    pub(crate) fn reduce_scatter<T: ReduceElement>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<std::ops::Range<usize>, CollectiveError> {
        let segment_elements = (self.segment_bytes / T::SIZE).max(1);
        let owned = chunk_range(buffer.len(), self.world_size, self.rank);
        let Some((call, links)) = self.begin(Op::ReduceScatter)? else {
            return Ok(owned);
        };
        let result = ring_reduce_scatter(call, links, buffer, op, segment_elements);
        self.poison(result).map(|()| owned)
    }

    /// Ring all-gather in place: rank `r` contributes `buffer[chunk_range(len, n, r)]` and
    /// afterwards every rank's buffer holds every chunk.
    pub(crate) fn all_gather_into(
        &mut self,
        buffer: &mut [u8],
        element_bytes: usize,
    ) -> Result<(), CollectiveError> {
        let segment_bytes = self.segment_bytes.max(element_bytes);
        let Some((call, links)) = self.begin(Op::AllGatherChunks)? else {
            return Ok(());
        };
        let result = ring_all_gather_into(call, links, buffer, element_bytes, segment_bytes);
        self.poison(result)
    }

    /// Ring all-gather of variable-length blocks.
    pub(crate) fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let Some((call, links)) = self.begin(Op::AllGather)? else {
            return Ok(vec![mine.to_vec()]);
        };
        let result = ring_all_gather(call, links, mine);
        self.poison(result)
    }
}

/// The chunk of a buffer of `len` elements that rank-position `index` of `parts` owns: sizes
/// differ by at most one, larger chunks first.
pub(crate) fn chunk_range(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

/// What a reader does with the incoming elements of a step.
#[derive(Clone, Copy)]
enum Apply {
    Reduce(ReduceOp),
    Overwrite,
}

fn ring_all_reduce<T: ReduceElement>(
    call: Call<'_>,
    links: &Links,
    buffer: &mut [T],
    op: ReduceOp,
    segment_elements: usize,
) -> Result<(), CollectiveError> {
    // Reduce-scatter: this rank ends with the fully reduced chunk r (a mean finished there).
    ring_reduce_scatter(call, links, buffer, op, segment_elements)?;
    // All-gather of the elements (in their wire form): at step s send chunk (r − s), receive
    // chunk (r − s − 1).
    let (world, rank, len) = (call.world, call.rank, buffer.len());
    for step in 0..world - 1 {
        let send = (rank + world - step) % world;
        let receive = (rank + 2 * world - step - 1) % world;
        exchange_chunks(
            call,
            links,
            buffer,
            chunk_range(len, world, send),
            chunk_range(len, world, receive),
            Apply::Overwrite,
            segment_elements,
        )?;
    }
    Ok(())
}

/// The reduce-scatter half on its own, shifted so that rank `r` ends with chunk `r`: at step
/// `s` it sends chunk `r − s − 1` (its own at step 0, then what it reduced the step before)
/// and receives and reduces chunk `r − s − 2`.
fn ring_reduce_scatter<T: ReduceElement>(
    call: Call<'_>,
    links: &Links,
    buffer: &mut [T],
    op: ReduceOp,
    segment_elements: usize,
) -> Result<(), CollectiveError> {
    let world = call.world;
    let rank = call.rank;
    let len = buffer.len();
    for step in 0..world - 1 {
        let send = (rank + 2 * world - step - 1) % world;
        let receive = (rank + 2 * world - step - 2) % world;
        exchange_chunks(
            call,
            links,
            buffer,
            chunk_range(len, world, send),
            chunk_range(len, world, receive),
            Apply::Reduce(op),
            segment_elements,
        )?;
    }
    if op == ReduceOp::Mean {
        for value in &mut buffer[chunk_range(len, world, rank)] {
            *value = value.divide(world);
        }
    }
    Ok(())
}

/// The all-gather half on its own, over bytes: at step `s` rank `r` sends chunk `r − s` and
/// receives chunk `r − s − 1` (chunks are counted in elements of `element_bytes`).
fn ring_all_gather_into(
    call: Call<'_>,
    links: &Links,
    buffer: &mut [u8],
    element_bytes: usize,
    segment_bytes: usize,
) -> Result<(), CollectiveError> {
    if element_bytes == 0 || !buffer.len().is_multiple_of(element_bytes) {
        return Err(call.protocol(format!(
            "all_gather_into needs a whole number of {element_bytes}-byte elements, found {} \
             bytes",
            buffer.len()
        )));
    }
    let world = call.world;
    let rank = call.rank;
    let elements = buffer.len() / element_bytes;
    let bytes = |index: usize| {
        let range = chunk_range(elements, world, index);
        range.start * element_bytes..range.end * element_bytes
    };
    for step in 0..world - 1 {
        let send = (rank + world - step) % world;
        let receive = (rank + 2 * world - step - 1) % world;
        exchange_bytes(call, links, buffer, bytes(send), bytes(receive), segment_bytes)?;
    }
    Ok(())
}

/// One all-gather step over bytes: sends `buffer[send]` to the right while the left
/// neighbour's chunk is read straight into `buffer[receive]` (no scratch, no conversion).
fn exchange_bytes(
    call: Call<'_>,
    links: &Links,
    buffer: &mut [u8],
    send: std::ops::Range<usize>,
    receive: std::ops::Range<usize>,
    segment_bytes: usize,
) -> Result<(), CollectiveError> {
    let (outgoing, incoming) = disjoint(buffer, send, receive);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            for segment in outgoing.chunks(segment_bytes) {
                call.send(&links.right, segment)?;
            }
            Ok(())
        });
        let read = incoming.chunks_mut(segment_bytes).try_for_each(|segment| {
            call.receive_exact(&links.left, segment, "an all-gather segment")
        });
        if read.is_err() {
            let _ = links.right.shutdown(Shutdown::Both);
        }
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(call.protocol("the ring writer thread panicked".into())));
        read.and(written)
    })
}

/// One ring step: sends `buffer[send]` to the right while receiving the left neighbour's chunk
/// into `buffer[receive]` (the two ranges are disjoint chunks).
fn exchange_chunks<T: ReduceElement>(
    call: Call<'_>,
    links: &Links,
    buffer: &mut [T],
    send: std::ops::Range<usize>,
    receive: std::ops::Range<usize>,
    apply: Apply,
    segment_elements: usize,
) -> Result<(), CollectiveError> {
    let (outgoing, incoming) = disjoint(buffer, send, receive);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            for segment in outgoing.chunks(segment_elements) {
                if cfg!(target_endian = "little") {
                    call.send(&links.right, bytemuck::cast_slice(segment))?;
                } else {
                    let wire: Vec<T> = segment.iter().map(|v| v.wire_encoded()).collect();
                    call.send(&links.right, bytemuck::cast_slice(&wire))?;
                }
            }
            Ok(())
        });
        let read = (|| {
            let mut scratch = vec![T::zeroed(); segment_elements.min(incoming.len())];
            for segment in incoming.chunks_mut(segment_elements) {
                let received = &mut scratch[..segment.len()];
                call.receive_exact(
                    &links.left,
                    bytemuck::cast_slice_mut(received),
                    "an all-reduce segment",
                )?;
                match apply {
                    Apply::Reduce(op) => {
                        for (value, wire) in segment.iter_mut().zip(received.iter()) {
                            *value = value.combine(wire.wire_decoded(), op);
                        }
                    }
                    Apply::Overwrite => {
                        for (value, wire) in segment.iter_mut().zip(received.iter()) {
                            *value = wire.wire_decoded();
                        }
                    }
                }
            }
            Ok(())
        })();
        if read.is_err() {
            // Unblock our writer (and tell the right neighbour) instead of waiting it out.
            let _ = links.right.shutdown(Shutdown::Both);
        }
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(call.protocol("the ring writer thread panicked".into())));
        read.and(written)
    })
}

/// Splits `buffer` into a shared view of `a` and a mutable view of `b` (disjoint ranges).
fn disjoint<T>(
    buffer: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    if a.start <= b.start {
        // a ends before b starts (the chunks are disjoint and ordered).
        let (left, right) = buffer.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = buffer.split_at_mut(a.start);
        (&right[..a.end - a.start], &mut left[b])
    }
}

fn ring_broadcast(
    call: Call<'_>,
    links: &Links,
    target: BroadcastTarget<'_>,
    root: usize,
    segment_bytes: usize,
) -> Result<(), CollectiveError> {
    // The rank before the root ends the chain.
    let forward = call.right != root;
    let buffer: &mut [u8] = if call.rank == root {
        let buffer = match target {
            BroadcastTarget::Fixed(b) => b,
            BroadcastTarget::Resizable(v) => v.as_mut_slice(),
        };
        call.send(&links.right, &(buffer.len() as u64).to_le_bytes())?;
        for segment in buffer.chunks(segment_bytes) {
            call.send(&links.right, segment)?;
        }
        return Ok(());
    } else {
        let mut raw_len = [0u8; 8];
        call.receive_exact(&links.left, &mut raw_len, "the broadcast length")?;
        let len = u64::from_le_bytes(raw_len);
        let buffer = match target {
            BroadcastTarget::Fixed(b) if b.len() as u64 == len => b,
            BroadcastTarget::Fixed(b) => {
                return Err(call.protocol(format!(
                    "broadcast from rank {root} carries {len} bytes, this rank's buffer holds {}",
                    b.len()
                )));
            }
            BroadcastTarget::Resizable(v) => {
                let len =
                    usize::try_from(len).ok().filter(|&l| l as u64 <= MAX_BLOCK_BYTES).ok_or_else(
                        || call.protocol(format!("broadcast length {len} is implausible")),
                    )?;
                v.clear();
                v.try_reserve_exact(len)
                    .map_err(|e| call.protocol(format!("cannot allocate {len} bytes: {e}")))?;
                v.resize(len, 0);
                v.as_mut_slice()
            }
        };
        if forward {
            call.send(&links.right, &raw_len)?;
        }
        buffer
    };
    for segment in buffer.chunks_mut(segment_bytes) {
        call.receive_exact(&links.left, segment, "a broadcast segment")?;
        if forward {
            call.send(&links.right, segment)?;
        }
    }
    Ok(())
}

fn ring_all_gather(
    call: Call<'_>,
    links: &Links,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let world = call.world;
    let rank = call.rank;
    let mut blocks: Vec<Option<Vec<u8>>> = vec![None; world];
    blocks[rank] = Some(mine.to_vec());
    // At step s pass on block (r − s), receive block (r − s − 1).
    for step in 0..world - 1 {
        let send = (rank + world - step) % world;
        let receive = (rank + world - step - 1) % world;
        let outgoing = blocks[send].as_deref().unwrap_or_default();
        let incoming = std::thread::scope(|scope| {
            let writer = scope.spawn(|| call.send(&links.right, outgoing));
            let read = (|| {
                let len = call.receive_header(&links.left)?;
                if len > MAX_BLOCK_BYTES {
                    return Err(
                        call.protocol(format!("all-gather block of {len} bytes is implausible"))
                    );
                }
                let len = len as usize;
                let mut block = Vec::new();
                block
                    .try_reserve_exact(len)
                    .map_err(|e| call.protocol(format!("cannot allocate {len} bytes: {e}")))?;
                block.resize(len, 0);
                let mut reader = &links.left;
                reader.read_exact(&mut block).map_err(|e| call.io_error(call.left, e))?;
                Ok(block)
            })();
            if read.is_err() {
                let _ = links.right.shutdown(Shutdown::Both);
            }
            let written = writer
                .join()
                .unwrap_or_else(|_| Err(call.protocol("the ring writer thread panicked".into())));
            written.and(read)
        })?;
        blocks[receive] = Some(incoming);
    }
    Ok(blocks.into_iter().map(Option::unwrap_or_default).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_tile_the_buffer(len in 0usize..1000, parts in 1usize..17) {
            let mut next = 0;
            for i in 0..parts {
                let r = chunk_range(len, parts, i);
                prop_assert_eq!(r.start, next);
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }
    }

    #[test]
    fn disjoint_views_point_at_the_right_elements() {
        let mut v: Vec<u32> = (0..10).collect();
        let (a, b) = disjoint(&mut v, 0..3, 5..8);
        assert_eq!(a, &[0, 1, 2]);
        assert_eq!(b, &mut [5, 6, 7]);
        let (a, b) = disjoint(&mut v, 7..10, 2..4);
        assert_eq!(a, &[7, 8, 9]);
        assert_eq!(b, &mut [2, 3]);
    }
}
