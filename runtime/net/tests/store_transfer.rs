//! Objects between two nodes' object stores over loopback: `StoreSource` serving from store A,
//! `pull_into_store` writing into store B.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use parking_lot::Mutex;
use rtrun_net::{
    Connection, Endpoint, HeadCredentials, NetConfig, NetError, ObjectSource, StoreSource,
    pull_into_store,
};
use rtrun_object_store::{HolderId, ObjectId, ObjectStore, PullConfig, StoreConfig};
use tempfile::TempDir;

const MIB: usize = 1 << 20;
/// The holder id store A's source pins under.
const SERVER: HolderId = HolderId(100);

/// A store of `capacity` bytes spilling into its own temporary directory.
fn store(capacity: usize) -> (Arc<ObjectStore>, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        spill_dir: Some(dir.path().into()),
        ..StoreConfig::with_capacity(capacity as u64)
    };
    (Arc::new(ObjectStore::open(config).unwrap()), dir)
}

/// Node "head" serves `source`; the returned connection is node "node-b"'s to it.
struct Link {
    _head: Arc<Endpoint>,
    _node: Endpoint,
    conn: Connection,
}

async fn link(source: Arc<dyn ObjectSource>) -> Link {
    let credentials = HeadCredentials::generate("head").unwrap();
    let head = Arc::new(head_endpoint(&credentials, NetConfig::default(), Some(source)));
    spawn_accept_echo(head.clone());
    let node = node_endpoint(issue(&credentials, "node-b"), NetConfig::default(), None);
    let conn = within(node.connect(head.local_addr().unwrap())).await.unwrap();
    Link { _head: head, _node: node, conn }
}

/// Polls `condition` until it holds, failing the test after the deadline.
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "{what} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn stored_sha256(store: &ObjectStore, id: ObjectId) -> Vec<u8> {
    sha256(&store.get(id, HolderId(999)).unwrap())
}

fn counts(store: &ObjectStore, id: ObjectId) -> BTreeMap<HolderId, i64> {
    let stats = store.stats();
    stats.per_object.into_iter().find(|object| object.id == id).unwrap().counts
}

fn config(chunk_size: usize) -> PullConfig {
    PullConfig { chunk_size: chunk_size as u64, ..PullConfig::default() }
}

/// A [`StoreSource`] that counts reads, can fail the read at one offset a number of times, and
/// can stop at one offset until released.
struct TestSource {
    inner: StoreSource,
    reads: AtomicUsize,
    failures: Mutex<Option<(u64, usize)>>,
    gate: Mutex<Option<Gate>>,
}

struct Gate {
    offset: u64,
    reached: tokio::sync::oneshot::Sender<()>,
    release: std::sync::mpsc::Receiver<()>,
}

impl TestSource {
    fn new(store: Arc<ObjectStore>) -> Arc<TestSource> {
        Arc::new(TestSource {
            inner: StoreSource::new(store, SERVER),
            reads: AtomicUsize::new(0),
            failures: Mutex::new(None),
            gate: Mutex::new(None),
        })
    }
}

impl ObjectSource for TestSource {
    fn size(&self, object: ObjectId) -> Option<u64> {
        self.inner.size(object)
    }

    fn read(&self, object: ObjectId, offset: u64, len: u64) -> Result<Bytes, String> {
        if let Some((at, left)) = &mut *self.failures.lock()
            && *at == offset
            && *left > 0
        {
            *left -= 1;
            return Err(format!("injected failure at offset {offset}"));
        }
        let gate = self.gate.lock().take_if(|gate| gate.offset == offset);
        if let Some(gate) = gate {
            gate.reached.send(()).unwrap();
            // Hands this worker's queued tasks to another thread while it waits.
            tokio::task::block_in_place(|| gate.release.recv().unwrap());
        }
        let bytes = self.inner.read(object, offset, len)?;
        self.reads.fetch_add(1, Ordering::Relaxed);
        Ok(bytes)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_object_is_pulled_intact_as_a_secondary_copy_and_the_source_unpins() {
    let (a, _a_dir) = store(80 * MIB);
    let (b, _b_dir) = store(80 * MIB);
    let id = ObjectId(1);
    let data = pattern(64 * MIB, 11);
    a.put(id, HolderId(1), &data).unwrap();
    let link = link(Arc::new(StoreSource::new(a.clone(), SERVER))).await;

    within(pull_into_store(&link.conn, &b, id, HolderId(2), PullConfig::default())).await.unwrap();
    assert_eq!(stored_sha256(&b, id), sha256(&data));
    assert_eq!(counts(&b, id), BTreeMap::from([(HolderId(2), 1)]));
    assert_eq!(b.stats().pinned_objects, 0);
    // The last chunks stay pinned until the peer acknowledged them.
    eventually("store A's pins released", || a.stats().pinned_objects == 0).await;
    assert_eq!(a.stats().per_object[0].pins, BTreeMap::new());

    // A copy is evicted, not spilled, when B needs the room.
    b.put(ObjectId(2), HolderId(3), &vec![7; 32 * MIB]).unwrap();
    assert!(!b.contains(id));
    assert_eq!(b.stats().spilled_objects, 0);
}

#[tokio::test]
async fn pulling_a_missing_object_fails_and_leaves_nothing_behind() {
    let (a, _a_dir) = store(4 * MIB);
    let (b, _b_dir) = store(4 * MIB);
    let link = link(Arc::new(StoreSource::new(a.clone(), SERVER))).await;

    let error = within(pull_into_store(&link.conn, &b, ObjectId(7), HolderId(2), config(MIB)))
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(&error, NetError::ObjectPull { object: ObjectId(7), peer, .. } if peer == "head"),
        "{message}"
    );
    assert!(message.contains(&format!("object {} is not on node head", ObjectId(7))), "{message}");
    let stats = b.stats();
    assert_eq!((stats.objects, stats.used_bytes), (0, 0));

    // An object being written in A is not served either.
    a.create(ObjectId(8), 100, HolderId(1)).unwrap();
    let error = within(pull_into_store(&link.conn, &b, ObjectId(8), HolderId(2), config(MIB)))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("is not on node head"), "{error}");
    assert_eq!(b.stats().objects, 0);
}

#[tokio::test]
async fn pulling_an_object_the_store_already_has_only_adds_a_holder() {
    // A has nothing at all: any transfer would fail.
    let (a, _a_dir) = store(4 * MIB);
    let (b, _b_dir) = store(4 * MIB);
    let source = TestSource::new(a);
    let link = link(source.clone()).await;
    let id = ObjectId(3);
    b.put(id, HolderId(1), &pattern(1000, 3)).unwrap();

    within(pull_into_store(&link.conn, &b, id, HolderId(2), config(MIB))).await.unwrap();
    within(pull_into_store(&link.conn, &b, id, HolderId(2), config(MIB))).await.unwrap();
    assert_eq!(counts(&b, id), BTreeMap::from([(HolderId(1), 1), (HolderId(2), 2)]));
    assert_eq!(source.reads.load(Ordering::Relaxed), 0);
    assert_eq!(stored_sha256(&b, id), sha256(&pattern(1000, 3)));
}

/// Runs on a current-thread runtime: the store calls run inline instead of `block_in_place`.
#[tokio::test]
async fn spilled_objects_are_restored_and_served() {
    let (a, _a_dir) = store(4 * MIB);
    let (b, _b_dir) = store(8 * MIB);
    let (first, second) = (pattern(3 * MIB, 1), pattern(3 * MIB + 5, 2));
    a.put(ObjectId(1), HolderId(1), &first).unwrap();
    a.put(ObjectId(2), HolderId(1), &second).unwrap();
    assert_eq!(a.stats().spilled_objects, 1, "object 1 went to disk to make room for 2");
    let link = link(Arc::new(StoreSource::new(a.clone(), SERVER))).await;

    within(pull_into_store(&link.conn, &b, ObjectId(1), HolderId(2), config(256 << 10)))
        .await
        .unwrap();
    assert_eq!(stored_sha256(&b, ObjectId(1)), sha256(&first));
    eventually("store A's pins released", || a.stats().pinned_objects == 0).await;
    // Restoring 1 spilled 2; serving 2 now spills 1 again.
    let spilled = a.stats().per_object.iter().map(|o| (o.id, o.state)).collect::<Vec<_>>();
    assert_eq!(spilled[1].1, rtrun_object_store::ObjectState::Spilled, "{spilled:?}");
    within(pull_into_store(&link.conn, &b, ObjectId(2), HolderId(2), config(256 << 10)))
        .await
        .unwrap();
    assert_eq!(stored_sha256(&b, ObjectId(2)), sha256(&second));
    eventually("store A's pins released", || a.stats().pinned_objects == 0).await;
}

#[tokio::test]
async fn an_empty_object_is_pulled_too() {
    let (a, _a_dir) = store(4 * MIB);
    let (b, _b_dir) = store(4 * MIB);
    a.put(ObjectId(4), HolderId(1), &[]).unwrap();
    let link = link(Arc::new(StoreSource::new(a.clone(), SERVER))).await;
    within(pull_into_store(&link.conn, &b, ObjectId(4), HolderId(2), config(MIB))).await.unwrap();
    assert_eq!(b.get(ObjectId(4), HolderId(2)).unwrap().len(), 0);
}

#[test]
fn store_source_reads_are_pinned_borrows_and_bad_ranges_are_errors() {
    let (a, _a_dir) = store(4 * MIB);
    let data = pattern(1000, 5);
    a.put(ObjectId(1), HolderId(1), &data).unwrap();
    a.create(ObjectId(2), 10, HolderId(1)).unwrap();
    let source = StoreSource::new(a.clone(), SERVER);
    assert_eq!(source.size(ObjectId(1)), Some(1000));
    assert_eq!(source.size(ObjectId(2)), None, "unsealed");
    assert_eq!(source.size(ObjectId(3)), None, "missing");
    assert_eq!(a.stats().pinned_objects, 0);

    let chunk = source.read(ObjectId(1), 10, 20).unwrap();
    assert_eq!(&chunk[..], &data[10..30]);
    let view = a.get(ObjectId(1), HolderId(1)).unwrap();
    assert_eq!(chunk.as_ptr(), view[10..].as_ptr(), "the chunk borrows the arena");
    drop(view);
    let tail = chunk.slice(5..);
    drop(chunk);
    assert_eq!(a.stats().per_object[0].pins, BTreeMap::from([(SERVER, 1)]));
    drop(tail);
    assert_eq!(a.stats().pinned_objects, 0);
    assert_eq!(source.read(ObjectId(1), 1000, 0).unwrap().len(), 0);

    for (offset, len) in [(990, 11), (1001, 0), (u64::MAX, 2), (0, u64::MAX)] {
        let error = source.read(ObjectId(1), offset, len).unwrap_err();
        let expected = format!("out of range of object {}, which has 1000 bytes", ObjectId(1));
        assert!(error.contains(&expected), "{error}");
    }
    let error = source.read(ObjectId(3), 0, 1).unwrap_err();
    assert!(error.contains(&format!("object {} not found", ObjectId(3))), "{error}");
    let error = source.read(ObjectId(2), 0, 1).unwrap_err();
    assert!(error.contains("expected a sealed object"), "{error}");
    assert_eq!(a.stats().pinned_objects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pulls_of_one_object_share_one_transfer() {
    let (a, _a_dir) = store(16 * MIB);
    let (b, _b_dir) = store(16 * MIB);
    let data = pattern(4 * MIB + 1, 9);
    a.put(ObjectId(5), HolderId(1), &data).unwrap();
    let source = TestSource::new(a.clone());
    let link = link(source.clone()).await;

    let pulls = [2, 3, 4]
        .map(|owner| pull_into_store(&link.conn, &b, ObjectId(5), HolderId(owner), config(MIB)));
    for result in within(futures::future::join_all(pulls)).await {
        result.unwrap();
    }
    assert_eq!(source.reads.load(Ordering::Relaxed), 5, "one transfer of 5 chunks");
    let expected = BTreeMap::from([(HolderId(2), 1), (HolderId(3), 1), (HolderId(4), 1)]);
    assert_eq!(counts(&b, ObjectId(5)), expected);
    assert_eq!(stored_sha256(&b, ObjectId(5)), sha256(&data));

    // When the first transfer fails (its stream and the resumed one), the waiting pull makes
    // its own.
    a.put(ObjectId(6), HolderId(1), &data).unwrap();
    *source.failures.lock() = Some((MIB as u64, 2));
    let first = pull_into_store(&link.conn, &b, ObjectId(6), HolderId(2), config(MIB));
    let second = pull_into_store(&link.conn, &b, ObjectId(6), HolderId(3), config(MIB));
    let (first, second) = within(futures::future::join(first, second)).await;
    assert!(first.unwrap_err().to_string().contains("injected failure"));
    second.unwrap();
    assert_eq!(counts(&b, ObjectId(6)), BTreeMap::from([(HolderId(3), 1)]));
    assert_eq!(stored_sha256(&b, ObjectId(6)), sha256(&data));
}

#[tokio::test]
async fn a_failed_stream_resumes_once_and_a_second_failure_leaves_nothing_behind() {
    let (a, _a_dir) = store(8 * MIB);
    let (b, _b_dir) = store(8 * MIB);
    let data = pattern(3 * MIB + 100, 4);
    a.put(ObjectId(6), HolderId(1), &data).unwrap();
    a.put(ObjectId(7), HolderId(1), &data).unwrap();
    let source = TestSource::new(a.clone());
    let link = link(source.clone()).await;

    *source.failures.lock() = Some((2 * MIB as u64, 1));
    within(pull_into_store(&link.conn, &b, ObjectId(6), HolderId(2), config(MIB))).await.unwrap();
    assert_eq!(stored_sha256(&b, ObjectId(6)), sha256(&data));
    // Four chunks, each served successfully once: the resume asked only for the missing ones.
    assert_eq!(source.reads.load(Ordering::Relaxed), 4);

    let before = b.stats();
    *source.failures.lock() = Some((2 * MIB as u64, 2));
    let error = within(pull_into_store(&link.conn, &b, ObjectId(7), HolderId(2), config(MIB)))
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(message.starts_with(&format!("pulling object {} from head", ObjectId(7))), "{message}");
    assert!(message.contains("injected failure"), "{message}");
    assert!(!b.contains(ObjectId(7)));
    let after = b.stats();
    assert_eq!((after.objects, after.used_bytes), (before.objects, before.used_bytes));
    eventually("store A's pins released", || a.stats().pinned_objects == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_dropped_pull_leaves_nothing_behind_and_a_later_one_succeeds() {
    let (a, _a_dir) = store(8 * MIB);
    let (b, _b_dir) = store(8 * MIB);
    let data = pattern(4 * MIB, 8);
    a.put(ObjectId(9), HolderId(1), &data).unwrap();
    let source = TestSource::new(a.clone());
    let link = link(source.clone()).await;
    let (reached_tx, reached) = tokio::sync::oneshot::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    *source.gate.lock() =
        Some(Gate { offset: 3 * MIB as u64, reached: reached_tx, release: release_rx });

    let pull = pull_into_store(&link.conn, &b, ObjectId(9), HolderId(2), config(MIB));
    tokio::select! {
        reached = reached => reached.unwrap(),
        result = pull => panic!("the pull ended past its gate: {result:?}"),
    }
    // The pull future is dropped: its partial object is freed.
    assert!(!b.contains(ObjectId(9)));
    assert_eq!(b.stats().used_bytes, 0);
    release.send(()).unwrap();

    within(pull_into_store(&link.conn, &b, ObjectId(9), HolderId(2), config(MIB))).await.unwrap();
    assert_eq!(stored_sha256(&b, ObjectId(9)), sha256(&data));
    assert_eq!(counts(&b, ObjectId(9)), BTreeMap::from([(HolderId(2), 1)]));
    eventually("store A's pins released", || a.stats().pinned_objects == 0).await;
}
