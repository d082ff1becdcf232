//! Job binaries by content: a driver's executable is named by its SHA-256, uploaded to the
//! head once, and fetched by every node that starts a worker of that job. Nodes keep them in a
//! cache directory; a file is written under a temporary name and renamed once its digest
//! checks, so a half-written or corrupted binary is never executed.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A directory of binaries named by their SHA-256 (hex).
#[derive(Debug)]
pub struct BinaryCache {
    dir: PathBuf,
}

/// The SHA-256 of `bytes`, in hex.
pub fn digest_of(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

/// The SHA-256 of a file, in hex.
pub fn digest_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))?;
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        context.update(&buffer[..n]);
    }
    Ok(hex(context.finish().as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn valid_digest(digest: &str) -> Result<()> {
    if digest.len() == 64
        && digest.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        Ok(())
    } else {
        Err(Error::Invalid(format!("`{digest}` is not a SHA-256 digest in lower-case hex")))
    }
}

impl BinaryCache {
    /// A cache in `dir` (created when missing).
    pub fn open(dir: impl Into<PathBuf>) -> Result<BinaryCache> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::System(format!("cannot create {}: {e}", dir.display())))?;
        Ok(BinaryCache { dir })
    }

    /// Where the binary with `digest` is (or would be).
    pub fn path(&self, digest: &str) -> PathBuf {
        self.dir.join(digest)
    }

    /// Whether the binary is present.
    pub fn contains(&self, digest: &str) -> bool {
        valid_digest(digest).is_ok() && self.path(digest).is_file()
    }

    /// Stores `bytes` as the binary `digest`, refusing bytes whose digest differs.
    pub fn insert(&self, digest: &str, bytes: &[u8]) -> Result<PathBuf> {
        valid_digest(digest)?;
        let actual = digest_of(bytes);
        if actual != digest {
            return Err(Error::Invalid(format!(
                "binary content does not match its digest: expected {digest}, found {actual}"
            )));
        }
        let path = self.path(digest);
        if path.is_file() {
            return Ok(path);
        }
        // One temporary file per upload: two drivers of the same binary uploading at once reach
        // the head's one process, and with one name per process the second truncated the
        // first's file (or wrote into it after its rename: `Text file busy` at the spawn).
        static UPLOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let upload = UPLOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = self.dir.join(format!(".{digest}.{}.{upload}.part", std::process::id()));
        let io = |e: std::io::Error| Error::System(format!("cannot write {}: {e}", temp.display()));
        std::fs::write(&temp, bytes).map_err(io)?;
        std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
        std::fs::rename(&temp, &path).map_err(io)?;
        Ok(path)
    }

    /// The bytes of binary `digest`.
    pub fn read(&self, digest: &str) -> Result<Vec<u8>> {
        valid_digest(digest)?;
        std::fs::read(self.path(digest))
            .map_err(|e| Error::Invalid(format!("binary {digest} is not available here: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binaries_are_checked_against_their_digest() {
        let dir = std::env::temp_dir().join(format!("rtrun-bin-test-{}", std::process::id()));
        let cache = BinaryCache::open(&dir).unwrap();
        let bytes = b"#!/bin/sh\necho hi\n".to_vec();
        let digest = digest_of(&bytes);
        assert!(!cache.contains(&digest));
        let path = cache.insert(&digest, &bytes).unwrap();
        assert!(cache.contains(&digest));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o111, 0o111);
        assert_eq!(cache.read(&digest).unwrap(), bytes);
        assert_eq!(digest_file(&path).unwrap(), digest);
        let wrong = cache.insert(&digest_of(b"other"), &bytes).unwrap_err().to_string();
        assert!(wrong.contains("does not match"), "{wrong}");
        assert!(cache.insert("../../etc/passwd", &bytes).is_err());
        assert!(!cache.contains("../x"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Uploads of one binary at the same time from threads of one process (what two drivers
    /// starting together do to the head) all succeed, and leave one complete file.
    #[test]
    fn concurrent_uploads_of_one_binary_all_succeed() {
        let dir = std::env::temp_dir().join(format!("rtrun-bin-race-{}", std::process::id()));
        let cache = std::sync::Arc::new(BinaryCache::open(&dir).unwrap());
        let bytes: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
        let digest = digest_of(&bytes);
        for _ in 0..5 {
            let _ = std::fs::remove_file(cache.path(&digest));
            let uploads: Vec<_> = (0..4)
                .map(|_| {
                    let (cache, bytes, digest) = (cache.clone(), bytes.clone(), digest.clone());
                    std::thread::spawn(move || cache.insert(&digest, &bytes).map(drop))
                })
                .collect();
            for upload in uploads {
                upload.join().unwrap().unwrap();
            }
            assert_eq!(digest_file(&cache.path(&digest)).unwrap(), digest);
        }
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".part"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
