//! Chunk bookkeeping for pulling an object from another node: a pure core that says which
//! chunks to request next, accepts arrivals in any order, and resumes after a lost connection
//! by requesting only the missing chunks. The runtime's transport moves the bytes; each chunk
//! is written straight into the destination allocation at [`PullState::destination`].

use serde::{Deserialize, Serialize};

use crate::alloc::Allocation;
use crate::id::ObjectId;

/// Tunables of cross-node pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullConfig {
    /// Bytes per chunk (the last chunk may be shorter). Default: 8 MiB, large enough to keep
    /// per-chunk overhead negligible, small enough that a resume repeats little work.
    pub chunk_size: u64,
    /// Chunks requested but not yet received, per pull. Default: 4.
    pub max_in_flight: usize,
}

impl Default for PullConfig {
    fn default() -> PullConfig {
        PullConfig { chunk_size: 8 << 20, max_in_flight: 4 }
    }
}

/// One chunk to request: bytes `offset..offset+len` of the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRequest {
    /// The object.
    pub id: ObjectId,
    /// Chunk number.
    pub index: u64,
    /// First byte within the object.
    pub offset: u64,
    /// Bytes in this chunk.
    pub len: u64,
}

/// Why a chunk arrival was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    /// The chunk size must be positive and the in-flight limit at least one.
    #[error(
        "pull config needs chunk_size > 0 and max_in_flight > 0, found {chunk_size} and {max_in_flight}"
    )]
    BadConfig {
        /// Configured chunk size.
        chunk_size: u64,
        /// Configured in-flight limit.
        max_in_flight: usize,
    },
    /// The chunk number is out of range.
    #[error("chunk {index} of object {id} does not exist, expected an index below {chunks}")]
    NoSuchChunk {
        /// The object.
        id: ObjectId,
        /// The index received.
        index: u64,
        /// Number of chunks.
        chunks: u64,
    },
    /// The chunk's length disagrees with the plan.
    #[error("chunk {index} of object {id} has {found} bytes, expected {expected}")]
    WrongLength {
        /// The object.
        id: ObjectId,
        /// The chunk.
        index: u64,
        /// Planned length.
        expected: u64,
        /// Received length.
        found: u64,
    },
}

/// What an arrival changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkOutcome {
    /// New data; more chunks are missing.
    Progress,
    /// A duplicate (already received): drop it.
    Duplicate,
    /// The last missing chunk: the object is complete and can be sealed.
    Complete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkStatus {
    Missing,
    InFlight,
    Received,
}

/// The progress of one pull.
#[derive(Debug, Clone)]
pub struct PullState {
    id: ObjectId,
    size: u64,
    config: PullConfig,
    chunks: Vec<ChunkStatus>,
    in_flight: usize,
    received: u64,
}

impl PullState {
    /// A pull of an object of `size` bytes; nothing received yet.
    pub fn new(id: ObjectId, size: u64, config: PullConfig) -> Result<PullState, PullError> {
        if config.chunk_size == 0 || config.max_in_flight == 0 {
            return Err(PullError::BadConfig {
                chunk_size: config.chunk_size,
                max_in_flight: config.max_in_flight,
            });
        }
        let count = size.div_ceil(config.chunk_size);
        let count = usize::try_from(count).map_err(|_| PullError::BadConfig {
            chunk_size: config.chunk_size,
            max_in_flight: config.max_in_flight,
        })?;
        Ok(PullState {
            id,
            size,
            config,
            chunks: vec![ChunkStatus::Missing; count],
            in_flight: 0,
            received: 0,
        })
    }

    /// The object being pulled.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// Whether every chunk has arrived (an empty object is complete at once).
    pub fn is_complete(&self) -> bool {
        self.received == self.chunk_count()
    }

    /// Bytes received so far.
    pub fn bytes_received(&self) -> u64 {
        self.chunks
            .iter()
            .enumerate()
            .filter(|(_, status)| **status == ChunkStatus::Received)
            .map(|(index, _)| self.chunk(index as u64).len)
            .sum()
    }

    /// Missing chunks to request now (lowest first), up to the in-flight limit; they are marked
    /// in flight.
    pub fn next_requests(&mut self) -> Vec<ChunkRequest> {
        let budget = self.config.max_in_flight.saturating_sub(self.in_flight);
        let picked: Vec<u64> = self
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, status)| **status == ChunkStatus::Missing)
            .take(budget)
            .map(|(index, _)| index as u64)
            .collect();
        for &index in &picked {
            self.chunks[index as usize] = ChunkStatus::InFlight;
        }
        self.in_flight += picked.len();
        picked.into_iter().map(|index| self.chunk(index)).collect()
    }

    /// A chunk arrived with `len` bytes. Chunks not requested are accepted too (a resumed
    /// sender may repeat work); duplicates are reported so their bytes are dropped.
    pub fn on_chunk(&mut self, index: u64, len: u64) -> Result<ChunkOutcome, PullError> {
        let status = self.status(index)?;
        let expected = self.chunk(index).len;
        if len != expected {
            return Err(PullError::WrongLength { id: self.id, index, expected, found: len });
        }
        match status {
            ChunkStatus::Received => return Ok(ChunkOutcome::Duplicate),
            ChunkStatus::InFlight => self.in_flight -= 1,
            ChunkStatus::Missing => {}
        }
        self.chunks[index as usize] = ChunkStatus::Received;
        self.received += 1;
        Ok(if self.is_complete() { ChunkOutcome::Complete } else { ChunkOutcome::Progress })
    }

    /// A request failed: the chunk is missing again.
    pub fn on_failure(&mut self, index: u64) -> Result<(), PullError> {
        if self.status(index)? == ChunkStatus::InFlight {
            self.chunks[index as usize] = ChunkStatus::Missing;
            self.in_flight -= 1;
        }
        Ok(())
    }

    /// The connection was lost: every chunk in flight is missing again; received ones are kept,
    /// so the pull resumes where it stopped (possibly from another node holding a copy).
    pub fn on_disconnect(&mut self) {
        for status in &mut self.chunks {
            if *status == ChunkStatus::InFlight {
                *status = ChunkStatus::Missing;
            }
        }
        self.in_flight = 0;
    }

    /// Where chunk `index` goes inside the destination allocation, as an arena range.
    pub fn destination(&self, allocation: Allocation, index: u64) -> Result<Allocation, PullError> {
        self.status(index)?;
        let chunk = self.chunk(index);
        Ok(Allocation { offset: allocation.offset + chunk.offset, size: chunk.len })
    }

    fn status(&self, index: u64) -> Result<ChunkStatus, PullError> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.chunks.get(i).copied())
            .ok_or(PullError::NoSuchChunk { id: self.id, index, chunks: self.chunk_count() })
    }

    /// Chunk `index`'s range (the caller has checked the index).
    fn chunk(&self, index: u64) -> ChunkRequest {
        let offset = index * self.config.chunk_size;
        let len = self.config.chunk_size.min(self.size - offset);
        ChunkRequest { id: self.id, index, offset, len }
    }
}

/// The range a sender serves for chunk `index` of an object of `size` bytes, or `None` when the
/// index is out of range (hostile request).
pub fn chunk_range(size: u64, chunk_size: u64, index: u64) -> Option<(u64, u64)> {
    let offset = index.checked_mul(chunk_size)?;
    (chunk_size > 0 && offset < size).then(|| (offset, chunk_size.min(size - offset)))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn config(chunk_size: u64, max_in_flight: usize) -> PullConfig {
        PullConfig { chunk_size, max_in_flight }
    }

    #[test]
    fn a_pull_resumes_with_only_the_missing_chunks() {
        let mut pull = PullState::new(ObjectId(1), 1000, config(300, 2)).unwrap();
        let first = pull.next_requests();
        assert_eq!(
            first.iter().map(|c| (c.index, c.offset, c.len)).collect::<Vec<_>>(),
            vec![(0, 0, 300), (1, 300, 300)]
        );
        assert_eq!(pull.on_chunk(1, 300).unwrap(), ChunkOutcome::Progress);
        pull.on_disconnect();
        let resumed: Vec<u64> = pull.next_requests().iter().map(|c| c.index).collect();
        assert_eq!(resumed, vec![0, 2]);
        assert_eq!(pull.on_chunk(1, 300).unwrap(), ChunkOutcome::Duplicate);
        assert!(matches!(pull.on_chunk(3, 99), Err(PullError::WrongLength { expected: 100, .. })));
        assert!(matches!(pull.on_chunk(4, 1), Err(PullError::NoSuchChunk { .. })));
        pull.on_chunk(0, 300).unwrap();
        pull.on_chunk(2, 300).unwrap();
        assert_eq!(pull.on_chunk(3, 100).unwrap(), ChunkOutcome::Complete);
        assert_eq!(pull.bytes_received(), 1000);
        let target = Allocation { offset: 640, size: 1000 };
        assert_eq!(pull.destination(target, 3).unwrap(), Allocation { offset: 1540, size: 100 });
    }

    #[test]
    fn empty_objects_are_complete_and_bad_configs_are_refused() {
        assert!(PullState::new(ObjectId(1), 0, config(8, 1)).unwrap().is_complete());
        assert!(PullState::new(ObjectId(1), 10, config(0, 1)).is_err());
        assert!(PullState::new(ObjectId(1), 10, config(8, 0)).is_err());
        assert_eq!(chunk_range(10, 4, 2), Some((8, 2)));
        assert_eq!(chunk_range(10, 4, 3), None);
        assert_eq!(chunk_range(10, 4, u64::MAX), None);
    }

    proptest! {
        #[test]
        fn any_interleaving_of_arrivals_failures_and_disconnects_assembles_every_byte_once(
            size in 0u64..5000,
            chunk_size in 1u64..700,
            max_in_flight in 1usize..5,
            events in prop::collection::vec((0u8..4, any::<prop::sample::Index>()), 0..400),
        ) {
            let mut pull = PullState::new(ObjectId(9), size, config(chunk_size, max_in_flight)).unwrap();
            let source: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
            let mut target = vec![0u8; size as usize];
            let mut written = vec![0u32; size as usize];
            let mut outstanding: Vec<ChunkRequest> = Vec::new();
            let whole = Allocation { offset: 0, size };
            let mut deliver = |pull: &mut PullState, request: ChunkRequest| {
                let (offset, len) = chunk_range(size, chunk_size, request.index).unwrap();
                if pull.on_chunk(request.index, len).unwrap() != ChunkOutcome::Duplicate {
                    let dest = pull.destination(whole, request.index).unwrap();
                    let range = dest.offset as usize..(dest.offset + dest.size) as usize;
                    target[range.clone()].copy_from_slice(&source[offset as usize..(offset + len) as usize]);
                    for count in &mut written[range] {
                        *count += 1;
                    }
                }
            };
            for (kind, pick) in events {
                outstanding.extend(pull.next_requests());
                prop_assert!(outstanding.len() <= max_in_flight);
                if outstanding.is_empty() {
                    break;
                }
                let request = outstanding.remove(pick.index(outstanding.len()));
                match kind {
                    0 => pull.on_failure(request.index).unwrap(),
                    1 => {
                        pull.on_disconnect();
                        outstanding.clear();
                    }
                    _ => deliver(&mut pull, request),
                }
            }
            loop {
                outstanding.extend(pull.next_requests());
                let Some(request) = outstanding.pop() else { break };
                deliver(&mut pull, request);
            }
            prop_assert!(pull.is_complete());
            prop_assert_eq!(&target, &source);
            prop_assert!(written.iter().all(|&count| count == 1));
        }
    }
}
