//! Spill files on disk: a changed byte is reported as corruption and never handed out, an
//! intact file round-trips, and the per-store spill directory exists only while something
//! spilled.

use std::path::{Path, PathBuf};

use rtrun_object_store::{HolderId, ObjectId, ObjectStore, StoreConfig, StoreError};

const NODE: HolderId = HolderId(0);
const CAPACITY: u64 = 1 << 20;
/// Two objects of this size cannot both be in memory, so the second put spills the first.
const OBJECT_LEN: usize = 700_000;

/// Bytes that differ from position to position and from object to object.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed * 17 + (i as u64 >> 8)) as u8)
        .collect()
}

/// A parent directory of spill directories for one test alone, removed when the test ends,
/// passed or failed.
struct TestParent(PathBuf);

impl TestParent {
    fn new(name: &str) -> TestParent {
        let name = format!("rtrun-spill-test-{name}-{}", std::process::id());
        let path = std::env::temp_dir().join(name);
        let _ = std::fs::remove_dir_all(&path);
        TestParent(path)
    }
}

impl Drop for TestParent {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open_store(parent: &Path) -> ObjectStore {
    let config = StoreConfig {
        spill_dir: Some(parent.to_path_buf()),
        ..StoreConfig::with_capacity(CAPACITY)
    };
    ObjectStore::open(config).unwrap()
}

/// Puts object 1 and then object 2, which spills object 1; returns object 1's spill file.
fn spill_object_one(store: &ObjectStore) -> PathBuf {
    store.put(ObjectId(1), NODE, &pattern(1, OBJECT_LEN)).unwrap();
    store.put(ObjectId(2), NODE, &pattern(2, OBJECT_LEN)).unwrap();
    assert_eq!(store.stats().spilled_objects, 1, "object 1 must have spilled");
    let files: Vec<PathBuf> =
        std::fs::read_dir(store.spill_dir()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file = files.into_iter().next().unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), pattern(1, OBJECT_LEN), "the file holds object 1");
    file
}

#[test]
fn an_intact_spill_file_restores_the_same_bytes() {
    let test_dir = TestParent::new("intact");
    let parent = test_dir.0.as_path();
    let store = open_store(parent);
    let file = spill_object_one(&store);
    let view = store.get(ObjectId(1), NODE).unwrap();
    assert_eq!(&*view, &pattern(1, OBJECT_LEN)[..]);
    drop(view);
    assert!(!file.exists(), "a restored object's spill file is removed");
    // Reading object 2 now spills object 1 again; both still round-trip.
    assert_eq!(&*store.get(ObjectId(2), NODE).unwrap(), &pattern(2, OBJECT_LEN)[..]);
    assert_eq!(&*store.get(ObjectId(1), NODE).unwrap(), &pattern(1, OBJECT_LEN)[..]);
    drop(store);
}

#[test]
fn a_bit_flipped_spill_file_is_an_error_naming_the_object_never_its_bytes() {
    let test_dir = TestParent::new("corrupt");
    let parent = test_dir.0.as_path();
    let store = open_store(parent);
    let file = spill_object_one(&store);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[OBJECT_LEN / 2 + 3] ^= 0b0001_0000;
    std::fs::write(&file, &bytes).unwrap();

    // Twice: a failed restore leaves the object spilled, and the second try must fail too.
    for attempt in 0..2 {
        let error = match store.get(ObjectId(1), NODE) {
            Ok(view) => panic!(
                "attempt {attempt}: corrupt bytes were handed out (equal to the original: {})",
                *view == pattern(1, OBJECT_LEN)[..]
            ),
            Err(error) => error,
        };
        let message = error.to_string();
        assert!(message.contains(&ObjectId(1).to_string()), "{message}");
        assert!(message.contains(&file.display().to_string()), "{message}");
        assert!(message.contains("corrupt"), "{message}");
        match error {
            StoreError::ObjectCorrupted { id, path, expected, found } => {
                assert_eq!((id, path), (ObjectId(1), file.clone()));
                assert_ne!(expected, found);
            }
            other => panic!("attempt {attempt}: expected ObjectCorrupted, found {other:?}"),
        }
    }
    // Making room for the failed restore spilled object 2; nothing is left pinned.
    let stats = store.stats();
    assert_eq!((stats.objects, stats.spilled_objects, stats.pinned_objects), (2, 2, 0));
    // The store is still usable: the other object restores intact, and freeing the corrupt one
    // removes its file.
    assert_eq!(&*store.get(ObjectId(2), NODE).unwrap(), &pattern(2, OBJECT_LEN)[..]);
    assert!(store.remove_holder(ObjectId(1), NODE).unwrap());
    assert!(!file.exists());
    drop(store);
}

#[test]
fn the_spill_directory_exists_only_once_something_spilled() {
    let test_dir = TestParent::new("lazy");
    let parent = test_dir.0.as_path();
    let store = open_store(parent);
    let spill_dir = store.spill_dir().to_path_buf();
    assert_eq!(spill_dir.parent(), Some(parent));
    store.put(ObjectId(1), NODE, &pattern(1, OBJECT_LEN)).unwrap();
    assert!(!spill_dir.exists(), "no object spilled, so no directory");
    drop(store);
    assert!(!spill_dir.exists());
    let left: Vec<_> = std::fs::read_dir(parent)
        .map(|dir| dir.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "a store that never spilled left {left:?}");

    let store = open_store(parent);
    let spill_dir = store.spill_dir().to_path_buf();
    assert!(!spill_dir.exists());
    let file = spill_object_one(&store);
    assert!(file.starts_with(parent) && spill_dir.is_dir());
    drop(store);
    assert!(!spill_dir.exists(), "the store removes its spill directory when it drops");
}
